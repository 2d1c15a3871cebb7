"""Host quantizers for the K-quant, IQ4, ternary and MXFP4 types, bit-exact with ggml.

Each follows the function ggml's `ggml_quantize_chunk` calls without an importance matrix
(`quantize_row_q*_K_ref`, `quantize_iq4_nl` / `quantize_iq4_xs` with ntry 7,
`quantize_row_tq*_0_ref`, `quantize_row_mxfp4_ref`): float32 blocks [n, block_size] ->
uint8 [n, type_size], the block structs of ggml-common.h.

Why this gives the same bytes: ggml computes in float32, one rounding per operation, no
fused multiply-add (ggml-base is built without FMA), and sums elements one after another.
Here the blocks are vectorised and the elements are the leading axis ([elements, blocks]),
so every operation is the same float32 operation as in C, in the same order:
`seq_sum` adds the rows of a C-contiguous array one after another (numpy's reduction over a
non-contiguous axis is that loop, not a pairwise sum), and `nearest_int` is ggml's
`nearest_int` bit trick itself, so out-of-range values give ggml's result too.
The three scale searches (make_qx_quants, make_qkx2_quants, make_qkx3_quants: most of the time)
run ggml's per-group loops in C instead where the native library is built (ggmlx/native/search.py).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..native import search
from ..types import GGMLType
from .kernels import NUMPY, k_scale_min

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
_ROUND_MAGIC = F32(12582912.0)  # 1.5 * 2**23: adding it rounds to an integer in the low mantissa bits


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even through the float32 mantissa, as int32."""
    bits = (v + _ROUND_MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0, adding row after row (C's `for (i...) s += a[i]`), float32."""
    return np.add.reduce(np.ascontiguousarray(a), axis=0)


def elements_first(x: np.ndarray, n: int) -> np.ndarray:
    """Blocks [nb, k] -> groups of n elements as [n, nb * k / n], contiguous (C's inner loop first)."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def groups_last(a: np.ndarray, nb: int) -> np.ndarray:
    """The inverse of `elements_first` for one value per element: [n, nb * g] -> [nb, g * n]."""
    return np.ascontiguousarray(a.T).reshape(nb, -1)


def signed_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Over axis 0: the largest |x| and the element holding it, as C's `if (ax > amax)` loop
    from 0 finds them: the first one when +a and -a both occur, NaN never taken, (0, +0) when
    nothing is above 0. Without argmax (slow over the leading axis): the sign is the one that
    occurs, and only the columns holding both signs are searched for the first."""
    a = np.fmax.reduce(np.abs(x), axis=0)
    a = select(a > 0, a, F32(0))
    pos = np.logical_or.reduce(x == a, axis=0)
    neg = np.logical_or.reduce(x == -a, axis=0) & (a > 0)
    mx = select(neg, -a, a)
    both = np.flatnonzero(pos & neg)
    if both.size:
        first = np.argmax(np.abs(x[:, both]) == a[both], axis=0)
        mx[both] = x[first, both]
    return a, mx


def _max0(a: np.ndarray, axis: int) -> np.ndarray:
    """C's `m = 0; if (v > m) m = v;` over an axis: the largest positive value, NaN skipped."""
    return np.where(a > 0, a, F32(0)).max(axis=axis)


def f16(v: np.ndarray) -> np.ndarray:
    """float32 -> float16 (round to nearest even, as GGML_FP32_TO_FP16)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """float16 [n] -> its 2 little-endian bytes [n, 2]."""
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def _pack_crumbs(q: np.ndarray, n_bytes: int) -> np.ndarray:
    """q [nb, 4 * n_bytes] in 0..3 -> bytes: byte j holds q[j], q[j + n], q[j + 2n], q[j + 3n] from bit 0."""
    q = q.astype(np.uint8).reshape(q.shape[0], -1, 4, n_bytes)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return out.reshape(q.shape[0], -1)


def pack_nibble_pairs(q: np.ndarray, n_bytes: int) -> np.ndarray:
    """q [nb, 2 * k * n_bytes] in 0..15 -> per run of 2 * n_bytes: q[j] | q[j + n_bytes] << 4."""
    q = q.astype(np.uint8).reshape(q.shape[0], -1, 2, n_bytes)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], -1)


def _k_scale_bytes(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [nb, 8] -> the 12 bytes get_scale_min_k4 reads."""
    lo_s, hi_s, lo_m, hi_m = ls[:, :4], ls[:, 4:], lm[:, :4], lm[:, 4:]
    return np.concatenate([lo_s | ((hi_s >> 4) << 6), lo_m | ((hi_m >> 4) << 6),
                           (hi_s & 0xF) | ((hi_m & 0xF) << 4)], axis=1).astype(np.uint8)


def select(mask: np.ndarray, if_true, if_false) -> np.ndarray:
    """np.where(mask, if_true, if_false) for 4-byte arrays, by bit masks: numpy's where branches
    per element and mispredicts on the random masks these searches make (several times slower)."""
    f = np.asarray(if_false)
    fi = f.view(np.int32)
    ti = np.asarray(if_true, dtype=f.dtype).view(np.int32)
    return (fi ^ ((fi ^ ti) & -mask.astype(np.int32))).view(f.dtype)


def round_in_range(v: np.ndarray) -> np.ndarray:
    """nearest_int(v) as float32 for |v| <= 2**22, where it is round half to even: the
    magic number added and taken away again (the bit trick without its integer steps)."""
    return (v + _ROUND_MAGIC) - _ROUND_MAGIC


def _rounded_levels(v: np.ndarray, lo: int, hi: int, safe: np.ndarray | bool) -> np.ndarray:
    """clip(nearest_int(v), lo, hi) as float32; the quick path when `safe` (all |v| <= 2**22)."""
    r = round_in_range(v) if np.all(safe) else nearest_int(v).astype(F32)
    return np.minimum(np.maximum(r, F32(lo)), F32(hi))


# --- make_qkx2_quants: affine (scale, min) fit of a group, the Q2_K / Q4_K / Q5_K core ---------


def _qkx2_error(x, w, L, scale, mn, use_mad: bool):
    diff = (scale * L + mn) - x
    return seq_sum(w * (np.abs(diff) if use_mad else diff * diff))


def _qkx2_levels(x, lo_x, mn, mx, iscale, nmax: int, flat):
    """clip(nearest_int(iscale * (x - mn)), 0, nmax): in range unless a block's extremes are
    not (iscale * (x - mn) is monotone in x, so its extremes bound it)."""
    ends = np.maximum(np.abs(iscale * (lo_x - mn)), np.abs(iscale * (mx - mn)))
    return _rounded_levels(iscale * (x - mn), 0, nmax, flat | (ends <= 4194304))


def _qkx2_step(x, w, sums, lo_x, mn, mx, iscale, nmax: int, use_mad: bool, flat):
    """One trial scale of make_qkx2_quants: its scale, min and error ([n, m] groups)."""
    sum_w, sum_x = sums
    laux = _qkx2_levels(x, lo_x, mn, mx, iscale, nmax, flat)
    wl = w * laux
    sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * laux), seq_sum(wl * x)
    det = sum_w * sum_l2 - sum_l * sum_l
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
    positive = this_min > 0
    this_min = select(positive, F32(0), this_min)
    this_scale = select(positive, sum_xl / sum_l2, this_scale)
    err = _qkx2_error(x, w, laux, this_scale, this_min, use_mad)
    return this_scale, this_min, err, det > 0


def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups x, weights w [n, m] -> (L [n, m] in 0..nmax as float32, scale [m], -min [m]).

    The quants of the best trial are computed again at the end from its (iscale, min), not
    carried through the search: the same values, one pass instead of one per trial."""
    c = search.lib()
    if c is not None and x.shape[0] <= search.MAX_GROUP:
        return search.make_qkx_quants(c, x, w, nmax, rmin, rdelta, nstep, use_mad, False)
    lo_x = x.min(axis=0)
    mn = select(lo_x > 0, F32(0), lo_x)
    mx = x.max(axis=0)
    flat = mx == mn
    sums = (seq_sum(w), seq_sum(w * x))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (mx - mn)
        scale = F32(1) / iscale
        best_iscale, best_mn = iscale, mn
        best = _qkx2_error(x, w, _qkx2_levels(x, lo_x, mn, mx, iscale, nmax, flat), scale, mn, use_mad)
        for step in range(nstep + 1):
            num = F32(F32(rmin) + F32(rdelta) * F32(step)) + F32(nmax)
            iscale = num / (mx - mn)
            this_scale, this_min, err, ok = _qkx2_step(x, w, sums, lo_x, mn, mx, iscale, nmax, use_mad, flat)
            better = ok & (err < best)
            best_iscale, best_mn = select(better, iscale, best_iscale), select(better, mn, best_mn)
            best = select(better, err, best)
            scale = select(better, this_scale, scale)
            mn = select(better, this_min, mn)
        L = _qkx2_levels(x, lo_x, best_mn, mx, best_iscale, nmax, flat)
    return select(flat, F32(0), L), select(flat, F32(0), scale), -mn


# --- make_qx_quants (rmse_type 1, no importance): symmetric fit, the Q6_K core -------------------


def make_qx_quants(x: np.ndarray, nmax: int, w: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Groups x [n, m], weights w (default x*x) -> (L [n, m] in 0..2*nmax-1 as float32, scale [m]).

    |iscale * x| <= nmax + 1 (iscale is about nmax / max|x|), so rounding takes the quick path;
    as in make_qkx2_quants the best trial's quants are computed again at the end."""
    c = search.lib()
    if c is not None and x.shape[0] <= search.MAX_GROUP:
        return search.make_qx_quants(c, x, nmax, w)
    amax, mx = signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x if w is None else w
    wx = w * x

    def trial(iscale):
        q = np.minimum(np.maximum(round_in_range(iscale * x), F32(-nmax)), F32(nmax - 1))
        return seq_sum(wx * q), seq_sum((w * q) * q)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        best_iscale = F32(-nmax) / mx
        sumlx, suml2 = trial(best_iscale)
        scale = select(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / mx
            sumlx, suml2 = trial(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            best_iscale = select(better, iscale, best_iscale)
            scale = select(better, sumlx / suml2, scale)
            best = select(better, scale * sumlx, best)
        L = np.minimum(np.maximum(round_in_range(best_iscale * x), F32(-nmax)), F32(nmax - 1)) + F32(nmax)
    return select(zero, F32(0), L), select(zero, F32(0), scale)


# --- make_q3_quants (do_rmse): symmetric fit refined one element at a time, the Q3_K core --------


def _q3_refine(x, w, L, sumlx, suml2, nmax: int):
    """Five passes of make_q3_quants' coordinate descent; L [n, m] float32, sums [m], updated.

    Per element, only the groups where the element's quant would move (a few percent) go on to
    the accept test, gathered. A group whose pass changed nothing is done (the next pass would
    see the same state), as C's `if (!n_changed) break`; later passes run on the others only."""
    n = x.shape[0]
    cols = np.arange(x.shape[1])
    xa, wa, wxa, la, sx, s2 = x, w, w * x, L[:, cols], sumlx[cols], suml2[cols]
    for _ in range(5):
        changed = np.zeros(cols.size, bool)
        for i in range(n):
            li, wi, wx = la[i], wa[i], wxa[i]
            slx = sx - wx * li
            sl2 = s2 - (wi * li) * li
            nf = np.minimum(np.maximum(nearest_int((xa[i] * sl2) / slx), -nmax), nmax - 1).astype(F32)
            j = np.flatnonzero((nf != li) & (slx > 0))
            nf_j, wi_j, sx_j, s2_j = nf[j], wi[j], sx[j], s2[j]
            slx2 = slx[j] + wx[j] * nf_j
            sl22 = sl2[j] + (wi_j * nf_j) * nf_j
            take = (sl22 > 0) & ((slx2 * slx2) * s2_j > (sx_j * sx_j) * sl22)
            t = j[take]
            li[t], sx[t], s2[t], changed[t] = nf_j[take], slx2[take], sl22[take], True
        L[:, cols], sumlx[cols], suml2[cols] = la, sx, s2
        if not changed.any():
            break
        cols = cols[changed]
        xa, wa, wxa, la = xa[:, changed], wa[:, changed], wxa[:, changed], la[:, changed]
        sx, s2 = sx[changed], s2[changed]
    return L, sumlx, suml2


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Groups x [n, m] -> (L [n, m] in 0..2*nmax-1 as float32, scale [m]) (make_q3_quants, do_rmse)."""
    amax, mx = signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        L = np.minimum(np.maximum(round_in_range((F32(-nmax) / mx) * x), F32(-nmax)), F32(nmax - 1))
        sumlx = seq_sum((w * x) * L)
        suml2 = seq_sum((w * L) * L)
        L, sumlx, suml2 = _q3_refine(x, w, L, sumlx, suml2, nmax)
        scale = select(suml2 > 0, sumlx / suml2, F32(0))
    return select(zero, F32(0), L + F32(nmax)), select(zero, F32(0), scale)


# --- the K-quant blocks ------------------------------------------------------------------------


def _requant(x: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray | None, lo: int, hi: int,
             offset: int = 0) -> np.ndarray:
    """Quants again from the stored (f16-rounded) group scales: nearest_int((x + dm) / d) (or
    x / d) limited to lo..hi, plus offset; groups with d == 0 keep L. x, L [n, m]; d, dm [m]."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(nearest_int((x if dm is None else x + dm) / d), lo, hi) + offset
    return np.where(d != 0, q, L).astype(np.uint8)


def _affine_superblock(scales, mins, qmax: int):
    """Q4_K / Q5_K: group scales and mins [nb, 8] -> 6-bit codes, f16 d and dmin (as float16)."""
    max_scale, max_min = _max0(scales, 1), _max0(mins, 1)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(qmax) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(qmax) / max_min, F32(0))
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, qmax)
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, qmax)
    return ls, lm, f16(max_scale / F32(qmax)), f16(max_min / F32(qmax))


def _q45_k(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared body of Q4_K and Q5_K: (xt, L, 12 scale bytes, d, dmin as float16)."""
    nb = x.shape[0]
    xt = elements_first(x, 32)
    av_x = np.sqrt(seq_sum(xt * xt) / F32(32))
    L, scales, mins = make_qkx2_quants(xt, av_x + np.abs(xt), nmax, rmin, rdelta, nstep, False)
    ls, lm, d, dmin = _affine_superblock(scales.reshape(nb, 8), mins.reshape(nb, 8), 63)
    return xt, L, _k_scale_bytes(ls, lm), d, dmin


def _q45_k_bytes(xt, L, sc, d, dmin, nmax: int) -> np.ndarray:
    """block_q4_K / block_q5_K from the group quants: requantized from the stored scales (read
    back from the 12 bytes, as get_scale_min_k4), then packed."""
    nb = sc.shape[0]
    scale, mins = k_scale_min(NUMPY, sc)
    dg = (d.astype(F32)[:, None] * scale.astype(F32)).reshape(-1)
    dmg = (dmin.astype(F32)[:, None] * mins.astype(F32)).reshape(-1)
    L = groups_last(_requant(xt, L, dg, dmg, 0, nmax), nb)
    head = [f16_bytes(d), f16_bytes(dmin), sc]
    if nmax == 15:
        return np.concatenate([*head, pack_nibble_pairs(L, 32)], axis=1)
    high = (L >> 4).reshape(nb, 8, 32)
    qh = np.zeros((nb, 32), np.uint8)
    for k in range(8):
        qh |= high[:, k] << k
    return np.concatenate([*head, qh, pack_nibble_pairs(L & 0xF, 32)], axis=1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """block_q4_K: d, dmin, scales[12], qs[128] (quantize_row_q4_K_ref)."""
    return _q45_k_bytes(*_q45_k(x, 15, -1.0, 0.1, 20), 15)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """block_q5_K: d, dmin, scales[12], qh[32], qs[128] (quantize_row_q5_K_ref)."""
    return _q45_k_bytes(*_q45_k(x, 31, -0.5, 0.1, 15), 31)


def _q2_k_bytes(xt, L, sc, d, dmin) -> np.ndarray:
    """block_q2_K from the group quants and the scale bytes (scale | min << 4), requantized."""
    nb = sc.shape[0]
    dg = (d.astype(F32)[:, None] * (sc & 0xF).astype(F32)).reshape(-1)
    dmg = (dmin.astype(F32)[:, None] * (sc >> 4).astype(F32)).reshape(-1)
    L = groups_last(_requant(xt, L, dg, dmg, 0, 3), nb)
    return np.concatenate([sc.astype(np.uint8), _pack_crumbs(L, 32), f16_bytes(d), f16_bytes(dmin)], axis=1)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """block_q2_K: scales[16] (scale | min << 4), qs[64], d, dmin (quantize_row_q2_K_ref)."""
    nb = x.shape[0]
    xt = elements_first(x, 16)
    L, scales, mins = make_qkx2_quants(xt, np.abs(xt), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale, max_min = _max0(scales, 1), _max0(mins, 1)
    with np.errstate(divide="ignore"):
        q_s = nearest_int((F32(15) / max_scale)[:, None] * scales)
        q_m = nearest_int((F32(15) / max_min)[:, None] * mins)
    sc = np.where(max_scale[:, None] > 0, q_s, 0) & 0xFF
    sc = (sc | np.where(max_min[:, None] > 0, q_m << 4, 0)) & 0xFF
    d = np.where(max_scale > 0, f16(max_scale / F32(15)), np.float16(0))
    dmin = np.where(max_min > 0, f16(max_min / F32(15)), np.float16(0))
    return _q2_k_bytes(xt, L, sc, d, dmin)


def _q3_scale_bytes(q: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit codes [nb, 16] -> the 12 bytes of block_q3_K.scales."""
    low = (q & 0xF).astype(np.uint8)
    high = (q >> 4).astype(np.uint8).reshape(-1, 4, 4)      # [nb, j // 4, j % 4]
    top = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    return np.concatenate([low[:, :8] | (low[:, 8:] << 4), top], axis=1)


def _high_bit_mask(L: np.ndarray) -> np.ndarray:
    """hmask[32] of Q3_K: bit k of byte m is set when quant 32 * k + m is above 3."""
    nb = L.shape[0]
    high = (L > 3).astype(np.uint8).reshape(nb, 8, 32)
    out = np.zeros((nb, 32), np.uint8)
    for k in range(8):
        out |= high[:, k] << k
    return out


def _q3_k_bytes(xt, L, codes, sc, d) -> np.ndarray:
    """block_q3_K from the group quants (0..7), the 6-bit scale codes [nb, 16], their 12 bytes
    and d: requantized from the stored scales, then packed."""
    nb = codes.shape[0]
    dg = (d.astype(F32)[:, None] * (codes - 32).astype(F32)).reshape(-1)
    L = groups_last(_requant(xt, L, dg, None, -4, 3, 4), nb)
    return np.concatenate([_high_bit_mask(L), _pack_crumbs(L & 3, 32), sc, f16_bytes(d)], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """block_q3_K: hmask[32], qs[64], scales[12], d (quantize_row_q3_K_ref)."""
    nb = x.shape[0]
    xt = elements_first(x, 16)
    L, scales = make_q3_quants(xt, 4)
    scales = scales.reshape(nb, 16)
    amax, max_scale = signed_absmax(scales.T)
    has = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = F32(-32) / max_scale
        q = np.clip(((nearest_int(iscale[:, None] * scales) + 128) & 0xFF) - 128, -32, 31) + 32
        d = np.where(has, f16(F32(1) / iscale), np.float16(0))
    q = np.where(has[:, None], q, 32)
    sc = np.where(has[:, None], _q3_scale_bytes(q), np.uint8(0))
    return _q3_k_bytes(xt, L, q, sc, d)


def _q6_k_bytes(xt, L, scales) -> np.ndarray:
    """block_q6_K from the group quants (0..63) and scales [nb, 16]: the 8-bit scale codes, d,
    the requantized quants (quantize_row_q6_K_ref's second half, shared with the imatrix path)."""
    nb = scales.shape[0]
    amax, max_scale = signed_absmax(scales.T)
    zero = amax < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / max_scale
        d = f16(F32(1) / iscale)
        sc = ((np.minimum(127, nearest_int(iscale[:, None] * scales)) + 128) & 0xFF) - 128
    dg = (d.astype(F32)[:, None] * sc.astype(F32)).reshape(-1)
    L = groups_last(_requant(xt, L, dg, None, -32, 31, 32), nb)
    ql = pack_nibble_pairs(L & 0xF, 64)
    qh = _pack_crumbs(L >> 4, 32)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), f16_bytes(d)], axis=1)
    out[zero] = 0
    return out


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128], qh[64], scales[16] int8, d (quantize_row_q6_K_ref)."""
    xt = elements_first(x, 16)
    L, scales = make_qx_quants(xt, 32)
    return _q6_k_bytes(xt, L, scales.reshape(x.shape[0], 16))


# --- with an importance matrix (quantize_row_*_impl) ----------------------------------------------


def make_qkx3_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx3_quants (squared error): make_qkx2_quants with its trial quants taken as
    `v > 0 ? nearest_int(MIN(v, nmax)) : 0` (in range, so rounded the quick way) -> (L, scale, -min)."""
    c = search.lib()
    if c is not None and x.shape[0] <= search.MAX_GROUP:
        return search.make_qkx_quants(c, x, w, nmax, rmin, rdelta, nstep, False, True)
    lo_x = x.min(axis=0)
    mn = select(lo_x > 0, F32(0), lo_x)
    mx = x.max(axis=0)
    flat = mx <= mn
    sums = (seq_sum(w), seq_sum(w * x))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (mx - mn)
        first_iscale, first_mn = iscale, mn
        scale = F32(1) / iscale
        best = _qkx2_error(x, w, _qkx2_levels(x, lo_x, mn, mx, iscale, nmax, flat), scale, mn, False)
        improved = np.zeros(mx.shape, bool)
        best_iscale, best_mn = iscale, mn
        for step in range(nstep + 1):
            iscale = (F32(F32(rmin) + F32(rdelta) * F32(step)) + F32(nmax)) / (mx - mn)
            this_scale, this_min, err, ok = _qkx3_step(x, w, sums, mn, iscale, nmax)
            better = ok & (err < best)
            best_iscale, best_mn = select(better, iscale, best_iscale), select(better, mn, best_mn)
            improved |= better
            best, scale, mn = select(better, err, best), select(better, this_scale, scale), select(better, this_min, mn)
        L = _qkx3_levels(x, best_mn, best_iscale, nmax)
        if not improved.all():      # groups left with the first quants (rounded the other way)
            L = select(improved, L, _qkx2_levels(x, lo_x, first_mn, mx, first_iscale, nmax, flat))
    return select(flat, F32(0), L), select(flat, F32(0), scale), -mn


def _qkx3_levels(x, mn, iscale, nmax: int):
    v = iscale * (x - mn)
    return select(v > 0, round_in_range(np.minimum(v, F32(nmax))), F32(0))


def _qkx3_step(x, w, sums, mn, iscale, nmax: int):
    sum_w, sum_x = sums
    laux = _qkx3_levels(x, mn, iscale, nmax)
    wl = w * laux
    sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * laux), seq_sum(wl * x)
    det = sum_w * sum_l2 - sum_l * sum_l
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
    positive = this_min > 0
    this_min = select(positive, F32(0), this_min)
    this_scale = select(positive, sum_xl / sum_l2, this_scale)
    return this_scale, this_min, _qkx2_error(x, w, laux, this_scale, this_min, False), det > 0


def _capped(v: np.ndarray, nmax: int) -> np.ndarray:
    """MIN(nmax, nearest_int(v)) as float32 (no lower bound: negative codes wrap where stored)."""
    return np.minimum(nearest_int(v), nmax).astype(F32)


def _as_uint8(v: np.ndarray) -> np.ndarray:
    """A code stored into uint8_t (negative ones wrap), as float32."""
    return (v.astype(np.int32) & 0xFF).astype(F32)


def make_qp_quants(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qp_quants: positive scales of a block [n, m] (weights w) -> (codes as uint8 values in
    float32, scale [m]); the codes wrap like C's uint8_t L[] when a scale is negative."""
    mx = np.zeros(x.shape[1], F32)
    for row in x:
        mx = select(mx > row, mx, row)          # MAX(max, x[i])
    zero = mx < GROUP_MAX_EPS
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / mx
        L = _as_uint8(nearest_int(iscale * x))
        diff = x - (F32(1) / iscale) * L
        best = seq_sum((w * diff) * diff)
        for step in (-4, -3, -2, -1, 1, 2, 3, 4):
            iscale_is = (F32(0.1) * F32(step) + F32(nmax)) / mx
            diff = x - (F32(1) / iscale_is) * _capped(iscale_is * x, nmax)
            mse = seq_sum((w * diff) * diff)
            better = mse < best
            best, iscale = select(better, mse, best), select(better, iscale_is, iscale)
        q = _capped(iscale * x, nmax)
        sumlx, suml2 = seq_sum(wx * q), seq_sum((w * q) * q)
        codes, scale = _qp_refine(x, w, wx, _as_uint8(q), sumlx, suml2, nmax)
    return select(zero, F32(0), codes), select(zero, F32(0), scale)


def _qp_refine(x, w, wx, L, sumlx, suml2, nmax: int):
    """make_qp_quants' five passes of coordinate descent -> (codes, scale)."""
    for _ in range(5):
        for i in range(x.shape[0]):
            li = L[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (w[i] * li) * li
            nl = _capped((x[i] * sl2) / slx, nmax)
            slx2 = slx + wx[i] * nl
            sl22 = sl2 + (w[i] * nl) * nl
            take = ((slx > 0) & (sl2 > 0) & (nl != li)
                    & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22))
            L[i] = select(take, _as_uint8(nl), li)
            sumlx, suml2 = select(take, slx2, sumlx), select(take, sl22, suml2)
    return L, select(suml2 > 0, sumlx / suml2, F32(0))


def _row_weights(rows: np.ndarray, imatrix: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of the rows and of the importance (the same for every row) [n, bs]."""
    qw = np.broadcast_to(imatrix.astype(F32).reshape(1, -1), rows.shape)
    return rows.reshape(-1, bs), np.ascontiguousarray(qw).reshape(-1, bs)


def _block_sigma2(x: np.ndarray, factor: float, n_groups: int) -> np.ndarray:
    """factor * sum x^2 over each block of x [nb, k] (C's order), repeated for its n_groups groups."""
    xt = elements_first(x, x.shape[1])
    return np.repeat((F32(factor) * seq_sum(xt * xt)) / F32(x.shape[1]), n_groups)


def _importance(xt: np.ndarray, qwt: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """quant_weights[i] * sqrtf(sigma2 + x[i]*x[i]) for groups [n, m]."""
    return qwt * np.sqrt(sigma2 + xt * xt)


def quantize_q2_k_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_impl: weighted qkx3 fits per 16, the scales and mins by make_qp_quants."""
    x, qw = _row_weights(rows, imatrix, 256)
    nb = x.shape[0]
    xt, qwt = elements_first(x, 16), elements_first(qw, 16)
    w = _importance(xt, qwt, _block_sigma2(x, 1.0, 16))
    sw = seq_sum(w).reshape(nb, 16).T
    L, scales, mins = make_qkx3_quants(xt, w, 3, -0.9, 0.05, 36)
    ls, dm = make_qp_quants(np.ascontiguousarray(scales.reshape(nb, 16).T), 15, sw)
    lm, mm = make_qp_quants(np.ascontiguousarray(mins.reshape(nb, 16).T), 15, sw)
    sc = (ls.T.astype(np.int32) | (lm.T.astype(np.int32) << 4)) & 0xFF
    return _q2_k_bytes(xt, L, sc, f16(dm), f16(mm)).reshape(rows.shape[0], -1)


def quantize_q3_k_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_impl: weighted make_qx_quants per 16, and again over the 16 scales."""
    x, qw = _row_weights(rows, imatrix, 256)
    nb = x.shape[0]
    xt, qwt = elements_first(x, 16), elements_first(qw, 16)
    w = _importance(xt, qwt, _block_sigma2(x, 2.0, 16))
    L, scales = make_qx_quants(xt, 4, w)
    codes, d_block = make_qx_quants(np.ascontiguousarray(scales.reshape(nb, 16).T), 32,
                                    np.ascontiguousarray(seq_sum(w).reshape(nb, 16).T))
    codes = codes.T.astype(np.int32)
    return _q3_k_bytes(xt, L, codes, _q3_scale_bytes(codes), f16(d_block)).reshape(rows.shape[0], -1)


def _q45_k_imatrix(rows: np.ndarray, imatrix: np.ndarray, nmax: int) -> np.ndarray:
    """quantize_row_q4_K_impl / _q5_K_impl: weighted qkx3 fits per 32, scales and mins by make_qp_quants."""
    x, qw = _row_weights(rows, imatrix, 256)
    nb = x.shape[0]
    xt, qwt = elements_first(x, 32), elements_first(qw, 32)
    w = _importance(xt, qwt, _block_sigma2(x, 2.0, 8))
    sw = np.ascontiguousarray(seq_sum(w).reshape(nb, 8).T)
    L, scales, mins = make_qkx3_quants(xt, w, nmax, -0.9, 0.05, 36)
    ls, d_block = make_qp_quants(np.ascontiguousarray(scales.reshape(nb, 8).T), 63, sw)
    lm, m_block = make_qp_quants(np.ascontiguousarray(mins.reshape(nb, 8).T), 63, sw)
    ls, lm = ls.T.astype(np.int32), lm.T.astype(np.int32)
    if nmax == 31:      # only the Q5_K impl limits the codes to 63
        ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    return _q45_k_bytes(xt, L, _k_scale_bytes(ls, lm), f16(d_block), f16(m_block), nmax).reshape(rows.shape[0], -1)


def quantize_q4_k_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    return _q45_k_imatrix(rows, imatrix, 15)


def quantize_q5_k_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    return _q45_k_imatrix(rows, imatrix, 31)


def quantize_q6_k_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_impl: make_qx_quants per 16 weighted by the importance itself."""
    x, qw = _row_weights(rows, imatrix, 256)
    xt = elements_first(x, 16)
    L, scales = make_qx_quants(xt, 32, elements_first(qw, 16))
    return _q6_k_bytes(xt, L, scales.reshape(x.shape[0], 16)).reshape(rows.shape[0], -1)


def _legacy_imatrix(rows: np.ndarray, imatrix: np.ndarray, nmax: int, affine: bool) -> np.ndarray:
    """quantize_row_q4_0/q4_1/q5_0/q5_1_impl: per 32, weights from the whole row's mean square;
    make_qx_quants (symmetric) or make_qkx3_quants (with a min)."""
    n = rows.shape[1]
    rt = np.ascontiguousarray(rows.T)
    sigma2 = np.repeat(seq_sum(rt * rt) / F32(n), n // 32)
    x, qw = _row_weights(rows, imatrix, 32)
    xt = elements_first(x, 32)
    w = _importance(xt, elements_first(qw, 32), sigma2)
    if affine:
        L, d, the_min = make_qkx3_quants(xt, w, nmax, -0.9, 0.05, 36)
        head = [f16_bytes(f16(d)), f16_bytes(f16(-the_min))]
    else:
        L, d = make_qx_quants(xt, (nmax + 1) // 2, w)
        head = [f16_bytes(f16(d))]
    q = groups_last(L.astype(np.uint8), x.shape[0])
    if nmax == 31:
        head.append(np.packbits((q >> 4) & 1, axis=1, bitorder="little"))
    return np.concatenate([*head, pack_nibble_pairs(q & 0xF, 16)], axis=1).reshape(rows.shape[0], -1)


def quantize_q4_0_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    return _legacy_imatrix(rows, imatrix, 15, False)


def quantize_q4_1_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    return _legacy_imatrix(rows, imatrix, 15, True)


def quantize_q5_0_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    return _legacy_imatrix(rows, imatrix, 31, False)


def quantize_q5_1_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    return _legacy_imatrix(rows, imatrix, 31, True)


HostKernel = Callable[[np.ndarray], np.ndarray]

KQUANT_KERNELS: dict[GGMLType, HostKernel] = {
    GGMLType.Q2_K: quantize_q2_k,
    GGMLType.Q3_K: quantize_q3_k,
    GGMLType.Q4_K: quantize_q4_k,
    GGMLType.Q5_K: quantize_q5_k,
    GGMLType.Q6_K: quantize_q6_k,
}

# Rows [r, n_per_row] and an importance per column [n_per_row] -> uint8 [r, row bytes].
ImatrixKernel = Callable[[np.ndarray, np.ndarray], np.ndarray]

IMATRIX_KERNELS: dict[GGMLType, ImatrixKernel] = {
    GGMLType.Q2_K: quantize_q2_k_imatrix,
    GGMLType.Q3_K: quantize_q3_k_imatrix,
    GGMLType.Q4_K: quantize_q4_k_imatrix,
    GGMLType.Q5_K: quantize_q5_k_imatrix,
    GGMLType.Q6_K: quantize_q6_k_imatrix,
    GGMLType.Q4_0: quantize_q4_0_imatrix,
    GGMLType.Q4_1: quantize_q4_1_imatrix,
    GGMLType.Q5_0: quantize_q5_0_imatrix,
    GGMLType.Q5_1: quantize_q5_1_imatrix,
}

