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


def _c_imatrix(lc, imatrix: dict[str, np.ndarray]):
    """llama_model_imatrix_data[] (terminated by a NULL name), and the buffers it points into."""
    arrays = [np.ascontiguousarray(v, np.float32) for v in imatrix.values()]
    entries = (lc.llama_model_imatrix_data * (len(arrays) + 1))()
    for e, name, a in zip(entries, imatrix, arrays, strict=False):
        e.name, e.data, e.size = name.encode(), a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), a.size
    return entries, arrays


def _c_kv_overrides(lc, overrides: list[tuple[str, str, object]]):
    """llama_model_kv_override[] from (key, "int" | "float" | "bool" | "str", value), terminated."""
    entries = (lc.llama_model_kv_override * (len(overrides) + 1))()
    tags = {"int": lc.LLAMA_KV_OVERRIDE_TYPE_INT, "float": lc.LLAMA_KV_OVERRIDE_TYPE_FLOAT,
            "bool": lc.LLAMA_KV_OVERRIDE_TYPE_BOOL, "str": lc.LLAMA_KV_OVERRIDE_TYPE_STR}
    fields = {"int": "val_i64", "float": "val_f64", "bool": "val_bool", "str": "val_str"}
    for e, (key, kind, value) in zip(entries, overrides, strict=False):
        e.key, e.tag = key.encode(), tags[kind]
        setattr(e.value, fields[kind], value.encode() if isinstance(value, str) else value)
    return entries


def _c_tensor_types(lc, tensor_types: list[tuple[str, int]]):
    entries = (lc.llama_model_tensor_override * (len(tensor_types) + 1))()
    for e, (pattern, t) in zip(entries, tensor_types, strict=False):
        e.pattern, e.type = pattern.encode(), t
    entries[len(tensor_types)].type = 43       # GGML_TYPE_COUNT: the terminator's type
    return entries


def _quantize_file(in_path: str, out_path: str, ftype: int, nthread: int, flags: dict[str, object],
                   imatrix: dict[str, np.ndarray] | None, kv_overrides: list[tuple[str, str, object]],
                   tensor_types: list[tuple[str, int]]) -> float:
    """In the child: llama_model_quantize with default params changed by the arguments; its seconds."""
    import llama_cpp as lc
    _silence(lc)
    p = lc.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = nthread
    for k, v in flags.items():
        setattr(p, k, v)
    keep = []
    if imatrix:
        entries, arrays = _c_imatrix(lc, imatrix)
        keep += [entries, arrays]
        p.imatrix = ctypes.cast(entries, ctypes.POINTER(lc.llama_model_imatrix_data))
    if kv_overrides:
        kvs = _c_kv_overrides(lc, kv_overrides)
        keep.append(kvs)
        p.kv_overrides = ctypes.cast(kvs, ctypes.POINTER(lc.llama_model_kv_override))
    if tensor_types:
        tts = _c_tensor_types(lc, tensor_types)
        keep.append(tts)
        p.tt_overrides = ctypes.cast(tts, ctypes.POINTER(lc.llama_model_tensor_override))
    t0 = time.perf_counter()
    rc = lc.llama_model_quantize(in_path.encode(), out_path.encode(), ctypes.byref(p))
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(_ERRORS[-1] if _ERRORS else f"llama_model_quantize failed (rc {rc})")
    return seconds


def quantize_file(in_path: str | os.PathLike, out_path: str | os.PathLike, ftype: int, nthread: int = 1,
                  imatrix: dict[str, np.ndarray] | None = None,
                  kv_overrides: list[tuple[str, str, object]] | None = None,
                  tensor_types: list[tuple[str, int]] | None = None, **flags: object) -> float:
    """llama.cpp quantizes in_path to out_path as llama_ftype `ftype`; returns its wall time in
    seconds (the call alone, not the child's start). imatrix: {tensor name: importance}
    (llama_model_imatrix_data); kv_overrides: (key, "int"/"float"/"bool"/"str", value);
    tensor_types: (regex, ggml type id); flags: other llama_model_quantize_params fields (pure,
    keep_split, quantize_output_tensor, output_tensor_type, allow_requantize, ...).
    RuntimeError with llama.cpp's message when it refuses."""
    llamacpp_child.require_llama_cpp()
    return llamacpp_child.call(_quantize_file, os.fspath(in_path), os.fspath(out_path), int(ftype), nthread,
                               dict(flags), imatrix, list(kv_overrides or []), list(tensor_types or []),
                               model_path=in_path)


def _ggml_base(lc) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(lc.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def _quantize_rows(ggml_type: int, rows: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    import llama_cpp as lc
    lib = _ggml_base(lc)
    x = np.ascontiguousarray(rows, np.float32)
    im = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    out = np.zeros((x.shape[0], lib.ggml_row_size(ggml_type, x.shape[1])), np.uint8)
    lib.ggml_quantize_chunk(ggml_type, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                            None if im is None else im.ctypes.data)
    return out


def quantize_rows(ggml_type: int, rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk(type, rows, imatrix): uint8 [n_rows, row bytes]."""
    llamacpp_child.require_llama_cpp()
    return llamacpp_child.call(_quantize_rows, int(ggml_type), np.asarray(rows, np.float32), imatrix,
                               model_path="(rows)")


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def _read_imatrix_ggml(path: str) -> tuple[dict, dict[str, tuple[int, tuple[int, ...], np.ndarray | None]]]:
    """In the child: common_imatrix_load's reading (common/imatrix-loader.cpp) through ggml's own
    GGUF reader: the provenance keys and every tensor's type, ne and values."""
    import llama_cpp as lc

    from llm.research.diff_llamacpp import GGMLTensor
    lib = ctypes.CDLL(str(Path(lc.__file__).parent / "lib" / "libggml-base.so"))
    vp, c64 = ctypes.c_void_p, ctypes.c_int64
    lib.gguf_init_from_file.restype = vp
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GGUFInitParams]
    for name, res, args in (("gguf_find_key", c64, [vp, ctypes.c_char_p]),
                            ("gguf_get_arr_n", ctypes.c_size_t, [vp, c64]),
                            ("gguf_get_arr_str", ctypes.c_char_p, [vp, c64, ctypes.c_size_t]),
                            ("gguf_get_val_u32", ctypes.c_uint32, [vp, c64]),
                            ("gguf_get_val_str", ctypes.c_char_p, [vp, c64]), ("gguf_get_n_tensors", c64, [vp]),
                            ("gguf_get_tensor_name", ctypes.c_char_p, [vp, c64]),
                            ("ggml_get_tensor", vp, [vp, ctypes.c_char_p]), ("gguf_free", None, [vp]),
                            ("ggml_free", None, [vp])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    ctx = ctypes.c_void_p()
    g = lib.gguf_init_from_file(path.encode(), _GGUFInitParams(False, ctypes.pointer(ctx)))
    if not g:
        raise RuntimeError(f"ggml's gguf_init_from_file could not read {path}")
    try:
        kv: dict = {}
        key = lib.gguf_find_key(g, b"general.type")
        kv["general.type"] = lib.gguf_get_val_str(g, key).decode() if key >= 0 else None
        key = lib.gguf_find_key(g, b"imatrix.datasets")
        kv["imatrix.datasets"] = [lib.gguf_get_arr_str(g, key, i).decode() for i in range(lib.gguf_get_arr_n(g, key))]
        for k in ("imatrix.chunk_count", "imatrix.chunk_size"):
            key = lib.gguf_find_key(g, k.encode())
            kv[k] = lib.gguf_get_val_u32(g, key) if key >= 0 else None
        tensors = {}
        for i in range(lib.gguf_get_n_tensors(g)):
            name = lib.gguf_get_tensor_name(g, i)
            t = GGMLTensor.from_address(lib.ggml_get_tensor(ctx, name))
            ne = tuple(int(t.ne[d]) for d in range(4))
            n = int(np.prod(ne))
            values = np.ctypeslib.as_array((ctypes.c_float * n).from_address(t.data)).copy() if t.type == 0 else None
            tensors[name.decode()] = (int(t.type), ne, values)
        return kv, tensors
    finally:
        lib.gguf_free(g)
        lib.ggml_free(ctx)


def read_imatrix_ggml(path: str | os.PathLike
                      ) -> tuple[dict, dict[str, tuple[int, tuple[int, ...], np.ndarray | None]]]:
    """An imatrix GGUF as llama-quantize's loader sees it (ggml's GGUF reader, in a child):
    ({general.type, imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size},
    {tensor name: (ggml type, ne, float32 values or None for another type)})."""
    llamacpp_child.require_llama_cpp()
    return llamacpp_child.call(_read_imatrix_ggml, os.fspath(path), model_path=path)
