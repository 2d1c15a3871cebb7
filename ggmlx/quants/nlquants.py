"""Host quantizers for the non-linear and ternary block types, bit-exact with ggml.

IQ4_NL and IQ4_XS follow `quantize_iq4_nl` / `quantize_iq4_xs` without an importance matrix
(ggml_quantize_chunk's path: weights x*x, 7 trial scales each side), TQ1_0 / TQ2_0
`quantize_row_tq*_0_ref`, MXFP4 `quantize_row_mxfp4_ref`. Same float32 discipline as
ggmlx.quants.kquants (elements on the leading axis, sums in C's order).
"""
from __future__ import annotations

import numpy as np

from ..native import search
from ..types import GGMLType
from . import iq_tables as tab
from .kquants import (
    F32,
    GROUP_MAX_EPS,
    HostKernel,
    ImatrixKernel,
    elements_first,
    f16,
    f16_bytes,
    groups_last,
    nearest_int,
    pack_nibble_pairs,
    select,
    seq_sum,
    signed_absmax,
)

_IQ4 = tab.KVALUES_IQ4NL
_IQ4_NTRY = 7


# The levels are integers, so the count of levels <= v is the count of levels <= floor(v):
# a table over floor(v) in -128..113 replaces a binary search (numpy's searchsorted is slow).
_CELL_LO = -128
_CELLS = np.arange(_CELL_LO, int(_IQ4[-1]) + 1, dtype=np.float32)
_UPPER = np.clip(np.searchsorted(_IQ4, _CELLS, side="right"), 1, 15).astype(np.int32)
_UPPER_VALUE, _LOWER_VALUE = _IQ4[_UPPER], _IQ4[_UPPER - 1]


def _best_index_iq4(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's best_index_int8 over kvalues_iq4nl -> (index, its level as float32): the nearer of
    the two levels around v by float32 distances `v - lo < hi - v` (the upper one on ties); below
    the first level 0, above the last (and for NaN) 15, as its early returns give."""
    with np.errstate(invalid="ignore"):
        cell = np.minimum(np.maximum(np.floor(v), F32(_CELL_LO)), _CELLS[-1]).astype(np.int32) - _CELL_LO
    cell = np.where(np.isnan(v), _CELLS.size - 1, cell)
    hi_i, lo, hi = _UPPER.take(cell), _LOWER_VALUE.take(cell), _UPPER_VALUE.take(cell)
    lower = (v - lo) < (hi - v)
    return hi_i - lower, select(lower, lo, hi)


def _iq4_sums(x: np.ndarray, w: np.ndarray, iscale: np.ndarray):
    """sum w*q*x and sum w*q*q over the group for the levels q nearest iscale * x."""
    q = _best_index_iq4(iscale * x)[1]
    wq = w * q
    return seq_sum(wq * x), seq_sum(wq * q)


def _iq4_group_scales(xt: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Groups of 32 [32, m], weights w -> each group's scale (quantize_row_iq4_nl_impl's search, ntry 7)."""
    c = search.lib()
    if c is not None:
        return search.iq4_scales(c, xt, w, _IQ4, _IQ4_NTRY)
    amax, mx = signed_absmax(xt)
    v0 = F32(_IQ4[0])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        sumqx, sumq2 = _iq4_sums(xt, w, F32(1) / (-mx / v0))
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0))
        best = d * sumqx
        for itry in range(-_IQ4_NTRY, _IQ4_NTRY + 1):
            sumqx, sumq2 = _iq4_sums(xt, w, F32(itry + int(_IQ4[0])) / mx)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d)
            best = np.where(better, d * sumqx, best)
    return np.where(amax < GROUP_MAX_EPS, F32(0), d)


def _iq4_weights(x: np.ndarray, qw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Groups of 32 of the super-blocks x [nb, 32 or 256] and their weights: x*x, or with an
    importance qw [nb, k] qw * sqrt(sigma2 + x*x), sigma2 = sum x^2 * 2 / k over the super-block."""
    xt = elements_first(x, 32)
    if qw is None:
        return xt, xt * xt
    k = x.shape[1]
    xs = elements_first(x, k)
    sigma2 = np.repeat(seq_sum(xs * xs) * F32(2.0 / k), k // 32)
    return xt, elements_first(qw, 32) * np.sqrt(sigma2 + xt * xt)


def _inverse(d: np.ndarray) -> np.ndarray:
    """`d ? 1/d : 0`."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0))


def quantize_iq4_nl(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """block_iq4_nl: d (f16), qs[16] (4-bit indices into kvalues_iq4nl)."""
    xt, w = _iq4_weights(x, qw)
    d = _iq4_group_scales(xt, w)
    L = groups_last(_best_index_iq4(_inverse(d) * xt)[0].astype(np.uint8), x.shape[0])
    return np.concatenate([f16_bytes(f16(d)), pack_nibble_pairs(L, 16)], axis=1)


def quantize_iq4_xs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """block_iq4_xs: d (f16), scales_h (u16), scales_l[4], qs[128]; eight 6-bit group scales."""
    nb = x.shape[0]
    xt, w = _iq4_weights(x, qw)
    scales = _iq4_group_scales(xt, w).reshape(nb, 8)
    _, max_scale = signed_absmax(scales.T)
    d = -max_scale / F32(32)
    q = np.clip(nearest_int(_inverse(d)[:, None] * scales), -32, 31)
    dl = (d[:, None] * q.astype(F32)).reshape(-1)
    L = groups_last(_best_index_iq4(_inverse(dl) * xt)[0].astype(np.uint8), nb)
    q = (q + 32).astype(np.uint16)
    scales_h = np.zeros(nb, np.uint16)
    for ib in range(8):
        scales_h |= (q[:, ib] >> 4) << (2 * ib)
    low = (q & 0xF).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    return np.concatenate([f16_bytes(f16(d)), scales_h.view(np.uint8).reshape(nb, 2), scales_l,
                           pack_nibble_pairs(L, 16)], axis=1)


def quantize_iq4_nl_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """quantize_iq4_nl with quant_weights (per 32: the importance, sigma2 over the 32)."""
    qw = np.ascontiguousarray(np.broadcast_to(imatrix.astype(F32), rows.shape)).reshape(-1, 32)
    return quantize_iq4_nl(rows.reshape(-1, 32), qw).reshape(rows.shape[0], -1)


def quantize_iq4_xs_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """quantize_iq4_xs with quant_weights (sigma2 over each 256)."""
    qw = np.ascontiguousarray(np.broadcast_to(imatrix.astype(F32), rows.shape)).reshape(-1, 256)
    return quantize_iq4_xs(rows.reshape(-1, 256), qw).reshape(rows.shape[0], -1)


# --- ternary ------------------------------------------------------------------------------------


def _ternary(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d = amax per block as float16, trits lroundf(x / amax) + 1 in 0..2 [nb, 256]). x / amax is
    within [-1, 1] (up to a rounding), where lroundf is -1 at or below -0.5, 1 at or above 0.5."""
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(1) / amax, F32(0))
    v = x * inv[:, None]
    return f16(amax), (v >= F32(0.5)).astype(np.int32) - (v <= F32(-0.5)) + 1


def _trit_bytes(t: np.ndarray, n_bytes: int, n_trits: int) -> np.ndarray:
    """Trits [nb, n_trits * n_bytes], trit k of byte j at j + k * n_bytes, most significant first,
    as the fixed-point byte ceil(v * 256 / 3**5) (a 4-trit byte is first shifted up one trit)."""
    t = t.reshape(t.shape[0], n_trits, n_bytes)
    v = np.zeros((t.shape[0], n_bytes), np.int32)
    for k in range(n_trits):
        v = v * 3 + t[:, k]
    if n_trits == 4:
        v = v * 3
    return ((v * 256 + 242) // 243).astype(np.uint8)


def quantize_tq1_0(x: np.ndarray) -> np.ndarray:
    """block_tq1_0: qs[48] (5 trits a byte), qh[4] (4 trits a byte), d (f16)."""
    d, t = _ternary(x)
    return np.concatenate([_trit_bytes(t[:, :160], 32, 5), _trit_bytes(t[:, 160:240], 16, 5),
                           _trit_bytes(t[:, 240:], 4, 4), f16_bytes(d)], axis=1)


def quantize_tq2_0(x: np.ndarray) -> np.ndarray:
    """block_tq2_0: qs[64] (element 32 * k + j of each 128 in bits 2k of byte j), d (f16)."""
    d, t = _ternary(x)
    t = t.astype(np.uint8).reshape(x.shape[0], 2, 4, 32)
    qs = t[:, :, 0] | (t[:, :, 1] << 2) | (t[:, :, 2] << 4) | (t[:, :, 3] << 6)
    return np.concatenate([qs.reshape(x.shape[0], 64), f16_bytes(d)], axis=1)


# --- MXFP4 --------------------------------------------------------------------------------------


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """GGML_E8M0_TO_FP32_HALF: 2^(e - 128) as float32 (the two smallest are subnormals)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23)
    return bits.astype(np.uint32).view(np.float32)


_MXFP4_MAGNITUDES = tab.KVALUES_MXFP4[:8]         # 0, 1, 2, 3, 4, 6, 8, 12 (codes 0-7; 8-15 negated)
# The count of magnitudes below u, by ceil(u) (they are integers): [j] = #(m <= j - 1).
_MXFP4_BELOW = np.searchsorted(_MXFP4_MAGNITUDES, np.arange(14, dtype=np.float32) - 1, side="right")


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """block_mxfp4: e (E8M0 exponent of amax / 4), qs[16] (best_index_mxfp4: the FP4 code nearest
    x, the first on ties). The errors |m d - x| grow with |m d - |x|| (d is a power of two, m d
    exact), so only the two magnitudes around |x| / d can be nearest; for x < 0 code 0 (+0) comes
    before 8 (-0), and the negative code m + 8 has the error of magnitude m."""
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        log2 = np.floor(np.log2(amax.astype(np.float64)).astype(F32))
    e = np.where(amax > 0, (log2 - F32(2) + F32(127)).astype(np.int32) & 0xFF, 0).astype(np.uint8)
    d = _e8m0_half(e)[:, None]
    a = np.abs(x)
    hi = np.minimum(_MXFP4_BELOW.take(np.minimum(np.ceil(a / d), F32(13)).astype(np.int32)), 7)
    lo = np.maximum(hi - 1, 0)
    err_lo = np.abs(_MXFP4_MAGNITUDES.take(lo) * d - a)
    err_hi = np.abs(_MXFP4_MAGNITUDES.take(hi) * d - a)
    k = hi - ((err_lo <= err_hi) & (hi > 0))
    q = (k + 8 * ((x < 0) & (k > 0))).astype(np.uint8)
    return np.concatenate([e[:, None], pack_nibble_pairs(q, 16)], axis=1)


NL_KERNELS: dict[GGMLType, HostKernel] = {
    GGMLType.IQ4_NL: quantize_iq4_nl,
    GGMLType.IQ4_XS: quantize_iq4_xs,
    GGMLType.TQ1_0: quantize_tq1_0,
    GGMLType.TQ2_0: quantize_tq2_0,
    GGMLType.MXFP4: quantize_mxfp4,
}

NL_IMATRIX_KERNELS: dict[GGMLType, ImatrixKernel] = {
    GGMLType.IQ4_NL: quantize_iq4_nl_imatrix,
    GGMLType.IQ4_XS: quantize_iq4_xs_imatrix,
}

