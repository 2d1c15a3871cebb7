"""The private JAX APIs ggmlx needs, in one place, behind a version check.

JAX has no public handle for these: whether device clients exist yet, reading a persistent
cache entry, switching the persistent cache off for one compilation, and the coordination
service's key-value client. Each is imported on first use (no JAX import at ggmlx import);
a JAX outside the tested range logs one warning, and a missing attribute is a clear error."""
from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

# the JAX versions whose private modules these calls were written against (inclusive, major.minor)
TESTED = ((0, 4), (0, 10))


@functools.cache
def _checked() -> None:
    import jax
    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    if not TESTED[0] <= version <= TESTED[1]:
        log.warning("JAX %s is outside the range ggmlx's private JAX calls were tested with (%s to %s)",
                    jax.__version__, ".".join(map(str, TESTED[0])), ".".join(map(str, TESTED[1])))


def _private(module: str, name: str):
    _checked()
    import importlib
    mod = importlib.import_module(module)
    try:
        return getattr(mod, name)
    except AttributeError as e:
        import jax
        raise RuntimeError(f"JAX {jax.__version__} has no {module}.{name}, which ggmlx needs") from e


def backends_are_initialized() -> bool:
    """Whether JAX has created its device clients."""
    return _private("jax._src.xla_bridge", "backends_are_initialized")()


def cache_entry_reader():
    """A function that decompresses and splits one persistent compilation cache entry (and
    raises if it is damaged); resolved up front, so a JAX without it fails here, not per entry."""
    decompress = _private("jax._src.compilation_cache", "decompress_executable")
    extract = _private("jax._src.compilation_cache", "extract_executable_and_time")
    return lambda data: extract(decompress(data))


def compilation_cache_dir() -> str | None:
    """The persistent compilation cache directory in effect (jax_compilation_cache_dir)."""
    return _private("jax._src.config", "compilation_cache_dir").value


def enable_compilation_cache(enabled: bool):
    """A context manager that turns JAX's persistent compilation cache on or off inside it."""
    return _private("jax._src.config", "enable_compilation_cache")(enabled)


def coordination_client():
    """jax.distributed's coordination-service client (None before jax.distributed.initialize)."""
    return _private("jax._src.distributed", "global_state").client
