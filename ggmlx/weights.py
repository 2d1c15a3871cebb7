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
- "int4": Q4_0, Q4_1 and Q4_K as packed nibbles, uint8 [n_rows, ne0 // 2] (per 32 elements
  16 bytes: byte j holds element j low, j + 16 high), plus f32 scale and offset per 32:
  0.75 bytes per element against int8's 1.25, for the native matvec of decode steps, which
  reads the nibbles directly. Every other quantized type is held as under "int8".
- "lanes" (numerics "ggml", a CPU with AVX-512 VNNI, the matrices of mul_mat): the GGUF blocks'
  bytes, each group of 16 rows re-ordered field by field (LANE_FIELDS) so that native.block_matmul
  reads 4 values of all 16 rows with one load and multiplies them with one instruction.

`mul_mat` and `get_rows` are how ops read a weight: neither dequantizes more than a chunk of
rows at a time, so a large matrix (a 262144-row lm_head) never exists as f32 in memory.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import flags, native, types
from ggmlx.backend import MESH_AXIS
from ggmlx.quants.int4 import INT4_CONVERTERS, to_int4
from ggmlx.quants.int8 import INT8_CONVERTERS, to_int8
from ggmlx.tensor import np_dtype, pad_ne
from ggmlx.types import GGMLType

FORMAT_PLAIN = "plain"
FORMAT_BLOCKS = "blocks"
FORMAT_INT8 = "int8"
FORMAT_INT4 = "int4"
FORMAT_LANES = "lanes"

WEIGHT_FORMATS = ("auto", "native", "int8", "int4", "f32")
# How products with quantized weights are computed. "exact": the weight's exact values times the
# f32 activations (f32 sums), the default for research and gradients. "ggml": as ggml-cpu, the
# activations quantized to the weight type's vec_dot_type and integer dot products, by
# native.block_matmul from the GGUF blocks, for the types it reads (native.BLOCK_TYPES) on the
# CPU; other types, other devices and derivatives keep the exact path.
NUMERICS = ("exact", "ggml")


def matmul_precision() -> jax.lax.Precision:
    """The precision of every f32 matmul (GGMLX_MATMUL_PRECISION, default HIGHEST: f32 stays
    f32 on GPUs, no TF32 unless asked), read at trace time."""
    return jax.lax.Precision[flags.matmul_precision()]


# Most elements of one dequantized chunk of rows inside mul_mat (f32: 16 MiB): large enough
# for an efficient dot, small enough to reuse one buffer (measured best: 4096 rows of 640).
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class WeightSplit:
    """How a 2-d weight is divided over the devices of a mesh (split_mode "row").

    dim 1 splits the rows (output features): each device computes its slice of the product,
    which stays split over the mesh, or is all-gathered when `gather` is set. dim 0 splits
    the columns (input features): each device multiplies its slice of x and the partial
    products are summed (all-reduce). `get_rows` of a row-split table (embeddings by
    vocabulary) gathers the local rows and sums; of a column-split table, takes the local
    columns of every row and all-gathers them.

    `heads`, when set, rearranges the split dimension before dividing it, in runs of `unit`
    (a head's features): run i of the held weight is run heads[i] of the file's, or zeros
    for -1. It pads attention to whole heads per device (and copies KV heads when there are
    fewer than devices)."""
    dim: int
    gather: bool = False
    heads: tuple[int, ...] | None = None
    unit: int = 0

    def __post_init__(self):
        if self.dim not in (0, 1):
            raise ValueError(f"a weight is split by rows (dim 1) or columns (dim 0), not dim {self.dim}")
        if self.heads is not None and self.unit <= 0:
            raise ValueError("a WeightSplit with heads needs the unit (features per head)")

    def padded_ne(self, ne) -> tuple[int, int, int, int]:
        """The held (global) shape of a file tensor of shape ne under this split."""
        ne4 = list(pad_ne(ne))
        if self.heads is not None:
            ne4[self.dim] = len(self.heads) * self.unit
        return (ne4[0], ne4[1], ne4[2], ne4[3])

    def __str__(self) -> str:
        s = ("rows" + ("+gather" if self.gather else "")) if self.dim == 1 else "cols+reduce"
        return s if self.heads is None else s + f"+heads{len(self.heads)}"


@jax.tree_util.register_static
@dataclass(frozen=True)
class WeightSpec:
    """The static half of a weight: its format, ggml type, shape (global) and, for int8 and
    int4, the sub-block length; for a weight divided over a mesh, the split and the mesh (part of
    cache keys). `rows` = (group, start, total) marks a member of a fused weight (fuse_rows):
    the arrays hold all `total` rows of the group, and this weight is rows start..start+ne1."""
    format: str
    type: GGMLType
    ne: tuple[int, int, int, int]
    sub_block: int = 0
    split: WeightSplit | None = None
    mesh: jax.sharding.Mesh | None = None
    rows: tuple[int, int, int] | None = None
    numerics: str = "exact"


@jax.tree_util.register_pytree_node_class
@dataclass
class DeviceWeight:
    """`array` holds the values (plain), the packed blocks (blocks), the int8 quants (int8) or
    the packed nibbles (int4); int8 weights also carry `scale` and, when the type has a
    minimum, `offset`, both [n_rows, ne0 // sub_block], f32 or f16 (F16_SCALES); int4 weights always both."""
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
        """Bytes held; a member of a fused weight counts its share of the group's arrays."""
        n = sum(int(a.size * a.dtype.itemsize) for a in self.arrays())
        return n if self.spec.rows is None else n * self.spec.ne[1] // self.spec.rows[2]

    def delete(self) -> None:
        for a in self.arrays():
            a.delete()


# ---- placing a tensor on a device ---------------------------------------------------------

# What "auto" means: int4 (exact like int8, which holds every type int4 does not). int8 was
# 1.2-1.4x faster than f32 for decode with no loss for prefill (SmolLM2-135M tg64 int8 62.2 vs
# f32 52.0 tok/s, pp512 1232 vs 1274; Gemma3-270M tg ~48 vs ~34); int4 reads 0.75 bytes per
# Q4 element instead of 1.25, and both models held both ways, alternated in one process on the
# 2-core machine (3 runs each): SmolLM2-135M (Q4_1) decode 1.10-1.15x faster (12.3-12.4 vs
# 13.6-14.3 ms/step), pp512 0.96-0.98x (XLA unpacks the nibbles of each prefill chunk: 5-9% per
# matmul at 512 rows); Gemma3-270M (Q4_K_M: only its Q4_K tensors change) decode 1.04-1.07x,
# pp512 0.98-1.01x.
AUTO_FORMAT = "int4"


def auto_format(devices) -> str:
    """What "auto" means for weights on these devices: AUTO_FORMAT, or int8 where no native
    kernel would read the int4 weights (GGMLX_NATIVE=0, the library not built, or a device
    other than a CPU among them): XLA's own int4 product of 1-16 rows reads 1.2-3.9 GB/s,
    its int8 one 3.5-17 (bench_native.py), so there int8 is the faster format."""
    cpu_only = all((d.platform if d is not None else jax.default_backend()) == "cpu" for d in devices)
    return AUTO_FORMAT if cpu_only and native.available() else FORMAT_INT8


def resolve_format(weight_format: str, t: GGMLType) -> str:
    """The held format for a tensor of type t under weight_format ("auto" must have been
    turned into AUTO_FORMAT). int4 holds the types without a packed 4-bit form as int8;
    int8 falls back to the blocks for types without an exact int8 form (the IQ codebook
    types, TQ*, MXFP4)."""
    if weight_format not in WEIGHT_FORMATS or weight_format == "auto":
        raise ValueError(f"weight_format must be one of native, int8, int4, f32, got {weight_format!r}")
    if not types.traits(t).is_quantized or weight_format == "f32":
        return FORMAT_PLAIN
    if weight_format == "int4" and t in INT4_CONVERTERS:
        return FORMAT_INT4
    if weight_format in ("int8", "int4") and t in INT8_CONVERTERS:
        return FORMAT_INT8
    return FORMAT_BLOCKS


def check_format(weight_format: str, numerics: str = "exact") -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")


def ggml_numerics(t: GGMLType, numerics: str) -> bool:
    """Whether a tensor of type t is held as its blocks for native.block_matmul."""
    return numerics == "ggml" and int(t) in native.BLOCK_TYPES


# The lanes format (block_matmul.cc's lane_pieces, the same order): a group of LANE_ROWS rows
# holds, block by block, a sequence of pieces, each the same bytes [off, off + elem) of the block
# in every row of the group ([LANE_ROWS rows][elem]): one 64-byte load is then the same 4 quant
# bytes of all 16 rows (as ggml's repacked q4_K_8x8). LANE_FIELDS: per type, each field of the
# block as (byte offset, bytes per piece, pieces), in the order of their pieces (Q6_K interleaves
# its low and high bits: lane_pieces).
LANE_ROWS = 16
LANE_FIELDS: dict[GGMLType, tuple[tuple[int, int, int], ...]] = {
    GGMLType.Q4_0: ((0, 2, 1), (2, 4, 4)),
    GGMLType.IQ4_NL: ((0, 2, 1), (2, 4, 4)),
    GGMLType.Q4_1: ((0, 2, 1), (2, 2, 1), (4, 4, 4)),
    GGMLType.Q5_0: ((0, 2, 1), (2, 4, 1), (6, 4, 4)),
    GGMLType.Q5_1: ((0, 2, 1), (2, 2, 1), (4, 4, 1), (8, 4, 4)),
    GGMLType.Q8_0: ((0, 2, 1), (2, 4, 8)),
    GGMLType.MXFP4: ((0, 1, 1), (1, 4, 4)),
    GGMLType.Q4_K: ((0, 2, 1), (2, 2, 1), (4, 4, 3), (16, 4, 32)),
    GGMLType.Q5_K: ((0, 2, 1), (2, 2, 1), (4, 4, 3), (16, 4, 8), (48, 4, 32)),
    GGMLType.Q6_K: ((0, 4, 32), (128, 4, 16), (192, 2, 8), (208, 2, 1)),
}


def lane_pieces(t: GGMLType) -> list[tuple[int, int]]:
    """The (offset, bytes) pieces of a type-t block in their lanes-format order. Q6_K's kernel
    takes per half h and t 4 bytes of ql[64h + 4t], ql[64h + 32 + 4t] and qh[32h + 4t] together,
    so they lie together (one stream from DRAM; as three the rate halved)."""
    if t == GGMLType.Q6_K:
        bits = [(off, 4) for h in range(2) for t4 in range(8)
                for off in (64 * h + 4 * t4, 64 * h + 32 + 4 * t4, 128 + 32 * h + 4 * t4)]
        return bits + [(192 + 2 * q, 2) for q in range(8)] + [(208, 2)]
    return [(off + c * elem, elem) for off, elem, count in LANE_FIELDS[t] for c in range(count)]


def lanes_ok(t: GGMLType, ne4, device=None) -> bool:
    """Whether a weight of type t and shape ne4, bound for device under numerics "ggml", is held
    in the lanes format: a 2-d matrix of whole 16-row groups, a type with a lane layout, a CPU
    whose block_matmul reads it in place (AVX-512 VNNI), GGMLX_LANES on."""
    return (t in LANE_FIELDS and ne4[1] % LANE_ROWS == 0 and ne4[2] == ne4[3] == 1 and flags.LANES.on()
            and types.nbytes(t, ne4) < 2**31   # get_rows gathers by int32 byte offsets
            and _on_cpu(device) and native.available()
            and native.block_cpu_isa() >= native.BLOCK_ISAS.index("avx512"))


def pack_lanes(blocks: np.ndarray, t: GGMLType, out: np.ndarray | None = None) -> np.ndarray:
    """GGUF blocks uint8 [M, row_bytes] (M a multiple of LANE_ROWS) in the lanes format, the same
    shape (into `out` when given). Any dtype moves as the bytes would (_lane_offsets); loading
    packs by native.pack_lanes, the same order in C."""
    m, row = blocks.shape
    size = types.type_size(t)
    g, nb = m // LANE_ROWS, row // size
    src = blocks.reshape(g, LANE_ROWS, nb, size)
    dst = (np.empty_like(blocks) if out is None else out).reshape(g, nb, LANE_ROWS * size)
    at = 0
    for off, elem in lane_pieces(t):
        dst[:, :, at:at + LANE_ROWS * elem] = src[:, :, :, off:off + elem].transpose(0, 2, 1, 3).reshape(g, nb, -1)
        at += LANE_ROWS * elem
    return dst.reshape(m, row)


@functools.cache
def _lane_offsets(t: GGMLType, row_bytes: int) -> np.ndarray:
    """int32 [LANE_ROWS, row_bytes]: where byte k of row r of a lane group lies in the group's bytes."""
    n = LANE_ROWS * row_bytes
    order = pack_lanes(np.arange(n, dtype=np.int32).reshape(LANE_ROWS, row_bytes), t).reshape(-1)
    where = np.empty(n, np.int32)
    where[order] = np.arange(n, dtype=np.int32)
    return where.reshape(LANE_ROWS, row_bytes)


def _take_lanes(w: DeviceWeight, idx: jax.Array) -> jax.Array:
    """Rows idx of a lanes-format weight as GGUF blocks uint8 [len(idx), row_bytes], gathered
    byte by byte from their groups (get_rows of an embedding the output head shares)."""
    row = types.row_size(w.spec.type, w.spec.ne[0])
    at = jnp.asarray(_lane_offsets(w.spec.type, row))
    idx = idx.astype(jnp.int32)
    return jnp.take(w.array.reshape(-1), (idx // LANE_ROWS * (LANE_ROWS * row))[:, None] + at[idx % LANE_ROWS])


def unpack_lanes(q: jax.Array, t: GGMLType) -> jax.Array:
    """pack_lanes undone inside a traced function: the GGUF blocks uint8 [M, row_bytes] (every
    row: materialize, mul_mat off the native path)."""
    m, row = q.shape
    size = types.type_size(t)
    g, nb = m // LANE_ROWS, row // size
    src = q.reshape(g, nb, LANE_ROWS * size)
    pieces, at = {}, 0
    for off, elem in lane_pieces(t):
        pieces[off] = src[:, :, at:at + LANE_ROWS * elem].reshape(g, nb, LANE_ROWS, elem).transpose(0, 2, 1, 3)
        at += LANE_ROWS * elem
    return jnp.concatenate([pieces[off] for off in sorted(pieces)], axis=3).reshape(m, row)


# Types whose int8/int4 scales and offsets are f16 fields of their blocks (d, m): held as f16,
# the same values in half the bytes (a decode step reads them all: SmolLM2-135M 111.6 -> 96
# MB per token). Q4_0 under int4 stays f32: its offset -8 d can leave the f16 range.
F16_SCALES = frozenset({GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                        GGMLType.IQ4_NL})
F16_SCALES_INT4 = frozenset({GGMLType.Q4_1})


def _as_f16(a: np.ndarray) -> np.ndarray:
    """a (f32 values of f16 block fields) as f16; ValueError if any value would change."""
    h = a.astype(np.float16)
    if not np.array_equal(h.astype(np.float32), a, equal_nan=True):
        raise ValueError("scales that are not f16 values cannot be held as f16")
    return h


def _held(raw: np.ndarray, t: GGMLType, ne4: tuple[int, int, int, int], fmt: str) -> tuple[WeightSpec, list]:
    """The spec and the numpy arrays that hold a tensor (or one block-aligned shard of it)
    of shape ne4 given its GGUF bytes (uint8) or typed values, in format fmt."""
    from ggmlx import quants
    rows = ne4[1] * ne4[2] * ne4[3]
    if fmt == FORMAT_PLAIN and types.traits(t).is_quantized:
        arr = quants.dequantize(raw.view(np.uint8).reshape(-1), t, ne4).reshape(tuple(reversed(ne4)))
        return WeightSpec(FORMAT_PLAIN, t, ne4), [arr]
    if fmt == FORMAT_PLAIN:
        dt = np_dtype(t)
        arr = raw.view(dt) if raw.dtype == np.uint8 else raw.astype(dt, copy=False)
        return WeightSpec(FORMAT_PLAIN, t, ne4), [arr.reshape(tuple(reversed(ne4)))]
    blocks = raw.view(np.uint8).reshape(rows, types.row_size(t, ne4[0]))
    if fmt == FORMAT_INT8:
        q, scale, offset = to_int8(blocks, t, rows)
        if t in F16_SCALES:
            scale, offset = _as_f16(scale), None if offset is None else _as_f16(offset)
        return WeightSpec(FORMAT_INT8, t, ne4, INT8_CONVERTERS[t][0]), [q, scale, offset]
    if fmt == FORMAT_INT4:
        q, scale, offset = to_int4(blocks, t, rows)
        if t in F16_SCALES_INT4:
            scale, offset = _as_f16(scale), _as_f16(offset)
        return WeightSpec(FORMAT_INT4, t, ne4, 32), [q, scale, offset]
    return WeightSpec(FORMAT_BLOCKS, t, ne4), [blocks]


# A weight this large (one 2 MiB page or more) bound for a CPU device is first copied into
# anonymous memory advised for transparent huge pages (GGMLX_HUGE_PAGES): a decode step streams
# every weight once, and with 4 KiB pages each 4 KiB costs a TLB miss. Measured on a 2-core
# Zen 4 at N = 1 from DRAM: Q6_K 32768x2048 27-28 -> 32 GB/s, Q4_K 8192x2048 26-27 -> 27-29.
HUGE_PAGE = 2 << 20


def _on_cpu(device) -> bool:
    return (jax.default_backend() if device is None else device.platform) == "cpu"


def mapped_array(shape: tuple[int, ...], dtype, *, huge: bool = False) -> np.ndarray:
    """An uninitialized C-contiguous array in a private anonymous mapping of its own, unmapped when
    the array (and every view or jax array holding it) is gone; page-aligned, or with `huge`
    starting on a 2 MiB boundary with its whole 2 MiB pages advised MADV_HUGEPAGE (Linux;
    elsewhere plain pages)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    mm = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(mm, np.uint8)
    start = -buf.ctypes.data % HUGE_PAGE if huge else 0
    whole = nbytes // HUGE_PAGE * HUGE_PAGE   # the tail short of a page stays in 4 KiB pages
    if huge and sys.platform == "linux" and whole:
        mm.madvise(mmap.MADV_HUGEPAGE, start, whole)
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def huge_page_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """mapped_array in transparent huge pages (GGMLX_HUGE_PAGES)."""
    return mapped_array(shape, dtype, huge=True)


def _huge(nbytes: int, device) -> bool:
    return nbytes >= HUGE_PAGE and flags.HUGE_PAGES.on() and _on_cpu(device)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere (another C library, another OS)."""
    try:
        glibc = sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        glibc = False
    if not glibc:
        return None
    fn = ctypes.CDLL(None).malloc_trim
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim). A load frees its
    temporaries (the members of fused weights, the vocabulary's build) inside the heap, where
    their pages stay resident and count in the process's peak: SmolLM2's `generate -n 32` peaked
    at 500 MB without this after the load, 450 MB with it (4 alternated pairs); so does an
    executable's deserialization (compile._load_executable). ~5 ms when there is garbage to
    return, 0.2 ms when not. A no-op without glibc."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


# host arrays of at least this many bytes get a mapping of their own
_MAPPED_MIN = 64 << 10


def host_array(shape: tuple[int, ...], dtype, device) -> np.ndarray:
    """An uninitialized C-contiguous array for weights computed on the host before
    jax.device_put: in huge pages where HUGE_PAGES says so, else from 64 KiB in an anonymous
    mapping of its own (page-aligned), else starting on a 64-byte boundary. On a CPU the client
    keeps such an array in place; numpy's own allocations (16-byte aligned) it copies three times
    in four (SmolLM2's ggml-numerics load copied 241 of its 332 arrays, 98 MB; now none). A
    mapping goes back to the OS as soon as its array is gone: the members of a fused weight, freed
    inside the C heap, stayed resident until the load ended (SmolLM2 generate -n 32 peak RSS)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if _huge(nbytes, device):
        return huge_page_array(shape, dtype)
    if nbytes >= _MAPPED_MIN and sys.platform != "win32":    # (Windows' mmap takes no flags)
        return mapped_array(shape, dtype)
    buf = np.empty(nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def _put(a: np.ndarray, device) -> jax.Array:
    """jax.device_put(a, device), a held in huge pages first where HUGE_PAGE says so (the CPU
    client then keeps that copy in place: it is 64-byte aligned)."""
    if _huge(a.nbytes, device):
        host = huge_page_array(a.shape, a.dtype)
        host[...] = a
        a = host
    return jax.device_put(a, device)


def converted(w: DeviceWeight) -> bool:
    """Whether w's arrays were computed from the file's bytes (int8, int4, lanes, dequantized), so
    they hold no view of them (plain floats and blocks may)."""
    return w.spec.format in (FORMAT_INT8, FORMAT_INT4, FORMAT_LANES) or (
        w.spec.format == FORMAT_PLAIN and types.traits(w.spec.type).is_quantized)


def aliases(w: DeviceWeight, data: np.ndarray) -> bool:
    """Whether w's array is `data` itself, not a copy: on a CPU, jax.device_put keeps a
    64-byte-aligned host array in place (a GGUF's 32-byte-aligned tensors are so about half the
    time)."""
    return w.array.is_fully_addressable and len(w.array.devices()) == 1 and \
        w.array.unsafe_buffer_pointer() == data.ctypes.data


# Source bytes packed into the lanes format per native call when the caller releases them as the
# packing goes (to_device's `release`): a 170 MB Q8_0 token embedding (Gemma3's) then never holds
# its file's pages and its packed copy whole at once (the load's peak RSS 736 -> ~580 MB).
PACK_SLICE_BYTES = 8 << 20


def to_device(data: np.ndarray, t: GGMLType, ne, device=None, weight_format: str = "native",
              numerics: str = "exact", lanes: bool = False,
              release: Callable[[int, int], None] | None = None) -> DeviceWeight:
    """Put a tensor's GGUF bytes (uint8, or typed values) on a device in the format that
    weight_format selects for its type (see resolve_format); under numerics "ggml" the types
    native.block_matmul reads stay as their blocks, or with `lanes` (a weight only mul_mat
    reads: the loader's choice) in the lanes format where lanes_ok allows. `release(start,
    stop)` is told each range of data's bytes once it is packed (the loader drops their pages)."""
    t = GGMLType(t)
    ne4 = pad_ne(ne)
    raw = np.ascontiguousarray(data)
    if raw.dtype == np.uint8 and raw.size != types.nbytes(t, ne4):
        raise ValueError(f"to_device: {t.name} tensor of ne={tuple(ne)} needs {types.nbytes(t, ne4)} bytes, "
                         f"got {raw.size}")
    if ggml_numerics(t, numerics) and raw.dtype == np.uint8 and lanes and lanes_ok(t, ne4, device):
        blocks = raw.reshape(-1, types.row_size(t, ne4[0]))
        host = host_array(blocks.shape, np.uint8, device)
        row = blocks.shape[1]
        step = len(blocks) if release is None else max(LANE_ROWS, PACK_SLICE_BYTES // row // LANE_ROWS * LANE_ROWS)
        for r0 in range(0, len(blocks), step):
            r1 = min(r0 + step, len(blocks))
            native.pack_lanes(blocks[r0:r1], int(t), host[r0:r1])
            if release is not None:
                release(r0 * row, r1 * row)
        return DeviceWeight(WeightSpec(FORMAT_LANES, t, ne4, numerics="ggml"), jax.device_put(host, device))
    if ggml_numerics(t, numerics) and raw.dtype == np.uint8:
        spec, arrs = _held(raw, t, ne4, FORMAT_BLOCKS)
        spec = dataclasses.replace(spec, numerics="ggml")
    else:
        spec, arrs = _held(raw, t, ne4, resolve_format(weight_format, t))
    q, scale, offset = (arrs + [None, None])[:3]
    return DeviceWeight(spec, _put(q, device), None if scale is None else _put(scale, device),
                        None if offset is None else _put(offset, device))


# ---- weights divided over a mesh (split_mode "row") -----------------------------------------

def check_split(name: str, t: GGMLType, ne, n: int, split: WeightSplit | None) -> None:
    """ValueError naming the tensor when it cannot be divided into n equal shards of whole
    quant blocks: a row split needs a 2-d tensor with rows divisible by n, a column split
    columns divisible into n runs of whole blocks."""
    if split is None or n == 1:
        return
    ne4 = pad_ne(ne)
    what = f"tensor {name!r} ({GGMLType(t).name}, ne={list(ne4[:2])})"
    if ne4[2] != 1 or ne4[3] != 1:
        raise ValueError(f"{what} has more than 2 dims and cannot be split over {n} devices")
    bs = types.block_size(t)
    if split.heads is not None:
        if ne4[split.dim] % split.unit or (split.dim == 0 and split.unit % bs):
            raise ValueError(f"{what}: its heads of {split.unit} features are not whole "
                             f"{GGMLType(t).name} blocks of {bs}")
        if max(split.heads) >= ne4[split.dim] // split.unit:
            raise ValueError(f"{what} has {ne4[split.dim] // split.unit} heads, fewer than the layout "
                             f"{list(split.heads)} reads")
        ne4 = split.padded_ne(ne4)
    if split.dim == 1 and ne4[1] % n:
        raise ValueError(f"{what}: its {ne4[1]} rows do not split evenly over {n} devices")
    if split.dim == 0 and (ne4[0] % n or (ne4[0] // n) % bs):
        raise ValueError(f"{what}: its {ne4[0]} columns do not split over {n} devices in whole "
                         f"{GGMLType(t).name} blocks of {bs}")


def _pad_heads(raw: np.ndarray, t: GGMLType, ne4, split: WeightSplit):
    """The file tensor's bytes rearranged as split.heads says (zero bytes, which every ggml
    type dequantizes to 0, for padded heads) and the held ne."""
    assert split.heads is not None
    heads = np.asarray(split.heads)
    real = heads >= 0
    K, M = ne4[0], ne4[1]
    by_row = raw.view(np.uint8).reshape(M, types.row_size(t, K))
    if split.dim == 1:
        src = by_row.reshape(M // split.unit, split.unit, by_row.shape[1])
        out = np.zeros((len(heads), split.unit, by_row.shape[1]), np.uint8)
        out[real] = src[heads[real]]
        return out.reshape(len(heads) * split.unit, -1), split.padded_ne(ne4)
    bpu = types.row_size(t, split.unit)
    src = by_row.reshape(M, K // split.unit, bpu)
    out = np.zeros((M, len(heads), bpu), np.uint8)
    out[:, real] = src[:, heads[real]]
    return out.reshape(M, -1), split.padded_ne(ne4)


def _shard_raw(raw: np.ndarray, t: GGMLType, ne4, split: WeightSplit | None, k: int, n: int):
    """Shard k of n of a 2-d tensor's bytes (a row range or a block-aligned column range),
    read from the mmap only where the shard lies, and the shard's ne."""
    if split is None:
        return raw, ne4
    K, M = ne4[0], ne4[1]
    by_row = raw.view(np.uint8).reshape(M, types.row_size(t, K))
    if split.dim == 1:
        m = M // n
        return np.ascontiguousarray(by_row[k * m:(k + 1) * m]), (K, m, 1, 1)
    c = K // n
    b0, b1 = types.row_size(t, k * c), types.row_size(t, (k + 1) * c)
    return np.ascontiguousarray(by_row[:, b0:b1]), (c, M, 1, 1)


def _leaf_pspec(split: WeightSplit | None, ndim: int) -> jax.sharding.PartitionSpec:
    """The PartitionSpec of a held array: plain arrays are 4-d numpy order (ggml dim d is
    axis 3 - d), blocks, int8 and int4 arrays 2-d [rows, cols] (an int4 column split divides
    its 16-byte runs of 32 elements, as check_split keeps whole blocks)."""
    P = jax.sharding.PartitionSpec
    if split is None:
        return P()
    axes: list[str | None] = [None] * ndim
    axes[ndim - 1 - split.dim] = MESH_AXIS
    return P(*axes)


def to_mesh(data: np.ndarray, t: GGMLType, ne, mesh: jax.sharding.Mesh, split: WeightSplit | None,
            weight_format: str = "native", name: str = "") -> DeviceWeight:
    """Put a tensor on every device of a 1-d mesh: divided by `split` (each device holds 1/n
    of the bytes) or replicated (split None). Only the shards of this process's devices are
    read from `data` (an mmap view) and converted, so every process of a multi-host run
    loads only what its devices hold."""
    t = GGMLType(t)
    ne4 = pad_ne(ne)
    devices = list(mesh.devices.flat)
    n = len(devices)
    check_split(name or "?", t, ne4, n, split)
    fmt = resolve_format(weight_format, t)
    if split is not None and split.heads is not None:
        data, ne4 = _pad_heads(np.asarray(data), t, ne4, split)
    mine = [(k, d) for k, d in enumerate(devices) if d.process_index == jax.process_index()]
    converted: dict[int, tuple[WeightSpec, list]] = {}
    for k, _ in mine:
        key = k if split is not None else 0
        if key not in converted:
            raw, ne_k = _shard_raw(np.asarray(data), t, ne4, split, k, n)
            converted[key] = _held(raw, t, ne_k, fmt)
    local_spec, first = next(iter(converted.values()))
    leaves: list[jax.Array | None] = []
    for j, a in enumerate(first):
        if a is None:
            leaves.append(None)
            continue
        shape = list(a.shape)
        if split is not None:
            shape[a.ndim - 1 - split.dim] *= n
        sharding = jax.sharding.NamedSharding(mesh, _leaf_pspec(split, a.ndim))
        parts = [jax.device_put(converted[k if split is not None else 0][1][j], d) for k, d in mine]
        leaves.append(jax.make_array_from_single_device_arrays(tuple(shape), sharding, parts))
    spec = WeightSpec(local_spec.format, t, ne4, local_spec.sub_block, split, mesh if split is not None else None)
    q, scale, offset = (leaves + [None, None])[:3]
    assert q is not None   # every format holds its values
    return DeviceWeight(spec, q, scale, offset)


def _split_of(w: DeviceWeight) -> tuple[WeightSplit, jax.sharding.Mesh]:
    """The split and mesh of a weight divided over a mesh."""
    if w.spec.split is None or w.spec.mesh is None:
        raise ValueError(f"a weight of ne={list(w.spec.ne)} is not split over a mesh")
    return w.spec.split, w.spec.mesh


def _local(w: DeviceWeight) -> DeviceWeight:
    """Inside shard_map: the weight as this device's shard (its own shape, no split)."""
    spec = w.spec
    split, mesh = _split_of(w)
    ne = list(spec.ne)
    ne[split.dim] //= mesh.devices.size
    local = WeightSpec(spec.format, spec.type, (ne[0], ne[1], ne[2], ne[3]), spec.sub_block)
    return DeviceWeight(local, w.array, w.scale, w.offset)


def _mul_mat_split(w: DeviceWeight, x: jax.Array) -> jax.Array:
    """mul_mat of a weight split over a mesh: shard_map of the local product, then (rows)
    the result split along its features or all-gathered, or (columns) all-reduced."""
    from jax import shard_map
    P = jax.sharding.PartitionSpec
    split, mesh = _split_of(w)
    lead = (None,) * (x.ndim - 1)
    w_spec = _leaf_pspec(split, w.array.ndim)
    x_spec = P(*lead, MESH_AXIS) if split.dim == 0 else P()
    split_out = split.dim == 1 and not split.gather
    out_spec = P(*lead, MESH_AXIS) if split_out else P()

    def local(wl, xl):
        y = mul_mat(_local(wl), xl, native_ok=False)
        if split.dim == 0:
            return jax.lax.psum(y, MESH_AXIS)
        if split.gather:
            return jax.lax.all_gather(y, MESH_AXIS, axis=y.ndim - 1, tiled=True)
        return y

    return shard_map(local, mesh=mesh, in_specs=(w_spec, x_spec), out_specs=out_spec,
                     check_vma=False)(w, x)


def _get_rows_split(w: DeviceWeight, idx: jax.Array) -> jax.Array:
    """get_rows of a split table. By rows (embeddings by vocabulary): each device takes the
    ids that fall in its rows, zeros for the others, and the results are summed. By
    columns: each device takes its columns of every id's row, and they are all-gathered."""
    from jax import shard_map
    P = jax.sharding.PartitionSpec
    split, mesh = _split_of(w)
    n_local = w.spec.ne[1] // mesh.devices.size

    def local(wl, il):
        if split.dim == 0:
            rows = get_rows(_local(wl), il)
            return jax.lax.all_gather(rows, MESH_AXIS, axis=rows.ndim - 1, tiled=True)
        li = il - jax.lax.axis_index(MESH_AXIS) * n_local
        ok = (li >= 0) & (li < n_local)
        rows = get_rows(_local(wl), jnp.where(ok, li, 0))
        return jax.lax.psum(jnp.where(ok[:, None], rows, 0.0), MESH_AXIS)

    return shard_map(local, mesh=mesh, in_specs=(_leaf_pspec(split, w.array.ndim), P()),
                     out_specs=P(), check_vma=False)(w, idx)


def concat_rows(ws: list[DeviceWeight]) -> DeviceWeight | None:
    """One weight whose rows are those of ws in order (ggml: concatenated along ne1), for a
    single dot where a graph had several over the same input (fused QKV, gate+up). None when
    the weights cannot share one array: not 2-d, different ne0, format, type, sub-block,
    dtype or device."""
    first = ws[0].spec
    same = all(w.spec.ne[0] == first.ne[0] and w.spec.ne[2] == w.spec.ne[3] == 1 and w.spec.format == first.format
               and w.spec.type == first.type and w.spec.sub_block == first.sub_block
               and w.spec.numerics == first.numerics
               and w.array.dtype == ws[0].array.dtype and w.array.devices() == ws[0].array.devices()
               and (w.scale is None) == (ws[0].scale is None) and (w.offset is None) == (ws[0].offset is None)
               for w in ws)
    if not same or first.ne[2] != 1 or first.ne[3] != 1:
        return None
    rows = sum(w.spec.ne[1] for w in ws)
    ne = (first.ne[0], rows, 1, 1)

    devices = ws[0].array.devices()
    device = next(iter(devices))

    def cat(parts: list[jax.Array]) -> jax.Array:
        flat = [p.reshape(p.shape[-2] if p.ndim == 4 else p.shape[0], -1) for p in parts]
        if len(devices) == 1 and _on_cpu(device):   # joined on the host (in huge pages where they pay)
            # (jnp.concatenate compiled a program per shape and ran one per layer: SmolLM2's 60
            # groups took 75 ms of its 330 ms load)
            shape = (sum(p.shape[0] for p in flat), flat[0].shape[1])
            host = host_array(shape, flat[0].dtype, device)
            out = jax.device_put(np.concatenate([np.asarray(p) for p in flat], out=host), device)
        else:
            out = jnp.concatenate(flat)
        return out.reshape(1, 1, rows, -1) if parts[0].ndim == 4 else out

    scale = None if ws[0].scale is None else cat([w.scale for w in ws if w.scale is not None])
    offset = None if ws[0].offset is None else cat([w.offset for w in ws if w.offset is not None])
    return DeviceWeight(WeightSpec(first.format, first.type, ne, first.sub_block, numerics=first.numerics),
                        cat([w.array for w in ws]), scale, offset)


def fuse_rows(ws: list[DeviceWeight], group: int) -> list[DeviceWeight] | None:
    """The weights ws as members of one fused weight (their rows concatenated in one set of
    arrays, the originals left to the caller to delete), or None when concat_rows cannot join
    them. A graph keeps one mul_mat node per member; the lowering computes the fused product
    once per input and gives each member its rows (ggmlx/lower.py _mul_mat_fused), so a decode
    step makes one weight pass where it made several. `group` names the group in cache keys."""
    fused = concat_rows(ws)
    if fused is None:
        return None
    total = fused.spec.ne[1]
    out, start = [], 0
    for w in ws:
        spec = WeightSpec(fused.spec.format, fused.spec.type, w.spec.ne, fused.spec.sub_block,
                          rows=(group, start, total), numerics=fused.spec.numerics)
        out.append(DeviceWeight(spec, fused.array, fused.scale, fused.offset))
        start += w.spec.ne[1]
    return out


def fused_parent(w: DeviceWeight) -> DeviceWeight:
    """The whole fused weight that member w is a row range of."""
    assert w.spec.rows is not None
    spec = WeightSpec(w.spec.format, w.spec.type, (w.spec.ne[0], w.spec.rows[2], 1, 1), w.spec.sub_block,
                      numerics=w.spec.numerics)
    return DeviceWeight(spec, w.array, w.scale, w.offset)


def member_rows(w: DeviceWeight, y: jax.Array, axis: int) -> jax.Array:
    """Member w's rows of y, a value computed for the whole fused weight, along axis."""
    assert w.spec.rows is not None
    return jax.lax.slice_in_dim(y, w.spec.rows[1], w.spec.rows[1] + w.spec.ne[1], axis=axis)


# ---- reading a weight inside a traced function ---------------------------------------------

def _rows_f32(w: DeviceWeight, q: jax.Array, scale: jax.Array | None, offset: jax.Array | None) -> jax.Array:
    """Dequantize n rows given as the held arrays sliced to those rows -> f32 [n, ne0]."""
    spec = w.spec
    n = q.shape[0]
    if spec.format == FORMAT_PLAIN:
        return q.reshape(n, spec.ne[0]).astype(jnp.float32)
    if spec.format in (FORMAT_BLOCKS, FORMAT_LANES):   # (lanes: _row_arrays gave the blocks)
        from ggmlx import quants
        return quants.dequantize_jax(q, spec.type, (spec.ne[0], n))
    assert scale is not None   # the int8 and int4 formats always have scales
    if spec.format == FORMAT_INT4:
        q = q.reshape(n, -1, 1, 16)
        q = jnp.concatenate([q & 15, q >> 4], axis=2)   # [n, nb, 2, 16]: elements j and j + 16
    y = q.astype(jnp.float32).reshape(n, -1, spec.sub_block) * scale.astype(jnp.float32)[..., None]
    if offset is not None:
        y = y + offset.astype(jnp.float32)[..., None]
    return y.reshape(n, spec.ne[0])


def _row_arrays(w: DeviceWeight) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The held arrays with rows as their leading axis (a fused member's own rows only; the
    lanes format as GGUF blocks)."""
    if w.spec.rows is not None:
        q, scale, offset = _row_arrays(fused_parent(w))
        return (member_rows(w, q, 0), None if scale is None else member_rows(w, scale, 0),
                None if offset is None else member_rows(w, offset, 0))
    rows = w.spec.ne[1] * w.spec.ne[2] * w.spec.ne[3]
    if w.spec.format == FORMAT_LANES:
        return unpack_lanes(w.array.reshape(rows, -1), w.spec.type), None, None
    return w.array.reshape(rows, -1), w.scale, w.offset


def materialize(w: DeviceWeight) -> jax.Array:
    """The weight as f32 in numpy order [ne3, ne2, ne1, ne0] (inside a traced function)."""
    spec = w.spec
    if spec.rows is not None:
        return member_rows(w, materialize(fused_parent(w)), 2)
    if spec.format == FORMAT_PLAIN:
        return w.array.astype(jnp.float32)
    return _rows_f32(w, *_row_arrays(w)).reshape(tuple(reversed(spec.ne)))


def get_rows(w: DeviceWeight, idx: jax.Array) -> jax.Array:
    """Rows idx of a 2-d weight as f32 [len(idx), ne0]; only the gathered rows are dequantized."""
    if w.spec.split is not None:
        return _get_rows_split(w, idx)
    if w.spec.format == FORMAT_LANES and w.spec.rows is None:
        return _rows_f32(w, _take_lanes(w, idx), None, None)
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


def _mul_mat_native(w: DeviceWeight, xt: jax.Array) -> jax.Array:
    """The native kernel of w's format on the CPU (the XLA path elsewhere): block_matmul for a
    weight under numerics "ggml", else the int4 or int8 matvec. An FFI call has no derivative,
    so the tangent (linear in xt: saliency, gradients of llm.trace) takes the XLA path."""
    lanes = w.spec.format == FORMAT_LANES   # read in place, not through _row_arrays
    q, scale, offset = (w.array.reshape(w.spec.ne[1], -1), None, None) if lanes else _row_arrays(w)

    def kernel(xt):
        if w.spec.numerics == "ggml":
            return native.block_matmul(xt, q, int(w.spec.type), lanes=lanes)
        assert scale is not None   # the int8 and int4 formats always have scales
        if w.spec.format == FORMAT_INT4:
            assert offset is not None
            return native.int4_matvec(xt, q, scale, offset)
        return native.int8_matvec(xt, q, scale, offset)

    @jax.custom_jvp
    def f(xt):
        return jax.lax.platform_dependent(xt, cpu=kernel, default=lambda xt: mul_mat(w, xt, native_ok=False))

    @f.defjvp
    def f_jvp(primals, tangents):
        return f(primals[0]), mul_mat(w, tangents[0], native_ok=False)

    return f(xt)


def mul_mat(w: DeviceWeight, x: jax.Array, native_ok: bool = True) -> jax.Array:
    """ggml mul_mat of a 2-d weight [M, K] (numpy order) by x [..., N, K] -> [..., N, M].

    A quantized (or non-f32) weight is dequantized a chunk of rows at a time inside a loop,
    each chunk feeding its own dot: XLA:CPU does not fuse dequantization into a dot, and one
    whole-matrix f32 temporary is several times slower (fresh pages every call). The last
    chunk starts early enough to end at row M (it recomputes a few rows: same values).
    An int8 or int4 weight times native.MIN_N..MAX_N rows, and a weight under numerics "ggml"
    times any rows, runs a native kernel instead on the CPU, when it is built (ggmlx/native);
    native_ok is False for the shards of a split
    weight."""
    spec = w.spec
    if spec.split is not None:
        return _mul_mat_split(w, x)
    if spec.rows is not None:       # alone, a member costs the whole product (the lowering shares it)
        return member_rows(w, mul_mat(fused_parent(w), x, native_ok), x.ndim - 1)
    K, M = spec.ne[0], spec.ne[1]
    lead = x.shape[:-1]
    xt = x.reshape(-1, K)
    arrs = _row_arrays(w)
    # ggml numerics: any row count; the int8/int4 matvecs: MIN_N..MAX_N rows
    kernel_rows = spec.numerics == "ggml" or (spec.format in (FORMAT_INT8, FORMAT_INT4)
                                              and native.MIN_N <= xt.shape[0] <= native.MAX_N)
    if native_ok and kernel_rows and xt.dtype == jnp.float32 and native.available():
        return _mul_mat_native(w, xt).reshape(*lead, M)
    if spec.format == FORMAT_PLAIN and w.array.dtype == jnp.float32:
        out = jnp.einsum("nk,mk->nm", xt, w.array.reshape(M, K), precision=matmul_precision())
        return out.reshape(*lead, M)
    R = _chunk_rows(M, K)
    if R == M:
        out = jnp.einsum("nk,mk->nm", xt, _rows_f32(w, *arrs), precision=matmul_precision())
        return out.reshape(*lead, M)

    def body(i, out):
        start = jnp.minimum(i * R, M - R)
        part = [None if a is None else jax.lax.dynamic_slice_in_dim(a, start, R, axis=0) for a in arrs]
        y = jnp.einsum("nk,mk->nm", xt, _rows_f32(w, *part), precision=matmul_precision())
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, axis=1)

    out = jax.lax.fori_loop(0, -(-M // R), body, jnp.zeros((xt.shape[0], M), jnp.float32))
    return out.reshape(*lead, M)
