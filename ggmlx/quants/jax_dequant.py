"""Device dequantization with JAX: packed blocks held as a device array -> float32, inside jit.

Device layout (what `dequantize_jax` expects) for a tensor of ggml shape `ne` (innermost
first), numpy shape `ne[::-1]`:

* quantized types: the raw block bytes, `uint8 [*ne[::-1][:-1], ne[0] // block_size, type_size]`.
  Rows stay a leading axis, so a row gather (`get_rows` on a quantized embedding) or a
  row split across devices works on the packed form before dequantizing.
* F32 / F16 / BF16: the elements as `float32` / `float16` / `bfloat16` in shape `ne[::-1]`.

`dequantize_jax` also takes any other shape of the same dtype and element count, such as
the rows as `uint8 [n_rows, row_bytes]`, which is how `weights.to_device` holds a "native"
weight: only the row-major byte order matters, and the reshape is free under jit.

The kernels (ggmlx.quants.kernels) are shared with the numpy path and use only vectorized
bit operations, reshapes and small-table gathers, so `dequantize_jax` traces to one fused
XLA computation and equals `ggmlx.quants.dequantize` bit for bit, with two exceptions
that no real weight hits: XLA flushes float32 subnormals to zero (only MXFP4 blocks whose
exponent byte is 0 or 1 produce them), and F16 NaNs come out as NaN with another payload.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..types import GGMLType, block_size, type_size
from .kernels import DEQUANTIZE_KERNELS, ArrayOps
from .numpy_ref import check_type, numpy_shape


def _rounded(x: jax.Array) -> jax.Array:
    """float32 x, rounded before its next use (no fused multiply-add with what follows).

    XLA contracts `a * b + c` into an FMA on CPU and GPU and drops optimization barriers and
    no-op reduce_precision. It cannot see through an XOR of the bits with a value it cannot
    prove zero: here the NaN flag of x itself, which leaves a NaN a NaN.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(bits ^ jnp.isnan(x).astype(jnp.uint32), jnp.float32)


JAX = ArrayOps(xp=jnp, bitcast=jax.lax.bitcast_convert_type, rounded=_rounded)

_FLOAT_DTYPES = {
    GGMLType.F32: np.dtype(np.float32),
    GGMLType.F16: np.dtype(np.float16),
    GGMLType.BF16: np.dtype(ml_dtypes.bfloat16),
}


def _device_layout(t: GGMLType, ne: tuple[int, ...] | list[int]) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of the blocks of a tensor of type t and ggml shape ne (module docstring)."""
    shape = numpy_shape(t, ne, "dequantize_jax")
    if t in _FLOAT_DTYPES:
        return shape, _FLOAT_DTYPES[t]
    return (*shape[:-1], shape[-1] // block_size(t), type_size(t)), np.dtype(np.uint8)


def dequantize_jax(blocks: jax.Array, type: GGMLType | int, ne: tuple[int, ...] | list[int]) -> jax.Array:
    """Device blocks (layout: see the module docstring) -> float32 [*ne[::-1]].

    `type` and `ne` are static; `blocks` may be a traced array inside `jax.jit`.
    """
    t = check_type(type, "dequantize_jax")
    shape, dtype = _device_layout(t, ne)
    if math.prod(blocks.shape) != math.prod(shape) or blocks.dtype != dtype:
        raise ValueError(f"dequantize_jax: {t.name} tensor of ne={tuple(ne)} needs blocks {dtype}{list(shape)}, "
                         f"got {blocks.dtype}{list(blocks.shape)}")
    blocks = jnp.asarray(blocks)
    out_shape = tuple(int(d) for d in ne)[::-1]
    if t in _FLOAT_DTYPES:
        return blocks.astype(jnp.float32).reshape(out_shape)
    y = DEQUANTIZE_KERNELS[t](JAX, blocks.reshape(-1, type_size(t)))
    return y.reshape(out_shape)
