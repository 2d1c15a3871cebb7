"""IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M, bit-exact with ggml's quantize_iq2_xxs,
quantize_iq2_xs, quantize_iq2_s, quantize_iq1_s and quantize_iq1_m (their quantize_row_*_impl).

All five share iq2xs_init_impl's tables: a grid of points with 8 levels each (0..2), the grid
index of every level code (kmap), and for a code off the grid its neighbours, the grid points at
the smallest squared distances between the odd values 2l+1 (IQ2_S: the nearest only, IQ2_XXS and
IQ2_XS: 2 distances, IQ1: 3), by distance then index. Only codes of levels 0..2 are ever looked
up, so the tables are indexed by the base-3 code (3^8 entries), rebuilt here from the grids.

IQ2: per block (32 for XXS, 16 for XS/S) a scan over trial scales rounds magnitudes to levels
0..2 per group of 8, snaps off-grid groups to their best neighbour (least sum w (s q - x)^2, the
first on a tie), and keeps the trial with the best weighted fit; XXS/XS store 7 sign bits per 8
(the 8th makes the count even: where it is odd, the element of least w x^2 goes in negative).

IQ1: an exhaustive search over the two boundaries that split a block's sorted values into the
levels -1, 0, 1 (shifted by +-IQ1S_DELTA), with C's running-best comparison replayed exactly:
every candidate is scored at once and only those that can still win (within 1e-3 of the running
maximum: float rounding moves the comparison by far less) go through the sequential replay.

Vectorised over blocks; the loops run over trial scales, neighbour ranks and candidate ranks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..native import search
from ..types import GGMLType
from . import iq_tables as tab
from .kquants import (
    F32,
    GROUP_MAX_EPS,
    ImatrixKernel,
    elements_first,
    f16,
    f16_bytes,
    make_qp_quants,
    nearest_int,
    round_in_range,
    select,
    seq_sum,
)

_N_CODES = 3 ** 8
_TERNARY = 3 ** np.arange(8, dtype=np.int64)
_FLT_MAX = F32(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Grid:
    """iq2xs_init_impl's tables by base-3 code: kmap [6561] (grid index, -1 off the grid),
    code_of [G] (the code of each grid point), the neighbours of each off-grid code in ggml's
    order padded to K: their grid indices [6561, K], their values as [K, 8, 6561] planes, and
    their count [6561]; by_index: each grid point's values as [8, G] planes; levels: each grid
    point's levels [G, 8] (float32)."""
    kmap: np.ndarray
    code_of: np.ndarray
    nb: np.ndarray
    values: np.ndarray
    count: np.ndarray
    by_index: np.ndarray
    levels: np.ndarray


def _grid(levels: np.ndarray, n_want: int, odd: bool) -> Grid:
    """The tables of a grid of levels [G, 8] in 0..2; values 2l+1 (IQ2) or l (IQ1)."""
    code_of = levels @ _TERNARY
    kmap = np.full(_N_CODES, -1, np.int64)
    kmap[code_of] = np.arange(len(levels))
    pos = 2 * ((np.arange(_N_CODES)[:, None] // _TERNARY) % 3) + 1
    pts = 2 * levels + 1
    d2 = (pos * pos).sum(axis=1)[:, None] + (pts * pts).sum(axis=1)[None] - 2 * pos @ pts.T
    order = np.argsort(d2, axis=1, kind="stable")                 # by distance, then index
    sd = np.take_along_axis(d2, order, axis=1)
    rank = np.concatenate([np.zeros((_N_CODES, 1), np.int64), np.diff(sd, axis=1) > 0], axis=1).cumsum(axis=1)
    keep = (rank < n_want) & (kmap < 0)[:, None]
    k = int(keep.sum(axis=1).max())
    nb = np.where(keep, order, 0)[:, :k]
    vals = pts if odd else levels
    values = np.ascontiguousarray(vals[nb].transpose(1, 2, 0)).astype(F32)
    return Grid(kmap, code_of, nb, values, keep.sum(axis=1), np.ascontiguousarray(vals.T).astype(F32),
                levels.astype(F32))


def _iq2_levels(g: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.array([8, 25, 43]), g.astype(np.int64))        # grid values -> 0..2


@functools.cache
def grid(t: GGMLType) -> Grid:
    if t == GGMLType.IQ2_XXS:
        return _grid(_iq2_levels(tab.IQ2XXS_GRID), 2, True)
    if t == GGMLType.IQ2_XS:
        return _grid(_iq2_levels(tab.IQ2XS_GRID), 2, True)
    if t == GGMLType.IQ2_S:
        return _grid(_iq2_levels(tab.IQ2S_GRID), 1, True)
    if t in (GGMLType.IQ1_S, GGMLType.IQ1_M):
        return _iq1_grid()
    raise KeyError(t)


@functools.cache
def _iq1_grid() -> Grid:
    return _grid(tab.IQ1S_GRID.astype(np.int64) + 1, 3, False)


# Neighbour ranks with fewer groups than this run flattened in one pass (the per-call cost of a
# loop step on a few groups is more than its work).
_LOOP_MIN = 512


def _best_neighbours(g: Grid, code: np.ndarray, xv: np.ndarray, wv: np.ndarray, scale: np.ndarray,
                     base: np.ndarray | None = None) -> np.ndarray:
    """iq2_find_best_neighbour / iq1_find_best_neighbour2 for n off-grid groups (codes [n],
    values and weights [n, 8], scale [n]; IQ1: q = base + level) -> the grid index of the first
    neighbour with the least sum(w * (scale * q - x)^2). The groups run sorted by neighbour count:
    rank j is computed for the groups that have one, in a loop over j while many do, then the
    remaining (group, rank) pairs all at once, each group's first minimum by segment."""
    lib = search.lib()
    if lib is not None:
        return g.nb[code, search.best_neighbours(lib, code, xv, wv, scale, base, g.values, g.count)]
    n = code.size
    k = g.values.shape[0]
    order = np.argsort((k - g.count[code]).astype(np.uint16), kind="stable")
    c, xv, wv, s = code[order], xv[order].T.copy(), wv[order].T.copy(), scale[order]
    b = None if base is None else base[order]
    cs = g.count[c]
    have = np.searchsorted(-cs, -np.arange(k), side="left")                # groups with > j
    best = np.full(n, _FLT_MAX, F32)
    pick = np.zeros(n, np.int64)
    j0 = int((have >= _LOOP_MIN).sum())
    for j in range(j0):
        m = int(have[j])
        cm, sm = c[:m], s[:m]
        d2 = None
        for i in range(8):
            q = g.values[j, i].take(cm)
            if b is not None:
                q = b[:m] + q
            diff = sm * q - xv[i, :m]
            t = (wv[i, :m] * diff) * diff
            d2 = t if d2 is None else d2 + t
        assert d2 is not None
        closer = d2 < best[:m]
        np.minimum(d2, best[:m], out=best[:m])                 # d2 >= 0: the same as the select
        pick[:m] = np.where(closer, j, pick[:m])
    mt = int(have[j0]) if j0 < k else 0
    if mt:
        n_t = cs[:mt] - j0
        starts = np.cumsum(n_t) - n_t
        jj = j0 + np.arange(int(n_t.sum())) - np.repeat(starts, n_t)
        gp = g.nb[np.repeat(c[:mt], n_t), jj]
        sp = np.repeat(s[:mt], n_t)
        bp = None if b is None else np.repeat(b[:mt], n_t)
        d2 = None
        for i in range(8):
            q = g.by_index[i].take(gp)
            if bp is not None:
                q = bp + q
            diff = sp * q - np.repeat(xv[i, :mt], n_t)
            t = (np.repeat(wv[i, :mt], n_t) * diff) * diff
            d2 = t if d2 is None else d2 + t
        assert d2 is not None
        mn = np.minimum.reduceat(d2, starts)
        first = np.minimum.reduceat(np.where(d2 == np.repeat(mn, n_t), jj, k), starts)
        closer = mn < best[:mt]
        pick[:mt] = np.where(closer, first, pick[:mt])
    out = np.empty(n, np.int64)
    out[order] = g.nb[c, pick]
    return out


def _codes(lv: np.ndarray) -> np.ndarray:
    """Levels [bs, m] -> the base-3 code of each group of 8 [m, bs // 8]."""
    m = lv.shape[1]
    return np.ascontiguousarray(lv.T).reshape(m, -1, 8).astype(np.int64) @ _TERNARY


def _round_levels(v: np.ndarray, hi: int) -> np.ndarray:
    """clip(nearest_int(v), 0, hi) as float32 (nearest_int's own bits where |v| is large)."""
    r = round_in_range(v) if float(np.abs(v).max(initial=0)) <= 2 ** 22 else nearest_int(v).astype(F32)
    return np.minimum(np.maximum(r, F32(0)), F32(hi))


# --- IQ2 ------------------------------------------------------------------------------------------


def _iq2_levels_at(g: Grid, xv_g: np.ndarray, wa_g: np.ndarray, xval: np.ndarray, iscale: np.ndarray,
                   scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Levels [bs, m] at iscale (clip(nearest_int(0.5 (iscale x - 1)), 0, 2)), the off-grid groups of
    8 replaced by their best neighbour at `scale`, and which groups were on the grid [m, bs // 8]."""
    bs, m = xval.shape
    lv = _round_levels(F32(0.5) * (iscale * xval - F32(1)), 2)
    code = _codes(lv)
    gi = g.kmap[code]
    off = np.flatnonzero(gi < 0)                       # as block * groups + group
    if off.size:
        c = code.reshape(-1)[off]
        gi.reshape(-1)[off] = _best_neighbours(g, c, xv_g[off], wa_g[off], scale[off // (bs // 8)])
    on_grid = g.kmap[code] >= 0
    lv_t = _grid_levels(g, gi)                         # [m * groups, 8]
    return np.ascontiguousarray(lv_t.reshape(m, bs).T), on_grid


def _grid_levels(g: Grid, gi: np.ndarray) -> np.ndarray:
    """Grid indices [...] -> their levels as float32 [n, 8]."""
    return g.levels.take(gi.reshape(-1), axis=0)


def _sums(w: np.ndarray, wx: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = F32(2) * L + F32(1)
    return seq_sum(wx * q), seq_sum((w * q) * q)


def _groups(a: np.ndarray) -> np.ndarray:
    """[bs, m] -> the groups of 8 [m * bs // 8, 8]."""
    return np.ascontiguousarray(a.T).reshape(-1, 8)


def _iq2_search(g: Grid, xval: np.ndarray, w: np.ndarray, zero: np.ndarray, xxs: bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scale search of each block [bs, m] -> (levels [bs, m], scale [m], zero [m]).

    XXS: trials (5 + 0.1 is) / eff_max, is in -6..6, from make_qp_quants' scale (eff_max = 3 s),
    then every group again at the best scale. XS/S: trials (5 + 0.1 is) / max, is in -9..9,
    then only the off-grid groups again."""
    bs, m = xval.shape
    waux = np.sqrt(w)
    wx = w * xval
    xv_g, wa_g = _groups(xval), _groups(waux)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if xxs:
            scale = make_qp_quants(xval, 4, w)[1]
            ref = scale * F32(3)
            zero = zero | ~(ref > 0)
            trials = range(-6, 7)
        else:
            ref = xval.max(axis=0)
            scale = ref / F32(5)
            trials = range(-9, 10)
        ref = select(zero, F32(1), ref)
        best = np.zeros(m, F32)
        L = np.zeros_like(xval)
        on_grid = np.ones((m, bs // 8), bool)
        for step in trials:
            iscale = (F32(5) + F32(step) * F32(0.1)) / ref
            laux, aux_on = _iq2_levels_at(g, xv_g, wa_g, xval, iscale, F32(1) / iscale)
            sumqx, sumq2 = _sums(w, wx, laux)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = select(better, sumqx / sumq2, scale)
            best = select(better, scale * sumqx, best)
            L = select(better, laux, L)
            on_grid = np.where(better[:, None], aux_on, on_grid)
        again = (scale > 0) & ~zero
        if not xxs:
            again &= ~on_grid.all(axis=1)
        again = np.flatnonzero(again)
        if again.size:          # the blocks again at the best scale
            s = scale[again]
            sub = (_groups(xval[:, again]), _groups(waux[:, again]))
            redo, _ = _iq2_levels_at(g, sub[0], sub[1], xval[:, again], F32(1) / s, s)
            if not xxs:
                keep = np.repeat(on_grid[again].T, 8, axis=0)
                redo = np.where(keep, L[:, again], redo)
            L[:, again] = redo
            sumqx, sumq2 = _sums(w[:, again], wx[:, again], redo)
            scale[again] = select(sumq2 > 0, sumqx / sumq2, s)
    L = select(zero, F32(0), L)
    scale = select(zero, F32(0), scale)
    return L, scale, zero


def _sigma2(x: np.ndarray, factor: float) -> np.ndarray:
    """factor * sum x^2 / 256 per super-block x [nb, 256] (C's order)."""
    xs = elements_first(x, 256)
    s = seq_sum(xs * xs)
    return (F32(factor) * s if factor != 1 else s) / F32(256)


def _weights(x: np.ndarray, qw: np.ndarray | None, bs: int, factor: float, plain: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [bs, m] of the super-blocks x [nb, 256] and their weights: qw * sqrt(sigma2 + x^2),
    or without an importance plain * sigma2 + x^2 (plain = 0: x^2)."""
    xt = elements_first(x, bs)
    sigma2 = np.repeat(_sigma2(x, factor), 256 // bs)
    if qw is None:
        return xt, (F32(plain) * sigma2 + xt * xt) if plain else xt * xt
    return xt, elements_first(qw, bs) * np.sqrt(sigma2 + xt * xt)


def _sign_bits(neg: np.ndarray) -> np.ndarray:
    """Negative flags [bs, m] -> one byte of 8 sign bits per group of 8 [bs // 8, m]."""
    bits = neg.reshape(-1, 8, neg.shape[1]).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    return bits.sum(axis=1).astype(np.uint8)


def _even_signs(xt: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """7 stored sign bits per 8: where the count of negatives is odd, the element of least w x^2
    (the first) keeps its sign and goes in negative. -> (values [bs, m], 7-bit signs [bs // 8, m])."""
    bs, m = xt.shape
    neg = xt < 0
    xval = np.abs(xt).reshape(bs // 8, 8, m)
    odd = neg.reshape(bs // 8, 8, m).sum(axis=1) % 2 == 1
    imin = np.argmin(((w * xt) * xt).reshape(bs // 8, 8, m), axis=1)
    k, col = np.nonzero(odd)
    xval[k, imin[k, col], col] *= F32(-1)
    signs = _sign_bits(neg)
    signs[k, col] ^= (np.uint8(1) << imin[k, col].astype(np.uint8))
    return xval.reshape(bs, m), signs & 127


def _scale_codes(sc: np.ndarray, n_max: float, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block scales [nb, k] -> (d = max / n_max, clip(nearest_int(0.5 (scale / d - 1)), 0, top), max > 0)."""
    max_scale = sc.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = max_scale / F32(n_max)
        codes = np.minimum(np.maximum(nearest_int(F32(0.5) * ((F32(1) / d)[:, None] * sc - F32(1))), 0), top)
    has = max_scale > 0
    return d, np.where(has[:, None], codes, 0), has


def quantize_iq2_xxs(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Super-blocks x [nb, 256] with importance qw -> block_iq2_xxs bytes [nb, 66]: d, then per
    block of 32 two uint32: 4 grid indices (bytes), 4 x 7 sign bits | 4-bit scale << 28."""
    nb = x.shape[0]
    g = grid(GGMLType.IQ2_XXS)
    xt, w = _weights(x, qw, 32, 1, 0)
    xval, signs = _even_signs(xt, w)
    zero = xval.max(axis=0) < GROUP_MAX_EPS
    L, scale, zero = _iq2_search(g, xval, w, zero, xxs=True)
    flip = scale < 0
    scale = select(flip, -scale, scale)
    signs = np.where(flip, ~signs & 127, signs).astype(np.uint32)
    signs = np.where(zero, 0, signs)
    gi = g.kmap[_codes(L)].astype(np.uint32).reshape(nb, 8, 4)
    d, codes, has = _scale_codes(scale.reshape(nb, 8), 31, 15)
    grid_word = gi[:, :, 0] | (gi[:, :, 1] << 8) | (gi[:, :, 2] << 16) | (gi[:, :, 3] << 24)
    grid_word = np.where(zero.reshape(nb, 8), 0, grid_word)
    s = signs.reshape(4, nb, 8)
    sign_word = s[0] | (s[1] << 7) | (s[2] << 14) | (s[3] << 21) | (codes.astype(np.uint32) << 28)
    words = np.stack([grid_word, sign_word], axis=2).reshape(nb, 16)
    words = np.where(has[:, None], words, 0).astype("<u4")
    dh = np.where(has, f16(d), np.float16(0))
    return np.concatenate([f16_bytes(dh), words.view(np.uint8)], axis=1)


def quantize_iq2_xs(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Super-blocks x [nb, 256] with importance qw -> block_iq2_xs bytes [nb, 74]: d, 32 uint16
    (9-bit grid index | 7 sign bits << 9), 8 bytes of 4-bit scale pairs."""
    nb = x.shape[0]
    g = grid(GGMLType.IQ2_XS)
    xt, w = _weights(x, qw, 16, 1, 0)
    xval, signs = _even_signs(xt, w)
    zero = xval.max(axis=0) < GROUP_MAX_EPS
    L, scale, zero = _iq2_search(g, xval, w, zero, xxs=False)
    flip = scale < 0
    scale = select(flip, -scale, scale)
    signs = np.where(flip, ~signs & 127, signs).astype(np.uint16)
    gi = g.kmap[_codes(L)].astype(np.uint16)                       # [m, 2]
    qs = np.where(zero[:, None], 0, gi | (signs.T << 9)).reshape(nb, 32)
    d, codes, has = _scale_codes(scale.reshape(nb, 16), 31, 15)
    scales = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    qs = np.where(has[:, None], qs, 0).astype("<u2")
    dh = np.where(has, f16(d), np.float16(0))
    return np.concatenate([f16_bytes(dh), qs.view(np.uint8), scales], axis=1)


def quantize_iq2_s(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Super-blocks x [nb, 256] (importance qw or None) -> block_iq2_s bytes [nb, 82]: d, 32 low
    bytes of the 10-bit grid indices, 32 sign bytes, 8 bytes of 2-bit high parts, 8 of scales."""
    nb = x.shape[0]
    g = grid(GGMLType.IQ2_S)
    xt, w = _weights(x, qw, 16, 2, 0.25)
    signs = _sign_bits(xt < 0)
    xval = np.abs(xt)
    zero = xval.max(axis=0) < F32(1e-8)                       # GROUP_MAX_EPS_IQ2_S
    L, scale, zero = _iq2_search(g, xval, w, zero, xxs=False)
    flip = scale < 0
    scale = select(flip, -scale, scale)
    signs = np.where(flip, ~signs, signs)
    gi = g.kmap[_codes(L)]                                   # [m, 2]
    gi = np.where(zero[:, None], 0, gi).reshape(nb, 32)
    signs = np.where(zero, 0, signs).T.reshape(nb, 32).astype(np.uint8)
    qh = ((gi >> 8) << (2 * (np.arange(32) % 4))).reshape(nb, 8, 4).sum(axis=2).astype(np.uint8)
    d, codes, has = _scale_codes(scale.reshape(nb, 16), 31, 15)
    scales = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    dh = np.where(has, f16(d * F32(0.9875)), np.float16(0))
    return np.concatenate([f16_bytes(dh), (gi & 255).astype(np.uint8), signs, qh, scales], axis=1)


# --- IQ1 ------------------------------------------------------------------------------------------

_X_P = (F32(-1) + tab.IQ1S_DELTA, tab.IQ1S_DELTA, F32(1) + tab.IQ1S_DELTA)
_X_M = (F32(-1) - tab.IQ1S_DELTA, -tab.IQ1S_DELTA, F32(1) - tab.IQ1S_DELTA)


def _replay(sumqx: np.ndarray, sumq2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """C's running best over candidates [m, C] in order (`sumq2 > 0 && sumqx^2 > best sumq2`,
    best from -FLT_MAX, then best = scale * sumqx with scale = sumqx / sumq2) -> (the last
    candidate taken [m], -1 for none; its scale [m]).

    A candidate can only be taken when its score sumqx^2 / sumq2 is within the rounding of
    the running best, which is within a few float32 ulps (at most 4.5e-4 over 1224 steps) of the
    highest score so far; the others are never taken and leave the best as it is, so only the
    candidates within 1e-3 of the running maximum are replayed. (With the native library, C's
    loop itself runs.)"""
    lib = search.lib()
    if lib is not None:
        return search.running_best(lib, sumqx, sumq2)
    m, n = sumqx.shape
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        valid = sumq2 > 0
        score = np.where(valid, (sumqx / sumq2) * sumqx, -np.inf).astype(F32)
        run = np.maximum.accumulate(score, axis=1)
        prev = np.concatenate([np.full((m, 1), -np.inf, F32), run[:, :-1]], axis=1)
        live = valid & (score >= prev * F32(1 - 1e-3))
        rows, cols = np.nonzero(live)
        counts = np.bincount(rows, minlength=m)
        start = np.cumsum(counts) - counts
        rank = np.arange(rows.size) - start[rows]
        r_max = int(counts.max(initial=0))
        cand = np.zeros((m, r_max), np.int64)
        cand[rows, rank] = cols
        best = np.full(m, -_FLT_MAX, F32)
        scale = np.zeros(m, F32)
        pick = np.full(m, -1, np.int64)
        ar = np.arange(m)
        for r in range(r_max):
            sel = ar[counts > r]
            cj = cand[sel, r]
            a, b = sumqx[sel, cj], sumq2[sel, cj]
            take = a * a > best[sel] * b
            t = sel[take]
            s = a[take] / b[take]
            scale[t] = s
            best[t] = s * a[take]
            pick[t] = cj[take]
    return pick, scale


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(i1, i2) for 0 <= i1 <= i2 <= n, i1 outer, as C's two loops."""
    i1, i2 = np.triu_indices(n + 1)
    return i1, i2


def _sorted_prefix(xt: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each block's values sorted (stable, as glibc's merge sort qsort) -> (the sort order [bs, m],
    the rank of each element [bs, m])."""
    order = np.argsort(xt, axis=0, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(xt.shape[0])[:, None], axis=0)
    return order, rank


def _cum(v: np.ndarray) -> np.ndarray:
    """Prefix sums [bs, m] -> [bs + 1, m] from 0, added in order."""
    return np.concatenate([np.zeros((1, v.shape[1]), F32), np.add.accumulate(v, axis=0)], axis=0)


def _iq1_groups(g: Grid, L: np.ndarray, xt: np.ndarray, w: np.ndarray, scale: np.ndarray, base: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Grid indices [m, bs // 8] of the levels L [bs, m], off-grid groups snapped by
    iq1_find_best_neighbour2 (q = base + level, base per group [m, bs // 8]); and whether all of a
    block's groups were on the grid [m]."""
    bs, m = L.shape
    code = _codes(L)
    gi = g.kmap[code]
    off = np.flatnonzero(gi < 0)
    if off.size:
        c = code.reshape(-1)[off]
        gi.reshape(-1)[off] = _best_neighbours(g, c, _groups(xt)[off], _groups(w)[off],
                                               scale[off // (bs // 8)], base.reshape(-1)[off])
    return gi, (g.kmap[code] >= 0).all(axis=1)


def _grid_q(g: Grid, gi: np.ndarray, base: np.ndarray) -> np.ndarray:
    """q = base + level of the grid points gi [m, k] as [k * 8, m] (elements first)."""
    m, k = gi.shape
    lv = _grid_levels(g, gi).reshape(m, k, 8)
    return np.ascontiguousarray((base[:, :, None] + lv).reshape(m, k * 8).T)


def quantize_iq1_s(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Super-blocks x [nb, 256] with importance qw -> block_iq1_s bytes [nb, 50]: d, 32 low bytes
    of the 11-bit grid indices, 8 uint16 (3 x 3 high bits | 3-bit scale << 12 | shift sign << 15)."""
    nb = x.shape[0]
    g = grid(GGMLType.IQ1_S)
    xt, w = _weights(x, qw, 32, 2, 0)
    m = xt.shape[1]
    zero = np.abs(xt).max(axis=0) < F32(1e-12)                # GROUP_MAX_EPS_IQ1_S
    order, rank = _sorted_prefix(xt, w)
    xs, ws = np.take_along_axis(xt, order, axis=0), np.take_along_axis(w, order, axis=0)
    S, W = _cum(ws * xs), _cum(ws)
    i1, i2 = _pairs(32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        A, B, C = S[i1].T, (S[i2] - S[i1]).T, (S[32][None] - S[i2]).T          # [m, 561]
        WA, WB, WC = W[i1].T, (W[i2] - W[i1]).T, (W[32][None] - W[i2]).T
        qx, q2 = [], []
        for xx in (_X_P, _X_M):
            qx.append((A * xx[0] + B * xx[1]) + C * xx[2])
            q2.append(((WA * xx[0]) * xx[0] + (WB * xx[1]) * xx[1]) + (WC * xx[2]) * xx[2])
        del A, B, C, WA, WB, WC
        sumqx = np.stack(qx, axis=2).reshape(m, -1)           # candidates (i1, i2, +) then (i1, i2, -)
        sumq2 = np.stack(q2, axis=2).reshape(m, -1)
        del qx, q2
    pick, scale = _replay(sumqx, sumq2)
    del sumqx, sumq2
    zero |= pick < 0
    pair, shift = np.maximum(pick, 0) // 2, np.where(pick % 2 == 0, 1, -1)
    L = (rank >= i1[pair][None]).astype(F32) + (rank >= i2[pair][None]).astype(F32)
    flip = scale < 0
    L = np.where(flip, F32(2) - L, L)
    scale = select(flip, -scale, scale)
    shift = np.where(flip, -shift, shift)
    base = np.where(shift == 1, _X_P[0], _X_M[0]).astype(F32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        gi, on_grid = _iq1_groups(g, L, xt, w, scale, np.repeat(base[:, None], 4, axis=1))
        redo = np.flatnonzero(~on_grid & ~zero)
        if redo.size:
            q = _grid_q(g, gi[redo], np.repeat(base[redo, None], 4, axis=1))
            wq = w[:, redo] * q
            sqx, sq2 = seq_sum(wq * xt[:, redo]), seq_sum(wq * q)
            scale[redo] = select((sqx > 0) & (sq2 > 0), sqx / sq2, scale[redo])
    scale = select(zero, F32(0), scale)
    shift = np.where(zero, 1, shift)
    gi = np.where(zero[:, None], 0, gi)
    qs = (gi & 255).astype(np.uint8).reshape(nb, 32)
    qh = (gi >> 8) << (3 * np.arange(4))
    qh = qh.sum(axis=1).reshape(nb, 8)
    d, codes, has = _scale_codes(scale.reshape(nb, 8), 15, 7)
    codes = np.where(has[:, None], codes | np.where(shift.reshape(nb, 8) == -1, 8, 0), 0)
    qh = (qh | (codes << 12)).astype("<u2")
    dh = np.where(has, f16(d * F32(1.125)), np.float16(0))
    return np.concatenate([f16_bytes(dh), qs, qh.view(np.uint8)], axis=1)


_IQ1M_MASKS = np.array([0x00, 0x80, 0x08, 0x88], np.int64)


def quantize_iq1_m(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """Super-blocks x [nb, 256] (importance qw or None) -> block_iq1_m bytes [nb, 56]: 32 low
    bytes of the grid indices, 16 bytes of 2 x (3 high bits | shift bit), 4 uint16 of 4 x 3-bit
    scales with the super-block's f16 scale in their top nibbles."""
    nb = x.shape[0]
    g = grid(GGMLType.IQ1_M)
    xt, w = _weights(x, qw, 16, 2, 0)
    m = xt.shape[1]
    zero = np.abs(xt).max(axis=0) < F32(1e-7)                 # GROUP_MAX_EPS_IQ1_M
    order, rank = _sorted_prefix(xt, w)
    xs, ws = np.take_along_axis(xt, order, axis=0), np.take_along_axis(w, order, axis=0)
    half = np.take_along_axis(np.broadcast_to((np.arange(16) >= 8)[:, None], xt.shape), order, axis=0)
    wx = ws * xs
    px = [_cum(np.where(half, F32(0), wx)), _cum(np.where(half, wx, F32(0)))]
    pw = [_cum(np.where(half, F32(0), ws)), _cum(np.where(half, ws, F32(0)))]
    p2, m2 = _X_P[2], _X_M[2]
    cp1, cp2 = _X_P[0] * _X_P[0] - _X_P[1] * _X_P[1], _X_P[1] * _X_P[1] - _X_P[2] * _X_P[2]
    cm1, cm2 = _X_M[0] * _X_M[0] - _X_M[1] * _X_M[1], _X_M[1] * _X_M[1] - _X_M[2] * _X_M[2]
    i1, i2 = _pairs(16)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        qxp, qxm, q2p, q2m = [], [], [], []
        for h in range(2):
            txs, tws = px[h][16][None], pw[h][16][None]
            sx = (px[h][i1] + px[h][i2]).T                       # [m, 153]
            qxp.append(txs.T * p2 - sx)
            qxm.append(txs.T * m2 - sx)
            a1, a2 = pw[h][i1].T, pw[h][i2].T
            q2p.append(((tws.T * p2) * p2 + a1 * cp1) + a2 * cp2)
            q2m.append(((tws.T * m2) * m2 + a1 * cm1) + a2 * cm2)
        sumqx = np.stack([qxp[0] + qxp[1], qxp[0] + qxm[1], qxm[0] + qxp[1], qxm[0] + qxm[1]], axis=2)
        sumq2 = np.stack([q2p[0] + q2p[1], q2p[0] + q2m[1], q2m[0] + q2p[1], q2m[0] + q2m[1]], axis=2)
        del qxp, qxm, q2p, q2m
    pick, scale = _replay(sumqx.reshape(m, -1), sumq2.reshape(m, -1))
    del sumqx, sumq2
    zero |= pick < 0
    pair, kk = np.maximum(pick, 0) // 4, np.maximum(pick, 0) % 4
    L = (rank >= i1[pair][None]).astype(F32) + (rank >= i2[pair][None]).astype(F32)
    flip = scale < 0
    L = np.where(flip, F32(2) - L, L)
    scale = select(flip, -scale, scale)
    kk = np.where(flip, 3 - kk, kk)
    kk = np.where(zero, 0, kk)
    # group 0 takes x_p for k < 2, group 1 for even k
    base = np.stack([np.where(kk < 2, _X_P[0], _X_M[0]), np.where(kk % 2 == 0, _X_P[0], _X_M[0])],
                    axis=1).astype(F32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        gi, on_grid = _iq1_groups(g, L, xt, w, scale, base)
        redo = np.flatnonzero(~on_grid & ~zero)
        if redo.size:
            q = _grid_q(g, gi[redo], base[redo])
            wq = w[:, redo] * q
            sqx, sq2 = seq_sum(wq * xt[:, redo]), seq_sum(wq * q)
            scale[redo] = select((sqx > 0) & (sq2 > 0), sqx / sq2, scale[redo])
    scale = select(zero, F32(0), scale)
    gi = np.where(zero[:, None], 0, gi)                         # [m, 2]
    qs = (gi & 255).astype(np.uint8).reshape(nb, 32)
    qh = ((gi[:, 0] >> 8) | ((gi[:, 1] >> 8) << 4)).reshape(nb, 16)
    d, codes, has = _scale_codes(scale.reshape(nb, 16), 15, 7)
    qh = np.where(has[:, None], qh | _IQ1M_MASKS[kk.reshape(nb, 16)], qh)
    sc = (codes << (3 * (np.arange(16) % 4))).reshape(nb, 4, 4).sum(axis=2)        # 4 uint16
    # the super-block scale: the weighted fit of all 256 values at the block scales' codes
    lq = F32(2) * codes.astype(F32) + F32(1)                     # [nb, 16]
    q = _grid_q(g, gi, base) * lq.reshape(1, -1)                     # [16, m]
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        wq = w * q
        sqx = seq_sum(elements_first(groups_to_rows(wq * xt, nb), 256))
        sq2 = seq_sum(elements_first(groups_to_rows(wq * q, nb), 256))
        dd = select(sq2 > 0, sqx / sq2, d)
    s16 = f16(dd * F32(1.1125)).view(np.uint16).astype(np.int64)
    top = np.stack([(s16 & 0x000F) << 12, (s16 & 0x00F0) << 8, (s16 & 0x0F00) << 4, s16 & 0xF000], axis=1)
    sc = np.where(has[:, None], sc | top, 0).astype("<u2")
    return np.concatenate([qs, qh.astype(np.uint8), sc.view(np.uint8)], axis=1)


def groups_to_rows(a: np.ndarray, nb: int) -> np.ndarray:
    """Blocks [bs, m] -> the super-blocks' values in order [nb, 256]."""
    return np.ascontiguousarray(a.T).reshape(nb, 256)


def _rows(kernel):
    def run(rows: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
        qw = np.ascontiguousarray(np.broadcast_to(imatrix.astype(F32), rows.shape)).reshape(-1, 256)
        return kernel(rows.reshape(-1, 256), qw).reshape(rows.shape[0], -1)
    return run


IQ2_IMATRIX_KERNELS: dict[GGMLType, ImatrixKernel] = {
    GGMLType.IQ2_XXS: _rows(quantize_iq2_xxs),
    GGMLType.IQ2_XS: _rows(quantize_iq2_xs),
    GGMLType.IQ2_S: _rows(quantize_iq2_s),
    GGMLType.IQ1_S: _rows(quantize_iq1_s),
    GGMLType.IQ1_M: _rows(quantize_iq1_m),
}
# The types ggml quantizes without an importance matrix too (ggml_quantize_requires_imatrix).
IQ2_KERNELS = {GGMLType.IQ2_S: quantize_iq2_s, GGMLType.IQ1_M: quantize_iq1_m}
REQUIRE_IMATRIX = (GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ1_S)
