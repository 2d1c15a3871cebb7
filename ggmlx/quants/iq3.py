"""IQ3_S and IQ3_XXS, bit-exact with ggml's quantize_iq3_s / quantize_iq3_xxs
(quantize_row_iq3_s_impl, quantize_row_iq3_xxs_impl).

Each group of 4 magnitudes is rounded to 3-bit levels and looked up in the grid (512 points for
IQ3_S, 256 for IQ3_XXS); a point off the grid takes the nearest of its precomputed neighbours
(iq3xs_init_impl: the grid points at the 3 (IQ3_S) or 2 (IQ3_XXS) smallest squared distances,
ordered by distance then index), by the weighted error at the trial scale. Vectorised over
blocks of 32; the neighbour search runs on the off-grid groups only (the first minimum, as C's
strict `<`).

ggml's IQ3_S block loop skips the qs/signs advance for an all-zero block of 32, so the later
blocks of that super-block are written one slot early (and the last slots stay 0); this follows it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..native import search
from ..types import GGMLType
from . import iq_tables as tab
from .kquants import F32, ImatrixKernel, elements_first, f16, f16_bytes, nearest_int, round_in_range, select, seq_sum


@dataclass(frozen=True)
class Grid:
    """A grid's lookup tables: kmap [4096] (the grid index of each level code, -1 off the grid);
    for an off-grid code its neighbours in ggml's order, padded to K: their levels (float32 rows
    [4096 * K, 4], code-major), their values 2l+1 as [K, 4, 4096] planes, and their count [4096]."""
    kmap: np.ndarray
    nb_levels: np.ndarray
    values: np.ndarray
    count: np.ndarray


def _grid(levels: np.ndarray, n_want: int) -> Grid:
    """iq3xs_init_impl for a grid of 3-bit levels [G, 4]."""
    shifts = 3 * np.arange(4)
    kmap = np.full(4096, -1, np.int64)
    kmap[(levels << shifts).sum(axis=1)] = np.arange(len(levels))
    points = 2 * levels + 1
    pos = 2 * ((np.arange(4096)[:, None] >> shifts) & 7) + 1
    d2 = ((points[None] - pos[:, None]) ** 2).sum(axis=2)
    order = np.argsort(d2, axis=1, kind="stable")                 # by distance, then index
    sd = np.take_along_axis(d2, order, axis=1)
    rank = np.concatenate([np.zeros((4096, 1), np.int64), np.diff(sd, axis=1) > 0], axis=1).cumsum(axis=1)
    keep = (rank < n_want) & (kmap < 0)[:, None]
    k = int(keep.sum(axis=1).max())
    nb = np.where(keep, order, 0)[:, :k]
    values = np.ascontiguousarray(points[nb].transpose(1, 2, 0)).astype(F32)
    return Grid(kmap, levels[nb].reshape(-1, 4).astype(F32), values, keep.sum(axis=1))


@functools.cache
def iq3s_grid() -> Grid:
    return _grid(((tab.IQ3S_GRID.astype(np.int64) - 1) // 2), 3)          # values 1, 3, ..., 15


@functools.cache
def iq3xxs_grid() -> Grid:
    values = np.array([4, 12, 20, 28, 36, 44, 52, 62])                   # iq3xxs_grid's levels 0..7
    return _grid(np.searchsorted(values, tab.IQ3XXS_GRID.astype(np.int64)), 2)


_CODE_WEIGHTS = np.array([1, 8, 64, 512], np.int64)
_FLT_MAX = F32(np.finfo(np.float32).max)


def _best_neighbours(grid: Grid, code: np.ndarray, xv: np.ndarray, wa: np.ndarray, scale: np.ndarray
                     ) -> np.ndarray:
    """iq3_find_best_neighbour for n off-grid groups (codes [n], magnitudes and sqrt weights [n, 4],
    scale [n]) -> the index among each code's neighbours: the first with the least
    sum(w * (scale * q - x)^2). The groups run sorted by neighbour count, so candidate j is
    computed for the groups that have one (IQ3_S: 11 of up to 38 on average)."""
    lib = search.lib()
    if lib is not None:
        return search.best_neighbours(lib, code, xv, wa, scale, None, grid.values, grid.count)
    n = code.size
    k = grid.values.shape[0]
    order = np.argsort((k - grid.count[code]).astype(np.uint8), kind="stable")     # a radix sort
    c, xv, wa, s = code[order], xv[order].T.copy(), wa[order].T.copy(), scale[order]
    have = np.searchsorted(-grid.count[c], -np.arange(k), side="left")              # groups with > j
    best = np.full(n, _FLT_MAX, F32)
    pick = np.zeros(n, np.int32)
    for j in range(k):
        m = int(have[j])
        if m == 0:
            break
        cm = c[:m]
        d2 = (wa[0, :m] * (diff := s[:m] * grid.values[j, 0].take(cm) - xv[0, :m])) * diff
        for i in range(1, 4):
            diff = s[:m] * grid.values[j, i].take(cm) - xv[i, :m]
            d2 = d2 + (wa[i, :m] * diff) * diff
        closer = (d2 < best[:m]).astype(np.int32)
        np.minimum(d2, best[:m], out=best[:m])                     # d2 >= 0: the same as the select
        pick[:m] += (np.int32(j) - pick[:m]) * closer
    out = np.empty(n, np.int64)
    out[order] = pick
    return out


def _codes(lv: np.ndarray) -> np.ndarray:
    """Levels [32, m] -> the level code of each group of 4 [m, 8]."""
    return np.ascontiguousarray(lv.T).reshape(-1, 8, 4).astype(np.int64) @ _CODE_WEIGHTS


def _levels(grid: Grid, xv_t: np.ndarray, wa_t: np.ndarray, xval: np.ndarray, iscale: np.ndarray,
            scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quant levels [32, m] of the blocks at iscale (clip(nearest_int(0.5 (iscale x - 1)), 0, 7)),
    off-grid groups of 4 replaced by their best neighbour at `scale`; and which groups were on
    the grid [8, m]. xv_t, wa_t: magnitudes and sqrt weights as [m, 8, 4]. |0.5 (iscale x - 1)|
    < 9, so rounding takes the quick path."""
    m = xval.shape[1]
    # fmax / fmin: the all-zero blocks (NaN here) get level 0 instead of a wild index
    lv = np.fmin(np.fmax(round_in_range(F32(0.5) * (iscale * xval - F32(1))), F32(0)), F32(7))
    lv_t = np.ascontiguousarray(lv.T).reshape(m, 8, 4)
    code = lv_t.astype(np.int64) @ _CODE_WEIGHTS                     # [m, 8]
    on_grid = grid.kmap[code] >= 0
    g = np.flatnonzero(~on_grid)                                     # off-grid groups, as block * 8 + k
    if g.size:
        c = code.reshape(-1)[g]
        j = _best_neighbours(grid, c, xv_t.reshape(-1, 4)[g], wa_t.reshape(-1, 4)[g], scale[g // 8])
        lv_t.reshape(-1, 4)[g] = grid.nb_levels[c * grid.values.shape[0] + j]
    return np.ascontiguousarray(lv_t.reshape(m, 32).T), on_grid.T


def _sums(w: np.ndarray, wx: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = F32(2) * L + F32(1)
    return seq_sum(wx * q), seq_sum((w * q) * q)


@dataclass(frozen=True)
class _Search:
    """Where quantize_row_iq3_s_impl and quantize_row_iq3_xxs_impl differ in the scale search."""
    grid: Grid
    trials: range
    on_grid_at_start: bool          # is_on_grid before any trial is taken
    again_all_groups: bool          # the final pass redoes every group (IQ3_S) or the off-grid ones


def _block_search(sr: _Search, xval: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scale search of each block of 32 -> (levels [32, m], scale [m])."""
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
        on_grid = np.full((8, m), sr.on_grid_at_start)
        for step in sr.trials:
            iscale = (F32(15) + F32(step) * F32(0.2)) / mx
            laux, aux_on = _levels(sr.grid, xv_t, wa_t, xval, iscale, F32(1) / iscale)
            sumqx, sumq2 = _sums(w, wx, laux)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = select(better, sumqx / sumq2, scale)
            best = select(better, scale * sumqx, best)
            L = select(better, laux, L)
            on_grid = np.where(better, aux_on, on_grid)
        again = np.flatnonzero((~on_grid).any(axis=0) & (scale > 0))
        if again.size:      # the blocks with off-grid groups, again at the best scale
            s = scale[again]
            redo, _ = _levels(sr.grid, xv_t[again], wa_t[again], xval[:, again], F32(1) / s, s)
            if not sr.again_all_groups:
                keep = np.repeat(on_grid[:, again], 4, axis=0)
                redo = np.where(keep, L[:, again], redo)
            L[:, again] = redo
            sumqx, sumq2 = _sums(w[:, again], wx[:, again], redo)
            scale[again] = select(sumq2 > 0, sumqx / sumq2, s)
    return L, scale


def _weights(x: np.ndarray, qw: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of 32 [32, m] of the super-blocks x [nb, 256] and their weights: x*x, or with an
    importance qw * sqrt(sigma2 + x*x), sigma2 = 2 * sum x^2 / 256 over the super-block."""
    xt = elements_first(x, 32)
    if qw is None:
        return xt, xt * xt
    xs = elements_first(x, 256)
    sigma2 = np.repeat((F32(2) * seq_sum(xs * xs)) / F32(256), 8)
    return xt, elements_first(qw, 32) * np.sqrt(sigma2 + xt * xt)


def _sign_bits(neg: np.ndarray) -> np.ndarray:
    """Negative flags [32, m] -> one byte of 8 sign bits per 8 elements [4, m]."""
    bits = neg.reshape(4, 8, -1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    return bits.sum(axis=1).astype(np.uint8)


def _scale_codes(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block scales [nb, 8] -> (d = max / 31, the 4-bit codes nearest_int(0.5 (scale / d - 1)), max > 0)."""
    max_scale = sc.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = max_scale / F32(31)
        codes = np.minimum(np.maximum(nearest_int(F32(0.5) * ((F32(1) / d)[:, None] * sc - F32(1))), 0), 15)
    return d, codes, max_scale > 0


def _pack_iq3s(nb: int, L: np.ndarray, scale: np.ndarray, signs: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """block_iq3_s: d, qs[64], qh[8], signs[32], scales[4]; the blocks after a zero one one slot early."""
    gi = iq3s_grid().kmap[_codes(L)].reshape(nb, 8, 8)              # [nb, ib, k]
    live = ~zero.reshape(nb, 8)
    slot = np.cumsum(live, axis=1) - 1
    qs, sg = np.zeros((nb, 8, 8), np.uint8), np.zeros((nb, 8, 4), np.uint8)
    b, ib = np.nonzero(live)
    qs[b, slot[b, ib]] = (gi[b, ib] & 255).astype(np.uint8)
    sg[b, slot[b, ib]] = signs.T.reshape(nb, 8, 4)[b, ib]
    qh = np.where(live[:, :, None], (gi >> 8) << np.arange(8), 0).sum(axis=2).astype(np.uint8)
    d, codes, has = _scale_codes(scale.reshape(nb, 8))
    dh = np.where(has, f16(d * F32(1.033)), np.float16(0))
    scales = np.where(has[:, None], codes[:, 0::2] | (codes[:, 1::2] << 4), 0).astype(np.uint8)
    return np.concatenate([f16_bytes(dh), qs.reshape(nb, 64), qh, sg.reshape(nb, 32), scales], axis=1)


def quantize_iq3_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Super-blocks x [nb, 256] (importance qw [nb, 256] or None) -> block_iq3_s bytes [nb, 110]."""
    xt, w = _weights(x, qw)
    signs = _sign_bits(xt < 0)
    xval = np.abs(xt)
    search = _Search(grid=iq3s_grid(), trials=range(-9, 10), on_grid_at_start=False, again_all_groups=True)
    L, scale = _block_search(search, xval, w)
    zero = xval.max(axis=0) == 0                # `if (!max)`
    L, scale = select(zero, F32(0), L), select(zero, F32(0), scale)
    flip = scale < 0        # "should never happen": ggml flips the scale and the signs
    scale = select(flip, -scale, scale)
    signs = np.where(flip, ~signs, signs)
    return _pack_iq3s(x.shape[0], L, scale, signs, zero)


def _even_signs(xt: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """IQ3_XXS stores 7 sign bits per 8 (the 8th makes the count even): where the count is odd,
    the element of least w x^2 (the first) keeps its sign and goes negative into the search.
    -> (magnitudes [32, m], 7-bit signs [4, m])."""
    neg = xt < 0
    xval = np.abs(xt).reshape(4, 8, -1)
    odd = neg.reshape(4, 8, -1).sum(axis=1) % 2 == 1                # [4, m]
    imin = np.argmin(((w * xt) * xt).reshape(4, 8, -1), axis=1)     # [4, m]
    k, col = np.nonzero(odd)
    xval[k, imin[k, col], col] *= F32(-1)
    signs = _sign_bits(neg)
    signs[k, col] ^= (np.uint8(1) << imin[k, col].astype(np.uint8))
    return xval.reshape(32, -1), signs & 127


def quantize_iq3_xxs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Super-blocks x [nb, 256] -> block_iq3_xxs bytes [nb, 98]: d, qs[64] (grid indices),
    8 uint32 (4 x 7 sign bits | 4-bit scale << 28)."""
    nb = x.shape[0]
    xt, w = _weights(x, qw)
    xval, signs = _even_signs(xt, w)
    search = _Search(grid=iq3xxs_grid(), trials=range(-15, 16), on_grid_at_start=True, again_all_groups=False)
    L, scale = _block_search(search, xval, w)
    zero = xval.max(axis=0) < F32(1e-8)         # GROUP_MAX_EPS_IQ3_XXS
    L, scale, signs = select(zero, F32(0), L), select(zero, F32(0), scale), np.where(zero, 0, signs)
    flip = scale < 0
    scale = select(flip, -scale, scale)
    signs = np.where(flip, ~signs & 127, signs).astype(np.uint32)
    d, codes, has = _scale_codes(scale.reshape(nb, 8))
    sas = (signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)).reshape(nb, 8)
    sas = sas | (codes.astype(np.uint32) << 28)
    qs = iq3xxs_grid().kmap[_codes(L)].reshape(nb, 64).astype(np.uint8)
    body = np.where(has[:, None], np.concatenate([qs, sas.astype("<u4").view(np.uint8)], axis=1), 0)
    dh = np.where(has, f16(d * F32(1.0125)), np.float16(0))
    return np.concatenate([f16_bytes(dh), body.astype(np.uint8)], axis=1)


def _rows(kernel):
    def run(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
        qw = np.ascontiguousarray(np.broadcast_to(imatrix.astype(F32), rows.shape)).reshape(-1, 256)
        return kernel(rows.reshape(-1, 256), qw).reshape(rows.shape[0], -1)
    return run


IQ3_IMATRIX_KERNELS: dict[GGMLType, ImatrixKernel] = {
    GGMLType.IQ3_S: _rows(quantize_iq3_s),
    GGMLType.IQ3_XXS: _rows(quantize_iq3_xxs),
}
