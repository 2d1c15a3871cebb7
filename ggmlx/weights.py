"""Device-side weight data bound to WEIGHT leaves, and how ops read it.

A weight's `data` is a `DeviceWeight`: the bytes or values on one device plus the format
they are held in. Plain types (F32, F16, BF16) keep their element dtype; block-quantized
types keep their packed blocks as uint8 [n_rows, row_bytes] and are dequantized inside
the compiled function (so a weight never exists as f32 in device memory between calls).
`get_rows` on a quantized weight dequantizes only the rows it gathers.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import types
from ggmlx.tensor import Tensor, np_dtype
from ggmlx.types import GGMLType

FORMAT_PLAIN = "plain"
FORMAT_BLOCKS = "blocks"


@jax.tree_util.register_static
@dataclass(frozen=True)
class WeightSpec:
    """The static half of a weight: its format, ggml type and shape (part of cache keys)."""
    format: str
    type: GGMLType
    ne: tuple[int, int, int, int]


def to_device(data: np.ndarray, t: GGMLType, ne, device=None) -> "DeviceWeight":
    """Put a tensor's GGUF bytes (uint8, or typed values) on a device in its held format."""
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    raw = np.ascontiguousarray(data)
    if not types.traits(t).is_quantized:
        dt = np_dtype(t)
        arr = raw.view(dt) if raw.dtype == np.uint8 else raw.astype(dt, copy=False)
        arr = arr.reshape(tuple(reversed(ne4)))
        spec = WeightSpec(FORMAT_PLAIN, GGMLType(t), ne4)
    else:
        rows = ne4[1] * ne4[2] * ne4[3]
        arr = raw.view(np.uint8).reshape(rows, types.row_size(t, ne4[0]))
        spec = WeightSpec(FORMAT_BLOCKS, GGMLType(t), ne4)
    return DeviceWeight(spec, jax.device_put(arr, device))


@jax.tree_util.register_pytree_node_class
@dataclass
class DeviceWeight:
    spec: WeightSpec
    array: jax.Array

    def tree_flatten(self):
        return (self.array,), self.spec

    @classmethod
    def tree_unflatten(cls, spec, children):
        return cls(spec, children[0])

    @property
    def nbytes(self) -> int:
        return int(self.array.size * self.array.dtype.itemsize)


def _dequant_rows(blocks: jax.Array, spec: WeightSpec, n_rows: int) -> jax.Array:
    from ggmlx import quants
    return quants.dequantize_jax(blocks, spec.type, (spec.ne[0], n_rows))


def materialize(w: DeviceWeight) -> jax.Array:
    """The weight as f32 in numpy order [ne3, ne2, ne1, ne0] (inside a traced function)."""
    spec = w.spec
    if spec.format == FORMAT_PLAIN:
        return w.array.astype(jnp.float32)
    rows = spec.ne[1] * spec.ne[2] * spec.ne[3]
    return _dequant_rows(w.array, spec, rows).reshape(tuple(reversed(spec.ne)))


def get_rows(w: DeviceWeight, idx: jax.Array) -> jax.Array:
    """Rows idx of a 2-d weight as f32 [len(idx), ne0]; quantized rows are gathered first."""
    spec = w.spec
    if spec.format == FORMAT_PLAIN:
        return jnp.take(w.array.reshape(-1, spec.ne[0]), idx, axis=0).astype(jnp.float32)
    picked = jnp.take(w.array, idx, axis=0)
    return _dequant_rows(picked, spec, idx.shape[0])


def describe(t: Tensor) -> str:
    w = t.data
    return f"{w.spec.format}:{w.spec.type.name}" if isinstance(w, DeviceWeight) else "unbound"
