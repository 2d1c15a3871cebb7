"""llm.arch: GGUF key templates and tensor names (tn); llm.models: the architecture registry."""
from __future__ import annotations

import json
import re

import pytest
from conftest import DATA

from llm import models
from llm.arch import LLMKV, LLMArch, LLMTensor, arch_from_name, tn
from llm.errors import ModelLoadError
from llm.models import ARCHS, get_arch, registered_archs


def test_enums_have_no_aliases():
    # a repeated value would silently make two names one member
    for enum_cls in (LLMArch, LLMKV, LLMTensor):
        assert len(enum_cls.__members__) == len(list(enum_cls)), enum_cls.__name__


def test_kv_key_formatting():
    assert LLMKV.CONTEXT_LENGTH.key("llama") == "llama.context_length"
    assert LLMKV.ATTENTION_HEAD_COUNT_KV.key(LLMArch.GEMMA3) == "gemma3.attention.head_count_kv"
    assert LLMKV.ATTENTION_LAYERNORM_RMS_EPS.key("qwen2") == "qwen2.attention.layer_norm_rms_epsilon"
    assert LLMKV.ROPE_SCALING_ORIG_CTX_LEN.key("phi3") == "phi3.rope.scaling.original_context_length"
    assert LLMKV.ROPE_SCALING_YARN_BETA_FAST.key("llama") == "llama.rope.scaling.yarn_beta_fast"
    assert LLMKV.ATTENTION_SLIDING_WINDOW.key("gemma2") == "gemma2.attention.sliding_window"
    assert LLMKV.FINAL_LOGIT_SOFTCAPPING.key("gemma2") == "gemma2.final_logit_softcapping"
    # keys without an architecture slot ignore the argument
    assert LLMKV.GENERAL_ARCHITECTURE.key() == "general.architecture"
    assert LLMKV.GENERAL_ALIGNMENT.key("llama") == "general.alignment"
    assert LLMKV.TOKENIZER_LIST.key() == "tokenizer.ggml.tokens"
    assert LLMKV.TOKENIZER_CHAT_TEMPLATE.key() == "tokenizer.chat_template"
    with pytest.raises(ValueError, match="CONTEXT_LENGTH"):
        LLMKV.CONTEXT_LENGTH.key()


def test_kv_table_covers_the_synthetic_models_keys():
    kv = json.loads((DATA / "hparams" / "synthetic_kv.json").read_text())
    known = {k.value for k in LLMKV}
    for name, model_kv in kv.items():
        arch = model_kv["general.architecture"]
        for key in model_kv:
            template = re.sub(rf"^{re.escape(arch)}\.", "%s.", key)
            assert template in known, (name, key)


def test_tn_formats_like_llm_tn():
    assert tn(LLMTensor.ATTN_Q, "weight", 3) == "blk.3.attn_q.weight"
    assert tn(LLMTensor.ATTN_Q, "bias", 0) == "blk.0.attn_q.bias"
    assert tn(LLMTensor.TOKEN_EMBD, "weight") == "token_embd.weight"
    assert tn(LLMTensor.OUTPUT) == "output"
    assert tn(LLMTensor.ATTN_POST_NORM, "weight", 11) == "blk.11.post_attention_norm.weight"
    assert tn(LLMTensor.FFN_POST_NORM, "weight", 2) == "blk.2.post_ffw_norm.weight"
    assert tn(LLMTensor.FFN_GATE_EXP, "weight", 1, 7) == "blk.1.ffn_gate.7.weight"
    assert tn(LLMTensor.FFN_UP_EXPS, "weight", 5) == "blk.5.ffn_up_exps.weight"


@pytest.mark.parametrize("tensor, bid, xid", [
    (LLMTensor.ATTN_Q, None, None),        # block id missing
    (LLMTensor.TOKEN_EMBD, 0, None),       # block id given to a global tensor
    (LLMTensor.FFN_GATE_EXP, 1, None),     # expert id missing
    (LLMTensor.ATTN_Q, 1, 2),              # expert id given to a non-expert tensor
    (LLMTensor.FFN_GATE_EXP, None, 2),     # expert id without block id
])
def test_tn_rejects_wrong_ids(tensor, bid, xid):
    with pytest.raises(ValueError, match=tensor.name):
        tn(tensor, "weight", bid, xid)


def _tn_names(n_layer: int, n_expert: int) -> set[str]:
    """Every name tn can produce, with .weight and .bias suffixes."""
    names = set()
    for tensor in LLMTensor:
        n_slots = tensor.value.count("%d")
        ids = [()] if n_slots == 0 else (
            [(il,) for il in range(n_layer)] if n_slots == 1 else
            [(il, x) for il in range(n_layer) for x in range(n_expert)])
        for id_ in ids:
            for suffix in ("weight", "bias"):
                names.add(tn(tensor, suffix, *id_))
    return names


@pytest.mark.parametrize("model, n_layer", [
    ("llama", 2), ("qwen2", 2), ("qwen3", 2), ("phi3", 2), ("gemma2", 2), ("gemma3", 2),
    ("llama_moe", 2), ("smollm2", 30), ("gemma3_270m", 18),
])
def test_every_tensor_of_real_files_has_a_tn_name(model, n_layer):
    file_names = json.loads((DATA / "hparams" / "tensor_names.json").read_text())[model]
    missing = set(file_names) - _tn_names(n_layer, n_expert=4)
    assert not missing


def test_arch_from_name():
    assert arch_from_name("gemma3") is LLMArch.GEMMA3
    assert arch_from_name("command-r") is LLMArch.COMMAND_R
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'llama9'"):
        arch_from_name("llama9")


def test_registry():
    assert registered_archs() == ["apertus", "bert", "cohere2", "command-r", "deepseek2", "ernie4_5", "ernie4_5-moe",
                                  "exaone", "exaone4", "falcon-h1", "gemma2", "gemma3", "gemma3n", "gemma4", "glm4",
                                  "glm4moe", "gpt-oss", "gpt2", "granite", "granitehybrid", "granitemoe", "hunyuan-moe",
                                  "jamba", "lfm2", "lfm2moe", "llama", "llama4", "mamba", "mamba2",
                                  "minimax-m2", "mistral3", "nemotron_h", "nomic-bert", "olmo2", "olmoe", "phi2",
                                  "phi3", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen35", "qwen35moe",
                                  "qwen3moe", "qwen3next", "qwen3vl", "qwen3vlmoe", "seed_oss", "smollm3", "starcoder2"]
    assert get_arch("qwen3") is models.qwen3
    assert all(ARCHS[arch_from_name(name)] is get_arch(name) for name in registered_archs())
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'nope'"):
        get_arch("nope")
    nearest = "'gptj' is not supported.*gemma3, gemma3n, gemma4, glm4, glm4moe.*nearest supported one is 'gpt2'"
    with pytest.raises(ModelLoadError, match=nearest):
        get_arch("gptj")
