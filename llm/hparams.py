"""Model hyperparameters from GGUF metadata, mirroring llama.cpp's `llama_hparams` and
`llama_model::load_hparams`: the generic `%s.*` keys first, then the architecture's own
`load_hparams` in its file under llm/models/ (rope type, norm epsilon, sliding-window
pattern, soft-caps, ...), then the consistency checks.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING

import numpy as np

from llm.arch import LLMKV, LLMArch, arch_from_name, llm_arch_is_hybrid, llm_arch_is_recurrent
from llm.errors import MetadataError
from llm.loader import GGUFMeta

if TYPE_CHECKING:
    from llm.arch import ArchBuilder

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


class PoolingType(enum.IntEnum):
    """llama_pooling_type: how per-token embeddings become one vector per sequence."""

    UNSPECIFIED = -1
    NONE = 0
    MEAN = 1
    CLS = 2
    LAST = 3
    RANK = 4

    @classmethod
    def parse(cls, value: PoolingType | int | str) -> PoolingType:
        """A pooling type from its llama.cpp name ("none", "mean", "cls", "last", "rank") or value."""
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown pooling type '{value}' (known: none, mean, cls, last, rank)") from None
        try:
            return cls(int(value))
        except ValueError:
            raise ValueError(f"unknown pooling type {value!r} (known: none, mean, cls, last, rank)") from None


class ExpertGatingFuncType(enum.IntEnum):
    """llama_expert_gating_func_type: how a mixture of experts turns router logits into expert
    weights (llm.graph's build_moe_ffn). IntEnum with llama.cpp's values, the ones GGUF's
    `%s.expert_gating_func` stores; NONE means unset (llama.cpp's default), no function."""

    NONE = 0
    SOFTMAX = 1
    SIGMOID = 2
    SOFTMAX_WEIGHT = 3   # experts chosen by raw logits, the chosen logits softmaxed (gpt-oss)


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
    # the sliding-window layers' head sizes and rotated dimensions where they differ (gemma4:
    # 256 against the full layers' 512; llama.cpp's n_embd_head_k_swa, ...); 0: the full layers'
    n_embd_head_k_swa: int = 0
    n_embd_head_v_swa: int = 0
    n_rot_swa: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0                 # one expert's FFN width (0: n_ff / n_expert_used)
    n_ff_shexp: int = 0               # the shared expert's FFN width (0: n_ff)
    expert_weights_scale: float = 0.0
    n_token_types: int = 0            # BERT-style token types (tokenizer.ggml.token_type_count)
    n_moe_layer_step: int = 0         # llama4: every n-th layer is a mixture of experts
    n_layer_dense_lead: int = 0       # the first layers with a dense FFN (ernie4_5-moe, deepseek2, glm4moe)
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)    # M-RoPE pairs per t, h, w, e stream
    n_deepstack_layers: int = 0       # qwen3vl: layers that add a slice of an image's wider embedding
    # KV sharing (gemma3n): when >= 0, only the first n_layer_kv_from_start layers write a KV
    # cache; the later ones attend to an earlier layer's (kv_layer)
    n_layer_kv_from_start: int = -1
    # Gemma 3n's AltUp streams and the one the layers compute, Laurel's rank, the per-layer
    # embedding width: llama.cpp's fixed values (no GGUF keys)
    n_altup: int = 4
    i_altup_act: int = 0
    laurel_rank: int = 64
    n_embd_altup: int = 256
    n_embd_per_layer: int = 0         # gemma4: each layer's per-layer embedding width (0: none)
    n_layer_nextn: int = 0            # MTP blocks after the trunk, in block_count but not run (glm4moe)
    n_expert_shared: int = 0          # shared experts beside the routed ones (glm4moe, deepseek2)
    expert_weights_norm: bool = False  # renormalize the chosen experts' weights (glm4moe, deepseek2)
    expert_gating_func: int = 0       # ExpertGatingFuncType value from `%s.expert_gating_func`
    # multi-head latent attention (deepseek2): Q and KV ranks, the per-head K/V sizes after
    # decompression; the cache then holds each token's latent (n_embd_head_k = kv rank + rope)
    n_expert_groups: int = 0          # DeepSeek-V3's group-limited routing: groups of experts ...
    n_group_used: int = 0             # ... and how many of them stay selectable per token
    n_lora_q: int = 0
    n_lora_kv: int = 0
    n_embd_head_k_mla: int = 0
    n_embd_head_v_mla: int = 0
    use_kq_norm: bool = False         # llama4: weightless RMS norm of Q and K after rope
    # Apertus' xIELU activation per layer: the file's raw alphas (ops.xielu constrains them)
    xielu_alpha_n: list[float] = dataclasses.field(default_factory=list)
    xielu_alpha_p: list[float] = dataclasses.field(default_factory=list)
    xielu_beta: list[float] = dataclasses.field(default_factory=list)
    xielu_eps: list[float] = dataclasses.field(default_factory=list)
    # state-space layers (Mamba, Mamba-2 and the hybrids): conv kernel width, inner width,
    # state size, dt rank (Mamba-2: the head count), B/C groups; which layers are recurrent
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_dt_rank: int = 0
    ssm_n_group: int = 0
    ssm_dt_b_c_rms: bool = False      # falcon-mamba: RMS norm of dt, B and C
    n_shortconv_l_cache: int = 0      # LFM2: the short convolution's kernel width
    recurrent_layers: list[bool] = dataclasses.field(default_factory=list)

    f_norm_eps: float = 0.0
    f_norm_rms_eps: float = 0.0
    f_attn_logit_softcapping: float = 50.0
    f_final_logit_softcapping: float = 30.0
    attn_soft_cap: bool = False
    # 0 means "use 1/sqrt(n_embd_head_k)" (llama.cpp's build_attn convention)
    f_attention_scale: float = 0.0
    # Granite's multipliers (0 = not used)
    f_embedding_scale: float = 0.0
    f_residual_scale: float = 0.0
    f_logit_scale: float = 0.0
    # attention temperature tuning (llama4, mistral3): 0 = off
    f_attn_temp_scale: float = 0.0
    f_attn_temp_offset: float = 0.0
    n_attn_temp_floor_scale: int = 0
    causal_attn: bool = True
    pooling_type: PoolingType = PoolingType.NONE   # the model's default (%s.pooling_type)
    n_cls_out: int = 1                             # classifier outputs (rank pooling)

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
    # layers that rotate Q and K (llama.cpp's rope_pattern); empty means all of them
    rope_layers: list[bool] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.swa_layers:
            self.swa_layers = [False] * self.n_layer
        if not self.rope_layers:
            self.rope_layers = [True] * self.n_layer
        if not self.recurrent_layers:
            self.recurrent_layers = [False] * self.n_layer
        for name in ("n_head_arr", "n_head_kv_arr", "n_ff_arr", "swa_layers", "rope_layers", "recurrent_layers"):
            if len(getattr(self, name)) != self.n_layer:
                raise ValueError(f"HParams.{name} has {len(getattr(self, name))} entries, "
                                 f"expected n_layer = {self.n_layer}")

    @property
    def is_mla(self) -> bool:
        """llama_hparams::is_mla: the cache holds the compressed latent, V is a view of K."""
        return self.n_embd_head_k_mla != 0 and self.n_embd_head_v_mla != 0

    def drop_nextn_layers(self, n: int) -> None:
        """Leave the last n blocks (MTP / NextN layers, counted in block_count) out of the
        trunk, as llama.cpp's n_layer() = n_layer_all - n_layer_nextn."""
        if not 0 <= n < self.n_layer:
            raise ValueError(f"{n} NextN layers of {self.n_layer} blocks: the trunk would be empty")
        self.n_layer_nextn = n
        if n:
            self.n_layer -= n
            for name in ("n_head_arr", "n_head_kv_arr", "n_ff_arr", "swa_layers", "rope_layers", "recurrent_layers"):
                setattr(self, name, getattr(self, name)[:self.n_layer])

    def _layer(self, il: int) -> int:
        if not 0 <= il < self.n_layer:
            raise IndexError(f"layer {il} out of range [0, {self.n_layer})")
        return il

    def is_recurrent(self, il: int) -> bool:
        """Does layer il keep a recurrent state (a Mamba block) rather than a KV cache?"""
        return self.recurrent_layers[self._layer(il)]

    def n_embd_r(self) -> int:
        """Width of one sequence's conv state in a recurrent layer (llama_hparams::n_embd_r):
        the last d_conv - 1 inputs of every conv channel (LFM2: of its n_embd channels)."""
        if self.n_shortconv_l_cache:
            return self.n_embd * (self.n_shortconv_l_cache - 1)
        return max(self.ssm_d_conv - 1, 0) * (self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state)

    def n_embd_s(self) -> int:
        """Width of one sequence's SSM state in a recurrent layer (llama_hparams::n_embd_s)."""
        return self.ssm_d_state * self.ssm_d_inner

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

    def n_embd_head_k_l(self, il: int) -> int:
        """Layer il's key head size (llama_hparams::n_embd_head_k(il)): SWA layers may have their own."""
        return (self.n_embd_head_k_swa or self.n_embd_head_k) if self.is_swa(il) else self.n_embd_head_k

    def n_embd_head_v_l(self, il: int) -> int:
        """Layer il's value head size (llama_hparams::n_embd_head_v(il))."""
        return (self.n_embd_head_v_swa or self.n_embd_head_v) if self.is_swa(il) else self.n_embd_head_v

    def n_rot_l(self, il: int) -> int:
        """Layer il's rotated dimensions (llama_hparams::n_rot(il))."""
        return (self.n_rot_swa or self.n_rot) if self.is_swa(il) else self.n_rot

    def n_embd_k_gqa(self, il: int = 0) -> int:
        """Width of one token's keys over all KV heads of layer il."""
        return self.n_embd_head_k_l(il) * self.n_head_kv(il)

    def n_embd_v_gqa(self, il: int = 0) -> int:
        """Width of one token's values over all KV heads of layer il."""
        return self.n_embd_head_v_l(il) * self.n_head_kv(il)

    def n_embd_inp(self) -> int:
        """Width of an input embedding: n_embd, and a slice for each DeepStack layer (qwen3vl)."""
        return self.n_embd * (1 + self.n_deepstack_layers)

    def n_pos_per_embd(self) -> int:
        """Positions per token: 4 (t, h, w, e) for M-RoPE models, else 1 (llama_hparams)."""
        return 4 if self.rope_type in (RopeType.MROPE, RopeType.IMROPE) else 1

    def has_rope(self, il: int) -> bool:
        """Does layer il rotate its queries and keys (and so its cached keys on a shift)?"""
        return self.rope_type != RopeType.NONE and self.rope_layers[self._layer(il)]

    def is_swa(self, il: int) -> bool:
        """Does layer il use sliding-window attention?"""
        return self.swa_layers[self._layer(il)]

    def has_kv(self, il: int) -> bool:
        """Does layer il write a KV cache of its own (llama_hparams::has_kv)?"""
        return self.n_layer_kv_from_start < 0 or self._layer(il) < self.n_layer_kv_from_start

    def kv_layer(self, il: int) -> int:
        """The layer whose KV cache layer il attends to: il itself when it has one, else
        n_layer_kv_from_start - 2 for a sliding-window layer and - 1 for a full one (llama.cpp's
        layer_reuse for Gemma 3n: the last layer of each kind in its pattern)."""
        if self.has_kv(il):
            return il
        return self.n_layer_kv_from_start - (2 if self.is_swa(il) else 1)

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


def load_hparams(ml: GGUFMeta, builder: ArchBuilder) -> HParams:
    """HParams from GGUF metadata: the generic keys, then `builder.load_hparams` for the
    architecture's extras (`builder` is `llm.models.get_arch(ml.arch_name)`).

    Raises ModelLoadError naming the file and the key for a missing required key, a value of
    the wrong type or an inconsistent value.
    """
    hp = _load_generic(ml)
    _check_sizes(hp, ml)
    builder.load_hparams(hp, ml)
    _check_values(hp, ml)
    return hp


def _load_generic(ml: GGUFMeta) -> HParams:
    """The keys every architecture shares (the part of load_hparams before the arch switch)."""
    arch = arch_from_name(ml.arch_name)
    n_layer = ml.get_key(LLMKV.BLOCK_COUNT, int)
    if not 0 < n_layer <= LLAMA_MAX_LAYERS:
        raise ml.error(f"key '{ml.key_name(LLMKV.BLOCK_COUNT)}' = {n_layer} is outside "
                      f"[1, {LLAMA_MAX_LAYERS}]")
    n_embd = ml.get_key(LLMKV.EMBEDDING_LENGTH, int)
    if n_embd <= 0:
        raise ml.error(f"key '{ml.key_name(LLMKV.EMBEDDING_LENGTH)}' = {n_embd} must be positive")

    # recurrent layers have no heads and Mamba blocks no FFN: llama.cpp reads both as optional
    recurrent = llm_arch_is_recurrent(arch) or llm_arch_is_hybrid(arch)
    none = [0] * n_layer if recurrent else None
    n_ff_arr = ml.get_key_or_arr(LLMKV.FEED_FORWARD_LENGTH, int, n_layer, default=none)
    n_head_arr = ml.get_key_or_arr(LLMKV.ATTENTION_HEAD_COUNT, int, n_layer, default=none)
    # n_head_kv is optional and defaults to n_head (no GQA)
    n_head_kv_arr = ml.get_key_or_arr(LLMKV.ATTENTION_HEAD_COUNT_KV, int, n_layer, default=n_head_arr)
    n_head0 = max(n_head_arr) if recurrent else n_head_arr[0]
    if n_head0 <= 0 and not (recurrent and n_head0 == 0):
        raise ml.error(f"key '{ml.key_name(LLMKV.ATTENTION_HEAD_COUNT)}' = {n_head_arr[0]} "
                      f"must be positive")
    if n_head0 and n_embd % n_head0 and not ml.has_key(LLMKV.ATTENTION_KEY_LENGTH):
        raise _invalid(ml, LLMKV.ATTENTION_HEAD_COUNT, n_head0,
                       f"does not divide '{ml.key_name(LLMKV.EMBEDDING_LENGTH)}' = {n_embd} "
                       f"(and '{ml.key_name(LLMKV.ATTENTION_KEY_LENGTH)}' is not given)")
    head_size = n_embd // n_head0 if n_head0 else 0
    n_embd_head_k = ml.get_key(LLMKV.ATTENTION_KEY_LENGTH, int, head_size)
    n_embd_head_v = ml.get_key(LLMKV.ATTENTION_VALUE_LENGTH, int, head_size)
    n_rot = ml.get_key(LLMKV.ROPE_DIMENSION_COUNT, int, n_embd_head_k)

    if ml.has_key(LLMKV.VOCAB_SIZE):
        n_vocab = ml.get_key(LLMKV.VOCAB_SIZE, int)
    elif ml.has_key(LLMKV.TOKENIZER_LIST):
        n_vocab = ml.get_arr_len(LLMKV.TOKENIZER_LIST, str)
    else:
        raise ml.error(f"missing both '{ml.key_name(LLMKV.VOCAB_SIZE)}' and "
                      f"'{LLMKV.TOKENIZER_LIST.key()}': cannot tell the vocabulary size")

    n_ctx_train = ml.get_key(LLMKV.CONTEXT_LENGTH, int)
    rope_freq_base = ml.get_key(LLMKV.ROPE_FREQ_BASE, float, 10000.0)
    scaling_name = ml.get_key(LLMKV.ROPE_SCALING_TYPE, str, "linear")
    if scaling_name not in _ROPE_SCALING_NAMES:
        raise ml.error(f"key '{ml.key_name(LLMKV.ROPE_SCALING_TYPE)}' = '{scaling_name}' is not "
                      f"one of {sorted(_ROPE_SCALING_NAMES)}")
    # the GGUF stores the scaling factor; the graph uses its inverse
    scale_key = LLMKV.ROPE_SCALING_FACTOR if ml.has_key(LLMKV.ROPE_SCALING_FACTOR) else LLMKV.ROPE_SCALE_LINEAR
    rope_scale = ml.get_key(scale_key, float, 0.0)
    rope_freq_scale = 1.0 if rope_scale == 0.0 else 1.0 / rope_scale
    if not (rope_scale >= 0.0 and math.isfinite(rope_scale) and math.isfinite(rope_freq_scale)):
        raise _invalid(ml, scale_key, rope_scale, "must be a finite number >= 0 (0: no scaling)")

    pooling = ml.get_key(LLMKV.POOLING_TYPE, int, int(PoolingType.NONE))
    if pooling not in {int(p) for p in PoolingType}:
        raise ml.error(f"key '{ml.key_name(LLMKV.POOLING_TYPE)}' = {pooling} is not a pooling type")
    labels = ml.get_arr(LLMKV.CLASSIFIER_OUTPUT_LABELS, str, [])

    return HParams(
        arch=arch,
        recurrent_layers=[llm_arch_is_recurrent(arch)] * n_layer,
        causal_attn=ml.get_key(LLMKV.ATTENTION_CAUSAL, bool, True),
        n_token_types=ml.get_key(LLMKV.TOKENIZER_TOKEN_TYPE_COUNT, int, 0),
        pooling_type=PoolingType(pooling),
        n_cls_out=len(labels) or 1,
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
        n_embd_head_k_swa=ml.get_key(LLMKV.ATTENTION_KEY_LENGTH_SWA, int, 0),
        n_embd_head_v_swa=ml.get_key(LLMKV.ATTENTION_VALUE_LENGTH_SWA, int, 0),
        n_rot_swa=ml.get_key(LLMKV.ROPE_DIMENSION_COUNT_SWA, int, 0),
        n_expert=ml.get_key(LLMKV.EXPERT_COUNT, int, 0),
        n_expert_used=ml.get_key(LLMKV.EXPERT_USED_COUNT, int, 0),
        rope_finetuned=ml.get_key(LLMKV.ROPE_SCALING_FINETUNED, bool, False),
        rope_freq_base_train=rope_freq_base,
        rope_freq_scale_train=rope_freq_scale,
        # sliding-window layers use the same rope as the others unless the arch says otherwise
        rope_freq_base_train_swa=rope_freq_base,
        rope_freq_scale_train_swa=rope_freq_scale,
        rope_scaling_type_train=_ROPE_SCALING_NAMES[scaling_name],
        rope_attn_factor=ml.get_key(LLMKV.ROPE_SCALING_ATTN_FACTOR, float, 1.0),
        n_ctx_orig_yarn=ml.get_key(LLMKV.ROPE_SCALING_ORIG_CTX_LEN, int, n_ctx_train),
        rope_yarn_log_mul=ml.get_key(LLMKV.ROPE_SCALING_YARN_LOG_MUL, float, 0.0),
        yarn_ext_factor=ml.get_key(LLMKV.ROPE_SCALING_YARN_EXT_FACTOR, float, -1.0),
        yarn_attn_factor=ml.get_key(LLMKV.ROPE_SCALING_YARN_ATTN_FACTOR, float, 1.0),
        yarn_beta_fast=ml.get_key(LLMKV.ROPE_SCALING_YARN_BETA_FAST, float, 32.0),
        yarn_beta_slow=ml.get_key(LLMKV.ROPE_SCALING_YARN_BETA_SLOW, float, 1.0),
    )


def _invalid(ml: GGUFMeta, key: LLMKV, value: object, rule: str) -> MetadataError:
    """A value that has the right type but no meaning: the error names the file and the key."""
    name = ml.key_name(key)
    return MetadataError(ml.path, name, f"key '{name}' = {value} {rule}")


def _check_sizes(hp: HParams, ml: GGUFMeta) -> None:
    """The generic sizes, before the architecture derives values from them."""
    vocab_key = LLMKV.VOCAB_SIZE if ml.has_key(LLMKV.VOCAB_SIZE) else LLMKV.TOKENIZER_LIST
    ints = [  # (key, value, lowest allowed)
        (vocab_key, hp.n_vocab, 1),
        (LLMKV.CONTEXT_LENGTH, hp.n_ctx_train, 1),
        (LLMKV.ATTENTION_KEY_LENGTH, hp.n_embd_head_k, 0 if all(hp.recurrent_layers) else 1),
        (LLMKV.ATTENTION_VALUE_LENGTH, hp.n_embd_head_v, 0 if all(hp.recurrent_layers) else 1),
        (LLMKV.ATTENTION_KEY_LENGTH_SWA, hp.n_embd_head_k_swa, 0),
        (LLMKV.ATTENTION_VALUE_LENGTH_SWA, hp.n_embd_head_v_swa, 0),
        (LLMKV.ROPE_SCALING_ORIG_CTX_LEN, hp.n_ctx_orig_yarn, 1),
        (LLMKV.EXPERT_COUNT, hp.n_expert, 0),
        (LLMKV.EXPERT_USED_COUNT, hp.n_expert_used, 0),
    ]
    for key, value, lo in ints:
        if value < lo:
            raise _invalid(ml, key, value, f"must be >= {lo}")
    recurrent = llm_arch_is_recurrent(hp.arch) or llm_arch_is_hybrid(hp.arch)
    for il in range(hp.n_layer):
        n_head, n_head_kv = hp.n_head(il), hp.n_head_kv(il)
        if recurrent and n_head_kv == 0 and n_head >= 0:
            continue        # a recurrent layer (the architecture says which, and checks its sizes)
        if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv != 0:
            raise ml.error(f"layer {il}: head count {n_head} ('"
                          f"{ml.key_name(LLMKV.ATTENTION_HEAD_COUNT)}') is not a positive multiple "
                          f"of KV head count {n_head_kv} ('"
                          f"{ml.key_name(LLMKV.ATTENTION_HEAD_COUNT_KV)}')")
        if hp.n_ff(il) <= 0 and not (recurrent and hp.n_ff(il) == 0):     # hybrids: attention-only layers
            raise ml.error(f"layer {il}: '{ml.key_name(LLMKV.FEED_FORWARD_LENGTH)}' = "
                          f"{hp.n_ff(il)} must be positive")


def _check_values(hp: HParams, ml: GGUFMeta) -> None:
    """Every value in range and consistent with the others, so a bad file fails here, naming
    the key, rather than as NaN logits or failed decodes later. The weights' shapes are
    checked against these values when the tensors are declared (ModelLoader.create_tensor)."""
    positive = "must be a finite number > 0"
    floats = [  # (key, value, ok): every float the graphs use
        # an architecture reads one of the two epsilons; LayerNorm ones (bert, gpt2, ...) leave rms at 0
        (LLMKV.ATTENTION_LAYERNORM_RMS_EPS, hp.f_norm_rms_eps,
         0.0 < hp.f_norm_rms_eps < 1.0 or (hp.f_norm_rms_eps == 0.0 and 0.0 < hp.f_norm_eps < 1.0),
         "must be a finite number in (0, 1)"),
        (LLMKV.ATTENTION_LAYERNORM_EPS, hp.f_norm_eps, 0.0 <= hp.f_norm_eps < 1.0,
         "must be a finite number in [0, 1)"),
        (LLMKV.ROPE_FREQ_BASE, hp.rope_freq_base_train, hp.rope_freq_base_train > 0.0, positive),
        (LLMKV.ROPE_FREQ_BASE_SWA, hp.rope_freq_base_train_swa, hp.rope_freq_base_train_swa > 0.0, positive),
        (LLMKV.ROPE_SCALING_ATTN_FACTOR, hp.rope_attn_factor, hp.rope_attn_factor > 0.0, positive),
        (LLMKV.ROPE_SCALING_YARN_LOG_MUL, hp.rope_yarn_log_mul, True, "must be finite"),
        (LLMKV.ROPE_SCALING_YARN_EXT_FACTOR, hp.yarn_ext_factor, True, "must be finite"),
        (LLMKV.ROPE_SCALING_YARN_ATTN_FACTOR, hp.yarn_attn_factor, hp.yarn_attn_factor > 0.0, positive),
        (LLMKV.ROPE_SCALING_YARN_BETA_FAST, hp.yarn_beta_fast, True, "must be finite"),
        (LLMKV.ROPE_SCALING_YARN_BETA_SLOW, hp.yarn_beta_slow, True, "must be finite"),
        (LLMKV.ATTN_LOGIT_SOFTCAPPING, hp.f_attn_logit_softcapping,
         hp.f_attn_logit_softcapping > 0.0 or not hp.attn_soft_cap, positive),
        (LLMKV.FINAL_LOGIT_SOFTCAPPING, hp.f_final_logit_softcapping, hp.f_final_logit_softcapping >= 0.0,
         "must be a finite number >= 0 (0: no soft-capping)"),
        (LLMKV.ATTENTION_SCALE, hp.f_attention_scale, hp.f_attention_scale >= 0.0,
         "must be a finite number >= 0 (0: 1/sqrt(head size))"),
    ]
    for key, value, ok, rule in floats:
        if not (math.isfinite(value) and ok):
            raise _invalid(ml, key, value, rule)
    if hp.rope_type != RopeType.NONE and not (0 < hp.n_rot <= hp.n_embd_head_k and hp.n_rot % 2 == 0):
        raise _invalid(ml, LLMKV.ROPE_DIMENSION_COUNT, hp.n_rot,
                       f"must be even and in [2, head size {hp.n_embd_head_k}]: rope turns pairs of values")
    if hp.rope_type != RopeType.NONE and hp.n_rot_swa and not (
            0 < hp.n_rot_swa <= (hp.n_embd_head_k_swa or hp.n_embd_head_k) and hp.n_rot_swa % 2 == 0):
        raise _invalid(ml, LLMKV.ROPE_DIMENSION_COUNT_SWA, hp.n_rot_swa,
                       "must be even and in [2, the sliding-window layers' head size]: rope turns pairs of values")
    if hp.n_expert_used > hp.n_expert:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_USED_COUNT)}' = {hp.n_expert_used} exceeds "
                      f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' = {hp.n_expert}")
    if hp.n_expert > 0 and hp.n_expert_used == 0:
        raise ml.error(f"'{ml.key_name(LLMKV.EXPERT_COUNT)}' = {hp.n_expert} needs a positive "
                      f"'{ml.key_name(LLMKV.EXPERT_USED_COUNT)}'")
    if hp.n_swa < 0:
        raise _invalid(ml, LLMKV.ATTENTION_SLIDING_WINDOW, hp.n_swa, "must be >= 0")
    if hp.swa_type != SWAType.NONE and hp.n_swa <= 0:
        raise ml.error(f"sliding-window attention needs a positive "
                      f"'{ml.key_name(LLMKV.ATTENTION_SLIDING_WINDOW)}', got {hp.n_swa}")


def load_swa_pattern(hp: HParams, ml, n_pattern: int) -> None:
    """llama.cpp's load_swa_pattern: `%s.attention.sliding_window_pattern` as one bool per
    layer, or as a period (every n-th layer dense), else the architecture's default period."""
    from llm.arch import LLMKV
    key = ml.key_name(LLMKV.ATTENTION_SLIDING_WINDOW_PATTERN)
    value = ml.kv.get(key)
    if isinstance(value, (list, tuple, np.ndarray)):
        pattern = ml.get_arr(LLMKV.ATTENTION_SLIDING_WINDOW_PATTERN, bool)
        if len(pattern) != hp.n_layer:
            raise ml.error(f"'{key}' has {len(pattern)} values, expected one per layer ({hp.n_layer})")
        hp.swa_layers = list(pattern)
        return
    hp.set_swa_pattern(ml.get_key(LLMKV.ATTENTION_SLIDING_WINDOW_PATTERN, int, n_pattern))
