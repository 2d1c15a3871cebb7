"""Dequantization kernels, one per ggml block type, written once for numpy and jax.numpy.

A kernel maps packed blocks `uint8 [n_blocks, type_size]` (the block structs of
ggml-common.h, byte for byte) to `float32 [n_blocks, block_size]`, following ggml's
`dequantize_row_*`. Only vectorized bit operations, reshapes and table lookups are used, so
the same code runs eagerly on numpy and traced inside `jax.jit`.

Why numpy and XLA agree bit for bit: every product of a scale and a quant is exact in
float32 (an f16 scale has 11 significant bits; sub-scale times quant adds at most 13 more),
so the order of the multiplications does not matter and the only rounding is the final
add of a block minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K), which is the same single rounding
everywhere, fused multiply-add or not.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ..types import GGMLType
from . import iq_tables as tab

F32 = np.float32


@dataclass(frozen=True)
class ArrayOps:
    """The array namespace a kernel runs on (numpy, or jax.numpy inside or outside jit).

    `bitcast(x, dtype)` reinterprets the bits of each element as `dtype` of the same width.
    `rounded(x)` returns x, but makes sure it is rounded to float32 before its next use:
    XLA contracts `a * b + c` into one fused multiply-add, which the quantizers must not do.
    """
    xp: ModuleType
    bitcast: Callable[[Any, Any], Any]
    rounded: Callable[[Any], Any]


def _numpy_bitcast(x: np.ndarray, dtype: Any) -> np.ndarray:
    return x.view(dtype)


def _identity(x: Any) -> Any:
    return x


NUMPY = ArrayOps(xp=np, bitcast=_numpy_bitcast, rounded=_identity)


# --- field readers -------------------------------------------------------------------


def _u16(ops: ArrayOps, b, off: int, count: int = 1):
    """`count` little-endian uint16 starting at byte `off` -> [n, count]."""
    xp = ops.xp
    end = off + 2 * count
    return b[:, off:end:2].astype(xp.uint16) | (b[:, off + 1:end:2].astype(xp.uint16) << 8)


def _u32(ops: ArrayOps, b, off: int, count: int = 1):
    """`count` little-endian uint32 starting at byte `off` -> [n, count]."""
    xp = ops.xp
    end = off + 4 * count
    v = b[:, off:end:4].astype(xp.uint32)
    for k in range(1, 4):
        v = v | (b[:, off + k:end:4].astype(xp.uint32) << (8 * k))
    return v


def read_f16(ops: ArrayOps, b, off: int):
    """The f16 (ggml_half) at byte `off` as float32 [n, 1]."""
    xp = ops.xp
    return ops.bitcast(_u16(ops, b, off), xp.float16).astype(xp.float32)


def unpack_bits(ops: ArrayOps, q, group: int, shifts: tuple[int, ...], mask: int):
    """Split bit fields out of bytes: q [n, m] -> [n, m * len(shifts)].

    The bytes are taken in runs of `group`; each run gives len(shifts) runs of `group`
    values `(byte >> shift) & mask`, lowest shift first. This is ggml's element order:
    e.g. for Q4_0 (group 16, shifts 0 and 4) the low nibbles of the 16 bytes are elements
    0..15 and the high nibbles elements 16..31.
    """
    xp = ops.xp
    n, m = q.shape
    s = xp.asarray(np.array(shifts, dtype=q.dtype)).reshape(1, 1, len(shifts), 1)
    v = (q.reshape(n, m // group, 1, group) >> s) & mask
    return v.reshape(n, m * len(shifts))


def _lookup(ops: ArrayOps, table: np.ndarray, idx):
    """table[idx] along the table's first axis (codebooks and sign tables)."""
    xp = ops.xp
    return xp.take(xp.asarray(table), idx, axis=0)


NIBBLES = (0, 4)
CRUMBS = (0, 2, 4, 6)
BITS = (0, 1, 2, 3, 4, 5, 6, 7)


# --- legacy 32-element blocks ---------------------------------------------------------


def q4_0(ops: ArrayOps, b):
    """block_q4_0: d (f16), qs[16]; y = (q - 8) * d."""
    xp = ops.xp
    d = read_f16(ops, b, 0)
    q = unpack_bits(ops, b[:, 2:18], 16, NIBBLES, 0xF).astype(xp.int8) - 8
    return d * q.astype(F32)


def q4_1(ops: ArrayOps, b):
    """block_q4_1: d, m (f16), qs[16]; y = q * d + m."""
    d = read_f16(ops, b, 0)
    m = read_f16(ops, b, 2)
    q = unpack_bits(ops, b[:, 4:20], 16, NIBBLES, 0xF)
    return d * q.astype(F32) + m


def q5_quants(ops: ArrayOps, qh, qs):
    """5-bit quants from qh (4 bytes: bit j is bit 4 of element j) and qs (16 bytes of nibbles)."""
    return unpack_bits(ops, qs, 16, NIBBLES, 0xF) | (unpack_bits(ops, qh, 1, BITS, 1) << 4)


def q5_0(ops: ArrayOps, b):
    """block_q5_0: d (f16), qh[4], qs[16]; y = (q - 16) * d."""
    xp = ops.xp
    d = read_f16(ops, b, 0)
    q = q5_quants(ops, b[:, 2:6], b[:, 6:22]).astype(xp.int8) - 16
    return d * q.astype(F32)


def q5_1(ops: ArrayOps, b):
    """block_q5_1: d, m (f16), qh[4], qs[16]; y = q * d + m."""
    d = read_f16(ops, b, 0)
    m = read_f16(ops, b, 2)
    q = q5_quants(ops, b[:, 4:8], b[:, 8:24])
    return d * q.astype(F32) + m


def q8_0(ops: ArrayOps, b):
    """block_q8_0: d (f16), qs[32] int8; y = q * d."""
    xp = ops.xp
    d = read_f16(ops, b, 0)
    return d * ops.bitcast(b[:, 2:34], xp.int8).astype(F32)


def mxfp4(ops: ArrayOps, b):
    """block_mxfp4: e (E8M0 exponent), qs[16] FP4 nibbles; y = kvalues_mxfp4[q] * 2^(e-128)."""
    xp = ops.xp
    e = b[:, 0:1].astype(xp.uint32)
    # ggml_e8m0_to_fp32_half: the two smallest exponents are f32 subnormals.
    bits = xp.where(e < 2, xp.uint32(0x00200000) << e, (e - 1) << 23)
    d = ops.bitcast(bits, xp.float32)
    return d * _lookup(ops, tab.KVALUES_MXFP4, unpack_bits(ops, b[:, 1:17], 16, NIBBLES, 0xF))


def iq4_nl(ops: ArrayOps, b):
    """block_iq4_nl: d (f16), qs[16]; y = kvalues_iq4nl[q] * d."""
    d = read_f16(ops, b, 0)
    return d * _lookup(ops, tab.KVALUES_IQ4NL, unpack_bits(ops, b[:, 2:18], 16, NIBBLES, 0xF))


# --- K-quants: 256-element super-blocks -----------------------------------------------


def q2_k(ops: ArrayOps, b):
    """block_q2_K: scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin (f16).

    y = d * scale * q - dmin * min per 16 elements; q is 2 bits.
    """
    n = b.shape[0]
    sc = b[:, 0:16]
    q = unpack_bits(ops, b[:, 16:80], 32, CRUMBS, 3)
    d = read_f16(ops, b, 80)
    dmin = read_f16(ops, b, 82)
    dl = (d * (sc & 0xF).astype(F32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).astype(F32)).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(F32) - ml).reshape(n, 256)


def q3_k(ops: ArrayOps, b):
    """block_q3_K: hmask[32], qs[64], scales[12] (16 x 6 bits), d (f16).

    q = (low 2 bits) - 4 where the hmask bit is clear; y = d * (scale - 32) * q.
    """
    xp = ops.xp
    n = b.shape[0]
    hbit = unpack_bits(ops, b[:, 0:32], 32, BITS, 1)
    low = unpack_bits(ops, b[:, 32:96], 32, CRUMBS, 3)
    s = b[:, 96:108]
    # Scale i: low nibble from byte i % 8 (i < 8: low half, else high half),
    # top 2 bits from byte 8 + i % 4 at bit 2 * (i // 4).
    scale = unpack_bits(ops, s[:, 0:8], 8, NIBBLES, 0xF) | (unpack_bits(ops, s[:, 8:12], 4, CRUMBS, 3) << 4)
    scale = scale.astype(xp.int8) - 32
    d = read_f16(ops, b, 108)
    q = low.astype(xp.int8) - ((hbit ^ 1) << 2).astype(xp.int8)
    dl = (d * scale.astype(F32)).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(F32)).reshape(n, 256)


def k_scale_min(ops: ArrayOps, s):
    """The 8 six-bit scales and mins packed in 12 bytes (get_scale_min_k4) -> [n, 8] each."""
    xp = ops.xp
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = xp.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
    mins = xp.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scale, mins


def _k_affine(ops: ArrayOps, b, q):
    """y = d * scale * q - dmin * min per 32 elements, for Q4_K and Q5_K (q: [n, 256])."""
    n = b.shape[0]
    d = read_f16(ops, b, 0)
    dmin = read_f16(ops, b, 2)
    scale, mins = k_scale_min(ops, b[:, 4:16])
    dl = (d * scale.astype(F32)).reshape(n, 8, 1)
    ml = (dmin * mins.astype(F32)).reshape(n, 8, 1)
    return (dl * q.reshape(n, 8, 32).astype(F32) - ml).reshape(n, 256)


def q4_k(ops: ArrayOps, b):
    """block_q4_K: d, dmin (f16), scales[12], qs[128] (4-bit)."""
    return _k_affine(ops, b, unpack_bits(ops, b[:, 16:144], 32, NIBBLES, 0xF))


def q5_k(ops: ArrayOps, b):
    """block_q5_K: d, dmin (f16), scales[12], qh[32] (bit 4: element 32 * bit + byte), qs[128]."""
    q = unpack_bits(ops, b[:, 48:176], 32, NIBBLES, 0xF) | (unpack_bits(ops, b[:, 16:48], 32, BITS, 1) << 4)
    return _k_affine(ops, b, q)


def q6_k(ops: ArrayOps, b):
    """block_q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d (f16).

    y = d * scale * (q - 32) per 16 elements.
    """
    xp = ops.xp
    n = b.shape[0]
    low = unpack_bits(ops, b[:, 0:128], 64, NIBBLES, 0xF)
    high = unpack_bits(ops, b[:, 128:192], 32, CRUMBS, 3)
    scale = ops.bitcast(b[:, 192:208], xp.int8)
    d = read_f16(ops, b, 208)
    q = (low | (high << 4)).astype(xp.int8) - 32
    dl = (d * scale.astype(F32)).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(F32)).reshape(n, 256)


def iq4_xs(ops: ArrayOps, b):
    """block_iq4_xs: d (f16), scales_h (u16), scales_l[4], qs[128].

    Eight 6-bit scales (low nibble from scales_l, top 2 bits from scales_h);
    y = d * (scale - 32) * kvalues_iq4nl[q] per 32 elements.
    """
    xp = ops.xp
    n = b.shape[0]
    d = read_f16(ops, b, 0)
    high = (_u16(ops, b, 2) >> xp.asarray(np.arange(0, 16, 2, dtype=np.uint16))) & 3
    scale = unpack_bits(ops, b[:, 4:8], 1, NIBBLES, 0xF) | (high.astype(xp.uint8) << 4)
    dl = (d * (scale.astype(xp.int8) - 32).astype(F32)).reshape(n, 8, 1)
    v = _lookup(ops, tab.KVALUES_IQ4NL, unpack_bits(ops, b[:, 8:136], 16, NIBBLES, 0xF))
    return (dl * v.reshape(n, 8, 32)).reshape(n, 256)


# --- ternary ----------------------------------------------------------------------------


def _trits(ops: ArrayOps, x, group: int, n_trits: int):
    """Base-3 digits stored as fixed-point fractions (TQ1_0): x [n, m] -> [n, m * n_trits] in -1..1.

    Multiplying a byte by 3^k (mod 256) moves digit k to the top; (v * 3) >> 8 reads it.
    """
    xp = ops.xp
    n, m = x.shape
    pow3 = xp.asarray(np.array([1, 3, 9, 27, 81][:n_trits], dtype=np.uint8)).reshape(1, 1, n_trits, 1)
    v = (x.reshape(n, m // group, 1, group) * pow3).reshape(n, m * n_trits)
    return ((v.astype(xp.uint16) * 3) >> 8).astype(xp.int8) - 1


def tq1_0(ops: ArrayOps, b):
    """block_tq1_0: qs[48] (5 trits per byte), qh[4] (4 trits per byte), d (f16)."""
    d = read_f16(ops, b, 52)
    q = ops.xp.concatenate([_trits(ops, b[:, 0:32], 32, 5),
                            _trits(ops, b[:, 32:48], 16, 5),
                            _trits(ops, b[:, 48:52], 4, 4)], axis=1)
    return d * q.astype(F32)


def tq2_0(ops: ArrayOps, b):
    """block_tq2_0: qs[64] (2 bits per element, value q - 1), d (f16)."""
    xp = ops.xp
    d = read_f16(ops, b, 64)
    q = unpack_bits(ops, b[:, 0:64], 32, CRUMBS, 3).astype(xp.int8) - 1
    return d * q.astype(F32)


# --- IQ codebook types --------------------------------------------------------------------


def _iq_scale(d, s, mul: float):
    """d * (0.5 + s) * mul: the sub-block scale of IQ2_* and IQ3_XXS."""
    return d * (0.5 + s.astype(F32)) * mul


def _ksign_index(ops: ArrayOps, aux):
    """Four 7-bit ksigns indices packed in the low 28 bits of uint32 [n, k] -> [n, k, 4]."""
    xp = ops.xp
    shifts = xp.asarray(np.array([0, 7, 14, 21], dtype=np.uint32))
    return (aux[:, :, None] >> shifts) & 127


def iq2_xxs(ops: ArrayOps, b):
    """block_iq2_xxs: d (f16), then per 32 elements two uint32.

    The first holds 4 grid indices (one byte per 8 elements); the second 4 x 7 sign bits
    and a 4-bit scale on top.
    """
    n = b.shape[0]
    d = read_f16(ops, b, 0)
    aux = _u32(ops, b, 2, 16).reshape(n, 8, 2)[:, :, 1]
    db = _iq_scale(d, aux >> 28, 0.25).reshape(n, 8, 1, 1)
    grid = _lookup(ops, tab.IQ2XXS_GRID, b[:, 2:66].reshape(n, 8, 8)[:, :, 0:4])
    signs = _lookup(ops, tab.SIGNS_FROM_KSIGNS, _ksign_index(ops, aux))
    return (db * grid * signs).reshape(n, 256)


def iq2_xs(ops: ArrayOps, b):
    """block_iq2_xs: d (f16), qs[32] uint16 (9-bit grid index | 7-bit ksigns index), scales[8]."""
    n = b.shape[0]
    d = read_f16(ops, b, 0)
    qs = _u16(ops, b, 2, 32)
    db = _iq_scale(d, unpack_bits(ops, b[:, 66:74], 1, NIBBLES, 0xF), 0.25).reshape(n, 16, 1, 1)
    grid = _lookup(ops, tab.IQ2XS_GRID, qs & 511).reshape(n, 16, 2, 8)
    signs = _lookup(ops, tab.SIGNS_FROM_KSIGNS, qs >> 9).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def iq2_s(ops: ArrayOps, b):
    """block_iq2_s: d (f16), qs[32] (grid index low 8 bits), signs[32], qh[8] (2 high bits each), scales[8]."""
    xp = ops.xp
    n = b.shape[0]
    d = read_f16(ops, b, 0)
    high = unpack_bits(ops, b[:, 66:74], 1, CRUMBS, 3)
    idx = b[:, 2:34].astype(xp.uint16) | (high.astype(xp.uint16) << 8)
    db = _iq_scale(d, unpack_bits(ops, b[:, 74:82], 1, NIBBLES, 0xF), 0.25).reshape(n, 16, 1, 1)
    grid = _lookup(ops, tab.IQ2S_GRID, idx).reshape(n, 16, 2, 8)
    signs = _lookup(ops, tab.SIGNS_FROM_BYTE, b[:, 34:66]).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def iq3_xxs(ops: ArrayOps, b):
    """block_iq3_xxs: d (f16), qs[64] grid indices (4 elements each), 8 uint32 (4 x 7 sign bits | 4-bit scale)."""
    n = b.shape[0]
    d = read_f16(ops, b, 0)
    aux = _u32(ops, b, 66, 8)
    db = _iq_scale(d, aux >> 28, 0.5).reshape(n, 8, 1, 1)
    grid = _lookup(ops, tab.IQ3XXS_GRID, b[:, 2:66]).reshape(n, 8, 4, 8)
    signs = _lookup(ops, tab.SIGNS_FROM_KSIGNS, _ksign_index(ops, aux))
    return (db * grid * signs).reshape(n, 256)


def iq3_s(ops: ArrayOps, b):
    """block_iq3_s: d (f16), qs[64], qh[8] (9th index bit), signs[32], scales[4]; y = d * (1 + 2 s) * grid * sign."""
    xp = ops.xp
    n = b.shape[0]
    d = read_f16(ops, b, 0)
    high = unpack_bits(ops, b[:, 66:74], 1, BITS, 1)
    idx = b[:, 2:66].astype(xp.uint16) | (high.astype(xp.uint16) << 8)
    scale = unpack_bits(ops, b[:, 106:110], 1, NIBBLES, 0xF)
    db = (d * (1 + 2 * scale).astype(F32)).reshape(n, 8, 1, 1)
    grid = _lookup(ops, tab.IQ3S_GRID, idx).reshape(n, 8, 4, 8)
    signs = _lookup(ops, tab.SIGNS_FROM_BYTE, b[:, 74:106]).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _iq1_delta(ops: ArrayOps, negative):
    xp = ops.xp
    return xp.where(negative, -tab.IQ1S_DELTA, tab.IQ1S_DELTA)


def iq1_s(ops: ArrayOps, b):
    """block_iq1_s: d (f16), qs[32] (grid index low 8 bits), qh[8] uint16.

    Each qh holds, for 32 elements, four 3-bit index tops, a 3-bit scale and the delta sign.
    y = d * (2 s + 1) * (grid +- 1/8).
    """
    xp = ops.xp
    n = b.shape[0]
    d = read_f16(ops, b, 0)
    qh = _u16(ops, b, 34, 8)
    dl = (d * (2 * ((qh >> 12) & 7) + 1).astype(F32)).reshape(n, 8, 1, 1)
    delta = _iq1_delta(ops, (qh & 0x8000) != 0).reshape(n, 8, 1, 1)
    high = (qh[:, :, None] >> xp.asarray(np.array([0, 3, 6, 9], dtype=np.uint16))) & 7
    idx = b[:, 2:34].reshape(n, 8, 4).astype(xp.uint16) | (high << 8)
    grid = _lookup(ops, tab.IQ1S_GRID, idx)
    return (dl * (grid + delta)).reshape(n, 256)


def iq1_m(ops: ArrayOps, b):
    """block_iq1_m: qs[32], qh[16] (per 8 elements: 3 index bits + delta sign), scales[4] uint16.

    The block's f16 scale is spread over the top nibbles of the four scale words; the rest
    holds sixteen 3-bit scales, one per 16 elements.
    """
    xp = ops.xp
    n = b.shape[0]
    sc = _u16(ops, b, 48, 4)
    dbits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = ops.bitcast(dbits, xp.float16).astype(F32).reshape(n, 1)
    s = (sc[:, :, None] >> xp.asarray(np.array([0, 3, 6, 9], dtype=np.uint16))) & 7
    dl = (d * (2 * s.reshape(n, 16) + 1).astype(F32)).reshape(n, 16, 1, 1)
    qh = unpack_bits(ops, b[:, 32:48], 1, NIBBLES, 0xF)
    idx = b[:, 0:32].astype(xp.uint16) | ((qh & 7).astype(xp.uint16) << 8)
    delta = _iq1_delta(ops, (qh & 8) != 0).reshape(n, 16, 2, 1)
    grid = _lookup(ops, tab.IQ1S_GRID, idx).reshape(n, 16, 2, 8)
    return (dl * (grid + delta)).reshape(n, 256)


DEQUANTIZE_KERNELS: dict[GGMLType, Callable[[ArrayOps, Any], Any]] = {
    GGMLType.Q4_0: q4_0,
    GGMLType.Q4_1: q4_1,
    GGMLType.Q5_0: q5_0,
    GGMLType.Q5_1: q5_1,
    GGMLType.Q8_0: q8_0,
    GGMLType.Q2_K: q2_k,
    GGMLType.Q3_K: q3_k,
    GGMLType.Q4_K: q4_k,
    GGMLType.Q5_K: q5_k,
    GGMLType.Q6_K: q6_k,
    GGMLType.IQ4_NL: iq4_nl,
    GGMLType.IQ4_XS: iq4_xs,
    GGMLType.IQ2_XXS: iq2_xxs,
    GGMLType.IQ2_XS: iq2_xs,
    GGMLType.IQ2_S: iq2_s,
    GGMLType.IQ3_XXS: iq3_xxs,
    GGMLType.IQ3_S: iq3_s,
    GGMLType.IQ1_S: iq1_s,
    GGMLType.IQ1_M: iq1_m,
    GGMLType.TQ1_0: tq1_0,
    GGMLType.TQ2_0: tq2_0,
    GGMLType.MXFP4: mxfp4,
}

# Plain float types: stored element by element, no blocks.
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
