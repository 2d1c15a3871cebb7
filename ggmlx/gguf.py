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
from collections.abc import Callable, Iterator, Sequence
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
_ARRAY_DTYPE: dict[GGUFValueType, np.dtype] = {
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

    def __init__(self, path: str, buf: mmap.mmap | bytes, size: int):
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


# string arrays of at least this many elements are kept as bytes by a lazy reader
_LAZY_STRINGS_MIN = 1024


class StringArray(Sequence[str]):
    """An array of strings kept as its bytes (a copy out of the mapping) and decoded on first
    use: what GGUFReader(lazy_strings=True) gives for large arrays, so that a loader whose
    vocabulary comes from a cache never decodes the tokens and merges (SmolLM2's 49152 tokens
    and 48900 merges: a 37 ms parse, 28 of them decoding). tolist() is the decoded list."""

    __slots__ = ("_data", "_n", "_strings")

    def __init__(self, data: bytes, n: int) -> None:
        self._data = data
        self._n = n
        self._strings: list[str] | None = None

    def tolist(self) -> list[str]:
        if self._strings is None:       # (the lengths were checked when the array was read)
            self._strings = _strings(_Cursor("<string array>", self._data, len(self._data)), self._n, decode=True)
        return self._strings

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self.tolist()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            other = other.tolist()
        return isinstance(other, (list, tuple)) and self.tolist() == list(other)

    __hash__ = None  # type: ignore[assignment]  # (a mutable sequence's equality)

    def __repr__(self) -> str:
        return f"StringArray({self._n} strings)"


def _read_value(cur: _Cursor, vtype: GGUFValueType):
    """One scalar value of a known non-array type, as a Python object."""
    if vtype == GGUFValueType.STRING:
        return cur.raw_string("string value").decode("utf-8", "surrogateescape")
    v = cur.scalar(vtype, f"{vtype.name} value")
    if vtype == GGUFValueType.BOOL:
        return v != 0
    return v


def _strings(cur: _Cursor, n: int, decode: bool) -> list[str]:
    """n GGUF strings from cur.pos on (cur.pos moves past them), decoded (or only walked, an
    empty list: a StringArray decodes them later); GGUFError for a length past the end."""
    buf, pos, size = cur.buf, cur.pos, cur.size
    out: list[str] = []
    append = out.append
    unpack = struct.Struct("<Q").unpack_from
    i = 0
    try:        # the fewest operations per string: a 262144-token vocabulary's loop 93 -> 78 ms
        for i in range(n):
            (length,) = unpack(buf, pos)
            end = pos + 8 + length
            if end > size:
                raise cur.error(f"string {i} of {n}: length {length} is larger than the "
                                f"{size - pos - 8} bytes left", pos)
            if decode:
                append(buf[pos + 8:end].decode("utf-8", "surrogateescape"))
            pos = end
    except struct.error:        # fewer than 8 bytes left for the length
        raise cur.error(f"truncated file: string {i} of {n} length needs 8 bytes", pos) from None
    cur.pos = pos
    return out


def _read_array(cur: _Cursor, etype: GGUFValueType, n: int, lazy_strings: bool = False):
    """n elements of type etype: list[str] for strings (a StringArray of the bytes with
    lazy_strings, from _LAZY_STRINGS_MIN elements), a numpy array otherwise."""
    start = cur.pos
    if etype == GGUFValueType.STRING:
        if n * 8 > cur.left():
            raise cur.error(f"array of {n} strings needs at least {n * 8} bytes, "
                            f"{cur.left()} left", start)
        if lazy_strings and n >= _LAZY_STRINGS_MIN:
            _strings(cur, n, decode=False)
            return StringArray(bytes(cur.buf[start:cur.pos]), n)
        return _strings(cur, n, decode=True)
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
             kv_offsets: dict, lazy_strings: bool) -> None:
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
            value = _read_array(cur, etype, n, lazy_strings)
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
    at = kv_offsets[KEY_ALIGNMENT]
    if kv_types[KEY_ALIGNMENT] != GGUFValueType.UINT32:
        raise cur.error(f"must be UINT32, not {kv_types[KEY_ALIGNMENT].name}", at)
    a = kv[KEY_ALIGNMENT]
    if a == 0 or a & (a - 1):
        raise cur.error(f"alignment {a} is not a power of two", at)
    if a > GGUF_MAX_ALIGNMENT:
        raise cur.error(f"alignment {a} is larger than the supported {GGUF_MAX_ALIGNMENT}", at)
    return a


@dataclass
class _RawTensorInfo:
    name: str
    type: GGMLType
    ne: tuple[int, ...]
    rel_offset: int
    nbytes: int
    offset_at: int          # where its offset field lies, for error messages


def _read_tensor_info(cur: _Cursor, i: int, n_tensors: int, seen: set[str]) -> _RawTensorInfo:
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
    dims: list[int] = []
    n_elements = 1
    for j in range(n_dims):
        d_at = cur.pos
        d = cur.scalar(GGUFValueType.INT64, f"ne[{j}]")
        if d < 0:
            raise cur.error(f"dimension {j} is negative ({d})", d_at)
        n_elements *= d
        if n_elements > INT64_MAX:
            raise cur.error(f"element count of shape {tuple(dims) + (d,)} overflows int64", d_at)
        dims.append(d)
    ne = tuple(dims)

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
    offset_at = cur.pos
    rel_offset = cur.u64("tensor data offset")
    return _RawTensorInfo(name, ggml_type, ne, rel_offset, nbytes, offset_at)


def _open_mapping(path: str) -> tuple[mmap.mmap | None, int]:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return None, 0
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), size


def read_shard(path: str | os.PathLike, shard: int = 0, lazy_strings: bool = False) -> GGUFShard:
    """Parse and validate one GGUF file (split keys are not followed here); lazy_strings: large
    string arrays as StringArray (decoded on first use)."""
    path = str(path)
    buf, size = _open_mapping(path)
    try:
        return _parse(path, buf, size, shard, lazy_strings)
    except BaseException:
        _close_mapping(buf)
        raise


def _close_mapping(buf: mmap.mmap | None) -> None:
    """Unmap, unless numpy views still export the buffer: then it goes with the last view."""
    if buf is None:
        return
    try:
        buf.close()
    except BufferError:
        pass


def _parse(path: str, buf: mmap.mmap | None, size: int, shard: int, lazy_strings: bool) -> GGUFShard:
    if size < _HEADER_BYTES:
        raise GGUFError(path, 0, "header", f"truncated file: {size} bytes, a GGUF header needs {_HEADER_BYTES}")
    assert buf is not None   # only an empty file has no mapping, and it failed above
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
    _read_kv(cur, n_kv, kv, kv_types, kv_array_types, kv_offsets, lazy_strings)
    alignment = _read_alignment(cur, kv, kv_types, kv_offsets)

    raw_infos: list[_RawTensorInfo] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        ti = _read_tensor_info(cur, i, n_tensors, seen)
        seen.add(ti.name)
        raw_infos.append(ti)

    data_offset = _pad(cur.pos, alignment)
    expected = 0
    for ti in raw_infos:
        cur.where = f"tensor {ti.name!r}"
        if ti.rel_offset != expected:
            raise cur.error(f"data offset {ti.rel_offset} does not match the expected {expected} "
                            f"(running total of sizes padded to {alignment})", ti.offset_at)
        expected += _pad(ti.nbytes, alignment)
        offset = data_offset + ti.rel_offset
        if offset + ti.nbytes > size:
            raise cur.error(f"data [{offset}, {offset + ti.nbytes}) lies outside the file of "
                            f"{size} bytes", ti.offset_at)
    # Views are made only once everything is valid, so a failed open leaves none behind.
    tensors: dict[str, TensorInfo] = {}
    for ti in raw_infos:
        offset = data_offset + ti.rel_offset
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
    value = shard.kv[key]
    assert isinstance(value, int)   # the type was checked above
    return value


def _split_no(shard: GGUFShard, count: int) -> int:
    no = _split_key(shard, KEY_SPLIT_NO, GGUFValueType.UINT16)
    if no is None:
        raise GGUFError(shard.path, _HEADER_BYTES, f"key {KEY_SPLIT_NO!r}",
                        f"missing from a shard of a {count}-file split model")
    return no


class GGUFReader:
    """A validated GGUF model: one file, or all shards of a split model opened from the first.

    `kv`, `kv_types`, `kv_array_types`, `version`, `alignment` and `data_offset` come from
    the first shard (which holds the model metadata); `tensors` merges every shard's table
    in file order, and each TensorInfo names its shard's path. With `lazy_strings`, string
    arrays of 1024 elements and more are StringArrays, decoded on first use.
    """

    def __init__(self, path: str | os.PathLike, *, lazy_strings: bool = False):
        self.path = str(path)
        self.shards: list[GGUFShard] = []
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self.shards.append(read_shard(self.path, lazy_strings=lazy_strings))
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

    def release(self, info: TensorInfo, start: int = 0, stop: int | None = None) -> None:
        """Drop the pages of a tensor's bytes [start, stop) (default: all) from this process's
        memory (madvise DONTNEED) once they were converted into arrays of their own: a mapped page
        the loader read stays in the process's RSS while the file is mapped, so a converted model
        would otherwise hold its file twice at the peak of a load. The pages are the file's, read
        again if touched: pages shared with a neighbouring range, or views still in use, only
        cost a re-read."""
        mapping = self.shards[info.shard].mapping
        stop = info.nbytes if stop is None else min(stop, info.nbytes)
        if mapping is None or stop <= start or sys.platform == "win32":   # (no madvise there)
            return
        first = (info.offset + start) // mmap.PAGESIZE * mmap.PAGESIZE
        mapping.madvise(mmap.MADV_DONTNEED, first, info.offset + stop - first)

    def _open_other_shards(self) -> None:
        first = self.shards[0]
        count = _split_key(first, KEY_SPLIT_COUNT, GGUFValueType.UINT16)
        if count is None or count <= 1:
            return
        if _split_no(first, count) != 0:
            raise GGUFError(self.path, first.kv_offsets[KEY_SPLIT_NO], f"key {KEY_SPLIT_NO!r}",
                            f"shard {first.kv[KEY_SPLIT_NO]} of a {count}-file split model: "
                            f"open the first shard")
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
            no = _split_no(shard, count)
            if no != i:
                raise GGUFError(p, shard.kv_offsets[KEY_SPLIT_NO], f"key {KEY_SPLIT_NO!r}",
                                f"is {no}, expected {i}")
            shard_count = _split_key(shard, KEY_SPLIT_COUNT, GGUFValueType.UINT16)
            if shard_count != count:
                raise GGUFError(p, shard.kv_offsets.get(KEY_SPLIT_COUNT, _HEADER_BYTES),
                                f"key {KEY_SPLIT_COUNT!r}", f"is {shard_count}, expected {count}")
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
            _close_mapping(shard.mapping)
        self.shards = []

    def __enter__(self) -> GGUFReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _infer_int_type(lo: int, hi: int) -> GGUFValueType:
    """Smallest of UINT32, INT32, INT64, UINT64 (in that order of preference) holding [lo, hi]."""
    for t in (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.INT64, GGUFValueType.UINT64):
        t_lo, t_hi = _INT_RANGE[t]
        if t_lo <= lo and hi <= t_hi:
            return t
    raise ValueError(f"integer range [{lo}, {hi}] does not fit in 64 bits")


_DTYPE_VALUE_TYPE: dict[np.dtype, GGUFValueType] = {np.dtype(np.bool_): GGUFValueType.BOOL}
_DTYPE_VALUE_TYPE.update({dt: t for t, dt in _ARRAY_DTYPE.items() if t != GGUFValueType.BOOL})


def _infer_scalar_type(value) -> GGUFValueType:
    if isinstance(value, np.generic):
        if value.dtype not in _DTYPE_VALUE_TYPE:
            raise ValueError(f"no GGUF value type for numpy {value.dtype}")
        return _DTYPE_VALUE_TYPE[value.dtype]
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return _infer_int_type(value, value)
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, (str, bytes)):
        return GGUFValueType.STRING
    raise ValueError(f"no GGUF value type for {type(value).__name__}")


def _infer_array_type(value) -> GGUFValueType:
    if isinstance(value, np.ndarray):
        if value.dtype not in _DTYPE_VALUE_TYPE:
            raise ValueError(f"no GGUF array element type for numpy {value.dtype}")
        return _DTYPE_VALUE_TYPE[value.dtype]
    if not value:
        raise ValueError("cannot infer the element type of an empty array: pass array_type")
    if all(isinstance(v, (str, bytes)) for v in value):
        return GGUFValueType.STRING
    if all(isinstance(v, bool) for v in value):
        return GGUFValueType.BOOL
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return _infer_int_type(min(value), max(value))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return GGUFValueType.FLOAT32
    raise ValueError("array elements must all be str, all bool, all int or all numbers")


def _encode_string(value) -> bytes:
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogateescape")
    elif not isinstance(value, bytes):
        raise ValueError(f"STRING value must be str or bytes, not {type(value).__name__}")
    return struct.pack("<Q", len(value)) + value


def _encode_scalar(vtype: GGUFValueType, value) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _encode_string(value)
    if vtype == GGUFValueType.BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"BOOL value must be a bool, not {type(value).__name__}")
        return b"\x01" if value else b"\x00"
    if vtype in _INTEGER_TYPES:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{vtype.name} value must be an int, not {type(value).__name__}")
        lo, hi = _INT_RANGE[vtype]
        if not lo <= int(value) <= hi:
            raise ValueError(f"{value} is out of range for {vtype.name}")
        return struct.pack(_SCALAR_FORMAT[vtype], int(value))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{vtype.name} value must be a number, not {type(value).__name__}")
    try:
        return struct.pack(_SCALAR_FORMAT[vtype], float(value))
    except OverflowError:
        raise ValueError(f"{value} is out of range for {vtype.name}") from None


def _check_element(etype: GGUFValueType, v) -> None:
    """One element of a Python list against the array's element type."""
    if etype == GGUFValueType.BOOL:
        if not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"BOOL array element must be a bool, not {type(v).__name__}")
    elif isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{etype.name} array element must be a number, not bool")
    elif etype in _INTEGER_TYPES:
        if not isinstance(v, (int, np.integer)):
            raise ValueError(f"{etype.name} array element must be an int, not {type(v).__name__}")
        lo, hi = _INT_RANGE[etype]
        if not lo <= int(v) <= hi:
            raise ValueError(f"array element {v} is out of range for {etype.name}")
    elif not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{etype.name} array element must be a number, not {type(v).__name__}")


def _encode_array(etype: GGUFValueType, value) -> bytes:
    head = struct.pack("<IQ", etype, len(value))
    if etype == GGUFValueType.STRING:
        return head + b"".join(_encode_string(v) for v in value)
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"array value must be one-dimensional, got shape {value.shape}")
        kind = "b" if etype == GGUFValueType.BOOL else "iu" if etype in _INTEGER_TYPES else "iuf"
        if value.size and value.dtype.kind not in kind:
            raise ValueError(f"{etype.name} array cannot hold numpy {value.dtype}")
        if value.size and etype in _INTEGER_TYPES:
            lo, hi = _INT_RANGE[etype]
            if not (lo <= int(value.min()) and int(value.max()) <= hi):
                raise ValueError(f"values out of range for {etype.name}")
    else:
        for v in value:
            _check_element(etype, v)
    src = np.asarray(value, dtype=np.float64) if etype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) else None
    with np.errstate(over="ignore"):
        arr = np.array(value, dtype=_ARRAY_DTYPE[etype])
    if src is not None and not np.array_equal(np.isfinite(src), np.isfinite(arr)):
        raise ValueError(f"values out of range for {etype.name}")
    return head + arr.tobytes()


_DTYPE_GGML_TYPE = {
    np.dtype(np.float32): GGMLType.F32, np.dtype(np.float16): GGMLType.F16,
    np.dtype(np.float64): GGMLType.F64, np.dtype(np.int8): GGMLType.I8,
    np.dtype(np.int16): GGMLType.I16, np.dtype(np.int32): GGMLType.I32,
    np.dtype(np.int64): GGMLType.I64,
}


@dataclass
class _PendingTensor:
    name: bytes
    type: GGMLType
    ne: tuple[int, ...]
    nbytes: int
    data: np.ndarray | None     # contiguous uint8 bytes; None: asked from `write`'s tensor_data


class GGUFWriter:
    """Builds a GGUF file: key/value pairs in insertion order, then tensors.

    Value types are explicit (`vtype`, and `array_type` for the elements of an array) or
    inferred: bool -> BOOL, int -> UINT32 if it fits, else INT32, INT64, UINT64;
    float -> FLOAT32; str/bytes -> STRING; numpy scalars and arrays by dtype; a list ->
    ARRAY whose element type follows the same rules over all elements (ints by min/max).
    The alignment is the value of `general.alignment` if added (it must be UINT32), else 32.
    """

    def __init__(self, version: int = 3):
        if version not in GGUF_VERSIONS:
            raise ValueError(f"GGUF version {version} cannot be written; supported: 2, 3")
        self.version = version
        self._kv: dict[str, bytes] = {}
        self._kv_values: dict[str, tuple[GGUFValueType, object]] = {}
        self._tensors: list[_PendingTensor] = []
        self._tensor_names: set[str] = set()

    def add_kv(self, key: str, value, vtype: GGUFValueType | None = None,
               array_type: GGUFValueType | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"GGUF key must be a non-empty str, got {key!r}")
        if key in self._kv:
            raise ValueError(f"duplicate GGUF key {key!r}")
        is_array = isinstance(value, (list, tuple, np.ndarray))
        try:
            if vtype is None:
                vtype = GGUFValueType.ARRAY if is_array else _infer_scalar_type(value)
            vtype = GGUFValueType(vtype)
            if (vtype == GGUFValueType.ARRAY) != is_array:
                raise ValueError(f"value of type {type(value).__name__} does not match {vtype.name}")
            if vtype == GGUFValueType.ARRAY:
                etype = GGUFValueType(array_type) if array_type is not None else _infer_array_type(value)
                if etype == GGUFValueType.ARRAY:
                    raise ValueError("arrays of arrays are not allowed")
                payload = _encode_array(etype, value)
            else:
                if array_type is not None:
                    raise ValueError("array_type given for a scalar value")
                payload = _encode_scalar(vtype, value)
        except ValueError as e:
            raise ValueError(f"GGUF key {key!r}: {e}") from None
        self._kv[key] = _encode_string(key) + struct.pack("<I", vtype) + payload
        self._kv_values[key] = (vtype, value)

    def add_tensor(self, name: str, data: np.ndarray, type: GGMLType | None = None,
                   ne: tuple[int, ...] | None = None) -> None:
        """Add a tensor from typed values (type inferred from the dtype) or from raw bytes.

        `ne` is in ggml order and defaults to the reversed numpy shape; the bytes of `data`
        must be exactly what `type` needs for `ne` (raw quant blocks: pass uint8 data, type
        and ne).
        """
        data = np.ascontiguousarray(data)
        if type is None:
            if data.dtype not in _DTYPE_GGML_TYPE and data.dtype.name != "bfloat16":
                raise ValueError(f"tensor {name!r}: no ggml type for dtype {data.dtype}; pass type")
            type = GGMLType.BF16 if data.dtype.name == "bfloat16" else _DTYPE_GGML_TYPE[data.dtype]
        ne = tuple(int(d) for d in (reversed(data.shape) if ne is None else ne))
        raw = data.reshape(-1).view(np.uint8)
        t = self._declare(name, type, ne)
        if raw.size != t.nbytes:
            raise ValueError(f"tensor {name!r}: data has {raw.size} bytes, {t.type.name} with "
                             f"ne {ne} needs {t.nbytes}")
        t.data = raw
        self._tensors.append(t)
        self._tensor_names.add(name)

    def add_tensor_info(self, name: str, type: GGMLType, ne: tuple[int, ...]) -> None:
        """Add a tensor whose bytes `write` asks `tensor_data` for, one tensor at a time, so a
        file larger than memory is written without holding its tensors (llama-quantize's way)."""
        self._tensors.append(self._declare(name, type, tuple(int(d) for d in ne)))
        self._tensor_names.add(name)

    def _declare(self, name: str, type: GGMLType, ne: tuple[int, ...]) -> _PendingTensor:
        encoded = name.encode("utf-8")
        if len(encoded) >= GGML_MAX_NAME:
            raise ValueError(f"tensor name {name!r} is {len(encoded)} bytes, must be under {GGML_MAX_NAME}")
        if name in self._tensor_names:
            raise ValueError(f"duplicate tensor name {name!r}")
        type = GGMLType(type)
        if len(ne) > GGML_MAX_DIMS:
            raise ValueError(f"tensor {name!r}: {len(ne)} dimensions, at most {GGML_MAX_DIMS}")
        try:
            expected = types.nbytes(type, ne + (1,) * (GGML_MAX_DIMS - len(ne)))
        except types.TypeSizeError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
        return _PendingTensor(encoded, type, ne, expected, None)

    def alignment(self) -> int:
        """The data alignment `write` will use, checked as the reader checks it."""
        if KEY_ALIGNMENT not in self._kv_values:
            return GGUF_DEFAULT_ALIGNMENT
        vtype, value = self._kv_values[KEY_ALIGNMENT]
        a = int(value) if isinstance(value, int | np.integer) else -1
        if vtype != GGUFValueType.UINT32 or a == 0 or a & (a - 1) or a > GGUF_MAX_ALIGNMENT:
            raise ValueError(f"{KEY_ALIGNMENT} must be a UINT32 power of two up to "
                             f"{GGUF_MAX_ALIGNMENT}, got {value!r} ({vtype.name})")
        return a

    def write(self, path: str | os.PathLike,
              tensor_data: Callable[[str], np.ndarray] | None = None) -> None:
        """Write the file. `tensor_data(name)` gives the bytes (uint8) of each tensor added by
        `add_tensor_info`, in file order."""
        alignment = self.alignment()
        infos = []
        offset = 0
        for t in self._tensors:
            infos.append(struct.pack("<Q", len(t.name)) + t.name + struct.pack("<I", len(t.ne))
                         + struct.pack(f"<{len(t.ne)}q", *t.ne) + struct.pack("<IQ", t.type, offset))
            offset += _pad(t.nbytes, alignment)
        head = b"".join([GGUF_MAGIC, struct.pack("<IQQ", self.version, len(self._tensors), len(self._kv)),
                         *self._kv.values(), *infos])
        with open(path, "wb") as fh:
            fh.write(head)
            fh.write(bytes(_pad(len(head), alignment) - len(head)))
            for t in self._tensors:
                data = t.data if t.data is not None else self._streamed(t, tensor_data)
                fh.write(data.data)
                fh.write(bytes(_pad(t.nbytes, alignment) - t.nbytes))

    @staticmethod
    def _streamed(t: _PendingTensor, tensor_data: Callable[[str], np.ndarray] | None) -> np.ndarray:
        name = t.name.decode("utf-8")
        if tensor_data is None:
            raise ValueError(f"tensor {name!r} was added without data: pass write(tensor_data=...)")
        data = np.ascontiguousarray(tensor_data(name)).reshape(-1).view(np.uint8)
        if data.size != t.nbytes:
            raise ValueError(f"tensor {name!r}: tensor_data gave {data.size} bytes, {t.type.name} with "
                             f"ne {t.ne} needs {t.nbytes}")
        return data


def _format_value(value, vtype: GGUFValueType, limit: int = 60) -> str:
    if vtype == GGUFValueType.STRING:
        text = repr(value)
        return text if len(text) <= limit else text[:limit] + "..."
    if vtype == GGUFValueType.FLOAT32:
        return str(np.float32(value))       # shortest text that reads back as this float32
    return str(value)


def _format_kv(value, vtype: GGUFValueType, etype: GGUFValueType | None) -> tuple[str, int, str]:
    if vtype != GGUFValueType.ARRAY:
        return vtype.name, 1, _format_value(value, vtype)
    assert etype is not None   # every array has an element type
    items = [_format_value(v, etype, 30) for v in value[:5]]
    more = ", ..." if len(value) > 5 else ""
    return f"[{etype.name}]", len(value), f"[{', '.join(items)}{more}]"


def dump(reader: GGUFReader, out=None) -> None:
    """Print metadata (arrays abbreviated) and the tensor table, like gguf-dump."""
    out = sys.stdout if out is None else out
    print(f"* File: {reader.path}", file=out)
    print(f"* GGUF v{reader.version}, alignment {reader.alignment}, data at offset "
          f"{reader.data_offset}, {len(reader.shards)} file(s)", file=out)
    print(f"* Metadata: {len(reader.kv)} key/value pairs", file=out)
    for i, (key, value) in enumerate(reader.kv.items(), 1):
        tname, n, text = _format_kv(value, reader.kv_types[key], reader.kv_array_types.get(key))
        print(f"{i:6}: {tname:10} | {n:8} | {key} = {text}", file=out)
    print(f"* Tensors: {len(reader.tensors)}", file=out)
    print(f"{'':6}  {'name':40} {'type':8} {'shape (ne)':24} {'offset':>12} {'bytes':>12}"
          + ("  file" if len(reader.shards) > 1 else ""), file=out)
    for i, t in enumerate(reader.tensors.values(), 1):
        shape = " x ".join(str(d) for d in t.ne)
        shard = f"  {t.shard + 1}" if len(reader.shards) > 1 else ""
        print(f"{i:6}: {t.name:40} {t.type.name:8} {shape:24} {t.offset:12} {t.nbytes:12}{shard}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ggmlx.gguf",
                                     description="Print the metadata and tensor table of a GGUF file.")
    parser.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    try:
        with GGUFReader(args.file) as reader:
            dump(reader)
    except (GGUFError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
