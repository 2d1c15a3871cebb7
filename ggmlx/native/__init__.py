"""Optional native CPU kernels, called from compiled graphs as XLA FFI custom calls.

`attn_decode` is ggml's flash_attn_ext for up to ATTN_MAX_N query rows, reading K and V in place
from the whole cache buffers through ggml's strides (f32, f16 or block rows), where XLA:CPU
copies the n_kv cells it attends to (heads moved in front) before its dots.

`int8_matvec` multiplies a few rows of activations by an "int8" weight (ggmlx/weights.py)
straight from its int8 quants, scales and offsets, where the pure-XLA path writes each
dequantized f32 chunk and reads it back for the dot. `int4_matvec` does the same for an
"int4" weight from its packed nibbles. Scales and offsets are f32, or f16 where they are the
block's own fields (0.56-1.25 bytes per weight element in all).

`top_k` (plain ctypes, like `pack_lanes`) is the samplers' top-k selection over a logits row.

The library (`_kernels`) is compiled by setup.py at install when a C++ compiler is present.
It is on by default for MIN_N..MAX_N rows (GGMLX_NATIVE=0 turns it off); when off or not
built, `available()` is False and the lowerings keep the pure-XLA paths. Nothing is loaded at
import: the library is loaded and its targets registered on the first `available()` with the
flag on (ggmlx.init() or a lowering)."""
from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import flags
from ggmlx.types import GGMLType

log = logging.getLogger(__name__)

# Most activation rows one call takes (the kernel passes over them in groups of 8, keeping one
# accumulator per row and weight row in registers, a chunk of weight rows in cache across the
# groups; int4 on AVX-512 from 32 rows dequantizes each weight once for all rows): decode,
# batched decode, speculative verification, and the small prompt chunks a server step mixes
# with its decodes, where the XLA path's dequantized copy of every weight
# costs more than the rows do (SmolLM2 int4, 7 decodes + a 25-token chunk: 94 -> 56 ms;
# pp64 626 -> 664 tok/s, llm bench). benchmarks/bench_native.py measures it per N.
MAX_N = 64
# Fewest rows it takes: every step. In a decode step each weight is read once, cold from memory;
# there the kernel (both cores, prefetch) reads int8 weights at 20-28 GB/s against XLA's fused
# matvec at 15-18 GB/s (bench_native.py, which rotates distinct copies of each weight), and a
# SmolLM2 decode step went from 14.8 to 11.9 ms (python -m llm bench --profile).
MIN_N = 1
# Most query rows attn_decode takes. It visits only the cells each row's mask lets through, so
# besides decode steps it wins on prompt chunks, most where a chunk shares its step with other
# sequences' decodes (the XLA path scores every cell of n_kv and copies the K and V windows):
# SmolLM2, 7 decodes + a 57-token chunk at n_kv 1024 168 -> 121 ms; pp64 500 -> 537 tok/s,
# pp128 723 -> 839; pp256 948 -> 915 (hence the bound; llm bench, 2 threads).
ATTN_MAX_N = 128

TARGET = "ggmlx_int8_matvec"
TARGET_OFFSET = "ggmlx_int8_matvec_offset"
TARGET_INT4 = "ggmlx_int4_matvec"
TARGET_ATTN = "ggmlx_attn_decode"
TARGET_BLOCKS = "ggmlx_block_matmul"
_SYMBOLS = {TARGET: "GgmlxInt8Matvec", TARGET_OFFSET: "GgmlxInt8MatvecOffset", TARGET_INT4: "GgmlxInt4Matvec",
            TARGET_ATTN: "GgmlxAttnDecode", TARGET_BLOCKS: "GgmlxBlockMatmul"}

# ggml types block_matmul reads (their ggml_type ids); a weight of another type keeps the exact
# path under numerics="ggml".
BLOCK_TYPES = frozenset(int(t) for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
                                         GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
                                         GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4))
_LIBRARY = "_kernels"


def library_path() -> str | None:
    """The compiled library beside this file (setup.py's build_ext), or None."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(__file__), _LIBRARY + "*.so")))
    return found[0] if found else None


@functools.cache
def load_error() -> str | None:
    """Load the library and register its FFI targets for the CPU, once per process. None when
    done, else why not (logged once at debug level)."""
    path = library_path()
    if path is None:
        why = "not built (no C++ compiler at install, or the build failed: pip install -e . rebuilds it)"
    else:
        try:
            lib = ctypes.cdll.LoadLibrary(path)
            for target, symbol in _SYMBOLS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            return None
        except (OSError, AttributeError, ValueError, RuntimeError) as e:
            why = f"{path} cannot be used: {type(e).__name__}: {e}"
    log.debug("native kernels off, pure-XLA path used: %s", why)
    return why


def available() -> bool:
    """True when the native kernels are on (GGMLX_NATIVE) and registered."""
    return flags.NATIVE.get() == "1" and load_error() is None


def int8_matvec(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None) -> jax.Array:
    """x f32 [N, K] (N <= MAX_N) times the int8 weight (q int8 [M, K], scale and offset f32
    [M, K // sub]) -> f32 [N, M]: y[n, m] = sum_k x[n, k] * (scale * q + offset)[m, k]. CPU only."""
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
    if offset is None:
        return jax.ffi.ffi_call(TARGET, out)(x, q, scale)
    return jax.ffi.ffi_call(TARGET_OFFSET, out)(x, q, scale, offset)


def int4_matvec(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
    """x f32 [N, K] (N <= MAX_N) times the int4 weight (q uint8 [M, K // 2], per 32 elements
    16 bytes with element j in the low and j + 16 in the high nibble of byte j; scale and
    offset f32 [M, K // 32]) -> f32 [N, M]. CPU only."""
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_INT4, out)(x, q, scale, offset)


def block_matmul(x: jax.Array, blocks: jax.Array, ggml_type: int, lanes: bool = False) -> jax.Array:
    """x f32 [N, K] (any N) times a weight held as its GGUF blocks (uint8 [M, row_bytes] of
    type ggml_type, one of BLOCK_TYPES) -> f32 [N, M], with ggml-cpu's numerics: x quantized
    to the type's vec_dot_type (Q8_0, Q8_1 or Q8_K) as ggml-cpu does, integer dot products
    (AMX tiles for more than 16 rows where the CPU has them; GGMLX_BLOCK_ISA caps the instruction set).
    `lanes`: the blocks are in the lanes format (ggmlx.weights.pack_lanes: 16-row groups, M a
    multiple of 16, a type of weights.LANE_FIELDS), read in place by the few-row AVX-512 kernels.
    CPU only."""
    out = jax.ShapeDtypeStruct((x.shape[0], blocks.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_BLOCKS, out)(x, blocks, type=np.int64(ggml_type), isa=np.int64(block_isa()),
                                                lanes=np.int64(lanes))


# The types block_matmul also reads in the lanes format (block_matmul.cc's lane_pieces; issue
# 33's pinned name). ggmlx.weights.LANE_FIELDS gives their layouts, for the same types (a test
# holds the two equal; weights imports this module, so this one cannot derive from it).
LANE_TYPES = frozenset(int(t) for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
                                        GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL,
                                        GGMLType.MXFP4))


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The library for plain ctypes calls (nothing registered with XLA), once loaded for FFI."""
    path = library_path()
    return None if load_error() is not None or path is None else ctypes.CDLL(path)


@functools.cache
def block_cpu_isa() -> int:
    """The widest instruction set block_matmul finds on this CPU, as an index of BLOCK_ISAS
    (0, plain, when the library is not loaded)."""
    lib = _lib()
    if lib is None:
        return 0
    lib.ggmlx_block_cpu_isa.restype = ctypes.c_int64
    return int(lib.ggmlx_block_cpu_isa())


def pack_lanes(blocks: np.ndarray, ggml_type: int, out: np.ndarray) -> None:
    """GGUF blocks uint8 [M, row_bytes] into `out` (the same shape, C-contiguous) in the lanes
    format by the library (ggmlx.weights.pack_lanes is the definition). RuntimeError when the
    library is not loaded (weights.lanes_ok checks available())."""
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"pack_lanes: the native library is not loaded: {load_error()}")
    src = np.ascontiguousarray(blocks)
    fn = lib.ggmlx_pack_lanes
    fn.restype = ctypes.c_int64
    i64 = ctypes.c_int64
    rc = fn(ctypes.c_void_p(src.ctypes.data), ctypes.c_void_p(out.ctypes.data), i64(src.shape[0]), i64(src.shape[1]),
            i64(ggml_type))
    if rc != 0:
        raise ValueError(f"pack_lanes: type {ggml_type} with {src.shape[0]} rows has no lanes layout")


@functools.cache
def _top_k_fn():
    """ggmlx_top_k of the loaded library, its argument types set once (None without it)."""
    lib = _lib()
    if lib is None:
        return None
    fn = lib.ggmlx_top_k
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int64
    return fn


def top_k(logits: np.ndarray, k: int) -> np.ndarray | None:
    """The samplers' top-k in C (top_k.cc): positions (int64) of the min(k, n) largest of logits
    (a 1-D float32 row without NaN), largest first and ties by position, as
    llm.sampling.samplers._top_k_order's numpy selection gives them; None when the library is off
    or not built (the caller then takes the numpy path)."""
    fn = _top_k_fn() if available() else None
    if fn is None:
        return None
    row = np.ascontiguousarray(logits, dtype=np.float32)
    out = np.empty(min(k, row.size), np.int32)
    got = fn(row.ctypes.data, row.size, k, out.ctypes.data)
    return out[:got].astype(np.int64)


# GGMLX_BLOCK_ISA's values, in block_matmul.cc's order (each includes the ones before it)
BLOCK_ISAS = ("plain", "avx2", "avx512", "amx")


def block_isa() -> int:
    """GGMLX_BLOCK_ISA as block_matmul's level; ValueError naming the variable for another value."""
    v = flags.BLOCK_ISA.get().lower()
    if v not in BLOCK_ISAS:
        raise ValueError(f"GGMLX_BLOCK_ISA must be one of {', '.join(BLOCK_ISAS)}, got {v!r}")
    return BLOCK_ISAS.index(v)


def attn_decode(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, kv_type: int, n_kv: int,
                n_head_kv: int, k_off: int, k_cell: int, k_head: int, v_off: int, v_cell: int, v_head: int,
                dv: int, scale: float, softcap: float) -> jax.Array:
    """Attention of q f32 [n_q, H, D] (n_q <= ATTN_MAX_N) over n_kv cells of the K and V caches
    (both of ggml type kv_type: F32, F16, or Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL as uint8 block
    bytes; any shape: read as flat memory), with mask f32 [n_q, n_kv] -> f32 [n_q, H, dv]. The
    row of (cell c, KV head g) of K starts at byte k_off + c * k_cell + g * k_head, likewise for
    V; query head h reads KV head h // (H // n_head_kv). CPU only."""
    out = jax.ShapeDtypeStruct((q.shape[0], q.shape[1], dv), jnp.float32)
    return jax.ffi.ffi_call(TARGET_ATTN, out)(
        q, k, v, mask, kv_type=np.int64(kv_type), n_kv=np.int64(n_kv), n_head_kv=np.int64(n_head_kv),
        k_off=np.int64(k_off),
        k_cell=np.int64(k_cell), k_head=np.int64(k_head), v_off=np.int64(v_off), v_cell=np.int64(v_cell),
        v_head=np.int64(v_head), scale=np.float32(scale), softcap=np.float32(softcap))
