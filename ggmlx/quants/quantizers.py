"""Quantizers, bit-exact with the ones ggml's ggml_quantize_chunk runs without an importance matrix.

The legacy block types have one kernel each, written for numpy and jax.numpy alike (see
ggmlx.quants.kernels): float32 [n_blocks, 32] -> uint8 [n_blocks, type_size]. `quantize` runs
them on the host and returns file bytes; `quantize_jax` runs them on device (inside jit too,
e.g. for a quantized KV cache) and returns the device layout that `dequantize_jax` reads.
The K-quants, IQ4, IQ3, IQ2, IQ1, ternary and MXFP4 types have host (numpy) kernels only
(ggmlx.quants.kquants, ggmlx.quants.nlquants, ggmlx.quants.iq3, ggmlx.quants.iq2): their
searches loop over trial scales. IQ2_XXS, IQ2_XS and IQ1_S need an importance matrix (as in
ggml_quantize_requires_imatrix).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..types import GGMLType, TypeSizeError, block_size, row_size, type_size
from . import iq_tables as tab
from .iq2 import IQ2_IMATRIX_KERNELS, IQ2_KERNELS, REQUIRE_IMATRIX
from .iq3 import IQ3_IMATRIX_KERNELS, quantize_iq3_s, quantize_iq3_xxs
from .jax_dequant import JAX
from .kernels import NUMPY, ArrayOps
from .kquants import IMATRIX_KERNELS as KQUANT_IMATRIX_KERNELS
from .kquants import KQUANT_KERNELS, HostKernel, ImatrixKernel
from .nlquants import NL_IMATRIX_KERNELS, NL_KERNELS
from .numpy_ref import CHUNK_ELEMENTS

F32 = np.float32


def _f16_bytes(ops: ArrayOps, v):
    """float32 [n, 1] -> its f16 (round to nearest even, as GGML_FP32_TO_FP16) as 2 bytes [n, 2]."""
    xp = ops.xp
    u = ops.bitcast(v.astype(xp.float16), xp.uint16)
    return xp.concatenate([(u & 0xFF).astype(xp.uint8), (u >> 8).astype(xp.uint8)], axis=1)


def _inverse(ops: ArrayOps, d):
    """1 / d, and 0 where d == 0 (`d ? 1.0f/d : 0.0f`)."""
    xp = ops.xp
    zero = d == 0
    return xp.where(zero, F32(0), F32(1) / xp.where(zero, F32(1), d))


# The float32 just below 0.5: trunc(x + copysign(this, x)) is roundf(x) for every float32 (a
# plain 0.5 would round x = 0.49999997 up, as x + 0.5 itself rounds to 1).
_HALF_BELOW = np.nextafter(F32(0.5), F32(0))


def _roundf(ops: ArrayOps, x):
    """C roundf: to nearest, halfway cases away from zero (x rounded to float32 first)."""
    xp = ops.xp
    x = ops.rounded(x)
    return xp.trunc(ops.rounded(x + xp.copysign(_HALF_BELOW, x)))


def _block_reduce(xp, f, a):
    """f (maximum or minimum) over the 32 elements of each block [n, 32] -> [n, 1], as a tree
    of adjacent pairs: numpy's reductions along a short last axis are several times slower."""
    while a.shape[1] > 1:
        a = f(a[:, 0::2], a[:, 1::2])
    return a


def _signed_max(ops: ArrayOps, x):
    """The element of largest magnitude per block (the first one on ties), keeping its sign."""
    xp = ops.xp
    i = xp.argmax(xp.abs(x), axis=1)[:, None]
    return xp.take_along_axis(x, i, axis=1)


def _pack_nibbles(q):
    """uint8 [n, 32] in 0..15 -> [n, 16]: element j in the low nibble, element j + 16 in the high."""
    return (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)


def _pack_high_bits(ops: ArrayOps, q):
    """Bit 4 of each of 32 quants -> 4 bytes (the little-endian uint32 qh of Q5_0 / Q5_1)."""
    xp = ops.xp
    return xp.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _trunc_clip(ops: ArrayOps, v, qmax: int):
    """C `(int8_t) v` (toward zero), limited to 0..qmax, as uint8."""
    xp = ops.xp
    return xp.clip(xp.trunc(v), 0, qmax).astype(xp.uint8)


def quantize_q8_0(ops: ArrayOps, x):
    """d = amax / 127, q = roundf(x / d) as int8."""
    xp = ops.xp
    d = _block_reduce(xp, xp.maximum, xp.abs(x)) / F32(127)
    q = _roundf(ops, x * _inverse(ops, d)).astype(xp.int8)
    return xp.concatenate([_f16_bytes(ops, d), ops.bitcast(q, xp.uint8)], axis=1)


def quantize_q4_0(ops: ArrayOps, x):
    """d = max / -8 (max: the signed element of largest magnitude), q = min(15, trunc(x / d + 8.5))."""
    xp = ops.xp
    d = _signed_max(ops, x) / F32(-8)
    q = _trunc_clip(ops, ops.rounded(x * _inverse(ops, d)) + F32(8.5), 15)
    return xp.concatenate([_f16_bytes(ops, d), _pack_nibbles(q)], axis=1)


def quantize_q4_1(ops: ArrayOps, x):
    """d = (max - min) / 15, q = min(15, trunc((x - min) / d + 0.5)); stores d and min."""
    xp = ops.xp
    lo = _block_reduce(xp, xp.minimum, x)
    d = (_block_reduce(xp, xp.maximum, x) - lo) / F32(15)
    q = _trunc_clip(ops, ops.rounded((x - lo) * _inverse(ops, d)) + F32(0.5), 15)
    return xp.concatenate([_f16_bytes(ops, d), _f16_bytes(ops, lo), _pack_nibbles(q)], axis=1)


def quantize_q5_0(ops: ArrayOps, x):
    """d = max / -16, q = min(31, trunc(x / d + 16.5)); low nibbles in qs, bit 4 in qh."""
    xp = ops.xp
    d = _signed_max(ops, x) / F32(-16)
    q = _trunc_clip(ops, ops.rounded(x * _inverse(ops, d)) + F32(16.5), 31)
    return xp.concatenate([_f16_bytes(ops, d), _pack_high_bits(ops, q), _pack_nibbles(q)], axis=1)


def quantize_q5_1(ops: ArrayOps, x):
    """d = (max - min) / 31, q = trunc((x - min) / d + 0.5); stores d and min."""
    xp = ops.xp
    lo = _block_reduce(xp, xp.minimum, x)
    d = (_block_reduce(xp, xp.maximum, x) - lo) / F32(31)
    q = _trunc_clip(ops, ops.rounded((x - lo) * _inverse(ops, d)) + F32(0.5), 31)
    return xp.concatenate([_f16_bytes(ops, d), _f16_bytes(ops, lo), _pack_high_bits(ops, q),
                           _pack_nibbles(q)], axis=1)


QUANTIZE_KERNELS: dict[GGMLType, Callable[[ArrayOps, Any], Any]] = {
    GGMLType.Q4_0: quantize_q4_0,
    GGMLType.Q4_1: quantize_q4_1,
    GGMLType.Q5_0: quantize_q5_0,
    GGMLType.Q5_1: quantize_q5_1,
    GGMLType.Q8_0: quantize_q8_0,
}

_IQ4_LEVELS = tab.KVALUES_IQ4NL.astype(F32)


def _best_index_iq4(ops: ArrayOps, v):
    """ggml's best_index_int8 over kvalues_iq4nl -> (index, level): the first level at or below
    v (clamped to 0..14) and the one above, the nearer by float32 distances `v - lo < hi - v`."""
    xp = ops.xp
    lo_i = xp.clip(xp.sum((v[..., None] >= _IQ4_LEVELS).astype(xp.int32), axis=-1) - 1, 0, 14)
    levels = xp.asarray(_IQ4_LEVELS)
    lo, hi = levels[lo_i], levels[lo_i + 1]
    lower = ops.rounded(v - lo) < ops.rounded(hi - v)
    return xp.where(lower, lo_i, lo_i + 1), xp.where(lower, lo, hi)


def _seq_sum(ops: ArrayOps, a):
    """Sum over the 32 columns one after another (C's `s += a[j]`), each product rounded first."""
    s = a[:, 0]
    for j in range(1, a.shape[1]):
        s = ops.rounded(s + a[:, j])
    return s[:, None]


def quantize_row_iq4_nl(ops: ArrayOps, x):
    """quantize_row_iq4_nl_ref (what ggml-cpu's set_rows runs; ggml_quantize_chunk searches 7
    trial scales more): d = max / -127, the nearest level of each x / d, then the least-squares
    scale over them with weights x * x. A block below GROUP_MAX_EPS stores d = 0 (its
    indices are whatever ggml's reused buffer held; here those for x / 1)."""
    xp = ops.xp
    mx = _signed_max(ops, x)
    small = xp.abs(mx) < F32(1e-15)
    d0 = xp.where(small, F32(1), mx / _IQ4_LEVELS[0])
    idx, q = _best_index_iq4(ops, ops.rounded(x * (F32(1) / d0)))
    wq = ops.rounded(ops.rounded(x * x) * q)
    sumqx, sumq2 = _seq_sum(ops, ops.rounded(wq * x)), _seq_sum(ops, ops.rounded(wq * q))
    d = xp.where(small | (sumq2 <= 0), F32(0), sumqx / xp.where(sumq2 > 0, sumq2, F32(1)))
    return xp.concatenate([_f16_bytes(ops, d), _pack_nibbles(idx.astype(xp.uint8))], axis=1)


# What ggml-cpu's set_rows writes into a quantized destination (its type's from_float): the
# quantize_row_*_ref functions. (On x86 its Q8_0 from_float is a SIMD variant with 127 / amax
# and round-half-even, which can differ from the reference in a last bit of a rare element.)
ROW_KERNELS: dict[GGMLType, Callable[[ArrayOps, Any], Any]] = {**QUANTIZE_KERNELS,
                                                             GGMLType.IQ4_NL: quantize_row_iq4_nl}


def _f16_bits(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_fp16 (the FP16 library's float-arithmetic conversion): round to
    nearest even, beyond the range inf, NaN as 0x7E00; in whole-array integer and float steps,
    twice as fast as numpy's astype(float16)."""
    with np.errstate(over="ignore"):
        base = (np.abs(x) * F32(2.0 ** 112)) * F32(2.0 ** -110)
    w = x.view(np.uint32)
    shl1 = w + w
    bias = np.maximum(shl1 & np.uint32(0xFF000000), np.uint32(0x71000000))
    bits = (((bias >> 1) + np.uint32(0x07800000)).view(np.float32) + base).view(np.uint32)
    nonsign = ((bits >> 13) & np.uint32(0x7C00)) + (bits & np.uint32(0x0FFF))
    nan = shl1 > np.uint32(0xFF000000)
    if nan.any():
        nonsign = np.where(nan, np.uint32(0x7E00), nonsign)
    return (((w & np.uint32(0x80000000)) >> 16) | nonsign).astype(np.uint16)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN stays NaN (quieted). In uint32: only
    NaN bit patterns overflow the rounding add, and those are replaced."""
    n = x.view(np.uint32)
    rounded = ((n + (0x7FFF + ((n >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    if not nan.any():
        return rounded
    return np.where(nan, ((n >> 16) | 64).astype(np.uint16), rounded)


# Host-only kernels: float32 blocks [n, block_size] -> uint8 [n, type_size]. Their searches make
# many passes over a chunk; chunks twice numpy_ref's size amortize the per-call overhead better.
HOST_CHUNK_ELEMENTS = 1 << 18
# Q3_K's later descent passes run on few groups, so their per-call cost wants larger chunks still.
_CHUNK = {GGMLType.Q3_K: 1 << 20}
HOST_KERNELS: dict[GGMLType, HostKernel] = {**KQUANT_KERNELS, **NL_KERNELS, GGMLType.IQ3_S: quantize_iq3_s,
                                         GGMLType.IQ3_XXS: quantize_iq3_xxs, **IQ2_KERNELS}

# Kernels that take an importance matrix (the others ignore it).
IMATRIX_KERNELS: dict[GGMLType, ImatrixKernel] = {**KQUANT_IMATRIX_KERNELS, **NL_IMATRIX_KERNELS,
                                                  **IQ3_IMATRIX_KERNELS, **IQ2_IMATRIX_KERNELS}
IMATRIX_TYPES: tuple[GGMLType, ...] = tuple(IMATRIX_KERNELS)
# Types ggml quantizes only with an importance matrix (ggml_quantize_requires_imatrix).
IMATRIX_ONLY_TYPES: tuple[GGMLType, ...] = REQUIRE_IMATRIX

QUANTIZE_TYPES: tuple[GGMLType, ...] = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, *QUANTIZE_KERNELS,
                                        *HOST_KERNELS, *IMATRIX_ONLY_TYPES)


def _check_quantize(x_shape: tuple[int, ...], t: GGMLType | int, what: str, allowed) -> GGMLType:
    try:
        t = GGMLType(t)
    except ValueError:
        raise ValueError(f"{what}: unknown ggml type id {t!r}") from None
    if t not in allowed:
        raise NotImplementedError(f"{what}: quantizing to {t.name} is not supported "
                                  f"(supported: {', '.join(a.name for a in allowed)})")
    if not x_shape or x_shape[-1] % block_size(t):
        raise TypeSizeError(f"{what}: rows of shape {x_shape} are not a multiple of the {t.name} "
                            f"block size {block_size(t)}")
    return t


def quantize(x: np.ndarray, type: GGMLType | int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """float32 array [..., ne0] -> uint8 [..., row bytes]: the GGUF bytes of each row.

    Bit-exact with ggml_quantize_chunk (for the legacy types without an importance matrix also
    with gguf-py's quantize). `imatrix` [ne0]: the importance of each column, for the types whose
    quantizers use one (IMATRIX_TYPES; the others ignore it, as ggml does). Non-finite input
    raises ValueError (ggml's result for it is undefined).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    t = _check_quantize(x.shape, type, "quantize", QUANTIZE_TYPES)
    if t == GGMLType.F32:
        return x.view(np.uint8).reshape(*x.shape[:-1], -1)
    if t in (GGMLType.F16, GGMLType.BF16):
        convert = _f16_bits if t == GGMLType.F16 else _bf16_bits
        flat = x.reshape(-1)
        out16 = np.empty(flat.size, np.uint16)
        for start in range(0, flat.size, CHUNK_ELEMENTS):      # cache-sized temporaries
            out16[start:start + CHUNK_ELEMENTS] = convert(flat[start:start + CHUNK_ELEMENTS])
        return out16.view(np.uint8).reshape(*x.shape[:-1], -1)
    if not np.isfinite(x).all():
        raise ValueError(f"quantize: {t.name} input contains NaN or infinity")
    if imatrix is not None and t in IMATRIX_KERNELS:
        return _quantize_rows(x, t, np.asarray(imatrix, dtype=np.float32))
    if t in IMATRIX_ONLY_TYPES:
        raise ValueError(f"quantize: {t.name} requires an importance matrix (imatrix)")
    blocks = x.reshape(-1, block_size(t))
    out = np.empty((blocks.shape[0], type_size(t)), dtype=np.uint8)
    step = _CHUNK.get(t, HOST_CHUNK_ELEMENTS if t in HOST_KERNELS else CHUNK_ELEMENTS) // block_size(t)
    with np.errstate(over="ignore", invalid="ignore"):  # a scale beyond the f16 range is inf, as in ggml
        for start in range(0, blocks.shape[0], step):
            out[start:start + step] = _kernel(t, blocks[start:start + step])
    return out.reshape(*x.shape[:-1], -1)


def _quantize_rows(x: np.ndarray, t: GGMLType, imatrix: np.ndarray) -> np.ndarray:
    """The imatrix kernels work on whole rows (some weigh by the row's mean square)."""
    if imatrix.shape != (x.shape[-1],):
        raise ValueError(f"quantize: imatrix of shape {imatrix.shape} for rows of {x.shape[-1]}")
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty((rows.shape[0], row_size(t, rows.shape[1])), dtype=np.uint8)
    step = max(1, HOST_CHUNK_ELEMENTS // rows.shape[1])
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, rows.shape[0], step):
            out[start:start + step] = IMATRIX_KERNELS[t](rows[start:start + step], imatrix)
    return out.reshape(*x.shape[:-1], -1)


def _kernel(t: GGMLType, blocks: np.ndarray) -> np.ndarray:
    if t in HOST_KERNELS:
        return HOST_KERNELS[t](blocks)
    return QUANTIZE_KERNELS[t](NUMPY, blocks)


def quantize_jax(x, type: GGMLType | int):
    """float32 [..., ne0] -> uint8 [..., ne0 // 32, type_size] on device (the layout of dequantize_jax).

    Usable inside jax.jit; types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (same bytes as `quantize` for
    finite input) and IQ4_NL (ggml's quantize_row_iq4_nl_ref, as `quantize_row`).
    """
    x = jnp.asarray(x, dtype=jnp.float32)
    t = _check_quantize(tuple(x.shape), type, "quantize_jax", tuple(ROW_KERNELS))
    q = ROW_KERNELS[t](JAX, x.reshape(-1, block_size(t)))
    return q.reshape(*x.shape[:-1], x.shape[-1] // block_size(t), type_size(t))


def quantize_row(x: np.ndarray, type: GGMLType | int) -> np.ndarray:
    """float32 [..., ne0] -> uint8 [..., row bytes] on the host by ggml's quantize_row_*_ref
    (ROW_KERNELS: what set_rows writes into a quantized KV cache); equal to `quantize` but
    for IQ4_NL, whose ggml_quantize_chunk searches more scales."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    t = _check_quantize(x.shape, type, "quantize_row", tuple(ROW_KERNELS))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        q = ROW_KERNELS[t](NUMPY, x.reshape(-1, block_size(t)))
    return q.reshape(*x.shape[:-1], -1)


# Byte offsets of the f16 scale fields of each block (d, and m / dmin where the type has one).
_SCALE_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
    GGMLType.TQ1_0: (52,), GGMLType.TQ2_0: (64,), GGMLType.IQ2_XXS: (0,), GGMLType.IQ2_XS: (0,),
    GGMLType.IQ2_S: (0,), GGMLType.IQ1_S: (0,),
}


def validate_row_data(data: np.ndarray, type: GGMLType | int) -> bool:
    """ggml_validate_row_data: no NaN or infinity among the values (float types) or the block
    scales (quant types). uint8 bytes of whole blocks."""
    t = GGMLType(type)
    if t == GGMLType.F32:
        return bool(np.isfinite(data.view(np.float32)).all())
    if t == GGMLType.F16:       # by the exponent bits: numpy's float16 isfinite is slow
        return _finite_f16(data.view(np.uint16))
    if t == GGMLType.BF16:
        return bool(((data.view(np.uint16) & 0x7F80) != 0x7F80).all())
    blocks = data.reshape(-1, type_size(t))
    return all(_finite_f16(np.ascontiguousarray(blocks[:, off:off + 2]).view(np.uint16))
               for off in _SCALE_FIELDS.get(t, ()))


def _finite_f16(bits: np.ndarray) -> bool:
    return bool(((bits & 0x7C00) != 0x7C00).all())

