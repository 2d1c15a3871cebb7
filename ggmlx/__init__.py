"""ggmlx: a mini-ggml on JAX. GGUF I/O, tensor types, quant blocks, ops, graphs, backends."""
from ggmlx.types import GGMLType

__all__ = ["GGMLType"]
