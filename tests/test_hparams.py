"""llm.hparams: HParams from GGUF metadata, per-arch extras, SWA pattern and mask rule."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
from conftest import DATA

from ggmlx.gguf import GGUFReader
from llm.arch import LLMKV, LLMArch
from llm.errors import MetadataError, ModelLoadError
from llm.hparams import HParams, RopeScalingType, RopeType, SWAType, is_masked_swa, load_hparams
from llm.loader import GGUFMeta
from llm.models import get_arch


@pytest.fixture(scope="module")
def synth_kv() -> dict[str, dict]:
    return json.loads((DATA / "hparams" / "synthetic_kv.json").read_text())


def _load(kv: dict, path: str = "model.gguf") -> HParams:
    ml = GGUFMeta(kv, path)
    return load_hparams(ml, get_arch(ml.arch_name))


# Expected values from the synthetic models' table in the reference README.
SYNTH = {
    #            n_head kv  head_dim rope base  rms eps  rope type
    "llama":     (4, 2, 64, 10000.0, 1e-5, RopeType.NORM),
    "qwen2":     (4, 2, 64, 1e6, 1e-6, RopeType.NEOX),
    "qwen3":     (4, 2, 128, 1e6, 1e-6, RopeType.NEOX),
    "phi3":      (4, 2, 64, 10000.0, 1e-5, RopeType.NEOX),
    "gemma2":    (4, 2, 64, 10000.0, 1e-6, RopeType.NEOX),
    "gemma3":    (4, 1, 64, 1e6, 1e-6, RopeType.NEOX),
    "llama_moe": (4, 2, 64, 500000.0, 1e-5, RopeType.NORM),
}


@pytest.mark.parametrize("name", sorted(SYNTH))
def test_synthetic_models_common(synth_kv, name):
    n_head, n_head_kv, head_dim, base, eps, rope_type = SYNTH[name]
    hp = _load(synth_kv[name])
    assert hp.arch.value == synth_kv[name]["general.architecture"]
    assert (hp.n_vocab, hp.n_ctx_train, hp.n_embd, hp.n_layer) == (512, 512, 256, 2)
    assert hp.n_ff_arr == [256 if name == "llama_moe" else 512] * 2
    assert hp.n_head_arr == [n_head] * 2 and hp.n_head_kv_arr == [n_head_kv] * 2
    assert (hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot) == (head_dim, head_dim, head_dim)
    assert hp.n_embd_k_gqa(1) == hp.n_embd_v_gqa(1) == head_dim * n_head_kv
    assert hp.n_gqa() == n_head // n_head_kv
    assert hp.rope_freq_base_train == base and hp.rope_freq_scale_train == 1.0
    assert hp.rope_scaling_type_train == RopeScalingType.LINEAR
    assert hp.n_ctx_orig_yarn == 512
    assert hp.f_norm_rms_eps == pytest.approx(eps)
    assert hp.rope_type == rope_type
    assert hp.causal_attn


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "phi3", "llama_moe"])
def test_synthetic_models_without_swa(synth_kv, name):
    hp = _load(synth_kv[name])
    assert hp.swa_type == SWAType.NONE and hp.n_swa == 0
    assert hp.swa_layers == [False, False] and not any(hp.swa_layers)
    assert hp.rope_freq_base_train_swa == hp.rope_freq_base_train
    assert hp.f_attention_scale == 0.0


def test_synthetic_moe(synth_kv):
    hp = _load(synth_kv["llama_moe"])
    assert (hp.n_expert, hp.n_expert_used) == (4, 2)


def test_synthetic_gemma2(synth_kv):
    hp = _load(synth_kv["gemma2"])
    assert hp.swa_type == SWAType.STANDARD and hp.n_swa == 8
    assert hp.swa_layers == [True, False]  # pattern 2: even layers local
    assert hp.attn_soft_cap
    assert (hp.f_attn_logit_softcapping, hp.f_final_logit_softcapping) == (3.0, 6.0)
    assert hp.f_attention_scale == pytest.approx(1 / 8)
    assert hp.rope_freq_base_train_swa == 10000.0


def test_synthetic_gemma3(synth_kv):
    hp = _load(synth_kv["gemma3"])
    assert hp.swa_type == SWAType.STANDARD and hp.n_swa == 8
    assert hp.swa_layers == [True, True]  # pattern 6 on 2 layers: both local
    assert hp.rope_freq_base_train == 1e6 and hp.rope_freq_base_train_swa == 10000.0
    assert hp.rope_freq_scale_train_swa == 1.0
    assert hp.f_final_logit_softcapping == 0.0 and not hp.attn_soft_cap
    assert hp.f_attention_scale == pytest.approx(1 / 8)


def test_gemma3_without_window_has_no_swa(synth_kv):
    kv = copy.deepcopy(synth_kv["gemma3"])
    del kv["gemma3.attention.sliding_window"]
    hp = _load(kv)
    assert hp.swa_type == SWAType.NONE and hp.swa_layers == [False, False]
    assert hp.rope_freq_base_train_swa == 1e6


def test_gemma2_window_defaults_to_4096(synth_kv):
    kv = copy.deepcopy(synth_kv["gemma2"])
    del kv["gemma2.attention.sliding_window"]
    del kv["gemma2.attn_logit_softcapping"]
    hp = _load(kv)
    assert hp.n_swa == 4096 and hp.f_attn_logit_softcapping == 50.0


def test_phi3_window_is_disabled(synth_kv):
    kv = copy.deepcopy(synth_kv["phi3"])
    kv["phi3.attention.sliding_window"] = 2047
    hp = _load(kv)
    assert hp.swa_type == SWAType.NONE and hp.n_swa == 0 and not any(hp.swa_layers)


def test_smollm2(smollm2_path):
    with GGUFReader(smollm2_path) as f:
        hp = _load(f.kv, str(smollm2_path))
    assert hp.arch == LLMArch.LLAMA
    assert (hp.n_vocab, hp.n_ctx_train, hp.n_embd, hp.n_layer) == (49152, 8192, 576, 30)
    assert hp.n_head(29) == 9 and hp.n_head_kv(29) == 3 and hp.n_ff(0) == 1536
    assert (hp.n_embd_head_k, hp.n_rot) == (64, 64)
    assert hp.rope_freq_base_train == 100000.0 and hp.rope_type == RopeType.NORM
    assert hp.f_norm_rms_eps == pytest.approx(1e-5)
    assert not any(hp.swa_layers)


def test_gemma3_270m(gemma3_path):
    with GGUFReader(gemma3_path) as f:
        hp = _load(f.kv, str(gemma3_path))
    assert hp.arch == LLMArch.GEMMA3
    assert (hp.n_vocab, hp.n_ctx_train, hp.n_embd, hp.n_layer) == (262144, 32768, 640, 18)
    assert (hp.n_head(), hp.n_head_kv(), hp.n_embd_head_k, hp.n_ff()) == (4, 1, 256, 2048)
    assert hp.n_embd_k_gqa(5) == 256
    assert hp.swa_type == SWAType.STANDARD and hp.n_swa == 512
    assert [il for il in range(18) if not hp.is_swa(il)] == [5, 11, 17]
    assert hp.rope_freq_base_train == 1e6 and hp.rope_freq_base_train_swa == 10000.0
    assert hp.f_attention_scale == pytest.approx(1 / 16)
    assert hp.f_final_logit_softcapping == 0.0
    assert hp.f_norm_rms_eps == pytest.approx(1e-6)


def test_per_layer_arrays(synth_kv):
    kv = copy.deepcopy(synth_kv["llama"])
    kv["llama.attention.head_count"] = np.array([4, 8], dtype=np.int32)
    kv["llama.attention.head_count_kv"] = [2, 4]
    kv["llama.feed_forward_length"] = [512, 1024]
    hp = _load(kv)
    assert (hp.n_head(0), hp.n_head(1), hp.n_head_kv(1), hp.n_ff(1)) == (4, 8, 4, 1024)
    assert hp.n_embd_k_gqa(1) == 64 * 4
    with pytest.raises(IndexError, match="layer 2"):
        hp.n_head(2)


def test_head_count_kv_defaults_to_head_count(synth_kv):
    kv = copy.deepcopy(synth_kv["llama"])
    del kv["llama.attention.head_count_kv"]
    assert _load(kv).n_head_kv_arr == [4, 4]


def test_rope_scaling(synth_kv):
    kv = copy.deepcopy(synth_kv["qwen2"])
    kv["qwen2.rope.scaling.type"] = "yarn"
    kv["qwen2.rope.scaling.factor"] = 4.0
    kv["qwen2.rope.scaling.original_context_length"] = 128
    kv["qwen2.rope.scaling.yarn_beta_fast"] = 16.0
    hp = _load(kv)
    assert hp.rope_scaling_type_train == RopeScalingType.YARN
    assert hp.rope_freq_scale_train == 0.25 and hp.rope_freq_scale_train_swa == 0.25
    assert hp.n_ctx_orig_yarn == 128 and hp.yarn_beta_fast == 16.0 and hp.yarn_beta_slow == 1.0


def test_vocab_size_from_tokens_list(synth_kv):
    kv = copy.deepcopy(synth_kv["llama"])
    del kv["llama.vocab_size"]
    kv["tokenizer.ggml.tokens"] = kv["tokenizer.ggml.tokens"][:300]
    assert _load(kv).n_vocab == 300


def _bad(kv: dict, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        _load(kv)


def test_missing_and_mistyped_keys(synth_kv):
    kv = copy.deepcopy(synth_kv["llama"])
    del kv["llama.block_count"]
    _bad(kv, r"model\.gguf: missing required key 'llama\.block_count'")

    kv = copy.deepcopy(synth_kv["llama"])
    kv["llama.block_count"] = "2"
    _bad(kv, r"key 'llama\.block_count' has a value of type str .* expected an integer")

    kv = copy.deepcopy(synth_kv["llama"])
    kv["llama.block_count"] = True
    _bad(kv, r"'llama\.block_count' has a value of type bool")

    kv = copy.deepcopy(synth_kv["llama"])
    del kv["llama.attention.layer_norm_rms_epsilon"]
    _bad(kv, r"missing required key 'llama\.attention\.layer_norm_rms_epsilon'")

    kv = copy.deepcopy(synth_kv["gemma2"])
    kv["gemma2.attn_logit_softcapping"] = "soft"
    _bad(kv, r"'gemma2\.attn_logit_softcapping' .* expected a number")

    kv = copy.deepcopy(synth_kv["llama"])
    kv["llama.rope.scaling.type"] = "cubic"
    _bad(kv, r"'llama\.rope\.scaling\.type' = 'cubic'")

    kv = copy.deepcopy(synth_kv["qwen2"])
    del kv["tokenizer.ggml.tokens"]
    _bad(kv, r"'qwen2\.vocab_size' and 'tokenizer\.ggml\.tokens'")


def test_metadata_errors_name_file_and_key(synth_kv):
    kv = copy.deepcopy(synth_kv["gemma2"])
    kv["gemma2.attention.sliding_window"] = 4.5
    with pytest.raises(MetadataError, match=r"^model\.gguf: key 'gemma2\.attention\.sliding_window' has a value "
                                            r"of type float \(4\.5\), expected an integer$") as e:
        _load(kv)
    assert (e.value.path, e.value.key) == ("model.gguf", "gemma2.attention.sliding_window")


def test_gguf_meta_getters():
    ml = GGUFMeta({"general.architecture": "llama", "llama.block_count": np.uint32(2),
                   "llama.feed_forward_length": np.array([3, 4], np.int32),
                   "llama.rope.freq_base": 10000, "tokenizer.ggml.add_bos_token": np.True_,
                   "tokenizer.ggml.scores": np.array([0.5, -1.25], np.float32),
                   "tokenizer.ggml.tokens": ["a", "b"]}, "m.gguf")
    assert ml.arch_name == "llama" and ml.key_name(LLMKV.BLOCK_COUNT) == "llama.block_count"
    assert ml.get_key(LLMKV.BLOCK_COUNT, int) == 2 and ml.get_key(LLMKV.ROPE_FREQ_BASE, float) == 10000.0
    assert ml.get_key(LLMKV.CONTEXT_LENGTH, int, 7) == 7 and not ml.has_key(LLMKV.CONTEXT_LENGTH)
    assert ml.get_key(LLMKV.TOKENIZER_ADD_BOS, bool) is True
    assert ml.get_key_or_arr(LLMKV.FEED_FORWARD_LENGTH, int, 2) == [3, 4]
    assert ml.get_key_or_arr(LLMKV.BLOCK_COUNT, int, 3) == [2, 2, 2]
    assert ml.get_key_or_arr(LLMKV.ATTENTION_HEAD_COUNT, int, 2, [5, 6]) == [5, 6]
    assert ml.get_arr(LLMKV.TOKENIZER_SCORES, float) == [0.5, -1.25]
    assert ml.get_arr(LLMKV.TOKENIZER_LIST, str) == ["a", "b"]
    assert ml.get_arr(LLMKV.TOKENIZER_MERGES, str, []) == []
    for read, key, expected in [
        (lambda: ml.get_key(LLMKV.TOKENIZER_ADD_BOS, int), "tokenizer.ggml.add_bos_token", "expected an integer"),
        (lambda: ml.get_key(LLMKV.TOKENIZER_LIST, str), "tokenizer.ggml.tokens", "expected a string"),
        (lambda: ml.get_key(LLMKV.BLOCK_COUNT, bool), "llama.block_count", "expected a bool"),
        (lambda: ml.get_arr(LLMKV.TOKENIZER_SCORES, int), "tokenizer.ggml.scores", "expected an array of integers"),
        (lambda: ml.get_arr(LLMKV.TOKENIZER_LIST, float), "tokenizer.ggml.tokens", "expected an array of numbers"),
        (lambda: ml.get_arr(LLMKV.BLOCK_COUNT, int), "llama.block_count", "expected an array of integers"),
        (lambda: ml.get_key_or_arr(LLMKV.FEED_FORWARD_LENGTH, int, 3), "llama.feed_forward_length",
         r"array of 2 values, expected one per layer \(3\)"),
        (lambda: ml.get_key_or_arr(LLMKV.TOKENIZER_SCORES, int, 2), "tokenizer.ggml.scores",
         "expected an integer or an array of integers"),
        (lambda: ml.get_key(LLMKV.CONTEXT_LENGTH, int), "llama.context_length",
         "missing required key 'llama.context_length'"),
    ]:
        with pytest.raises(MetadataError, match=expected) as e:
            read()
        assert e.value.key == key and str(e.value).startswith("m.gguf: ")
    with pytest.raises(MetadataError, match="missing required key 'general.architecture'"):
        GGUFMeta({}).key_name(LLMKV.BLOCK_COUNT)


def test_inconsistent_values(synth_kv):
    kv = copy.deepcopy(synth_kv["llama"])
    kv["llama.attention.head_count"] = [4, 4, 4]
    _bad(kv, r"'llama\.attention\.head_count' has an array of 3 values, expected one per layer \(2\)")

    kv = copy.deepcopy(synth_kv["llama"])
    kv["llama.attention.head_count_kv"] = 3
    _bad(kv, r"layer 0: head count 4 .* KV head count 3")

    kv = copy.deepcopy(synth_kv["llama"])
    kv["llama.rope.dimension_count"] = 32
    _bad(kv, r"invalid 'llama\.rope\.dimension_count' = 32")

    kv = copy.deepcopy(synth_kv["llama_moe"])
    kv["llama.expert_used_count"] = 5
    _bad(kv, r"'llama\.expert_used_count' = 5 exceeds 'llama\.expert_count' = 4")

    kv = copy.deepcopy(synth_kv["llama"])
    kv["llama.block_count"] = 0
    _bad(kv, r"'llama\.block_count' = 0 is outside")


def test_unknown_and_unsupported_architectures(synth_kv):
    for arch, match in (("llama9", "unknown model architecture: 'llama9'"),
                        ("rwkv6", "model architecture 'rwkv6' is not supported")):
        kv = {k.replace("llama.", f"{arch}."): v for k, v in synth_kv["llama"].items()}
        kv["general.architecture"] = arch
        _bad(kv, match)


def test_set_swa_pattern():
    hp = HParams(arch=LLMArch.GEMMA3, n_vocab=1, n_ctx_train=1, n_embd=8, n_layer=12,
                 n_head_arr=[1] * 12, n_head_kv_arr=[1] * 12, n_ff_arr=[1] * 12,
                 n_embd_head_k=8, n_embd_head_v=8, n_rot=8)
    assert not any(hp.swa_layers)
    hp.set_swa_pattern(6)
    assert hp.swa_layers == [True] * 5 + [False] + [True] * 5 + [False]
    hp.set_swa_pattern(2)
    assert hp.swa_layers == [True, False] * 6
    hp.set_swa_pattern(3, dense_first=True)
    assert hp.swa_layers == [False, True, True] * 4
    hp.set_swa_pattern(0)
    assert all(hp.swa_layers)
    hp.set_swa_pattern(1)
    assert not any(hp.swa_layers)


def test_hparams_checks_array_lengths():
    with pytest.raises(ValueError, match="n_ff_arr has 1 entries, expected n_layer = 2"):
        HParams(arch=LLMArch.LLAMA, n_vocab=1, n_ctx_train=1, n_embd=8, n_layer=2,
                n_head_arr=[1, 1], n_head_kv_arr=[1, 1], n_ff_arr=[1],
                n_embd_head_k=8, n_embd_head_v=8, n_rot=8)


def test_is_masked_swa():
    p1 = 10
    p0 = np.arange(0, 13)
    # standard window 3: a token sees itself and the 2 positions before it
    assert list(np.flatnonzero(~is_masked_swa(3, SWAType.STANDARD, p0, p1))) == [8, 9, 10, 11, 12]
    # chunked 4: only positions of the chunk [8, 12) that holds p1 (and later ones)
    assert list(np.flatnonzero(~is_masked_swa(4, SWAType.CHUNKED, p0, p1))) == [8, 9, 10, 11, 12]
    # symmetric 4: |p1 - p0| <= 2
    assert list(np.flatnonzero(~is_masked_swa(4, SWAType.SYMMETRIC, p0, p1))) == [8, 9, 10, 11, 12]
    assert list(np.flatnonzero(~is_masked_swa(8, SWAType.STANDARD, p0, p1))) == list(range(3, 13))
    assert not is_masked_swa(3, SWAType.NONE, p0, p1).any()
    # broadcasting: tokens x cells
    m = is_masked_swa(2, SWAType.STANDARD, np.arange(4)[None, :], np.arange(4)[:, None])
    assert m.shape == (4, 4) and m[3, 1] and not m[3, 2]


def test_attention_scale_27b_rule(synth_kv):
    kv = copy.deepcopy(synth_kv["gemma3"])
    kv["gemma3.block_count"] = 62
    kv["gemma3.attention.key_length"] = 128  # 27B: n_embd / n_head (= 64) wins over head dim
    hp = _load(kv)
    assert hp.f_attention_scale == pytest.approx(1 / math.sqrt(64))
    assert [il for il in range(12) if not hp.is_swa(il)] == [5, 11]


NAN, INF = float("nan"), float("inf")

# (model, key without the arch prefix, bad value): each must fail at load naming the key
BAD_VALUES = [
    ("llama", "attention.layer_norm_rms_epsilon", v) for v in (-1e-5, 0.0, NAN, INF, 1.5)
] + [
    ("llama", "rope.freq_base", v) for v in (0.0, -1.0, NAN, INF)
] + [
    ("llama", "context_length", 0), ("llama", "context_length", -5), ("llama", "vocab_size", 0),
    ("llama", "embedding_length", 0), ("llama", "attention.head_count", 3),
    ("llama", "rope.scaling.factor", -2.0), ("llama", "rope.scaling.factor", NAN),
    ("llama", "rope.scaling.factor", 1e-320), ("llama", "rope.scale_linear", INF),
    ("llama", "rope.scaling.attn_factor", 0.0), ("llama", "rope.scaling.original_context_length", 0),
    ("llama", "rope.scaling.yarn_beta_fast", NAN), ("llama", "rope.scaling.yarn_ext_factor", INF),
    ("llama", "rope.scaling.yarn_attn_factor", -1.0), ("llama", "rope.scaling.yarn_log_multiplier", NAN),
    ("llama", "expert_count", -1),
    ("gemma2", "attn_logit_softcapping", 0.0), ("gemma2", "attn_logit_softcapping", NAN),
    ("gemma2", "final_logit_softcapping", -1.0), ("gemma2", "final_logit_softcapping", INF),
    ("gemma3", "attention.sliding_window", -4), ("gemma3", "attention.key_length", 0),
    ("gemma3", "attention.value_length", -1), ("gemma3", "rope.freq_base", NAN),
    ("qwen2", "rope.dimension_count", 63), ("qwen2", "rope.dimension_count", 0),
    ("qwen2", "rope.dimension_count", 128),
]


@pytest.mark.parametrize("name,key,value", BAD_VALUES)
def test_nonsense_values_fail_at_load_naming_the_key(synth_kv, name, key, value):
    kv = copy.deepcopy(synth_kv[name])
    kv[f"{name}.{key}"] = value
    with pytest.raises(ModelLoadError, match=rf"^model\.gguf: .*'{name}\.{key}'") as e:
        _load(kv)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", sorted(SYNTH))
def test_real_values_pass_the_checks(synth_kv, name):
    """Boundary values that real models use stay accepted."""
    kv = copy.deepcopy(synth_kv[name])
    a = kv["general.architecture"]
    kv[f"{a}.attention.layer_norm_rms_epsilon"] = 1e-12
    kv[f"{a}.rope.scaling.factor"] = 0.0        # 0 = no scaling
    kv[f"{a}.rope.scaling.yarn_ext_factor"] = -1.0
    hp = _load(kv)
    assert hp.f_norm_rms_eps == 1e-12 and hp.rope_freq_scale_train == 1.0


@pytest.mark.parametrize("key,value", [("attention.layer_norm_rms_epsilon", -1e-5), ("rope.freq_base", 0.0),
                                       ("rope.freq_base", -1.0), ("rope.freq_base", NAN)])
def test_load_model_rejects_nonsense_hparams(tmp_path, key, value):
    """The whole loader, on a written file: the issue's cases fail at load, not as failed
    decodes or NaN logits later."""
    from tiny_model import TinySpec, model_kv, model_tensors, write_gguf

    import llm
    spec = TinySpec()
    kv = model_kv(spec)
    kv[f"llama.{key}"] = value
    path = write_gguf(tmp_path / "bad.gguf", kv, model_tensors(spec))
    with pytest.raises(ModelLoadError, match=rf"bad\.gguf: key 'llama\.{key}' = "):
        llm.load_model(path)
