"""Model hyperparameters from GGUF metadata, mirroring llama.cpp's `llama_hparams` and
`llama_model::load_hparams`: the generic `%s.*` keys first, then one function per
architecture for its extras (norm epsilon, sliding-window pattern, soft-caps, ...).
"""
from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable

import numpy as np

from llm.arch import LLMKV, LLMArch, arch_from_name
from llm.errors import ModelLoadError

LLAMA_MAX_LAYERS = 512


class RopeType(enum.IntEnum):
    """llama_rope_type; the values are ggml's rope mode bits (GGML_ROPE_TYPE_*)."""

    NONE = -1
    NORM = 0     # rotate pairs of consecutive head values
    NEOX = 2     # rotate pairs offset by n_rot / 2
    MROPE = 8
    VISION = 24
    IMROPE = 40


class RopeScalingType(enum.IntEnum):
    """llama_rope_scaling_type, named in GGUF by `%s.rope.scaling.type`."""

    NONE = 0
    LINEAR = 1
    YARN = 2
    LONGROPE = 3


_ROPE_SCALING_NAMES = {
    "none": RopeScalingType.NONE,
    "linear": RopeScalingType.LINEAR,
    "yarn": RopeScalingType.YARN,
    "longrope": RopeScalingType.LONGROPE,
}


class SWAType(enum.IntEnum):
    """llama_swa_type: how a sliding-window layer masks old positions."""

    NONE = 0
    STANDARD = 1   # masked when p1 - p0 >= n_swa
    CHUNKED = 2    # masked when p0 is before the n_swa-chunk that holds p1
    SYMMETRIC = 3  # masked when |p1 - p0| > n_swa / 2


def is_masked_swa(n_swa: int, swa_type: SWAType, p0, p1) -> np.ndarray:
    """llama_hparams::is_masked_swa, vectorized: may a token at position p1 NOT see the cell at p0?

    p0 and p1 broadcast against each other (numpy arrays or ints); the result is a bool array.
    """
    p0 = np.asarray(p0)
    p1 = np.asarray(p1)
    if swa_type == SWAType.NONE:
        return np.zeros(np.broadcast_shapes(p0.shape, p1.shape), dtype=bool)
    if swa_type == SWAType.STANDARD:
        return (p1 - p0) >= n_swa
    if swa_type == SWAType.CHUNKED:
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == SWAType.SYMMETRIC:
        half = n_swa // 2
        diff = p1 - p0
        return (diff < -half) | (diff > half)
    raise ValueError(f"unknown swa_type {swa_type!r}")


@dataclasses.dataclass(kw_only=True)
class HParams:
    """Hyperparameters of one model (llama.cpp's llama_hparams, the fields our graphs use).

    Per-layer values live in `*_arr` lists of length n_layer; read them through the
    accessors (`n_head(il)`, ...). `swa_layers` left empty means no sliding-window layer.
    """

    arch: LLMArch
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head_arr: list[int]
    n_head_kv_arr: list[int]
    n_ff_arr: list[int]
    n_embd_head_k: int
    n_embd_head_v: int
    n_rot: int
    n_expert: int = 0
    n_expert_used: int = 0

    f_norm_eps: float = 0.0
    f_norm_rms_eps: float = 0.0
    f_attn_logit_softcapping: float = 50.0
    f_final_logit_softcapping: float = 30.0
    attn_soft_cap: bool = False
    # 0 means "use 1/sqrt(n_embd_head_k)" (llama.cpp's build_attn convention)
    f_attention_scale: float = 0.0
    causal_attn: bool = True

    rope_type: RopeType = RopeType.NONE
    rope_finetuned: bool = False
    rope_freq_base_train: float = 10000.0
    rope_freq_scale_train: float = 1.0
    rope_freq_base_train_swa: float = 10000.0
    rope_freq_scale_train_swa: float = 1.0
    rope_scaling_type_train: RopeScalingType = RopeScalingType.LINEAR
    rope_attn_factor: float = 1.0
    n_ctx_orig_yarn: int = 0
    rope_yarn_log_mul: float = 0.0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    swa_type: SWAType = SWAType.NONE
    n_swa: int = 0
    swa_layers: list[bool] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.swa_layers:
            self.swa_layers = [False] * self.n_layer
        for name in ("n_head_arr", "n_head_kv_arr", "n_ff_arr", "swa_layers"):
            if len(getattr(self, name)) != self.n_layer:
                raise ValueError(f"HParams.{name} has {len(getattr(self, name))} entries, "
                                 f"expected n_layer = {self.n_layer}")

    def _layer(self, il: int) -> int:
        if not 0 <= il < self.n_layer:
            raise IndexError(f"layer {il} out of range [0, {self.n_layer})")
        return il

    def n_head(self, il: int = 0) -> int:
        return self.n_head_arr[self._layer(il)]

    def n_head_kv(self, il: int = 0) -> int:
        return self.n_head_kv_arr[self._layer(il)]

    def n_ff(self, il: int = 0) -> int:
        return self.n_ff_arr[self._layer(il)]

    def n_gqa(self, il: int = 0) -> int:
        """Query heads per KV head (0 for a layer without KV heads)."""
        n_head_kv = self.n_head_kv(il)
        return self.n_head(il) // n_head_kv if n_head_kv else 0

    def n_embd_k_gqa(self, il: int = 0) -> int:
        """Width of one token's keys over all KV heads of layer il."""
        return self.n_embd_head_k * self.n_head_kv(il)

    def n_embd_v_gqa(self, il: int = 0) -> int:
        """Width of one token's values over all KV heads of layer il."""
        return self.n_embd_head_v * self.n_head_kv(il)

    def is_swa(self, il: int) -> bool:
        """Does layer il use sliding-window attention?"""
        return self.swa_layers[self._layer(il)]

    def is_swa_any(self) -> bool:
        return any(self.swa_layers)

    def set_swa_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """llama.cpp's set_swa_pattern: every n_pattern-th layer is dense (global), the rest SWA.

        dense_first=False: the dense layer ends each group (pattern 6: layers 0-4 SWA, 5 dense);
        dense_first=True: it starts each group. n_pattern 0 = all SWA, 1 = all dense.
        """
        if dense_first:
            self.swa_layers = [n_pattern == 0 or il % n_pattern != 0 for il in range(self.n_layer)]
        else:
            self.swa_layers = [n_pattern == 0 or il % n_pattern < n_pattern - 1
                               for il in range(self.n_layer)]


class _KVReader:
    """Typed reads of GGUF metadata; errors name the key and the file."""

    def __init__(self, kv: dict, arch: LLMArch, path: str | None):
        self.kv = kv
        self.arch = arch
        self.where = f"{path}: " if path else ""

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.where}{message}")

    def has(self, key: LLMKV) -> bool:
        return key.key(self.arch) in self.kv

    def _get(self, key: LLMKV, default, check: Callable[[object], bool], type_name: str):
        name = key.key(self.arch)
        if name not in self.kv:
            if default is None:
                raise self.error(f"missing required key '{name}'")
            return default
        value = self.kv[name]
        if not check(value):
            raise self.error(f"key '{name}' has a value of type {type(value).__name__} "
                             f"({value!r:.60}), expected {type_name}")
        return value

    def get_int(self, key: LLMKV, default: int | None = None) -> int:
        return int(self._get(key, default, _is_int, "an integer"))

    def get_float(self, key: LLMKV, default: float | None = None) -> float:
        return float(self._get(key, default, _is_number, "a number"))

    def get_bool(self, key: LLMKV, default: bool | None = None) -> bool:
        return bool(self._get(key, default, _is_bool, "a bool"))

    def get_str(self, key: LLMKV, default: str | None = None) -> str:
        return self._get(key, default, lambda v: isinstance(v, str), "a string")

    def get_int_or_arr(self, key: LLMKV, n: int, default: list[int] | None = None) -> list[int]:
        """llama_model_loader::get_key_or_arr: a scalar for every layer, or one value per layer."""
        name = key.key(self.arch)
        if name not in self.kv:
            if default is None:
                raise self.error(f"missing required key '{name}'")
            return list(default)
        value = self.kv[name]
        if _is_int(value):
            return [int(value)] * n
        if isinstance(value, (list, tuple, np.ndarray)) and all(_is_int(v) for v in value):
            if len(value) != n:
                raise self.error(f"key '{name}' has an array of {len(value)} values, "
                                 f"expected one per layer ({n})")
            return [int(v) for v in value]
        raise self.error(f"key '{name}' has a value of type {type(value).__name__} "
                         f"({value!r:.60}), expected an integer or an array of integers")


def _is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not _is_bool(v)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not _is_bool(v)


def load_hparams(kv: dict, arch: str, path: str | None = None) -> HParams:
    """HParams from GGUF metadata (`ggmlx.gguf.GGUFReader(path).kv`) for architecture `arch`.

    Raises ModelLoadError naming the key (and `path` when given) for a missing required key,
    a value of the wrong type or an inconsistent value.
    """
    llm_arch = arch_from_name(arch)
    if llm_arch not in ARCH_HPARAMS:
        supported = ", ".join(sorted(a.value for a in ARCH_HPARAMS))
        raise ModelLoadError(f"{path + ': ' if path else ''}no hyperparameter loader for "
                             f"architecture '{arch}' (supported: {supported})")
    r = _KVReader(kv, llm_arch, path)
    hp = _load_generic(r)
    spec = ARCH_HPARAMS[llm_arch]
    hp.rope_type = spec.rope_type
    spec.load_extras(hp, r)
    _check(hp, r)
    return hp


def _load_generic(r: _KVReader) -> HParams:
    """The keys every architecture shares (the part of load_hparams before the arch switch)."""
    n_layer = r.get_int(LLMKV.BLOCK_COUNT)
    if not 0 < n_layer <= LLAMA_MAX_LAYERS:
        raise r.error(f"key '{LLMKV.BLOCK_COUNT.key(r.arch)}' = {n_layer} is outside "
                      f"[1, {LLAMA_MAX_LAYERS}]")
    n_embd = r.get_int(LLMKV.EMBEDDING_LENGTH)
    if n_embd <= 0:
        raise r.error(f"key '{LLMKV.EMBEDDING_LENGTH.key(r.arch)}' = {n_embd} must be positive")

    n_ff_arr = r.get_int_or_arr(LLMKV.FEED_FORWARD_LENGTH, n_layer)
    n_head_arr = r.get_int_or_arr(LLMKV.ATTENTION_HEAD_COUNT, n_layer)
    # n_head_kv is optional and defaults to n_head (no GQA)
    n_head_kv_arr = r.get_int_or_arr(LLMKV.ATTENTION_HEAD_COUNT_KV, n_layer, default=n_head_arr)
    if n_head_arr[0] <= 0:
        raise r.error(f"key '{LLMKV.ATTENTION_HEAD_COUNT.key(r.arch)}' = {n_head_arr[0]} "
                      f"must be positive")
    n_embd_head_k = r.get_int(LLMKV.ATTENTION_KEY_LENGTH, n_embd // n_head_arr[0])
    n_embd_head_v = r.get_int(LLMKV.ATTENTION_VALUE_LENGTH, n_embd // n_head_arr[0])
    n_rot = r.get_int(LLMKV.ROPE_DIMENSION_COUNT, n_embd_head_k)

    if r.has(LLMKV.VOCAB_SIZE):
        n_vocab = r.get_int(LLMKV.VOCAB_SIZE)
    elif LLMKV.TOKENIZER_LIST.key() in r.kv:
        n_vocab = len(r.kv[LLMKV.TOKENIZER_LIST.key()])
    else:
        raise r.error(f"missing both '{LLMKV.VOCAB_SIZE.key(r.arch)}' and "
                      f"'{LLMKV.TOKENIZER_LIST.key()}': cannot tell the vocabulary size")

    n_ctx_train = r.get_int(LLMKV.CONTEXT_LENGTH)
    rope_freq_base = r.get_float(LLMKV.ROPE_FREQ_BASE, 10000.0)
    scaling_name = r.get_str(LLMKV.ROPE_SCALING_TYPE, "linear")
    if scaling_name not in _ROPE_SCALING_NAMES:
        raise r.error(f"key '{LLMKV.ROPE_SCALING_TYPE.key(r.arch)}' = '{scaling_name}' is not "
                      f"one of {sorted(_ROPE_SCALING_NAMES)}")
    # the GGUF stores the scaling factor; the graph uses its inverse
    if r.has(LLMKV.ROPE_SCALING_FACTOR):
        rope_scale = r.get_float(LLMKV.ROPE_SCALING_FACTOR)
    else:
        rope_scale = r.get_float(LLMKV.ROPE_SCALE_LINEAR, 0.0)
    rope_freq_scale = 1.0 if rope_scale == 0.0 else 1.0 / rope_scale

    return HParams(
        arch=r.arch,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head_arr=n_head_arr,
        n_head_kv_arr=n_head_kv_arr,
        n_ff_arr=n_ff_arr,
        n_embd_head_k=n_embd_head_k,
        n_embd_head_v=n_embd_head_v,
        n_rot=n_rot,
        n_expert=r.get_int(LLMKV.EXPERT_COUNT, 0),
        n_expert_used=r.get_int(LLMKV.EXPERT_USED_COUNT, 0),
        rope_finetuned=r.get_bool(LLMKV.ROPE_SCALING_FINETUNED, False),
        rope_freq_base_train=rope_freq_base,
        rope_freq_scale_train=rope_freq_scale,
        # sliding-window layers use the same rope as the others unless the arch says otherwise
        rope_freq_base_train_swa=rope_freq_base,
        rope_freq_scale_train_swa=rope_freq_scale,
        rope_scaling_type_train=_ROPE_SCALING_NAMES[scaling_name],
        rope_attn_factor=r.get_float(LLMKV.ROPE_SCALING_ATTN_FACTOR, 1.0),
        n_ctx_orig_yarn=r.get_int(LLMKV.ROPE_SCALING_ORIG_CTX_LEN, n_ctx_train),
        rope_yarn_log_mul=r.get_float(LLMKV.ROPE_SCALING_YARN_LOG_MUL, 0.0),
        yarn_ext_factor=r.get_float(LLMKV.ROPE_SCALING_YARN_EXT_FACTOR, -1.0),
        yarn_attn_factor=r.get_float(LLMKV.ROPE_SCALING_YARN_ATTN_FACTOR, 1.0),
        yarn_beta_fast=r.get_float(LLMKV.ROPE_SCALING_YARN_BETA_FAST, 32.0),
        yarn_beta_slow=r.get_float(LLMKV.ROPE_SCALING_YARN_BETA_SLOW, 1.0),
    )


def _check(hp: HParams, r: _KVReader) -> None:
    """Consistency checks llama.cpp asserts; here they are load errors naming the key."""
    if hp.n_expert_used > hp.n_expert:
        raise r.error(f"'{LLMKV.EXPERT_USED_COUNT.key(r.arch)}' = {hp.n_expert_used} exceeds "
                      f"'{LLMKV.EXPERT_COUNT.key(r.arch)}' = {hp.n_expert}")
    if hp.n_expert > 0 and hp.n_expert_used == 0:
        raise r.error(f"'{LLMKV.EXPERT_COUNT.key(r.arch)}' = {hp.n_expert} needs a positive "
                      f"'{LLMKV.EXPERT_USED_COUNT.key(r.arch)}'")
    for il in range(hp.n_layer):
        n_head, n_head_kv = hp.n_head(il), hp.n_head_kv(il)
        if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv != 0:
            raise r.error(f"layer {il}: head count {n_head} ('"
                          f"{LLMKV.ATTENTION_HEAD_COUNT.key(r.arch)}') is not a positive multiple "
                          f"of KV head count {n_head_kv} ('"
                          f"{LLMKV.ATTENTION_HEAD_COUNT_KV.key(r.arch)}')")
        if hp.n_ff(il) <= 0:
            raise r.error(f"layer {il}: '{LLMKV.FEED_FORWARD_LENGTH.key(r.arch)}' = "
                          f"{hp.n_ff(il)} must be positive")
    if hp.swa_type != SWAType.NONE and hp.n_swa <= 0:
        raise r.error(f"sliding-window attention needs a positive "
                      f"'{LLMKV.ATTENTION_SLIDING_WINDOW.key(r.arch)}', got {hp.n_swa}")


# --- per-architecture extras (the arch switch of llama_model::load_hparams) ---

def _load_llama(hp: HParams, r: _KVReader) -> None:
    hp.f_norm_rms_eps = r.get_float(LLMKV.ATTENTION_LAYERNORM_RMS_EPS)
    if hp.n_rot != hp.n_embd_head_k:
        raise r.error(f"invalid '{LLMKV.ROPE_DIMENSION_COUNT.key(r.arch)}' = {hp.n_rot}: "
                      f"llama rotates whole heads, expected {hp.n_embd_head_k}")


def _load_qwen2(hp: HParams, r: _KVReader) -> None:
    hp.f_norm_rms_eps = r.get_float(LLMKV.ATTENTION_LAYERNORM_RMS_EPS)


def _load_qwen3(hp: HParams, r: _KVReader) -> None:
    hp.f_norm_rms_eps = r.get_float(LLMKV.ATTENTION_LAYERNORM_RMS_EPS)


def _load_phi3(hp: HParams, r: _KVReader) -> None:
    hp.f_norm_rms_eps = r.get_float(LLMKV.ATTENTION_LAYERNORM_RMS_EPS)
    # llama.cpp disables Phi-3's sliding window (its converters do not describe the pattern)
    hp.swa_type = SWAType.NONE
    hp.n_swa = 0
    hp.set_swa_pattern(1)


def _load_gemma2(hp: HParams, r: _KVReader) -> None:
    hp.swa_type = SWAType.STANDARD
    hp.n_swa = r.get_int(LLMKV.ATTENTION_SLIDING_WINDOW, 4096)
    hp.set_swa_pattern(2)
    hp.attn_soft_cap = True
    hp.f_norm_rms_eps = r.get_float(LLMKV.ATTENTION_LAYERNORM_RMS_EPS)
    hp.f_attn_logit_softcapping = r.get_float(LLMKV.ATTN_LOGIT_SOFTCAPPING, 50.0)
    hp.f_final_logit_softcapping = r.get_float(LLMKV.FINAL_LOGIT_SOFTCAPPING, 30.0)
    hp.f_attention_scale = _gemma_attention_scale(hp, is_27b=hp.n_layer == 46)


def _load_gemma3(hp: HParams, r: _KVReader) -> None:
    hp.n_swa = r.get_int(LLMKV.ATTENTION_SLIDING_WINDOW, 0)
    if hp.n_swa > 0:
        # 5 local layers then 1 global; local layers use their own rope base, as in llama.cpp
        hp.swa_type = SWAType.STANDARD
        hp.set_swa_pattern(6)
        hp.rope_freq_base_train_swa = 10000.0
        hp.rope_freq_scale_train_swa = 1.0
    else:
        hp.swa_type = SWAType.NONE
    hp.f_final_logit_softcapping = r.get_float(LLMKV.FINAL_LOGIT_SOFTCAPPING, 0.0)
    hp.f_norm_rms_eps = r.get_float(LLMKV.ATTENTION_LAYERNORM_RMS_EPS)
    hp.f_attention_scale = _gemma_attention_scale(hp, is_27b=hp.n_layer == 62)


def _gemma_attention_scale(hp: HParams, is_27b: bool) -> float:
    """Gemma's query scale: 1/sqrt(head dim), except the 27B models use n_embd / n_head."""
    if is_27b:
        return 1.0 / math.sqrt(float(hp.n_embd // hp.n_head(0)))
    return 1.0 / math.sqrt(float(hp.n_embd_head_k))


@dataclasses.dataclass(frozen=True)
class ArchHParams:
    """Per-architecture part of hparams loading: rope type (llama_model_rope_type) and extras."""

    rope_type: RopeType
    load_extras: Callable[[HParams, _KVReader], None]


ARCH_HPARAMS: dict[LLMArch, ArchHParams] = {
    LLMArch.LLAMA: ArchHParams(RopeType.NORM, _load_llama),
    LLMArch.QWEN2: ArchHParams(RopeType.NEOX, _load_qwen2),
    LLMArch.QWEN3: ArchHParams(RopeType.NEOX, _load_qwen3),
    LLMArch.PHI3: ArchHParams(RopeType.NEOX, _load_phi3),
    LLMArch.GEMMA2: ArchHParams(RopeType.NEOX, _load_gemma2),
    LLMArch.GEMMA3: ArchHParams(RopeType.NEOX, _load_gemma3),
}
