"""ggmlx: a mini-ggml on JAX. GGUF I/O, tensor types, quant blocks, ops, graphs, backends.

Importing ggmlx changes nothing outside it; `ggmlx.init()` sets up JAX for it (the llm
loader calls it) and must run before JAX's first computation.
"""
import logging
import os

import jax

from ggmlx import flags, native
from ggmlx.types import GGMLType

__all__ = ["GGMLType", "flags", "init"]

_CPU_SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
_warned_late = False
_cache_path_checked: str | None = None    # the last cache folder checked (and used if usable)
log = logging.getLogger("ggmlx")


def init() -> None:
    """Configure JAX for ggmlx; safe to call any number of times.

    - XLA_FLAGS: XLA:CPU's concurrency-optimized scheduler hoists every layer's dequantized
      weights into one huge temporary buffer (measured: decode 4x slower), so it is turned
      off unless XLA_FLAGS already says either way. XLA reads the flag when JAX creates its
      CPU client; if that already happened (a caller listed `jax.devices()` to choose them),
      the flag cannot apply any more: results are the same, decode is slower, and a warning
      says how to avoid it.
    - XLA's on-disk compilation cache in `flags.cache_root()/xla`, so a second process
      starts warm (off with GGMLX_NO_PERSISTENT_CACHE=1). A folder that cannot be written
      (a file, no permission) gives one warning and no persistent cache: a cache never
      stops the engine.
    - The native kernels (ggmlx/native), when built and on, are loaded and registered with
      XLA here, before any cached executable that calls them is loaded.
    """
    native.available()
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if _CPU_SCHEDULER_FLAG not in xla_flags:
        if _backends_initialized():
            global _warned_late
            if not _warned_late:
                _warned_late = True
                log.warning("JAX's backends were created before ggmlx.init(), without "
                            "--%s=false in XLA_FLAGS: CPU decode may be up to 4x slower. Call "
                            "ggmlx.init() before the first JAX call, or set XLA_FLAGS='--%s=false' "
                            "(=true keeps XLA's default and silences this).",
                            _CPU_SCHEDULER_FLAG, _CPU_SCHEDULER_FLAG)
        else:
            os.environ["XLA_FLAGS"] = f"{xla_flags} --{_CPU_SCHEDULER_FLAG}=false".strip()
    global _cache_path_checked
    path = os.path.join(flags.cache_root(), "xla")
    if not flags.NO_PERSISTENT_CACHE.on() and path != _cache_path_checked:
        _cache_path_checked = path
        problem = flags.usable_dir(path)
        if problem is not None:
            log.warning("compile cache %s is not usable (%s); running without the persistent cache", path, problem)
            return
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _backends_initialized() -> bool:
    """Whether JAX has created its device clients (no public API says so)."""
    from ggmlx import _jax_private
    return _jax_private.backends_are_initialized()
