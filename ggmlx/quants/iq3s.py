"""IQ3_S, bit-exact with ggml's quantize_iq3_s (quantize_row_iq3_s_impl).

Each group of 4 magnitudes is rounded to 3-bit levels and looked up in the 512-point grid; a
point off the grid takes the nearest of its precomputed neighbours (iq3xs_init_impl: the grid
points at the three smallest squared distances, ordered by distance then index), by the
weighted error at the trial scale. Vectorised over blocks of 32; the neighbour search runs on
the off-grid groups only, all their candidates at once (the first minimum, as C's strict `<`).

ggml's block loop skips the qs/signs advance for an all-zero block of 32, so the later blocks of
that super-block are written one slot early (and the last slots stay 0); this follows it.
"""
from __future__ import annotations

import functools

import numpy as np

from ..types import GGMLType
from . import iq_tables as tab
from .kquants import F32, ImatrixKernel, elements_first, f16, f16_bytes, nearest_int, round_in_range, select, seq_sum

_GRID = tab.IQ3S_GRID                   # [512, 4]: 1, 3, ..., 15
_N_WANT = 3                             # neighbours: the points at the 3 smallest distances
_TRIALS = range(-9, 10)


@functools.cache
def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """kmap [4096]: the grid index of each level code (-1 off the grid); for an off-grid code its
    neighbours in ggml's order (iq3xs_init_impl), padded to K: their levels (float32 rows
    [4096 * K, 4], code-major), their values as [K, 4, 4096] planes, and how many there are [4096]."""
    grid = _GRID.astype(np.int64)
    shifts = 3 * np.arange(4)
    kmap = np.full(4096, -1, np.int64)
    kmap[(((grid - 1) // 2) << shifts).sum(axis=1)] = np.arange(len(grid))
    pos = 2 * ((np.arange(4096)[:, None] >> shifts) & 7) + 1
    d2 = ((grid[None] - pos[:, None]) ** 2).sum(axis=2)
    order = np.argsort(d2, axis=1, kind="stable")                 # by distance, then index
    sd = np.take_along_axis(d2, order, axis=1)
    rank = np.concatenate([np.zeros((4096, 1), np.int64), np.diff(sd, axis=1) > 0], axis=1).cumsum(axis=1)
    keep = (rank < _N_WANT) & (kmap < 0)[:, None]
    k = int(keep.sum(axis=1).max())
    nb = np.where(keep, order, 0)[:, :k]
    values = np.ascontiguousarray(_GRID[nb].transpose(1, 2, 0))
    return kmap, ((_GRID[nb] - 1) // 2).reshape(-1, 4), values, keep.sum(axis=1)


_CODE_WEIGHTS = np.array([1, 8, 64, 512], np.int64)
_FLT_MAX = F32(np.finfo(np.float32).max)


def _best_neighbours(code: np.ndarray, xv: np.ndarray, wa: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """iq3_find_best_neighbour for n off-grid groups (codes [n], magnitudes and sqrt weights [n, 4],
    scale [n]) -> the index among each code's neighbours: the first with the least
    sum(w * (scale * q - x)^2). The groups run sorted by neighbour count, so candidate j is
    computed for the groups that have one (on average 7 of up to 38)."""
    _, _, values, count = _tables()
    n = code.size
    k = values.shape[0]
    order = np.argsort((k - count[code]).astype(np.uint8), kind="stable")     # a radix sort
    c, xv, wa, s = code[order], xv[order].T.copy(), wa[order].T.copy(), scale[order]
    have = np.searchsorted(-count[c], -np.arange(k), side="left")              # groups with > j
    best = np.full(n, _FLT_MAX, F32)
    pick = np.zeros(n, np.int32)
    for j in range(k):
        m = int(have[j])
        if m == 0:
            break
        cm = c[:m]
        d2 = (wa[0, :m] * (diff := s[:m] * values[j, 0].take(cm) - xv[0, :m])) * diff
        for i in range(1, 4):
            diff = s[:m] * values[j, i].take(cm) - xv[i, :m]
            d2 = d2 + (wa[i, :m] * diff) * diff
        closer = (d2 < best[:m]).astype(np.int32)
        np.minimum(d2, best[:m], out=best[:m])                     # d2 >= 0: the same as the select
        pick[:m] += (np.int32(j) - pick[:m]) * closer
    out = np.empty(n, np.int64)
    out[order] = pick
    return out


def _levels(xv_t: np.ndarray, wa_t: np.ndarray, xval: np.ndarray, iscale: np.ndarray, scale: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """Quant levels [32, m] of the blocks at iscale (clip(nearest_int(0.5 (iscale x - 1)), 0, 7)),
    off-grid groups of 4 replaced by their best neighbour at `scale`; and which groups were on
    the grid [8, m]. xv_t, wa_t: magnitudes and sqrt weights as [m, 8, 4]. |0.5 (iscale x - 1)|
    < 9, so rounding takes the quick path."""
    kmap, nb_levels = _tables()[:2]
    m = xval.shape[1]
    # fmax / fmin: the all-zero blocks (NaN here) get level 0 instead of a wild index
    lv = np.fmin(np.fmax(round_in_range(F32(0.5) * (iscale * xval - F32(1))), F32(0)), F32(7))
    lv_t = np.ascontiguousarray(lv.T).reshape(m, 8, 4)
    code = lv_t.astype(np.int64) @ _CODE_WEIGHTS                     # [m, 8]
    on_grid = kmap[code] >= 0
    g = np.flatnonzero(~on_grid)                                     # off-grid groups, as block * 8 + k
    if g.size:
        c = code.reshape(-1)[g]
        j = _best_neighbours(c, xv_t.reshape(-1, 4)[g], wa_t.reshape(-1, 4)[g], scale[g // 8])
        lv_t.reshape(-1, 4)[g] = nb_levels[c * _tables()[2].shape[0] + j]
    return np.ascontiguousarray(lv_t.reshape(m, 32).T), on_grid.T


def _sums(w: np.ndarray, wx: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = F32(2) * L + F32(1)
    return seq_sum(wx * q), seq_sum((w * q) * q)


def _block_search(xval: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scale search of each block of 32 -> (levels [32, m], scale [m]); zero blocks give 0."""
    m = xval.shape[1]
    waux = np.sqrt(w)
    wx = w * xval
    mx = xval.max(axis=0)
    xv_t = np.ascontiguousarray(xval.T).reshape(m, 8, 4)
    wa_t = np.ascontiguousarray(waux.T).reshape(m, 8, 4)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        best = np.zeros(m, F32)
        scale = mx / F32(15)
        L = np.zeros_like(xval)
        on_grid = np.zeros((8, m), bool)
        for step in _TRIALS:
            iscale = (F32(15) + F32(step) * F32(0.2)) / mx
            laux, aux_on = _levels(xv_t, wa_t, xval, iscale, F32(1) / iscale)
            sumqx, sumq2 = _sums(w, wx, laux)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = select(better, sumqx / sumq2, scale)
            best = select(better, scale * sumqx, best)
            L = select(better, laux, L)
            on_grid = np.where(better, aux_on, on_grid)
        again = np.flatnonzero((~on_grid).any(axis=0) & (scale > 0))
        if again.size:      # the blocks with off-grid groups: every group again at the best scale
            s = scale[again]
            L[:, again], _ = _levels(xv_t[again], wa_t[again], xval[:, again], F32(1) / s, s)
            sumqx, sumq2 = _sums(w[:, again], wx[:, again], L[:, again])
            scale[again] = select(sumq2 > 0, sumqx / sumq2, s)
    zero = mx == 0
    return select(zero, F32(0), L), select(zero, F32(0), scale)


def _pack(nb: int, L: np.ndarray, scale: np.ndarray, signs: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """block_iq3_s: d, qs[64], qh[8], signs[32], scales[4]; the blocks after a zero one one slot early."""
    kmap = _tables()[0]
    m = L.shape[1]
    g = L.astype(np.int64).reshape(8, 4, m)
    gi = kmap[g[:, 0] | (g[:, 1] << 3) | (g[:, 2] << 6) | (g[:, 3] << 9)].T.reshape(nb, 8, 8)   # [nb, ib, k]
    live = ~zero.reshape(nb, 8)
    slot = np.cumsum(live, axis=1) - 1
    qs, sg = np.zeros((nb, 8, 8), np.uint8), np.zeros((nb, 8, 4), np.uint8)
    b, ib = np.nonzero(live)
    qs[b, slot[b, ib]] = (gi[b, ib] & 255).astype(np.uint8)
    sg[b, slot[b, ib]] = signs.T.reshape(nb, 8, 4)[b, ib]
    qh = np.where(live[:, :, None], (gi >> 8) << np.arange(8), 0).sum(axis=2).astype(np.uint8)
    sc = scale.reshape(nb, 8)
    max_scale = sc.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = max_scale / F32(31)
        codes = np.minimum(np.maximum(nearest_int(F32(0.5) * ((F32(1) / d)[:, None] * sc - F32(1))), 0), 15)
    has = max_scale > 0
    dh = np.where(has, f16(d * F32(1.033)), np.float16(0))
    scales = np.where(has[:, None], codes[:, 0::2] | (codes[:, 1::2] << 4), 0).astype(np.uint8)
    return np.concatenate([f16_bytes(dh), qs.reshape(nb, 64), qh, sg.reshape(nb, 32), scales], axis=1)


def quantize_iq3_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Super-blocks x [nb, 256] (importance qw [nb, 256] or None) -> block_iq3_s bytes [nb, 110]."""
    nb = x.shape[0]
    xt = elements_first(x, 32)
    if qw is None:
        w = xt * xt
    else:
        xs = elements_first(x, 256)
        sigma2 = np.repeat((F32(2) * seq_sum(xs * xs)) / F32(256), 8)
        w = elements_first(qw, 32) * np.sqrt(sigma2 + xt * xt)
    neg = (xt < 0).reshape(4, 8, -1)
    signs = (neg.astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    xval = np.abs(xt)
    L, scale = _block_search(xval, w)
    flip = scale < 0        # "should never happen": ggml flips the scale and the signs
    scale = select(flip, -scale, scale)
    signs = np.where(flip, ~signs, signs)
    return _pack(nb, L, scale, signs, xval.max(axis=0) == 0)


def quantize_iq3_s_imatrix(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    qw = np.ascontiguousarray(np.broadcast_to(imatrix.astype(F32), rows.shape)).reshape(-1, 256)
    return quantize_iq3_s(rows.reshape(-1, 256), qw).reshape(rows.shape[0], -1)


IQ3S_IMATRIX_KERNELS: dict[GGMLType, ImatrixKernel] = {GGMLType.IQ3_S: quantize_iq3_s_imatrix}
