"""llama.cpp's quantizer as an oracle, through llama-cpp-python, in a child process.

`quantize_file` runs llama_model_quantize (llama-quantize's work) and `quantize_rows` ggml's
ggml_quantize_chunk on rows of floats; both in a spawned child (llm.research.llamacpp_child), so
a crash in llama.cpp is an exception here. The reference generator of tests/test_quantize.py
and benchmarks/bench_quantize.py use them; the tests themselves read only committed hashes.
"""
from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from llm.research import llamacpp_child

_ERRORS: list[str] = []
GGML_LOG_LEVEL_ERROR = 4     # ggml.h enum ggml_log_level


def _silence(lc) -> None:
    """Drop llama.cpp's log lines (one per tensor) in the child, keeping its error lines."""
    def sink(level, text, user):
        if level == GGML_LOG_LEVEL_ERROR and text.strip():
            _ERRORS.append(text.decode(errors="replace").strip())

    callback = lc.llama_log_callback(sink)
    globals()["_SINK"] = callback       # keep the callback alive for the child's life
    lc.llama_log_set(callback, ctypes.c_void_p())


def _quantize_file(in_path: str, out_path: str, ftype: int, nthread: int, flags: dict[str, object]) -> float:
    """In the child: llama_model_quantize with default params changed by `flags`; its seconds."""
    import llama_cpp as lc
    _silence(lc)
    p = lc.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = nthread
    for k, v in flags.items():
        setattr(p, k, v)
    t0 = time.perf_counter()
    rc = lc.llama_model_quantize(in_path.encode(), out_path.encode(), ctypes.byref(p))
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(_ERRORS[-1] if _ERRORS else f"llama_model_quantize failed (rc {rc})")
    return seconds


def quantize_file(in_path: str | os.PathLike, out_path: str | os.PathLike, ftype: int, nthread: int = 1,
                  **flags: object) -> float:
    """llama.cpp quantizes in_path to out_path as llama_ftype `ftype`; returns its wall time in
    seconds (the call alone, not the child's start). flags: llama_model_quantize_params fields
    (pure, keep_split, quantize_output_tensor, output_tensor_type, allow_requantize, ...).
    RuntimeError when llama.cpp refuses."""
    llamacpp_child.require_llama_cpp()
    return llamacpp_child.call(_quantize_file, os.fspath(in_path), os.fspath(out_path), int(ftype), nthread,
                               dict(flags), model_path=in_path)


def _ggml_base(lc) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(lc.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def _quantize_rows(ggml_type: int, rows: np.ndarray) -> np.ndarray:
    import llama_cpp as lc
    lib = _ggml_base(lc)
    x = np.ascontiguousarray(rows, np.float32)
    out = np.zeros((x.shape[0], lib.ggml_row_size(ggml_type, x.shape[1])), np.uint8)
    lib.ggml_quantize_chunk(ggml_type, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
    return out


def quantize_rows(ggml_type: int, rows: np.ndarray) -> np.ndarray:
    """ggml_quantize_chunk(type, rows) without an importance matrix: uint8 [n_rows, row bytes]."""
    llamacpp_child.require_llama_cpp()
    return llamacpp_child.call(_quantize_rows, int(ggml_type), np.asarray(rows, np.float32), model_path="(rows)")
