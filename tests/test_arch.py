"""llm.arch: GGUF key templates, tensor names (tn) and the architecture registry."""
from __future__ import annotations

import json
import re

import pytest
from conftest import DATA

from llm import arch as arch_mod
from llm.arch import (
    ARCH_TENSORS,
    LLMKV,
    LLMArch,
    LLMTensor,
    arch_from_name,
    get_arch,
    register_arch,
    registered_archs,
    tn,
)
from llm.errors import ModelLoadError


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


def test_tn_checks_the_architecture_table():
    assert tn(LLMTensor.ATTN_QKV, "weight", 0, arch=LLMArch.PHI3) == "blk.0.attn_qkv.weight"
    with pytest.raises(ValueError, match="ATTN_QKV.*llama"):
        tn(LLMTensor.ATTN_QKV, "weight", 0, arch=LLMArch.LLAMA)
    with pytest.raises(ValueError, match="ATTN_Q_NORM.*gemma2"):
        tn(LLMTensor.ATTN_Q_NORM, "weight", 0, arch=LLMArch.GEMMA2)


def _tn_names(arch: LLMArch, n_layer: int, n_expert: int) -> set[str]:
    """Every name tn can produce for arch, with .weight and .bias suffixes."""
    names = set()
    for tensor in ARCH_TENSORS[arch]:
        n_slots = tensor.value.count("%d")
        ids = [()] if n_slots == 0 else (
            [(il,) for il in range(n_layer)] if n_slots == 1 else
            [(il, x) for il in range(n_layer) for x in range(n_expert)])
        for id_ in ids:
            for suffix in ("weight", "bias"):
                names.add(tn(tensor, suffix, *id_, arch=arch))
    return names


@pytest.mark.parametrize("model, arch, n_layer", [
    ("llama", LLMArch.LLAMA, 2), ("qwen2", LLMArch.QWEN2, 2), ("qwen3", LLMArch.QWEN3, 2),
    ("phi3", LLMArch.PHI3, 2), ("gemma2", LLMArch.GEMMA2, 2), ("gemma3", LLMArch.GEMMA3, 2),
    ("llama_moe", LLMArch.LLAMA, 2), ("smollm2", LLMArch.LLAMA, 30),
    ("gemma3_270m", LLMArch.GEMMA3, 18),
])
def test_every_tensor_of_real_files_has_a_tn_name(model, arch, n_layer):
    file_names = json.loads((DATA / "hparams" / "tensor_names.json").read_text())[model]
    missing = set(file_names) - _tn_names(arch, n_layer, n_expert=4)
    assert not missing


def test_arch_from_name():
    assert arch_from_name("gemma3") is LLMArch.GEMMA3
    assert arch_from_name("command-r") is LLMArch.COMMAND_R
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'llama9'"):
        arch_from_name("llama9")


def test_registry(monkeypatch):
    monkeypatch.setattr(arch_mod, "_BUILDERS", {})

    @register_arch("qwen3")
    class Qwen3Builder:
        pass

    assert get_arch("qwen3") is Qwen3Builder
    assert registered_archs() == ["qwen3"]
    with pytest.raises(ValueError, match="'qwen3' already has a registered builder"):
        register_arch("qwen3")(object())
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'nope'"):
        get_arch("nope")
    with pytest.raises(ModelLoadError, match="'mamba' is not supported.*qwen3"):
        get_arch("mamba")
    with pytest.raises(ModelLoadError, match="unknown model architecture: 'nope'"):
        register_arch("nope")
