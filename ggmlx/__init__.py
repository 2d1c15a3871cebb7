"""ggmlx: a mini-ggml on JAX. GGUF I/O, tensor types, quant blocks, ops, graphs, backends."""
import os


def _set_xla_flags() -> None:
    """XLA:CPU's concurrency-optimized scheduler hoists every layer's dequantized weights into
    one huge temporary buffer (measured: decode 4x slower); turn it off unless the user set it.
    Must run before JAX creates its CPU client, which importing ggmlx first guarantees."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()


_set_xla_flags()

from ggmlx.types import GGMLType  # noqa: E402

__all__ = ["GGMLType"]
