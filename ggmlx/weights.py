"""Device-side weight data bound to WEIGHT leaves, and how ops read it.

A weight's `data` is a `DeviceWeight`: the arrays on one device plus the format they are
held in (chosen at load time by `weight_format`):

- "plain": F32/F16/BF16 values in their own dtype (also every weight loaded as "f32").
- "blocks": block-quantized types kept as their packed GGUF blocks, uint8 [n_rows, row_bytes],
  dequantized inside the compiled function ("native").
- "int8": block-quantized types re-expressed at load time as int8 values plus an f32 scale
  (and, for types with a minimum, an f32 offset) per sub-block of 16 or 32 elements along
  ne0: y = scale * q + offset, exactly the values ggml dequantizes to. XLA:CPU does not fuse
  4-bit unpacking into a dot; int8 upcasts cheaply, so this is the fastest CPU format.

`mul_mat` and `get_rows` are how ops read a weight: neither dequantizes more than a chunk of
rows at a time, so a large matrix (a 262144-row lm_head) never exists as f32 in memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import types
from ggmlx.quants.int8 import INT8_CONVERTERS, to_int8
from ggmlx.tensor import np_dtype, pad_ne
from ggmlx.types import GGMLType

FORMAT_PLAIN = "plain"
FORMAT_BLOCKS = "blocks"
FORMAT_INT8 = "int8"

WEIGHT_FORMATS = ("auto", "native", "int8", "f32")

HIGHEST = jax.lax.Precision.HIGHEST

# Most elements of one dequantized chunk of rows inside mul_mat (f32: 16 MiB): large enough
# for an efficient dot, small enough to reuse one buffer (measured best: 4096 rows of 640).
CHUNK_ELEMENTS = 1 << 22


@jax.tree_util.register_static
@dataclass(frozen=True)
class WeightSpec:
    """The static half of a weight: its format, ggml type, shape and, for int8, the
    sub-block length (part of cache keys)."""
    format: str
    type: GGMLType
    ne: tuple[int, int, int, int]
    sub_block: int = 0


@jax.tree_util.register_pytree_node_class
@dataclass
class DeviceWeight:
    """`array` holds the values (plain), the packed blocks (blocks) or the int8 quants (int8);
    int8 weights also carry `scale` and, when the type has a minimum, `offset`,
    both f32 [n_rows, ne0 // sub_block]."""
    spec: WeightSpec
    array: jax.Array
    scale: jax.Array | None = None
    offset: jax.Array | None = None

    def tree_flatten(self):
        return (self.array, self.scale, self.offset), self.spec

    @classmethod
    def tree_unflatten(cls, spec, children):
        return cls(spec, *children)

    def arrays(self) -> list[jax.Array]:
        return [a for a in (self.array, self.scale, self.offset) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(int(a.size * a.dtype.itemsize) for a in self.arrays())

    def delete(self) -> None:
        for a in self.arrays():
            a.delete()


# ---- placing a tensor on a device ---------------------------------------------------------

# What "auto" means: int8 is exact, 4x smaller than f32 and, on an idle 2-core machine, the
# fastest for decode with no loss for prefill (python -m llm bench, one session: SmolLM2-135M
# tg64 int8 62.2 vs f32 52.0 tok/s, pp512 1232 vs 1274; Gemma3-270M tg int8 ~48 vs f32 ~34).
AUTO_FORMAT = "int8"


def resolve_format(weight_format: str, t: GGMLType) -> str:
    """The held format for a tensor of type t under weight_format ("auto" must have been
    turned into AUTO_FORMAT). int8 falls back to the blocks for types
    without an exact int8 form (the IQ codebook types, TQ*, MXFP4)."""
    if weight_format not in WEIGHT_FORMATS or weight_format == "auto":
        raise ValueError(f"weight_format must be one of native, int8, f32, got {weight_format!r}")
    if not types.traits(t).is_quantized or weight_format == "f32":
        return FORMAT_PLAIN
    if weight_format == "int8" and t in INT8_CONVERTERS:
        return FORMAT_INT8
    return FORMAT_BLOCKS


def check_format(weight_format: str) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")


def to_device(data: np.ndarray, t: GGMLType, ne, device=None, weight_format: str = "native") -> DeviceWeight:
    """Put a tensor's GGUF bytes (uint8, or typed values) on a device in the format that
    weight_format selects for its type (see resolve_format)."""
    from ggmlx import quants
    t = GGMLType(t)
    ne4 = pad_ne(ne)
    rows = ne4[1] * ne4[2] * ne4[3]
    raw = np.ascontiguousarray(data)
    if raw.dtype == np.uint8 and raw.size != types.nbytes(t, ne4):
        raise ValueError(f"to_device: {t.name} tensor of ne={tuple(ne)} needs {types.nbytes(t, ne4)} bytes, "
                         f"got {raw.size}")
    fmt = resolve_format(weight_format, t)
    if fmt == FORMAT_PLAIN and types.traits(t).is_quantized:
        arr = quants.dequantize(raw.view(np.uint8).reshape(-1), t, ne4).reshape(tuple(reversed(ne4)))
        return DeviceWeight(WeightSpec(FORMAT_PLAIN, t, ne4), jax.device_put(arr, device))
    if fmt == FORMAT_PLAIN:
        dt = np_dtype(t)
        arr = raw.view(dt) if raw.dtype == np.uint8 else raw.astype(dt, copy=False)
        arr = arr.reshape(tuple(reversed(ne4)))
        return DeviceWeight(WeightSpec(FORMAT_PLAIN, t, ne4), jax.device_put(arr, device))
    blocks = raw.view(np.uint8).reshape(rows, types.row_size(t, ne4[0]))
    if fmt == FORMAT_INT8:
        q, scale, offset = to_int8(blocks, t, rows)
        spec = WeightSpec(FORMAT_INT8, t, ne4, INT8_CONVERTERS[t][0])
        return DeviceWeight(spec, jax.device_put(q, device), jax.device_put(scale, device),
                            None if offset is None else jax.device_put(offset, device))
    return DeviceWeight(WeightSpec(FORMAT_BLOCKS, t, ne4), jax.device_put(blocks, device))


# ---- reading a weight inside a traced function ---------------------------------------------

def _rows_f32(w: DeviceWeight, q: jax.Array, scale: jax.Array | None, offset: jax.Array | None) -> jax.Array:
    """Dequantize n rows given as the held arrays sliced to those rows -> f32 [n, ne0]."""
    spec = w.spec
    n = q.shape[0]
    if spec.format == FORMAT_PLAIN:
        return q.reshape(n, spec.ne[0]).astype(jnp.float32)
    if spec.format == FORMAT_BLOCKS:
        from ggmlx import quants
        return quants.dequantize_jax(q, spec.type, (spec.ne[0], n))
    assert scale is not None   # the int8 format always has scales
    y = q.astype(jnp.float32).reshape(n, -1, spec.sub_block) * scale[..., None]
    if offset is not None:
        y = y + offset[..., None]
    return y.reshape(n, spec.ne[0])


def _row_arrays(w: DeviceWeight) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The held arrays with rows as their leading axis."""
    rows = w.spec.ne[1] * w.spec.ne[2] * w.spec.ne[3]
    return w.array.reshape(rows, -1), w.scale, w.offset


def materialize(w: DeviceWeight) -> jax.Array:
    """The weight as f32 in numpy order [ne3, ne2, ne1, ne0] (inside a traced function)."""
    spec = w.spec
    if spec.format == FORMAT_PLAIN:
        return w.array.astype(jnp.float32)
    return _rows_f32(w, *_row_arrays(w)).reshape(tuple(reversed(spec.ne)))


def get_rows(w: DeviceWeight, idx: jax.Array) -> jax.Array:
    """Rows idx of a 2-d weight as f32 [len(idx), ne0]; only the gathered rows are dequantized."""
    q, scale, offset = _row_arrays(w)
    return _rows_f32(w, jnp.take(q, idx, axis=0),
                     None if scale is None else jnp.take(scale, idx, axis=0),
                     None if offset is None else jnp.take(offset, idx, axis=0))


def _chunk_rows(n_rows: int, ne0: int) -> int:
    """Rows per dequantized chunk: a power of two with at most CHUNK_ELEMENTS elements."""
    r = 1
    while r * 2 * ne0 <= CHUNK_ELEMENTS:
        r *= 2
    return min(r, n_rows)


def mul_mat(w: DeviceWeight, x: jax.Array) -> jax.Array:
    """ggml mul_mat of a 2-d weight [M, K] (numpy order) by x [..., N, K] -> [..., N, M].

    A quantized (or non-f32) weight is dequantized a chunk of rows at a time inside a loop,
    each chunk feeding its own dot: XLA:CPU does not fuse dequantization into a dot, and one
    whole-matrix f32 temporary is several times slower (fresh pages every call). The last
    chunk starts early enough to end at row M (it recomputes a few rows: same values)."""
    spec = w.spec
    K, M = spec.ne[0], spec.ne[1]
    lead = x.shape[:-1]
    xt = x.reshape(-1, K)
    arrs = _row_arrays(w)
    if spec.format == FORMAT_PLAIN and w.array.dtype == jnp.float32:
        out = jnp.einsum("nk,mk->nm", xt, w.array.reshape(M, K), precision=HIGHEST)
        return out.reshape(*lead, M)
    R = _chunk_rows(M, K)
    if R == M:
        out = jnp.einsum("nk,mk->nm", xt, _rows_f32(w, *arrs), precision=HIGHEST)
        return out.reshape(*lead, M)

    def body(i, out):
        start = jnp.minimum(i * R, M - R)
        part = [None if a is None else jax.lax.dynamic_slice_in_dim(a, start, R, axis=0) for a in arrs]
        y = jnp.einsum("nk,mk->nm", xt, _rows_f32(w, *part), precision=HIGHEST)
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, axis=1)

    out = jax.lax.fori_loop(0, -(-M // R), body, jnp.zeros((xt.shape[0], M), jnp.float32))
    return out.reshape(*lead, M)
