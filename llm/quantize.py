"""llama.cpp's llama_model_quantize: a GGUF model rewritten in a llama-quantize file type.

`model_quantize(in_path, out_path, QuantizeParams(ftype=LlamaFType.MOSTLY_Q4_K_M))` writes the
bytes llama.cpp writes for the same input: the same tensor order (non-layer tensors, then by
layer, by name within), the same per-tensor type choice (src/llama-quant.cpp's
llama_tensor_get_type: the output and token embedding, attention V / output, FFN down and the
first and last layers by `use_more_bits`, MoE experts, rows that do not divide the block size
falling back), the same metadata (the input's keys, split keys removed, general.quantization_version
and general.file_type set last) and the same quantized bytes (ggmlx.quants.quantize, bit-exact
with ggml_quantize_chunk). The output goes to a temporary file renamed at the end, so an error
leaves no partial file.

With an importance matrix (`imatrix`, as `load_imatrix` reads llama-imatrix's files) the
quantizers take ggml's weighted paths, also bit-exact; the IQ1 / IQ2 file types (IQ1_S, IQ1_M,
IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M, and IQ3_XXS whose attention Q/K are IQ2_S) need one, as in
llama.cpp. Not implemented (QuantizeError says so): the NVFP4 / Q1_0 / Q2_0 file types (no such
ggmlx types).
"""
from __future__ import annotations

import enum
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np

from ggmlx import gguf, quants
from ggmlx.gguf import GGUFReader, GGUFValueType, GGUFWriter, TensorInfo
from ggmlx.types import GGMLType, block_size, traits
from llm.arch import LLMKV

log = logging.getLogger(__name__)

GGML_QNT_VERSION = 2        # general.quantization_version that ggml writes
# Elements each thread quantizes at a time (whole rows; llama.cpp's chunks are 32 * 512): large,
# as the quantizers run best on large chunks, and the pipeline runs several tensors at once.
_THREAD_CHUNK = 1 << 20
# Input elements quantized ahead of the writer, at most (plus one tensor).
_AHEAD_ELEMENTS = 1 << 24


class QuantizeError(ValueError):
    """A quantization that cannot be done: bad type, input or output (the message says which)."""


class LlamaFType(enum.IntEnum):
    """llama_ftype: the file types of llama-quantize (general.file_type)."""
    ALL_F32 = 0
    MOSTLY_F16 = 1
    MOSTLY_Q4_0 = 2
    MOSTLY_Q4_1 = 3
    MOSTLY_Q8_0 = 7
    MOSTLY_Q5_0 = 8
    MOSTLY_Q5_1 = 9
    MOSTLY_Q2_K = 10
    MOSTLY_Q3_K_S = 11
    MOSTLY_Q3_K_M = 12
    MOSTLY_Q3_K_L = 13
    MOSTLY_Q4_K_S = 14
    MOSTLY_Q4_K_M = 15
    MOSTLY_Q5_K_S = 16
    MOSTLY_Q5_K_M = 17
    MOSTLY_Q6_K = 18
    MOSTLY_IQ2_XXS = 19
    MOSTLY_IQ2_XS = 20
    MOSTLY_Q2_K_S = 21
    MOSTLY_IQ3_XS = 22
    MOSTLY_IQ3_XXS = 23
    MOSTLY_IQ1_S = 24
    MOSTLY_IQ4_NL = 25
    MOSTLY_IQ3_S = 26
    MOSTLY_IQ3_M = 27
    MOSTLY_IQ2_S = 28
    MOSTLY_IQ2_M = 29
    MOSTLY_IQ4_XS = 30
    MOSTLY_IQ1_M = 31
    MOSTLY_BF16 = 32
    MOSTLY_TQ1_0 = 36
    MOSTLY_TQ2_0 = 37
    MOSTLY_MXFP4_MOE = 38


F = LlamaFType
T = GGMLType

# llama_ftype_get_default_type
DEFAULT_TYPE: dict[LlamaFType, GGMLType] = {
    F.MOSTLY_Q4_0: T.Q4_0, F.MOSTLY_Q4_1: T.Q4_1, F.MOSTLY_Q5_0: T.Q5_0, F.MOSTLY_Q5_1: T.Q5_1,
    F.MOSTLY_Q8_0: T.Q8_0, F.MOSTLY_F16: T.F16, F.MOSTLY_BF16: T.BF16, F.ALL_F32: T.F32,
    F.MOSTLY_MXFP4_MOE: T.MXFP4,
    F.MOSTLY_Q2_K_S: T.Q2_K, F.MOSTLY_Q2_K: T.Q2_K, F.MOSTLY_IQ3_XS: T.IQ3_S,
    F.MOSTLY_Q3_K_S: T.Q3_K, F.MOSTLY_Q3_K_M: T.Q3_K, F.MOSTLY_Q3_K_L: T.Q3_K,
    F.MOSTLY_Q4_K_S: T.Q4_K, F.MOSTLY_Q4_K_M: T.Q4_K, F.MOSTLY_Q5_K_S: T.Q5_K, F.MOSTLY_Q5_K_M: T.Q5_K,
    F.MOSTLY_Q6_K: T.Q6_K, F.MOSTLY_TQ1_0: T.TQ1_0, F.MOSTLY_TQ2_0: T.TQ2_0,
    F.MOSTLY_IQ2_XXS: T.IQ2_XXS, F.MOSTLY_IQ2_XS: T.IQ2_XS, F.MOSTLY_IQ2_S: T.IQ2_XS, F.MOSTLY_IQ2_M: T.IQ2_S,
    F.MOSTLY_IQ3_XXS: T.IQ3_XXS, F.MOSTLY_IQ1_S: T.IQ1_S, F.MOSTLY_IQ1_M: T.IQ1_M,
    F.MOSTLY_IQ4_NL: T.IQ4_NL, F.MOSTLY_IQ4_XS: T.IQ4_XS, F.MOSTLY_IQ3_S: T.IQ3_S, F.MOSTLY_IQ3_M: T.IQ3_S,
}

# The names llama-quantize takes for TYPE (tools/quantize/quantize.cpp QUANT_OPTIONS, in its order);
# "COPY" copies every tensor as it is.
FTYPE_NAMES: dict[str, LlamaFType] = {
    "Q4_0": F.MOSTLY_Q4_0, "Q4_1": F.MOSTLY_Q4_1, "MXFP4_MOE": F.MOSTLY_MXFP4_MOE,
    "Q5_0": F.MOSTLY_Q5_0, "Q5_1": F.MOSTLY_Q5_1,
    "IQ2_XXS": F.MOSTLY_IQ2_XXS, "IQ2_XS": F.MOSTLY_IQ2_XS, "IQ2_S": F.MOSTLY_IQ2_S, "IQ2_M": F.MOSTLY_IQ2_M,
    "IQ1_S": F.MOSTLY_IQ1_S, "IQ1_M": F.MOSTLY_IQ1_M, "TQ1_0": F.MOSTLY_TQ1_0, "TQ2_0": F.MOSTLY_TQ2_0,
    "Q2_K": F.MOSTLY_Q2_K, "Q2_K_S": F.MOSTLY_Q2_K_S, "IQ3_XXS": F.MOSTLY_IQ3_XXS, "IQ3_S": F.MOSTLY_IQ3_S,
    "IQ3_M": F.MOSTLY_IQ3_M, "Q3_K": F.MOSTLY_Q3_K_M, "IQ3_XS": F.MOSTLY_IQ3_XS, "Q3_K_S": F.MOSTLY_Q3_K_S,
    "Q3_K_M": F.MOSTLY_Q3_K_M, "Q3_K_L": F.MOSTLY_Q3_K_L, "IQ4_NL": F.MOSTLY_IQ4_NL, "IQ4_XS": F.MOSTLY_IQ4_XS,
    "Q4_K": F.MOSTLY_Q4_K_M, "Q4_K_S": F.MOSTLY_Q4_K_S, "Q4_K_M": F.MOSTLY_Q4_K_M, "Q5_K": F.MOSTLY_Q5_K_M,
    "Q5_K_S": F.MOSTLY_Q5_K_S, "Q5_K_M": F.MOSTLY_Q5_K_M, "Q6_K": F.MOSTLY_Q6_K, "Q8_0": F.MOSTLY_Q8_0,
    "F16": F.MOSTLY_F16, "BF16": F.MOSTLY_BF16, "F32": F.ALL_F32, "COPY": F.ALL_F32,
}

# The ftype llama_model_loader guesses from the most common tensor type (no general.file_type).
_FTYPE_OF_TYPE: dict[GGMLType, LlamaFType] = {
    T.F32: F.ALL_F32, T.F16: F.MOSTLY_F16, T.BF16: F.MOSTLY_BF16, T.Q4_0: F.MOSTLY_Q4_0, T.Q4_1: F.MOSTLY_Q4_1,
    T.Q5_0: F.MOSTLY_Q5_0, T.Q5_1: F.MOSTLY_Q5_1, T.Q8_0: F.MOSTLY_Q8_0, T.MXFP4: F.MOSTLY_MXFP4_MOE,
    T.Q2_K: F.MOSTLY_Q2_K, T.Q3_K: F.MOSTLY_Q3_K_M, T.Q4_K: F.MOSTLY_Q4_K_M, T.Q5_K: F.MOSTLY_Q5_K_M,
    T.Q6_K: F.MOSTLY_Q6_K, T.TQ1_0: F.MOSTLY_TQ1_0, T.TQ2_0: F.MOSTLY_TQ2_0, T.IQ2_XXS: F.MOSTLY_IQ2_XXS,
    T.IQ2_XS: F.MOSTLY_IQ2_XS, T.IQ2_S: F.MOSTLY_IQ2_S, T.IQ3_XXS: F.MOSTLY_IQ3_XXS, T.IQ1_S: F.MOSTLY_IQ1_S,
    T.IQ1_M: F.MOSTLY_IQ1_M, T.IQ4_NL: F.MOSTLY_IQ4_NL, T.IQ4_XS: F.MOSTLY_IQ4_XS, T.IQ3_S: F.MOSTLY_IQ3_S,
}
FTYPE_GUESSED = 1024


# llama-quantize's file types whose tensor types ggmlx does not have.
_NO_GGMLX_TYPE = {"NVFP4": 39, "Q1_0": 40, "Q2_0": 41}


def parse_ftype(name: str) -> tuple[LlamaFType, bool]:
    """A llama-quantize TYPE (a name, any case, or a number) -> (ftype, only_copy)."""
    upper = name.upper()
    if upper in FTYPE_NAMES:
        return FTYPE_NAMES[upper], upper == "COPY"
    if upper in _NO_GGMLX_TYPE or upper in {str(v) for v in _NO_GGMLX_TYPE.values()}:
        raise QuantizeError(f"file type {upper} is not implemented (ggmlx has no such tensor type)")
    try:
        return LlamaFType(int(name)), False
    except ValueError:
        raise QuantizeError(f"invalid ftype '{name}': one of {', '.join(FTYPE_NAMES)}") from None


def parse_ggml_type(name: str) -> GGMLType:
    """A ggml type name as ggml_type_name spells it (q4_K, f16, ...), any case."""
    try:
        return GGMLType[name.upper()]
    except KeyError:
        raise QuantizeError(f"invalid ggml_type '{name}': one of {', '.join(t.name for t in GGMLType)}") from None


@dataclass
class QuantizeParams:
    """llama_model_quantize_params (with llama-quantize's --include/--exclude-weights)."""
    ftype: LlamaFType = LlamaFType.MOSTLY_Q8_0
    nthread: int = 0                                # <= 0: the number of CPUs
    output_tensor_type: GGMLType | None = None
    token_embedding_type: GGMLType | None = None
    allow_requantize: bool = False
    quantize_output_tensor: bool = True             # False: --leave-output-tensor
    only_copy: bool = False                         # llama-quantize's COPY
    pure: bool = False
    keep_split: bool = False
    imatrix: dict[str, np.ndarray] | None = None    # tensor name -> importance per column (ne0 * n_expert)
    include_weights: list[str] = field(default_factory=list)
    exclude_weights: list[str] = field(default_factory=list)
    tensor_types: list[tuple[str, GGMLType]] = field(default_factory=list)   # (regex, type), first match
    # keys set last in the output (llama.cpp's kv_overrides): a bool, an int (written as the UINT32
    # of its absolute value, as llama.cpp does), a float (FLOAT32) or a str
    kv_overrides: list[tuple[str, bool | int | float | str]] = field(default_factory=list)

    def importance(self) -> dict[str, np.ndarray] | None:
        """The imatrix entries --include-weights / --exclude-weights leave (name substrings); None
        when they leave none, as llama-quantize then passes no imatrix at all."""
        if self.imatrix is None:
            return None
        kept = {n: np.asarray(v, np.float32).reshape(-1) for n, v in self.imatrix.items()
                if not any(p in n for p in self.exclude_weights)
                and (not self.include_weights or any(p in n for p in self.include_weights))}
        return kept if kept or not (self.include_weights or self.exclude_weights) else None


# --- which type each tensor gets (src/llama-quant.cpp) ----------------------------------------


class Category(enum.Enum):
    """tensor_category: the broad roles the type choice distinguishes."""
    TOKEN_EMBD = enum.auto()
    ATTENTION_Q = enum.auto()
    ATTENTION_V = enum.auto()
    ATTENTION_K = enum.auto()
    ATTENTION_QKV = enum.auto()
    ATTENTION_KV_B = enum.auto()
    ATTENTION_OUTPUT = enum.auto()
    FFN_UP = enum.auto()
    FFN_GATE = enum.auto()
    FFN_DOWN = enum.auto()
    OUTPUT = enum.auto()
    OTHER = enum.auto()


TOKEN_EMBD_NAMES = ("token_embd.weight", "per_layer_token_embd.weight")
OUTPUT_NAME = "output.weight"
# (substring, category), tested in this order after the exact names.
_CATEGORY_PARTS = (
    ("attn_qkv.weight", Category.ATTENTION_QKV), ("attn_kv_b.weight", Category.ATTENTION_KV_B),
    ("attn_v.weight", Category.ATTENTION_V), ("attn_k.weight", Category.ATTENTION_K),
    ("attn_q.weight", Category.ATTENTION_Q), ("attn_output.weight", Category.ATTENTION_OUTPUT),
    ("ffn_up", Category.FFN_UP), ("ffn_gate", Category.FFN_GATE), ("ffn_down", Category.FFN_DOWN),
)
_ATTN_V_LIKE = (Category.ATTENTION_V, Category.ATTENTION_QKV, Category.ATTENTION_KV_B)


def tensor_category(name: str) -> Category:
    if name == OUTPUT_NAME:
        return Category.OUTPUT
    if name in TOKEN_EMBD_NAMES:
        return Category.TOKEN_EMBD
    for part, cat in _CATEGORY_PARTS:
        if part in name:
            return cat
    return Category.OTHER


# Substrings of the 2-d weights llama.cpp never quantizes (norms, routers, small or
# positional tensors of particular architectures).
_NEVER_QUANTIZED_PARTS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos",
    ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
_NEVER_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")


def n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last one above 1 (at least 1)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def allows_quantization(name: str, ne: tuple[int, ...], params: QuantizeParams) -> bool:
    """tensor_allows_quantization: 2-d and 3-d weights, except those listed above."""
    if params.only_copy or n_dims(ne) < 2:
        return False
    # llama.cpp's `name.rfind("weight") == name.size() - 6` (true for a 5-character name too)
    if not (name.endswith("weight") or len(name) == 5):
        return False
    if not params.quantize_output_tensor and name == OUTPUT_NAME:
        return False
    if name in _NEVER_QUANTIZED_NAMES:
        return False
    return not any(part in name for part in _NEVER_QUANTIZED_PARTS)


@dataclass(frozen=True)
class ModelInfo:
    """The hyperparameters the type choice reads (layer 0's head counts, as hparams.n_gqa())."""
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """LLM_TYPE_70B: what llama.cpp calls an 80-layer llama with grouped-query attention."""
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv


def _first_int(value: object, default: int) -> int:
    """A scalar key, or an array key's first element (per-layer head counts)."""
    if value is None:
        return default
    if isinstance(value, (list, tuple, np.ndarray)):
        return int(value[0]) if len(value) else default
    return int(value)   # type: ignore[call-overload]


def model_info(kv: dict[str, object]) -> ModelInfo:
    arch = str(kv.get(LLMKV.GENERAL_ARCHITECTURE.key(), ""))
    if not arch:
        raise QuantizeError(f"the model has no {LLMKV.GENERAL_ARCHITECTURE.key()} key")
    n_head = _first_int(kv.get(LLMKV.ATTENTION_HEAD_COUNT.key(arch)), 0)
    return ModelInfo(arch=arch, n_layer=_first_int(kv.get(LLMKV.BLOCK_COUNT.key(arch)), 0), n_head=n_head,
                     n_head_kv=_first_int(kv.get(LLMKV.ATTENTION_HEAD_COUNT_KV.key(arch)), n_head),
                     n_expert=_first_int(kv.get(LLMKV.EXPERT_COUNT.key(arch)), 0))


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The first and last eighth of the layers, and every third one between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


_IQ12 = (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ1_M)
_LAYER_RE = re.compile(r"blk\.([+-]?\d+)")     # sscanf(name, "blk.%d.", &il) == 1


@dataclass
class _Counters:
    """quantize_state_impl's counters: attention-V-like tensors and FFN layers seen so far."""
    n_attention_wv: int = 0
    n_layer: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    n_fallback: int = 0


class TypeChooser:
    """llama_tensor_get_type over a model's tensors, called in file order (it counts as it goes)."""

    def __init__(self, info: ModelInfo, params: QuantizeParams, ftype: LlamaFType, names: list[str],
                 has_imatrix: bool):
        self.info = info
        self.params = params
        self.ftype = ftype
        self.has_imatrix = has_imatrix
        self.tied = OUTPUT_NAME not in names        # the token embedding doubles as the output
        self.c = _Counters(n_attention_wv=sum(tensor_category(n) in _ATTN_V_LIKE for n in names),
                           n_layer=info.n_layer)
        self.overrides = [(re.compile(p), t) for p, t in params.tensor_types]

    def choose(self, name: str, ne: tuple[int, ...], cur_type: GGMLType, default: GGMLType) -> GGMLType:
        if not allows_quantization(name, ne, self.params):
            return cur_type
        cat = tensor_category(name)
        if self.params.token_embedding_type is not None and cat == Category.TOKEN_EMBD:
            return self.params.token_embedding_type
        if self.params.output_tensor_type is not None and cat == Category.OUTPUT:
            return self.params.output_tensor_type
        if not traits(default).is_quantized:
            return default
        new_type = default
        manual = next((t for p, t in self.overrides if p.search(name)), None)
        if manual is not None:
            new_type = manual
        elif not self.params.pure:
            new_type = self._mix(new_type, name, ne, cat)
        return self._fallback(name, ne[0], new_type)

    def _fallback(self, name: str, ncols: int, t: GGMLType) -> GGMLType:
        """tensor_type_fallback: a type whose block divides the rows; F16 when that one does not
        either, or when there is none (the legacy types)."""
        if ncols % block_size(t) == 0:
            return t
        self.c.n_fallback += 1
        fallback = _FALLBACK.get(t, GGMLType.F16)
        if ncols % block_size(fallback):
            fallback = GGMLType.F16
        log.info("%s: %d columns not divisible by %d (required for %s), falling back to %s",
                    name, ncols, block_size(t), t.name, fallback.name)
        return fallback

    def _layer(self, i_counter: int, name: str) -> tuple[int, int]:
        """layer_info: the counter, or with experts the layer number in the name."""
        n = self.c.n_layer
        if self.info.n_expert <= 1:
            return i_counter, n
        m = _LAYER_RE.match(name)
        if m is None:
            raise QuantizeError(f"failed to determine the layer of tensor {name}")
        il = int(m.group(1))
        if not 0 <= il < n:
            raise QuantizeError(f"bad layer {il} for tensor {name}: must be in [0, {n})")
        return il, n

    def _mix(self, new_type: GGMLType, name: str, ne: tuple[int, ...], cat: Category) -> GGMLType:
        """llama_tensor_get_type_impl: the file type's mixture."""
        ftype, info = self.ftype, self.info
        if cat == Category.OUTPUT or (self.tied and cat == Category.TOKEN_EMBD):
            return self._output_type(new_type, ne)
        if ftype == F.MOSTLY_MXFP4_MOE:
            is_expert = info.arch != "bailingmoe3" or cat in (Category.FFN_UP, Category.FFN_GATE, Category.FFN_DOWN)
            return T.MXFP4 if len(ne) > 2 and ne[2] > 1 and is_expert else T.Q8_0
        if cat == Category.TOKEN_EMBD:
            return _TOKEN_EMBD_TYPE.get(ftype, new_type)
        if ftype in _IQ12:
            return self._mix_iq12(new_type, cat)
        if cat in _ATTN_V_LIKE:
            return self._attn_v(new_type)
        if cat in (Category.ATTENTION_K, Category.ATTENTION_Q):
            if cat == Category.ATTENTION_K and info.n_expert == 8:
                return T.Q8_0
            return {F.MOSTLY_IQ3_XS: T.IQ3_XXS, F.MOSTLY_IQ3_XXS: T.IQ2_S}.get(ftype, new_type)
        if cat == Category.FFN_DOWN:
            il, n = self._layer(self.c.i_ffn_down, name)
            self.c.i_ffn_down += 1
            return self._ffn_down(new_type, il, n)
        if cat == Category.ATTENTION_OUTPUT:
            return self._attn_output(new_type)
        if cat in (Category.FFN_GATE, Category.FFN_UP):
            gate = cat == Category.FFN_GATE
            il, n = self._layer(self.c.i_ffn_gate if gate else self.c.i_ffn_up, name)
            if gate:
                self.c.i_ffn_gate += 1
            else:
                self.c.i_ffn_up += 1
            if ftype == F.MOSTLY_IQ3_XS and n // 8 <= il < 7 * n // 8:
                return T.IQ3_XXS
        return new_type

    def _output_type(self, new_type: GGMLType, ne: tuple[int, ...]) -> GGMLType:
        if self.params.output_tensor_type is not None:
            return self.params.output_tensor_type
        if self.ftype == F.MOSTLY_MXFP4_MOE or self.info.arch == "falcon" or ne[0] % block_size(new_type):
            return T.Q8_0
        if self.ftype in (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S,
                          F.MOSTLY_IQ2_M, F.MOSTLY_IQ1_M):
            return T.Q5_K
        return new_type if new_type == T.Q8_0 else T.Q6_K

    def _mix_iq12(self, new_type: GGMLType, cat: Category) -> GGMLType:
        """The IQ1 / IQ2 file types' rules."""
        ftype, info = self.ftype, self.info
        iq2_s_m = ftype in (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M)
        if cat in _ATTN_V_LIKE:
            self.c.i_attention_wv += 1
            if info.n_gqa >= 4 or info.n_expert >= 4:
                return T.Q4_K
            return T.IQ3_S if iq2_s_m else T.Q2_K
        if info.n_expert == 8 and cat == Category.ATTENTION_K:
            return T.Q4_K
        if cat == Category.FFN_DOWN:
            early = self.c.i_ffn_down < self.c.n_layer // 8
            self.c.i_ffn_down += 1
            if early:
                return T.IQ3_S if iq2_s_m else T.Q2_K
        elif cat == Category.ATTENTION_OUTPUT:
            if info.n_expert == 8:
                return T.Q5_K
            if ftype in (F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
                return T.IQ2_XXS
            if iq2_s_m:
                return T.IQ3_S
        return new_type

    def _attn_v(self, new_type: GGMLType) -> GGMLType:
        """Attention V (and fused QKV, MLA's kv_b) of the non-IQ1/IQ2 file types."""
        ftype, info, c = self.ftype, self.info, self.c
        gqa4 = info.n_gqa >= 4
        if ftype == F.MOSTLY_Q2_K:
            new_type = T.Q4_K if gqa4 else T.Q3_K
        elif ftype == F.MOSTLY_Q2_K_S and gqa4:
            new_type = T.Q4_K
        elif ftype == F.MOSTLY_IQ3_XXS:
            new_type = T.Q4_K if gqa4 else T.IQ3_S if not self.has_imatrix else T.IQ3_XXS
        elif ftype in (F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S) and gqa4:
            new_type = T.Q4_K
        elif ftype == F.MOSTLY_IQ3_M:
            new_type = T.Q4_K
        elif ftype == F.MOSTLY_Q3_K_M:
            new_type = T.Q5_K if c.i_attention_wv < 2 else T.Q4_K
        elif ftype == F.MOSTLY_Q3_K_L:
            new_type = T.Q5_K
        elif ftype in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and gqa4:
            new_type = T.Q5_K
        elif ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(c.i_attention_wv, c.n_attention_wv):
            new_type = T.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and c.i_attention_wv < 4:
            new_type = T.Q5_K
        if info.is_70b and new_type in (T.Q3_K, T.Q4_K):
            new_type = T.Q5_K
        if info.n_expert == 8:
            new_type = T.Q8_0
        c.i_attention_wv += 1
        return new_type

    def _ffn_down(self, new_type: GGMLType, il: int, n: int) -> GGMLType:
        ftype, info = self.ftype, self.info
        falcon = info.arch == "falcon"
        if ftype == F.MOSTLY_Q2_K:
            return T.Q3_K
        if ftype == F.MOSTLY_Q2_K_S:
            return T.Q4_K if il < n // 8 else new_type
        if ftype == F.MOSTLY_IQ3_XXS and not self.has_imatrix:
            return T.Q4_K if il < n // 8 else T.Q3_K
        if ftype == F.MOSTLY_Q3_K_M:
            return T.Q5_K if il < n // 16 else T.Q4_K if not falcon or use_more_bits(il, n) else T.Q3_K
        if ftype == F.MOSTLY_IQ3_M and (il < n // 8 or (info.n_expert == 8 and use_more_bits(il, n))):
            return T.Q4_K
        if ftype == F.MOSTLY_Q3_K_L:
            return T.Q4_K if falcon else T.Q5_K
        if ftype == F.MOSTLY_Q4_K_M:
            if falcon:
                return T.Q6_K if il < n // 16 else T.Q5_K if use_more_bits(il, n) else T.Q4_K
            return T.Q6_K if use_more_bits(il, n) else new_type
        if il < n // 8 and ftype in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and not self.has_imatrix:
            return T.Q5_K
        if ftype == F.MOSTLY_Q5_K_M and use_more_bits(il, n):
            return T.Q6_K
        if ftype == F.MOSTLY_Q4_K_S and not falcon and il < n // 8:
            return T.Q5_K
        if ftype in (F.MOSTLY_Q4_0, F.MOSTLY_Q5_0) and self.has_imatrix and il < n // 8:
            return T.Q4_1 if ftype == F.MOSTLY_Q4_0 else T.Q5_1
        return new_type

    def _attn_output(self, new_type: GGMLType) -> GGMLType:
        ftype, info = self.ftype, self.info
        if info.arch == "falcon":
            return T.Q4_K if ftype == F.MOSTLY_Q3_K_L else new_type
        if info.n_expert == 8:
            return T.Q5_K if ftype in _ATTN_OUTPUT_Q5K_8_EXPERTS else new_type
        return {F.MOSTLY_Q2_K: T.Q3_K, F.MOSTLY_IQ3_XXS: T.IQ3_S, F.MOSTLY_Q3_K_M: T.Q4_K,
                F.MOSTLY_Q3_K_L: T.Q5_K, F.MOSTLY_IQ3_M: T.Q4_K}.get(ftype, new_type)


_FALLBACK: dict[GGMLType, GGMLType] = {
    T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL,
    T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL,
    T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.TQ1_0: T.Q4_0, T.TQ2_0: T.Q4_0,
    T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
}
_TOKEN_EMBD_TYPE: dict[LlamaFType, GGMLType] = {
    F.MOSTLY_IQ2_XXS: T.Q2_K, F.MOSTLY_IQ2_XS: T.Q2_K, F.MOSTLY_IQ1_S: T.Q2_K, F.MOSTLY_IQ1_M: T.Q2_K,
    F.MOSTLY_IQ2_S: T.IQ3_S, F.MOSTLY_IQ2_M: T.IQ3_S, F.MOSTLY_IQ3_XXS: T.IQ3_S,
    F.MOSTLY_TQ1_0: T.Q4_K, F.MOSTLY_TQ2_0: T.Q4_K,
}
_ATTN_OUTPUT_Q5K_8_EXPERTS = (
    F.MOSTLY_Q2_K, F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_Q3_K_S, F.MOSTLY_Q3_K_M, F.MOSTLY_IQ4_NL,
    F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M, F.MOSTLY_IQ3_S, F.MOSTLY_IQ3_M, F.MOSTLY_IQ4_XS)


def requires_imatrix(name: str, t: GGMLType, ftype: LlamaFType) -> bool:
    """tensor_requires_imatrix: the IQ1/IQ2/IQ3_XXS types (and Q2_K in a Q2_K_S file), except
    for the token embedding and the output."""
    if name in TOKEN_EMBD_NAMES or name == OUTPUT_NAME:
        return False
    if t in (T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S):
        return True
    return t == T.Q2_K and ftype == F.MOSTLY_Q2_K_S


# --- the driver (llama_model_quantize_impl) ------------------------------------------------------

_SPLIT_KEYS = (LLMKV.SPLIT_NO.key(), LLMKV.SPLIT_COUNT.key(), LLMKV.SPLIT_TENSORS_COUNT.key())


@dataclass
class _Planned:
    """One tensor of the output: where it comes from and the type it gets."""
    info: TensorInfo
    new_type: GGMLType

    @property
    def ne(self) -> tuple[int, ...]:
        return self.info.ne[:n_dims(self.info.ne)]


def _sort_key(name: str) -> tuple[int, bytes]:
    """weight_name_comparer: tensors outside the layers first, then by layer; by name within."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)) if m else -1, name.encode())


def _file_ftype(reader: GGUFReader) -> int:
    """llama_model_loader's ftype: general.file_type, else guessed from the commonest tensor type."""
    key = LLMKV.GENERAL_FILE_TYPE.key()
    if key in reader.kv:
        return int(reader.kv[key])   # type: ignore[call-overload]
    counts: dict[GGMLType, int] = {}
    for ti in reader.tensors.values():
        counts[ti.type] = counts.get(ti.type, 0) + 1
    commonest = max(sorted(counts), key=lambda t: counts[t]) if counts else T.F32
    return int(_FTYPE_OF_TYPE.get(commonest, F.ALL_F32)) | FTYPE_GUESSED


def plan(reader: GGUFReader, params: QuantizeParams, ftype: LlamaFType, has_imatrix: bool) -> list[_Planned]:
    """Every tensor in output order with its new type; refuses what cannot be done before writing
    (a missing importance matrix first, as llama.cpp checks that before it quantizes)."""
    default = DEFAULT_TYPE[ftype]
    infos = sorted(reader.tensors.values(), key=lambda ti: _sort_key(ti.name))
    if params.keep_split:
        infos.sort(key=lambda ti: (ti.shard, ti.offset))
    chooser = TypeChooser(model_info(reader.kv), params, ftype, [ti.name for ti in infos], has_imatrix)
    out = [_Planned(ti, chooser.choose(ti.name, ti.ne[:n_dims(ti.ne)], ti.type, default)) for ti in infos]
    for p in out:
        if not has_imatrix and allows_quantization(p.info.name, p.ne, params) \
                and requires_imatrix(p.info.name, p.new_type, ftype):
            raise QuantizeError(f"this quantization requires an importance matrix (--imatrix): "
                                f"tensor {p.info.name} gets {p.new_type.name}")
    for p in out:
        if p.new_type != p.info.type:
            _check_convertible(p.info, p.new_type, params)
    if chooser.c.n_fallback:
        log.warning("%d of %d tensor(s) required fallback quantization", chooser.c.n_fallback, len(out))
    return out


def _check_convertible(ti: TensorInfo, new_type: GGMLType, params: QuantizeParams) -> None:
    if new_type not in quants.QUANTIZE_TYPES:
        raise QuantizeError(f"tensor {ti.name}: quantizing to {new_type.name} is not implemented "
                            f"(supported: {', '.join(t.name for t in quants.QUANTIZE_TYPES)})")
    if ti.type in (T.F32, T.F16, T.BF16):
        return
    if not traits(ti.type).is_quantized or ti.type not in quants.SUPPORTED_TYPES:
        raise QuantizeError(f"tensor {ti.name}: cannot dequantize/convert tensor type {ti.type.name}")
    if not params.allow_requantize:
        raise QuantizeError(f"tensor {ti.name}: requantizing from type {ti.type.name} is disabled "
                            f"(--allow-requantize)")


_KV = tuple[str, object, GGUFValueType, GGUFValueType | None]


def _override(key: str, value: bool | int | float | str) -> _KV:
    """A kv_override as llama_model_quantize sets it (an int as the UINT32 of its absolute value)."""
    if isinstance(value, bool):
        return key, value, GGUFValueType.BOOL, None
    if isinstance(value, int):
        return key, abs(value) & 0xFFFFFFFF, GGUFValueType.UINT32, None
    if isinstance(value, float):
        return key, value, GGUFValueType.FLOAT32, None
    return key, str(value), GGUFValueType.STRING, None


def _metadata(reader: GGUFReader, ftype: int, overrides: list[tuple[str, bool | int | float | str]]) -> list[_KV]:
    """The input's keys without the split keys, then general.quantization_version,
    general.file_type and the overrides (gguf_set_val moves an existing key to the end)."""
    kv: list[_KV] = [(k, v, reader.kv_types[k], reader.kv_array_types.get(k)) for k, v in reader.kv.items()
                     if k not in _SPLIT_KEYS]
    qv, ft = LLMKV.GENERAL_QUANTIZATION_VERSION.key(), LLMKV.GENERAL_FILE_TYPE.key()
    for key, number in ((qv, GGML_QNT_VERSION), (ft, ftype)):
        kv = [e for e in kv if e[0] != key] + [(key, number, GGUFValueType.UINT32, None)]
    for key, value in overrides:
        kv = [e for e in kv if e[0] != key] + [_override(key, value)]
    return kv


def _f32_rows(ti: TensorInfo) -> np.ndarray:
    """The tensor as float32 rows [n_rows, ne0] (F16/BF16 converted, quant types dequantized)."""
    if ti.type == T.F32:
        x = ti.data.view(np.float32)
    elif ti.type in (T.F16, T.BF16) or traits(ti.type).is_quantized:
        x = quants.dequantize(ti.data, ti.type, ti.ne)
    else:
        raise QuantizeError(f"tensor {ti.name}: cannot dequantize/convert tensor type {ti.type.name}")
    return x.reshape(-1, ti.ne[0])


def _tensor_importance(p: _Planned, importance: dict[str, np.ndarray] | None, ftype: LlamaFType
                       ) -> np.ndarray | None:
    """The tensor's importance rows [n_expert, ne0], as llama_model_quantize_impl looks it up."""
    if importance is None:
        return None
    name, ne = p.info.name, p.info.ne
    n_expert = ne[2] if len(ne) > 2 else 1
    v = importance.get(name)
    if v is not None and v.size != ne[0] * n_expert:
        if name not in TOKEN_EMBD_NAMES:
            raise QuantizeError(f"imatrix size {v.size} is different from tensor size {ne[0] * n_expert} "
                                f"for {name}")
        log.info("imatrix size %d is different from tensor size %d for %s: not used", v.size,
                 ne[0] * n_expert, name)
        v = None
    if v is None:
        if requires_imatrix(name, p.new_type, ftype):
            raise QuantizeError(f"missing importance matrix for tensor {name} in a very low-bit quantization")
        log.info("the imatrix has no weights for %s", name)
        return None
    return v.reshape(n_expert, ne[0])


_Job = tuple[np.ndarray, np.ndarray | None]     # rows of one expert, and its importance


def _jobs(p: _Planned, importance: dict[str, np.ndarray] | None, ftype: LlamaFType) -> list[_Job]:
    """One tensor's rows in chunks of about _THREAD_CHUNK elements (never across experts: each has
    its own importance), as llama.cpp hands them to its threads."""
    ti = p.info
    im = _tensor_importance(p, importance, ftype)
    rows = _f32_rows(ti)
    n_expert = ti.ne[2] if len(ti.ne) > 2 else 1
    per_expert = rows.shape[0] // n_expert
    step = max(1, min(per_expert, _THREAD_CHUNK // rows.shape[1]))
    return [(rows[e * per_expert + i:e * per_expert + min(i + step, per_expert)], None if im is None else im[e])
            for e in range(n_expert) for i in range(0, per_expert, step)]


def _run_job(name: str, t: GGMLType, job: _Job) -> np.ndarray:
    """Quantize one chunk and check it as ggml_validate_row_data does (while it is in cache)."""
    try:
        part = quants.quantize(job[0], t, job[1]).reshape(-1)
    except ValueError as e:
        raise QuantizeError(f"tensor {name}: {e}") from None
    if not quants.validate_row_data(part, t):
        raise QuantizeError(f"tensor {name}: quantized data validation failed ({t.name} scales or "
                            f"values are not finite: the input is out of range)")
    return part


class _Pipeline:
    """The output tensors' bytes in file order, quantized ahead of the writer: the chunks of the
    next tensors (up to _AHEAD_ELEMENTS) wait in the pool while the current one is written, so the
    threads stay busy across tensors and writes."""

    def __init__(self, planned: list[_Planned], pool: ThreadPoolExecutor | None,
                 importance: dict[str, np.ndarray] | None, ftype: LlamaFType):
        self.planned, self.pool, self.importance, self.ftype = planned, pool, importance, ftype
        self.by_name = {p.info.name: p for p in planned}
        self.pending: dict[str, list[Future[np.ndarray]]] = {}
        self.next = 0
        self.ahead = 0

    def _submit(self) -> None:
        while self.pool is not None and self.next < len(self.planned) and self.ahead < _AHEAD_ELEMENTS:
            p = self.planned[self.next]
            self.next += 1
            if p.new_type != p.info.type:
                jobs = _jobs(p, self.importance, self.ftype)
                self.pending[p.info.name] = [self.pool.submit(_run_job, p.info.name, p.new_type, j) for j in jobs]
                self.ahead += p.info.n_elements

    def data(self, name: str) -> np.ndarray:
        p = self.by_name[name]
        if p.new_type == p.info.type:
            return p.info.data
        self._submit()
        futures = self.pending.pop(name, None)
        if futures is None:         # no pool: quantized here, in turn
            return np.concatenate([_run_job(name, p.new_type, j) for j in _jobs(p, self.importance, self.ftype)])
        parts = [f.result() for f in futures]
        self.ahead -= p.info.n_elements
        self._submit()
        return np.concatenate(parts)

    def cancel(self) -> None:
        """Drop the chunks still queued (after an error: the pool would otherwise run them)."""
        for futures in self.pending.values():
            for f in futures:
                f.cancel()


@contextmanager
def _temporary(paths: list[str]) -> Iterator[list[str]]:
    """Temporary files next to `paths`, renamed onto them when the block succeeds, removed if not."""
    temps: list[str] = []
    try:
        for path in paths:
            d, base = os.path.split(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=d)
            os.close(fd)
            temps.append(tmp)
        yield temps
        for tmp, path in zip(temps, paths, strict=True):
            os.replace(tmp, path)
        temps = []
    except OSError as e:
        raise QuantizeError(f"cannot write {e.filename or paths[0]}: {e.strerror}") from None
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)


def _writers(reader: GGUFReader, planned: list[_Planned], params: QuantizeParams, ftype: int) -> list[GGUFWriter]:
    """One GGUFWriter per output file: all keys in the first; with keep_split, one per input
    shard, each with the split keys (the others hold no other key, as llama.cpp writes them)."""
    n_split = max(p.info.shard for p in planned) + 1 if params.keep_split and planned else 1
    writers = [GGUFWriter() for _ in range(n_split)]
    for k, v, vtype, atype in _metadata(reader, ftype, params.kv_overrides):
        writers[0].add_kv(k, v, vtype, atype)
    if n_split > 1:
        for i, w in enumerate(writers):
            w.add_kv(LLMKV.SPLIT_NO.key(), i, GGUFValueType.UINT16)
            w.add_kv(LLMKV.SPLIT_COUNT.key(), n_split, GGUFValueType.UINT16)
            w.add_kv(LLMKV.SPLIT_TENSORS_COUNT.key(), len(planned), GGUFValueType.INT32)
    for p in planned:
        writers[p.info.shard if n_split > 1 else 0].add_tensor_info(p.info.name, p.new_type, p.ne)
    return writers


def output_paths(out_path: str | os.PathLike, n_split: int, keep_split: bool) -> list[str]:
    """The output file(s): with keep_split, llama_split_path(out_path, i, n) for each shard."""
    if not keep_split:
        return [os.fspath(out_path)]
    return [gguf.split_path(out_path, i, n_split) for i in range(n_split)]


def input_files(in_path: str | os.PathLike) -> list[str]:
    """The file(s) of a model: its shards when it is split."""
    with GGUFReader(in_path) as r:
        return [s.path for s in r.shards]


def output_files(in_path: str | os.PathLike, out_path: str | os.PathLike, keep_split: bool) -> list[str]:
    """The file(s) model_quantize(in_path, out_path) writes."""
    return output_paths(out_path, len(input_files(in_path)), keep_split)


def model_quantize(in_path: str | os.PathLike, out_path: str | os.PathLike,
                   params: QuantizeParams | None = None) -> list[str]:
    """llama_model_quantize: write `in_path` quantized as `params.ftype`; returns the file(s) written.

    Raises QuantizeError for what llama.cpp refuses (and for what is not implemented here), with
    nothing written; ggmlx.gguf.GGUFError for a broken input file."""
    params = params or QuantizeParams()
    try:
        ftype = LlamaFType(params.ftype)
    except ValueError:
        raise QuantizeError(f"invalid output file type {params.ftype}") from None
    importance = params.importance()
    if importance is not None and not all(np.isfinite(v).all() for v in importance.values()):
        raise QuantizeError("the imatrix contains non-finite values")
    nthread = params.nthread if params.nthread > 0 else (os.cpu_count() or 1)
    with ExitStack() as stack:
        reader = stack.enter_context(GGUFReader(in_path))
        file_ftype = _file_ftype(reader) if params.only_copy else int(ftype)
        if importance and not set(importance) & set(reader.tensors):
            raise QuantizeError(f"the imatrix names none of the model's tensors (made for another model?), "
                                f"e.g. {next(iter(importance))}")
        planned = plan(reader, params, ftype, importance is not None)
        writers = _writers(reader, planned, params, file_ftype)
        paths = output_paths(out_path, len(writers), params.keep_split)
        pool = stack.enter_context(ThreadPoolExecutor(nthread)) if nthread > 1 else None
        pipeline = _Pipeline(planned, pool, importance, ftype)
        stack.callback(pipeline.cancel)
        with _temporary(paths) as temps:
            for w, tmp in zip(writers, temps, strict=True):
                w.write(tmp, pipeline.data)
    log.debug("quantized %s to %s as %s", in_path, ", ".join(paths), ftype.name)
    return paths


# --- importance matrix files (llama-quantize's load_imatrix, common_imatrix_load) ---------------


@dataclass
class ImatrixFile:
    """An importance matrix as llama-quantize reads it: per tensor the mean squared activation
    of each column (per expert for 3-d tensors), and the provenance llama-imatrix recorded."""
    values: dict[str, np.ndarray]
    datasets: list[str]
    chunk_count: int


_IN_SUM2, _COUNTS = ".in_sum2", ".counts"


def _imatrix_gguf(path: str, r: GGUFReader) -> ImatrixFile:
    """The GGUF format: <name>.in_sum2 (sums of squares, per expert) and <name>.counts (per expert)."""
    keys = (LLMKV.IMATRIX_DATASETS.key(), LLMKV.IMATRIX_CHUNK_COUNT.key(), LLMKV.IMATRIX_CHUNK_SIZE.key())
    if not all(k in r.kv for k in keys):
        raise QuantizeError(f"{path}: missing imatrix metadata ({', '.join(k for k in keys if k not in r.kv)})")
    datasets = r.kv[keys[0]]
    values: dict[str, np.ndarray] = {}
    for name, ti in r.tensors.items():
        if not name.endswith(_IN_SUM2):
            continue
        base = name[:-len(_IN_SUM2)]
        counts_ti = r.tensors.get(base + _COUNTS)
        if counts_ti is None or ti.type != T.F32 or counts_ti.type != T.F32:
            raise QuantizeError(f"{path}: {base}: needs F32 {_IN_SUM2} and {_COUNTS} tensors")
        sums = ti.data.view(np.float32)
        c = counts_ti.data.view(np.float32).astype(np.float64)
        counts = (np.sign(c) * np.floor(np.abs(c) + 0.5)).astype(np.float32)     # std::lround, as float
        if not counts.size or sums.size % counts.size:
            raise QuantizeError(f"{path}: {base}: {sums.size} sums for {counts.size} counts")
        per = sums.reshape(counts.size, -1)
        with np.errstate(divide="ignore", invalid="ignore"):
            values[base] = np.where(counts[:, None] > 0, per / counts[:, None], np.float32(1)).reshape(-1)
    return ImatrixFile(values, [str(d) for d in datasets] if isinstance(datasets, list) else [],
                       int(r.kv[keys[1]]))   # type: ignore[call-overload]


def _imatrix_legacy(path: str) -> ImatrixFile:
    """The legacy .dat format: int32 n; per entry int32 name length, name, int32 ncall, int32 n,
    n float32 (sums of squares scaled to ncall calls); then optionally int32 chunks, int32 length,
    the dataset name."""
    data = np.fromfile(path, dtype=np.uint8)
    at = 0

    def i32() -> int:
        nonlocal at
        if at + 4 > data.size:
            raise QuantizeError(f"{path}: truncated imatrix file (at byte {at})")
        v = int(data[at:at + 4].view(np.int32)[0])
        at += 4
        return v

    def raw(n: int) -> np.ndarray:
        nonlocal at
        if n < 0 or at + n > data.size:
            raise QuantizeError(f"{path}: truncated imatrix file (at byte {at})")
        at += n
        return data[at - n:at]

    n_entries = i32()
    if n_entries < 1:
        raise QuantizeError(f"{path}: no data in the imatrix file")
    values: dict[str, np.ndarray] = {}
    for _ in range(n_entries):
        name = raw(i32()).tobytes().decode(errors="replace")
        ncall, nval = i32(), i32()
        if nval < 1:
            raise QuantizeError(f"{path}: entry {name!r} has {nval} values")
        sums = raw(4 * nval).view(np.float32)
        values[name] = sums / np.float32(ncall) if ncall > 0 else sums.copy()
    chunk_count, datasets = 0, []
    if at < data.size:
        chunk_count = i32()
        if at + 4 <= data.size:
            n = i32()
            if n > 0 and at + n <= data.size:
                datasets.append(raw(n).tobytes().split(b"\0")[0].decode(errors="replace"))
    return ImatrixFile(values, datasets, chunk_count)


def load_imatrix(path: str | os.PathLike) -> ImatrixFile:
    """An importance matrix file, GGUF (llama-imatrix's default) or the legacy .dat format."""
    path = os.fspath(path)
    try:
        reader = GGUFReader(path)
    except gguf.GGUFError:
        return _imatrix_legacy(path)
    with reader:
        return _imatrix_gguf(path, reader)


def _c_string(s: str) -> str:
    """What fits llama_model_kv_override's char[128] (llama-quantize copies 127 bytes)."""
    return s.encode()[:127].decode(errors="ignore")


def imatrix_overrides(path: str, imatrix: ImatrixFile, n_entries: int) -> list[tuple[str, bool | int | float | str]]:
    """The provenance keys llama-quantize writes with an importance matrix of n_entries tensors."""
    out: list[tuple[str, bool | int | float | str]] = [(LLMKV.QUANTIZE_IMATRIX_FILE.key(), _c_string(path))]
    if imatrix.datasets:
        out.append((LLMKV.QUANTIZE_IMATRIX_DATASET.key(), _c_string(imatrix.datasets[0])))
    out.append((LLMKV.QUANTIZE_IMATRIX_N_ENTRIES.key(), n_entries))
    if imatrix.chunk_count > 0:
        out.append((LLMKV.QUANTIZE_IMATRIX_N_CHUNKS.key(), imatrix.chunk_count))
    return out
