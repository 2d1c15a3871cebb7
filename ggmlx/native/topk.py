"""The samplers' top-k in C (top_k.cc): the positions of a row's k largest logits, largest first,
ties by position, as llm.sampling.samplers._top_k_order's numpy selection gives them. Used when the
native library is built and GGMLX_NATIVE is on; `top_k` returns None otherwise. A plain ctypes
call: nothing is registered with XLA."""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from ggmlx import flags
from ggmlx.native import library_path


@functools.cache
def _load():
    path = library_path()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).ggmlx_top_k
    except (OSError, AttributeError):       # an older build without it
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int64
    return fn


def top_k(logits: np.ndarray, k: int) -> np.ndarray | None:
    """Positions (int64) of the min(k, n) largest of logits (a 1-D float32 row without NaN), in
    rank order; None when the library is not there or is off."""
    fn = _load() if flags.NATIVE.get() == "1" else None
    if fn is None:
        return None
    row = np.ascontiguousarray(logits, dtype=np.float32)
    out = np.empty(min(k, row.size), np.int32)
    got = fn(row.ctypes.data, row.size, k, out.ctypes.data)
    return out[:got].astype(np.int64)
