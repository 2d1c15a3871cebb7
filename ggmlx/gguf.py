"""GGUF files: a validating reader over mmap and a writer.

Layout (little-endian, versions 2 and 3 are identical on disk):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x      key (string) | value type u32 | value
    n_tensors x name (string) | n_dims u32 | ne[n_dims] i64 | ggml type u32 | offset u64
    padding to the alignment | tensor data (each tensor padded to the alignment)

A string is a u64 byte length followed by the bytes; an array value is an element type
u32, a u64 count and the elements. Tensor offsets are relative to the start of the data
section and must equal the running sum of the padded tensor sizes (as ggml's gguf.cpp
requires).

The reader checks every length against the bytes left in the file before it builds
anything, so a hostile file fails with `GGUFError` (naming file, key or tensor and byte
offset) instead of allocating what it claims. Tensor data is never copied: each
`TensorInfo.data` is a read-only uint8 view into the mapping.

`python -m ggmlx.gguf FILE` prints the metadata and the tensor table (like gguf-dump).
"""
from __future__ import annotations

import argparse
import enum
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ggmlx import types
from ggmlx.types import GGMLType

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
GGUF_DEFAULT_ALIGNMENT = 32
# ggml puts no upper bound on general.alignment; we reject anything above 1 MiB, which is far
# above what any writer uses (32 by default) and keeps padding arithmetic sane.
GGUF_MAX_ALIGNMENT = 1 << 20
GGML_MAX_NAME = 64          # tensor name buffer in ggml, including the terminating NUL
GGML_MAX_DIMS = 4
INT64_MAX = (1 << 63) - 1

KEY_ALIGNMENT = "general.alignment"
KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS_COUNT = "split.tensors.count"

_HEADER_BYTES = 4 + 4 + 8 + 8
# Smallest possible encodings, used to bound n_kv and n_tensors by the bytes left before
# any table is built: a kv is at least key length (8) + value type (4) + a 1-byte value;
# a tensor info is at least name length (8) + n_dims (4) + type (4) + offset (8).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


class GGUFError(ValueError):
    """A malformed or unsupported GGUF file. `offset` is the byte offset of the fault."""

    def __init__(self, path: str | os.PathLike, offset: int, where: str, message: str):
        self.path = str(path)
        self.offset = offset
        self.where = where
        super().__init__(f"{self.path}: {where}: {message} (at byte offset {offset})")


class GGUFValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size value types: struct format (little-endian) and numpy dtype for arrays.
_SCALAR_FORMAT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<B",
}
_SCALAR_SIZE = {t: struct.calcsize(f) for t, f in _SCALAR_FORMAT.items()}
_ARRAY_DTYPE = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("<u1"),
}
_INT_RANGE = {
    GGUFValueType.UINT8: (0, (1 << 8) - 1), GGUFValueType.INT8: (-(1 << 7), (1 << 7) - 1),
    GGUFValueType.UINT16: (0, (1 << 16) - 1), GGUFValueType.INT16: (-(1 << 15), (1 << 15) - 1),
    GGUFValueType.UINT32: (0, (1 << 32) - 1), GGUFValueType.INT32: (-(1 << 31), (1 << 31) - 1),
    GGUFValueType.UINT64: (0, (1 << 64) - 1), GGUFValueType.INT64: (-(1 << 63), (1 << 63) - 1),
}
_INTEGER_TYPES = frozenset(_INT_RANGE)


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass
class TensorInfo:
    """One tensor of a GGUF file; `data` is a zero-copy read-only uint8 view of its bytes."""
    name: str
    type: GGMLType
    ne: tuple[int, ...]     # ggml order: ne[0] is the innermost (contiguous) dimension
    offset: int             # absolute byte offset in `path`
    nbytes: int
    data: np.ndarray = field(repr=False)
    path: str = ""          # the file (shard) holding the data
    shard: int = 0          # index of that shard, 0 for a single-file model

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


@dataclass
class GGUFShard:
    """One parsed GGUF file. A split model has one per `-0000i-of-0000N.gguf` file."""
    path: str
    version: int
    alignment: int
    data_offset: int
    file_size: int
    kv: dict[str, object]
    kv_types: dict[str, GGUFValueType]
    kv_array_types: dict[str, GGUFValueType]
    kv_offsets: dict[str, int]      # where each key/value pair starts, for error messages
    tensors: dict[str, TensorInfo]
    mapping: mmap.mmap = field(repr=False)


class _Cursor:
    """Bounds-checked little-endian reads from a mapped file; `where` names what is read."""

    def __init__(self, path: str, buf: mmap.mmap, size: int):
        self.path = path
        self.buf = buf
        self.size = size
        self.pos = 0
        self.where = "header"

    def error(self, message: str, offset: int | None = None) -> GGUFError:
        return GGUFError(self.path, self.pos if offset is None else offset, self.where, message)

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.error(f"truncated file: {what} needs {n} bytes, {self.size - self.pos} left")

    def scalar(self, vtype: GGUFValueType, what: str):
        n = _SCALAR_SIZE[vtype]
        self.need(n, what)
        (v,) = struct.unpack_from(_SCALAR_FORMAT[vtype], self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def raw_string(self, what: str) -> bytes:
        start = self.pos
        n = self.u64(f"{what} length")
        if n > self.left():
            raise self.error(f"{what} length {n} is larger than the {self.left()} bytes left", start)
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s


def _read_value(cur: _Cursor, vtype: GGUFValueType):
    """One scalar value of a known non-array type, as a Python object."""
    if vtype == GGUFValueType.STRING:
        return cur.raw_string("string value").decode("utf-8", "surrogateescape")
    v = cur.scalar(vtype, f"{vtype.name} value")
    if vtype == GGUFValueType.BOOL:
        return v != 0
    return v


def _read_array(cur: _Cursor, etype: GGUFValueType, n: int):
    """n elements of type etype: list[str] for strings, a numpy array otherwise."""
    start = cur.pos
    if etype == GGUFValueType.STRING:
        if n * 8 > cur.left():
            raise cur.error(f"array of {n} strings needs at least {n * 8} bytes, "
                            f"{cur.left()} left", start)
        buf, pos, size = cur.buf, cur.pos, cur.size
        out = []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(n):
            if pos + 8 > size:
                raise cur.error(f"truncated file: string {i} of {n} length needs 8 bytes", pos)
            (length,) = unpack(buf, pos)
            pos += 8
            if length > size - pos:
                raise cur.error(f"string {i} of {n}: length {length} is larger than the "
                                f"{size - pos} bytes left", pos - 8)
            out.append(buf[pos:pos + length].decode("utf-8", "surrogateescape"))
            pos += length
        cur.pos = pos
        return out
    dtype = _ARRAY_DTYPE[etype]
    nbytes = n * dtype.itemsize
    if nbytes > cur.left():
        raise cur.error(f"array of {n} {etype.name} needs {nbytes} bytes, {cur.left()} left", start)
    arr = np.frombuffer(cur.buf, dtype=dtype, count=n, offset=cur.pos).copy()
    cur.pos += nbytes
    if etype == GGUFValueType.BOOL:
        return arr != 0
    return arr


def _read_value_type(cur: _Cursor, what: str) -> GGUFValueType:
    start = cur.pos
    t = cur.u32(what)
    try:
        return GGUFValueType(t)
    except ValueError:
        raise cur.error(f"unknown {what} {t}", start) from None


def _read_kv(cur: _Cursor, n_kv: int, shard_kv: dict, kv_types: dict, kv_array_types: dict,
             kv_offsets: dict) -> None:
    for i in range(n_kv):
        start = cur.pos
        cur.where = f"key {i} of {n_kv}"
        raw = cur.raw_string("key")
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise cur.error(f"key {raw!r} is not valid UTF-8", start) from None
        if not key:
            raise cur.error("empty key", start)
        cur.where = f"key {key!r}"
        if key in shard_kv:
            raise cur.error("duplicate key", start)
        vtype = _read_value_type(cur, "value type")
        if vtype == GGUFValueType.ARRAY:
            etype_at = cur.pos
            etype = _read_value_type(cur, "array element type")
            if etype == GGUFValueType.ARRAY:
                raise cur.error("array of arrays is not allowed", etype_at)
            n = cur.u64("array length")
            value = _read_array(cur, etype, n)
            kv_array_types[key] = etype
        else:
            value = _read_value(cur, vtype)
        shard_kv[key] = value
        kv_types[key] = vtype
        kv_offsets[key] = start


def _read_alignment(cur: _Cursor, kv: dict, kv_types: dict, kv_offsets: dict) -> int:
    if KEY_ALIGNMENT not in kv:
        return GGUF_DEFAULT_ALIGNMENT
    cur.where = f"key {KEY_ALIGNMENT!r}"
    cur.pos = kv_offsets[KEY_ALIGNMENT]
    if kv_types[KEY_ALIGNMENT] != GGUFValueType.UINT32:
        raise cur.error(f"must be UINT32, not {kv_types[KEY_ALIGNMENT].name}")
    a = kv[KEY_ALIGNMENT]
    if a == 0 or a & (a - 1):
        raise cur.error(f"alignment {a} is not a power of two")
    if a > GGUF_MAX_ALIGNMENT:
        raise cur.error(f"alignment {a} is larger than the supported {GGUF_MAX_ALIGNMENT}")
    return a


@dataclass
class _RawTensorInfo:
    name: str
    type: GGMLType
    ne: tuple[int, ...]
    rel_offset: int
    nbytes: int
    info_offset: int        # where its tensor info starts, for error messages


def _read_tensor_info(cur: _Cursor, i: int, n_tensors: int, seen: set[str]) -> _RawTensorInfo:
    start = cur.pos
    cur.where = f"tensor {i} of {n_tensors}"
    name_at = cur.pos
    n = cur.u64("tensor name length")
    if n >= GGML_MAX_NAME:
        raise cur.error(f"tensor name is {n} bytes, must be under {GGML_MAX_NAME}", name_at)
    cur.need(n, "tensor name")
    raw = cur.buf[cur.pos:cur.pos + n]
    cur.pos += n
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise cur.error(f"tensor name {raw!r} is not valid UTF-8", name_at) from None
    cur.where = f"tensor {name!r}"
    if name in seen:
        raise cur.error("duplicate tensor name", name_at)

    dims_at = cur.pos
    n_dims = cur.u32("n_dims")
    if n_dims > GGML_MAX_DIMS:
        raise cur.error(f"{n_dims} dimensions, at most {GGML_MAX_DIMS} allowed", dims_at)
    ne = []
    n_elements = 1
    for j in range(n_dims):
        d_at = cur.pos
        d = cur.scalar(GGUFValueType.INT64, f"ne[{j}]")
        if d < 0:
            raise cur.error(f"dimension {j} is negative ({d})", d_at)
        n_elements *= d
        if n_elements > INT64_MAX:
            raise cur.error(f"element count of shape {tuple(ne) + (d,)} overflows int64", d_at)
        ne.append(d)
    ne = tuple(ne)

    type_at = cur.pos
    type_id = cur.u32("tensor type")
    try:
        ggml_type = GGMLType(type_id)
    except ValueError:
        raise cur.error(f"unknown ggml type {type_id}", type_at) from None
    # ggml pads the shape to 4 dimensions with ones; sizes follow from that shape.
    ne4 = ne + (1,) * (GGML_MAX_DIMS - n_dims)
    try:
        nbytes = types.nbytes(ggml_type, ne4)
    except types.TypeSizeError as e:
        raise cur.error(f"shape {ne} of type {ggml_type.name}: {e}", type_at) from None
    rel_offset = cur.u64("tensor data offset")
    return _RawTensorInfo(name, ggml_type, ne, rel_offset, nbytes, start)


def _open_mapping(path: str) -> tuple[mmap.mmap | None, int]:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return None, 0
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), size


def read_shard(path: str | os.PathLike, shard: int = 0) -> GGUFShard:
    """Parse and validate one GGUF file (split keys are not followed here)."""
    path = str(path)
    buf, size = _open_mapping(path)
    try:
        return _parse(path, buf, size, shard)
    except BaseException:
        if buf is not None:
            buf.close()
        raise


def _parse(path: str, buf: mmap.mmap | None, size: int, shard: int) -> GGUFShard:
    if size < _HEADER_BYTES:
        raise GGUFError(path, 0, "header", f"truncated file: {size} bytes, a GGUF header needs {_HEADER_BYTES}")
    cur = _Cursor(path, buf, size)
    magic = buf[0:4]
    if magic != GGUF_MAGIC:
        raise cur.error(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}")
    cur.pos = 4
    version = cur.u32("version")
    if version not in GGUF_VERSIONS:
        hint = " (big-endian file?)" if version & 0xFFFF == 0 else ""
        raise cur.error(f"unsupported GGUF version {version}{hint}; supported: 2, 3", 4)
    n_tensors = cur.u64("n_tensors")
    n_kv = cur.u64("n_kv")
    left = cur.left()
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > left:
        raise cur.error(f"{n_kv} key/value pairs and {n_tensors} tensor infos cannot fit in "
                        f"the {left} bytes left (each kv takes at least {_MIN_KV_BYTES} bytes, "
                        f"each tensor info at least {_MIN_TENSOR_INFO_BYTES})", 8)

    kv: dict[str, object] = {}
    kv_types: dict[str, GGUFValueType] = {}
    kv_array_types: dict[str, GGUFValueType] = {}
    kv_offsets: dict[str, int] = {}
    _read_kv(cur, n_kv, kv, kv_types, kv_array_types, kv_offsets)
    infos_at = cur.pos
    alignment = _read_alignment(cur, kv, kv_types, kv_offsets)
    cur.pos = infos_at

    raw_infos: list[_RawTensorInfo] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        ti = _read_tensor_info(cur, i, n_tensors, seen)
        seen.add(ti.name)
        raw_infos.append(ti)

    data_offset = _pad(cur.pos, alignment)
    tensors: dict[str, TensorInfo] = {}
    expected = 0
    for ti in raw_infos:
        cur.where = f"tensor {ti.name!r}"
        if ti.rel_offset != expected:
            raise cur.error(f"data offset {ti.rel_offset} does not match the expected {expected} "
                            f"(running total of sizes padded to {alignment})", ti.info_offset)
        expected += _pad(ti.nbytes, alignment)
        offset = data_offset + ti.rel_offset
        if offset + ti.nbytes > size:
            raise cur.error(f"data [{offset}, {offset + ti.nbytes}) lies outside the file of "
                            f"{size} bytes", ti.info_offset)
        data = np.frombuffer(buf, dtype=np.uint8, count=ti.nbytes, offset=offset)
        tensors[ti.name] = TensorInfo(name=ti.name, type=ti.type, ne=ti.ne, offset=offset,
                                      nbytes=ti.nbytes, data=data, path=path, shard=shard)
    return GGUFShard(path=path, version=version, alignment=alignment, data_offset=data_offset,
                     file_size=size, kv=kv, kv_types=kv_types, kv_array_types=kv_array_types,
                     kv_offsets=kv_offsets, tensors=tensors, mapping=buf)


_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_path(prefix: str | os.PathLike, split_no: int, split_count: int) -> str:
    """Path of shard `split_no` (0-based) of a split model, as llama_split_path names it."""
    return f"{prefix}-{split_no + 1:05d}-of-{split_count:05d}.gguf"


def _split_key(shard: GGUFShard, key: str, vtype: GGUFValueType) -> int | None:
    if key not in shard.kv:
        return None
    if shard.kv_types[key] != vtype:
        raise GGUFError(shard.path, shard.kv_offsets[key], f"key {key!r}",
                        f"must be {vtype.name}, not {shard.kv_types[key].name}")
    return shard.kv[key]


class GGUFReader:
    """A validated GGUF model: one file, or all shards of a split model opened from the first.

    `kv`, `kv_types`, `kv_array_types`, `version`, `alignment` and `data_offset` come from
    the first shard (which holds the model metadata); `tensors` merges every shard's table
    in file order, and each TensorInfo names its shard's path.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.shards: list[GGUFShard] = []
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self.shards.append(read_shard(self.path))
            self._open_other_shards()
        except BaseException:
            self.close()
            raise
        first = self.shards[0]
        self.version = first.version
        self.alignment = first.alignment
        self.data_offset = first.data_offset
        self.kv = first.kv
        self.kv_types = first.kv_types
        self.kv_array_types = first.kv_array_types
        for shard in self.shards:
            self.tensors.update(shard.tensors)

    def _open_other_shards(self) -> None:
        first = self.shards[0]
        count = _split_key(first, KEY_SPLIT_COUNT, GGUFValueType.UINT16)
        if count is None or count <= 1:
            return
        no = _split_key(first, KEY_SPLIT_NO, GGUFValueType.UINT16)
        if no != 0:
            raise GGUFError(self.path, first.kv_offsets[KEY_SPLIT_NO], f"key {KEY_SPLIT_NO!r}",
                            f"shard {no} of a {count}-file split model: open the first shard")
        m = _SPLIT_NAME.match(os.path.basename(self.path))
        if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
            raise GGUFError(self.path, first.kv_offsets[KEY_SPLIT_COUNT], f"key {KEY_SPLIT_COUNT!r}",
                            f"split model of {count} files, but the file name does not end "
                            f"in -00001-of-{count:05d}.gguf")
        prefix = os.path.join(os.path.dirname(self.path), m["prefix"])
        names = set(first.tensors)
        for i in range(1, count):
            p = split_path(prefix, i, count)
            if not os.path.exists(p):
                raise GGUFError(p, 0, "split model", f"missing shard {i + 1} of {count}")
            shard = read_shard(p, shard=i)
            self.shards.append(shard)
            no = _split_key(shard, KEY_SPLIT_NO, GGUFValueType.UINT16)
            if no != i:
                raise GGUFError(p, shard.kv_offsets.get(KEY_SPLIT_NO, 0), f"key {KEY_SPLIT_NO!r}",
                                f"is {no}, expected {i}")
            shard_count = _split_key(shard, KEY_SPLIT_COUNT, GGUFValueType.UINT16)
            if shard_count != count:
                raise GGUFError(p, shard.kv_offsets.get(KEY_SPLIT_COUNT, 0), f"key {KEY_SPLIT_COUNT!r}",
                                f"is {shard_count}, expected {count}")
            for name, ti in shard.tensors.items():
                if name in names:
                    raise GGUFError(p, ti.offset, f"tensor {name!r}", "duplicated in another shard")
                names.add(name)
        total = _split_key(first, KEY_SPLIT_TENSORS_COUNT, GGUFValueType.INT32)
        if total is not None and total != len(names):
            raise GGUFError(self.path, first.kv_offsets[KEY_SPLIT_TENSORS_COUNT],
                            f"key {KEY_SPLIT_TENSORS_COUNT!r}",
                            f"says {total} tensors, the {count} shards hold {len(names)}")

    def close(self) -> None:
        """Unmap the files. A mapping stays alive while numpy views into it are still held."""
        self.tensors = {}
        for shard in self.shards:
            shard.tensors.clear()
            if shard.mapping is None:
                continue
            try:
                shard.mapping.close()
            except BufferError:
                pass
        self.shards = []

    def __enter__(self) -> GGUFReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
