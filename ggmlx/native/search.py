"""The quantizers' scale searches in C (quant_search.cc), for `llm quantize`.

ggmlx/quants/kquants.py runs make_qx_quants, make_qkx2_quants and make_qkx3_quants (nlquants.py
the IQ4 scale search, iq2.py / iq3.py the grids' neighbour search and IQ1's scale choice) over
many groups at once in numpy; these run ggml's per-group loops instead, with the same float32
operations in the same order (the same bytes, tests/test_quantize.py), at a few times the speed.
Used when the native library is built and GGMLX_NATIVE is on; `lib()` is None otherwise and the
numpy searches run. Plain ctypes calls: nothing is registered with XLA.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from ggmlx import flags
from ggmlx.native import library_path

_F32P = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
MAX_GROUP = 256       # quant_search.cc's Group buffers


@functools.cache
def _load() -> ctypes.CDLL | None:
    path = library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        qx, qkx, iq4 = lib.ggmlx_make_qx_quants, lib.ggmlx_make_qkx_quants, lib.ggmlx_iq4_scales
        nbr, rb = lib.ggmlx_best_neighbours, lib.ggmlx_running_best
    except (OSError, AttributeError):       # an older build without the searches
        return None
    i64, i32, f32, vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
    qx.argtypes = [i64, i64, _F32P, vp, i32, _F32P, _F32P]
    qx.restype = None
    qkx.argtypes = [i64, i64, _F32P, _F32P, i32, f32, f32, i32, i32, i32, _F32P, _F32P, _F32P]
    qkx.restype = None
    iq4.argtypes = [i64, i64, _F32P, _F32P, _F32P, i32, _F32P]
    iq4.restype = None
    i64p = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")
    nbr.argtypes = [i64, i32, i32, i64, i64p, _F32P, _F32P, _F32P, vp, _F32P, i64p, i64p]
    nbr.restype = None
    rb.argtypes = [i64, i64, _F32P, _F32P, i64p, _F32P]
    rb.restype = None
    return lib


def lib() -> ctypes.CDLL | None:
    """The library with the searches, or None (not built, or GGMLX_NATIVE=0)."""
    return _load() if flags.NATIVE.get() == "1" else None


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _check_group(n: int) -> None:
    if n > MAX_GROUP:
        raise ValueError(f"quantizer search: groups of {n} elements (at most {MAX_GROUP})")


def make_qx_quants(c: ctypes.CDLL, x: np.ndarray, nmax: int, w: np.ndarray | None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """kquants.make_qx_quants in C: x, w [n, m] -> (L [n, m] float32, scale [m])."""
    n, m = x.shape
    _check_group(n)
    wf = None if w is None else _f32(w)
    L = np.empty((n, m), np.float32)
    scale = np.empty(m, np.float32)
    c.ggmlx_make_qx_quants(m, n, _f32(x), None if wf is None else wf.ctypes.data, nmax, L, scale)
    return L, scale


def make_qkx_quants(c: ctypes.CDLL, x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                    nstep: int, use_mad: bool, qkx3: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """kquants.make_qkx2_quants (qkx3 False) or make_qkx3_quants in C: x, w [n, m] ->
    (L [n, m] float32, scale [m], -min [m])."""
    n, m = x.shape
    _check_group(n)
    L = np.empty((n, m), np.float32)
    scale, neg_min = np.empty(m, np.float32), np.empty(m, np.float32)
    c.ggmlx_make_qkx_quants(m, n, _f32(x), _f32(w), nmax, rmin, rdelta, nstep, int(use_mad), int(qkx3),
                            L, scale, neg_min)
    return L, scale, neg_min


def iq4_scales(c: ctypes.CDLL, x: np.ndarray, w: np.ndarray, levels: np.ndarray, ntry: int) -> np.ndarray:
    """nlquants' IQ4 group scale search in C: x, w [n, m] -> d [m]."""
    n, m = x.shape
    _check_group(n)
    d = np.empty(m, np.float32)
    c.ggmlx_iq4_scales(m, n, _f32(x), _f32(w), _f32(levels), ntry, d)
    return d


def best_neighbours(c: ctypes.CDLL, codes: np.ndarray, xv: np.ndarray, wv: np.ndarray, scale: np.ndarray,
                    base: np.ndarray | None, values: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The IQ grids' neighbour search in C: n off-grid groups (codes [n], values and weights
    [n, D], scale [n], base [n] or None), the neighbours' values as planes [K, D, n_codes] and
    their count per code -> each group's pick among its code's neighbours [n] (int64)."""
    n, d = xv.shape
    k, _, n_codes = values.shape
    pick = np.empty(n, np.int64)
    b = None if base is None else _f32(base)
    c.ggmlx_best_neighbours(n, d, k, n_codes, np.ascontiguousarray(codes, np.int64), _f32(xv), _f32(wv), _f32(scale),
                            None if b is None else b.ctypes.data, _f32(values), np.ascontiguousarray(count, np.int64),
                            pick)
    return pick


def running_best(c: ctypes.CDLL, sumqx: np.ndarray, sumq2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """iq2._replay in C: each row's candidates [m, n] in order -> (the last taken [m], -1 for
    none; its scale [m])."""
    m, n = sumqx.shape
    pick, scale = np.empty(m, np.int64), np.empty(m, np.float32)
    c.ggmlx_running_best(m, n, np.ascontiguousarray(sumqx, np.float32), np.ascontiguousarray(sumq2, np.float32),
                         pick, scale)
    return pick, scale
