"""Every `GGMLX_*` environment variable, in one place with its default and meaning.

Code reads a flag through its `EnvFlag` here (`flags.SCHED_DEBUG.on()`), never through
`os.environ` directly, so `ALL` is the complete list.
Values are read when used, not at import: setting a variable before the call it affects
is enough. `XLA_FLAGS` is JAX's, not ours: `ggmlx.init()` only adds one CPU scheduler flag.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvFlag:
    """One environment variable: its name, its default and what it does."""
    name: str
    default: str
    doc: str

    def get(self) -> str:
        """The value, the default when unset or empty."""
        return os.environ.get(self.name) or self.default

    def on(self) -> bool:
        """True when set to "1"."""
        return self.get() == "1"


CACHE_DIR = EnvFlag(
    "GGMLX_CACHE_DIR", "",
    "where XLA's compilation cache (xla/) and assembled models live; default $XDG_CACHE_HOME/ggmlx "
    "or ~/.cache/ggmlx (cache_root())")
NO_PERSISTENT_CACHE = EnvFlag(
    "GGMLX_NO_PERSISTENT_CACHE", "",
    "1: ggmlx.init() leaves XLA's on-disk compilation cache off (every process compiles afresh)")
SCHED_DEBUG = EnvFlag(
    "GGMLX_SCHED_DEBUG", "",
    "1: the scheduler logs each graph split (backend, nodes, copies) at WARNING on the ggmlx.sched "
    "logger, so it shows on stderr without any logging setup (like GGML_SCHED_DEBUG)")
REFERENCE = EnvFlag(
    "GGMLX_REFERENCE", "",
    "llama.cpp reference outputs for the parity tests and benchmarks/parity_report.py; "
    "default ../shared/reference beside the repository")

EXE_CACHE = EnvFlag(
    "GGMLX_EXE_CACHE", "1",
    "1 (default): keep serialized executables in cache_root()/exe, keyed by graph signature, "
    "argument shapes, ggmlx sources, JAX versions, XLA_FLAGS, device kind and host CPU, so a warm "
    "process skips tracing and lowering (the first token of a warm SmolLM2 process: no compile); "
    "0: only XLA's compilation cache")
MATMUL_PRECISION = EnvFlag(
    "GGMLX_MATMUL_PRECISION", "highest",
    "precision of every f32 matmul the lowering emits: highest (default: full f32 on every backend, "
    "no TF32 on GPUs), high (bf16x3 / TF32-class on GPUs) or default (the backend's fastest, TF32 or "
    "bf16); part of compiled-graph cache keys")
NATIVE = EnvFlag(
    "GGMLX_NATIVE", "1",
    "0: never use the native int8/int4 matvecs (ggmlx/native, XLA FFI custom calls built at install) for "
    "int8 and int4 weights times 1-64 rows (decode, batched decode, speculative verification, small prompt chunks) "
    "or the native attention on the CPU, keeping the "
    "pure-XLA dequantize-then-dot path; benchmarks/bench_native.py: 1.3-2.2x faster per product; part of "
    "compiled-graph cache keys")

BLOCK_ISA = EnvFlag(
    "GGMLX_BLOCK_ISA", "amx",
    "the widest instruction set native.block_matmul (numerics=\"ggml\") may use: amx (AMX-INT8 tiles for "
    "products of more than 16 rows, where the CPU has them and Linux grants the tile state; else as avx512), "
    "avx512 (AVX-512 VNNI), avx2 or plain (loops any CPU runs); the CPU's own widest caps it; part of "
    "compiled-graph cache keys")

HUGE_PAGES = EnvFlag(
    "GGMLX_HUGE_PAGES", "1",
    "1 (default): weights of 2 MiB or more bound for a CPU device are held in anonymous memory advised "
    "for transparent huge pages (Linux), so that a decode step streams them with a TLB miss per 2 MiB, "
    "not per 4 KiB; 0: as jax.device_put holds them (in place in the file's mapping where aligned)")

LANES = EnvFlag(
    "GGMLX_LANES", "1",
    "1 (default): under numerics=\"ggml\" on a CPU with AVX-512 VNNI, the matrices of mul_mat are held in "
    "the lanes format (ggmlx.weights.FORMAT_LANES: 16 rows packed across the vector lanes), read in place "
    "by the few-row kernels; 0: as their GGUF blocks. Read at load")

ALL: tuple[EnvFlag, ...] = (CACHE_DIR, NO_PERSISTENT_CACHE, SCHED_DEBUG, REFERENCE, EXE_CACHE, MATMUL_PRECISION,
                            NATIVE, BLOCK_ISA, HUGE_PAGES, LANES)

_PRECISIONS = {"highest": "HIGHEST", "high": "HIGH", "default": "DEFAULT"}


def matmul_precision() -> str:
    """GGMLX_MATMUL_PRECISION as a jax.lax.Precision name; ValueError naming the variable
    for any other value."""
    v = MATMUL_PRECISION.get().lower()
    if v not in _PRECISIONS:
        raise ValueError(f"{MATMUL_PRECISION.name} must be one of {', '.join(_PRECISIONS)}, got {v!r}")
    return _PRECISIONS[v]


def cache_root() -> str:
    """GGMLX_CACHE_DIR, else $XDG_CACHE_HOME/ggmlx or ~/.cache/ggmlx."""
    return CACHE_DIR.get() or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                           "ggmlx")



def usable_dir(path: str) -> str | None:
    """None when `path` is (or can be made) a folder we can write files into, else why not."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None
