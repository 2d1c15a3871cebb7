"""GGUF reader/writer: validation of malformed files, round trips, gguf-py parity, splits, CLI."""
from __future__ import annotations

import os
import struct
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from ggmlx import gguf
from ggmlx.gguf import GGUFError, GGUFReader, GGUFWriter
from ggmlx.gguf import GGUFValueType as VT
from ggmlx.types import GGMLType

# ---------------------------------------------------------------------------------------------
# Raw byte builders (no validation), for files the writer refuses to produce.


def _str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _kv(key: bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _kv_u32(key: bytes, value: int) -> bytes:
    return _kv(key, VT.UINT32, struct.pack("<I", value))


def _info(name: bytes, ne, ttype: int, offset: int) -> bytes:
    return (_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}q", *ne)
            + struct.pack("<IQ", ttype, offset))


def _file(kvs=(), infos=(), data=b"", version=3, n_kv=None, n_tensors=None, magic=b"GGUF",
          alignment=32) -> bytes:
    head = (magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                len(kvs) if n_kv is None else n_kv)
            + b"".join(kvs) + b"".join(infos))
    return head + bytes(-len(head) % alignment) + data


def _write(tmp_path, data: bytes, name="m.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _error(path, *fragments, bad_file=None) -> GGUFError:
    """Open a bad file; the GGUFError must name the faulty file (default: `path`), each
    fragment, and a byte offset."""
    with pytest.raises(GGUFError) as info:
        GGUFReader(path)
    msg = str(info.value)
    assert str(bad_file or path) in msg and "byte offset" in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return info.value


_HDR = 24   # magic + version + n_tensors + n_kv

# ---------------------------------------------------------------------------------------------
# Header


def test_error_is_value_error():
    assert issubclass(GGUFError, ValueError)


def test_bad_magic(tmp_path):
    e = _error(_write(tmp_path, _file(magic=b"GGML")), "bad magic", "b'GGML'")
    assert e.offset == 0


@pytest.mark.parametrize("version", [0, 1, 4, 0x03000000])
def test_bad_version(tmp_path, version):
    e = _error(_write(tmp_path, _file(version=version)), f"version {version}")
    assert e.offset == 4


def test_big_endian_version_hint(tmp_path):
    _error(_write(tmp_path, _file(version=0x03000000)), "big-endian")


@pytest.mark.parametrize("size", [0, 3, 10, 23])
def test_truncated_header(tmp_path, size):
    _error(_write(tmp_path, _file()[:size]), "truncated")


@pytest.mark.parametrize("field", ["n_kv", "n_tensors"])
def test_impossible_counts_fail_fast_without_allocating(tmp_path, field):
    data = _file(**{field: 2 ** 60})
    data += bytes(100 - len(data))
    path = _write(tmp_path, data)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        _error(path, "cannot fit", f"{2 ** 60}")
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5 and peak < 1 << 20


def test_counts_just_too_large_for_the_file(tmp_path):
    # One real kv; the header claims two: there is no room for a second one.
    _error(_write(tmp_path, _file(kvs=[_kv_u32(b"a", 1)], n_kv=2, alignment=1)), "cannot fit")


# ---------------------------------------------------------------------------------------------
# Key/value pairs


@pytest.mark.parametrize("what,kvs,fragments", [
    ("key length", [struct.pack("<Q", 2 ** 62) + b"k" * 20], ["key length", "larger than"]),
    ("string value", [_kv(b"k", VT.STRING, struct.pack("<Q", 2 ** 61) + b"x" * 20)],
     ["key 'k'", "string value length", "larger than"]),
    ("numeric array", [_kv(b"k", VT.ARRAY, struct.pack("<IQ", VT.UINT8, 2 ** 40) + b"x" * 20)],
     ["key 'k'", f"array of {2 ** 40} UINT8"]),
    ("string array count", [_kv(b"k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2 ** 59) + b"x" * 40)],
     ["key 'k'", "strings needs at least"]),
    ("string in array",
     [_kv(b"k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 1) + struct.pack("<Q", 2 ** 50) + b"x" * 40)],
     ["key 'k'", "string 0 of 1", "larger than"]),
])
def test_lengths_larger_than_the_file_fail_without_allocating(tmp_path, what, kvs, fragments):
    path = _write(tmp_path, _file(kvs=kvs))
    tracemalloc.start()
    try:
        _error(path, *fragments)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, what


def test_empty_key(tmp_path):
    e = _error(_write(tmp_path, _file(kvs=[_kv_u32(b"", 1)])), "empty key")
    assert e.offset == _HDR


def test_duplicate_key(tmp_path):
    first = _kv_u32(b"a.b", 1)
    e = _error(_write(tmp_path, _file(kvs=[first, _kv_u32(b"a.b", 2)])), "key 'a.b'", "duplicate key")
    assert e.offset == _HDR + len(first)


def test_key_not_utf8(tmp_path):
    _error(_write(tmp_path, _file(kvs=[_kv_u32(b"\xff\xfe", 1)])), "not valid UTF-8")


@pytest.mark.parametrize("payload,fragment", [
    (struct.pack("<I", 13) + b"\0" * 8, "unknown value type 13"),
    (struct.pack("<II", VT.ARRAY, 77) + b"\0" * 16, "unknown array element type 77"),
    (struct.pack("<II", VT.ARRAY, VT.ARRAY) + b"\0" * 16, "array of arrays"),
])
def test_bad_value_types(tmp_path, payload, fragment):
    data = _file(kvs=[_str(b"my.key") + payload])
    e = _error(_write(tmp_path, data), "key 'my.key'", fragment)
    assert e.offset > _HDR


@pytest.mark.parametrize("kv,fragment", [
    (_kv(b"general.alignment", VT.UINT64, struct.pack("<Q", 32)), "must be UINT32, not UINT64"),
    (_kv(b"general.alignment", VT.INT32, struct.pack("<i", 32)), "must be UINT32, not INT32"),
    (_kv_u32(b"general.alignment", 0), "alignment 0 is not a power of two"),
    (_kv_u32(b"general.alignment", 48), "alignment 48 is not a power of two"),
    (_kv_u32(b"general.alignment", 1 << 21), "larger than the supported"),
])
def test_bad_alignment(tmp_path, kv, fragment):
    e = _error(_write(tmp_path, _file(kvs=[_kv_u32(b"x", 1), kv])), "key 'general.alignment'", fragment)
    assert e.offset == _HDR + len(_kv_u32(b"x", 1))


# ---------------------------------------------------------------------------------------------
# Tensor infos


def _f32_file(infos, data_bytes: int, **kw) -> bytes:
    return _file(infos=infos, data=bytes(data_bytes), **kw)


def test_tensor_name_length_limit(tmp_path):
    ok = _write(tmp_path, _f32_file([_info(b"n" * 63, [4], GGMLType.F32, 0)], 32), "ok.gguf")
    assert list(GGUFReader(ok).tensors) == ["n" * 63]
    bad = _write(tmp_path, _f32_file([_info(b"n" * 64, [4], GGMLType.F32, 0)], 32))
    e = _error(bad, "tensor 0 of 1", "64 bytes")
    assert e.offset == _HDR


def test_tensor_name_length_larger_than_file(tmp_path):
    info = struct.pack("<Q", 2 ** 60) + b"\0" * 30
    _error(_write(tmp_path, _file(infos=[info])), "tensor 0 of 1", "must be under 64")


def test_duplicate_tensor_names(tmp_path):
    first = _info(b"w", [8], GGMLType.F32, 0)
    infos = [first, _info(b"w", [8], GGMLType.F32, 32)]
    e = _error(_write(tmp_path, _f32_file(infos, 64)), "tensor 'w'", "duplicate tensor name")
    assert e.offset == _HDR + len(first)


def test_too_many_dims(tmp_path):
    _error(_write(tmp_path, _f32_file([_info(b"w", [1, 1, 1, 1, 1], GGMLType.F32, 0)], 32)),
           "tensor 'w'", "5 dimensions")


def test_negative_dim(tmp_path):
    _error(_write(tmp_path, _f32_file([_info(b"w", [4, -2], GGMLType.F32, 0)], 32)),
           "tensor 'w'", "dimension 1 is negative")


def test_element_count_overflow(tmp_path):
    _error(_write(tmp_path, _f32_file([_info(b"w", [2 ** 32, 2 ** 31], GGMLType.F32, 0)], 32)),
           "tensor 'w'", "overflows int64")


def test_byte_size_overflow(tmp_path):
    _error(_write(tmp_path, _f32_file([_info(b"w", [2 ** 62], GGMLType.F32, 0)], 32)),
           "tensor 'w'", "overflows")


@pytest.mark.parametrize("type_id", [4, 31, 1000])
def test_unknown_tensor_type(tmp_path, type_id):
    _error(_write(tmp_path, _f32_file([_info(b"w", [32], type_id, 0)], 32)),
           "tensor 'w'", f"unknown ggml type {type_id}")


def test_row_not_multiple_of_block_size(tmp_path):
    _error(_write(tmp_path, _f32_file([_info(b"w", [33, 2], GGMLType.Q4_0, 0)], 64)),
           "tensor 'w'", "Q4_0", "not a multiple")


def test_zero_dims_quantized_is_not_a_whole_block(tmp_path):
    # ggml pads the shape with ones: a 0-dim Q4_0 tensor has a row of 1, not a multiple of 32.
    _error(_write(tmp_path, _f32_file([_info(b"w", [], GGMLType.Q4_0, 0)], 32)), "tensor 'w'")


@pytest.mark.parametrize("offsets,bad", [([8, 32], "'a'"), ([0, 16], "'b'"), ([0, 64], "'b'")])
def test_offsets_must_match_running_padded_total(tmp_path, offsets, bad):
    infos = [_info(b"a", [4], GGMLType.F32, offsets[0]), _info(b"b", [4], GGMLType.F32, offsets[1])]
    _error(_write(tmp_path, _f32_file(infos, 96)), f"tensor {bad}", "does not match the expected")


def test_tensor_data_outside_file(tmp_path):
    infos = [_info(b"a", [4], GGMLType.F32, 0), _info(b"b", [16], GGMLType.F32, 32)]
    _error(_write(tmp_path, _f32_file(infos, 32 + 63)), "tensor 'b'", "outside the file")


def test_zero_element_tensor_is_valid(tmp_path):
    infos = [_info(b"empty", [0, 4], GGMLType.Q4_K, 0), _info(b"b", [4], GGMLType.F32, 0)]
    f = GGUFReader(_write(tmp_path, _f32_file(infos, 16)))
    assert f.tensors["empty"].nbytes == 0 and f.tensors["empty"].n_elements == 0
    assert f.tensors["empty"].data.size == 0
    assert f.tensors["b"].offset == f.data_offset


# ---------------------------------------------------------------------------------------------
# Robustness: every truncation and every single-byte corruption gives GGUFError or a valid file.


def _small_model(path, version=3, alignment=None):
    w = GGUFWriter(version=version)
    if alignment is not None:
        w.add_kv("general.alignment", alignment, vtype=VT.UINT32)
    w.add_kv("general.architecture", "llama")
    w.add_kv("llama.block_count", 2)
    w.add_kv("llama.rope.freq_base", 10000.0)
    w.add_kv("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "b"])
    w.add_kv("tokenizer.ggml.scores", np.arange(4, dtype=np.float32))
    w.add_kv("tokenizer.ggml.add_bos_token", True)
    w.add_tensor("token_embd.weight", np.arange(16, dtype=np.float32).reshape(4, 4))
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float16))
    w.add_tensor("blk.0.attn_q.weight", np.arange(2 * 18, dtype=np.uint8), type=GGMLType.Q4_0, ne=(32, 2))
    w.write(path)
    return path


def test_every_truncation_is_a_gguf_error(tmp_path):
    data = _small_model(tmp_path / "full.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    for cut in range(len(data) - 1):
        if cut and data[cut:].strip(b"\0") == b"":
            continue   # only trailing padding removed: the file is still whole
        path.write_bytes(data[:cut])
        with pytest.raises(GGUFError):
            GGUFReader(path).close()


def test_single_byte_corruption_never_crashes(tmp_path):
    src = _small_model(tmp_path / "full.gguf")
    data = bytearray(src.read_bytes())
    head = GGUFReader(src).data_offset
    path = tmp_path / "bad.gguf"
    for pos in range(head):
        for value in (0x00, 0xFF, data[pos] ^ 0x01):
            bad = bytearray(data)
            bad[pos] = value
            path.write_bytes(bytes(bad))
            try:
                GGUFReader(path).close()
            except GGUFError:
                pass


# ---------------------------------------------------------------------------------------------
# Writer -> reader round trip

_SCALARS = [
    (VT.UINT8, 255), (VT.INT8, -128), (VT.UINT16, 65535), (VT.INT16, -32768),
    (VT.UINT32, 2 ** 32 - 1), (VT.INT32, -2 ** 31), (VT.FLOAT32, 1.5), (VT.BOOL, True),
    (VT.BOOL, False), (VT.STRING, "héllo ☃"), (VT.UINT64, 2 ** 64 - 1), (VT.INT64, -2 ** 63),
    (VT.FLOAT64, 0.1),
]
_ARRAYS = [
    (VT.UINT8, [0, 1, 255]), (VT.INT8, [-128, 0, 127]), (VT.UINT16, [0, 65535]),
    (VT.INT16, [-32768, 32767]), (VT.UINT32, [0, 2 ** 32 - 1]), (VT.INT32, [-2 ** 31, 2 ** 31 - 1]),
    (VT.FLOAT32, [0.5, -2.25, 1e30]), (VT.BOOL, [True, False, True]),
    (VT.STRING, ["a", "", "ü€𝄞", "x" * 300]), (VT.UINT64, [0, 2 ** 64 - 1]),
    (VT.INT64, [-2 ** 63, 2 ** 63 - 1]), (VT.FLOAT64, [0.1, -1e300]),
    (VT.UINT8, []), (VT.STRING, []),
]


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("alignment", [None, 32, 64])
def test_round_trip(tmp_path, version, alignment):
    w = GGUFWriter(version=version)
    if alignment is not None:
        w.add_kv("general.alignment", alignment, vtype=VT.UINT32)
    for i, (vt, v) in enumerate(_SCALARS):
        w.add_kv(f"s.{i}", v, vtype=vt)
    for i, (vt, v) in enumerate(_ARRAYS):
        w.add_kv(f"a.{i}", v, array_type=vt)
    rng = np.random.default_rng(0)
    tensors = {
        "f32": (GGMLType.F32, (5, 3), rng.standard_normal((3, 5)).astype(np.float32)),
        "f16": (GGMLType.F16, (7,), rng.standard_normal(7).astype(np.float16)),
        "bf16": (GGMLType.BF16, (4, 2), rng.standard_normal((2, 4)).astype(ml_dtypes.bfloat16)),
        "i32": (GGMLType.I32, (3,), np.array([1, -2, 3], dtype=np.int32)),
        "q4_0": (GGMLType.Q4_0, (64, 3), rng.integers(0, 256, 2 * 3 * 18, dtype=np.uint8)),
        "q4_k": (GGMLType.Q4_K, (256, 2, 1, 2), rng.integers(0, 256, 4 * 144, dtype=np.uint8)),
        "empty": (GGMLType.F32, (0, 3), np.zeros(0, dtype=np.float32)),
        "last": (GGMLType.Q8_0, (32,), rng.integers(0, 256, 34, dtype=np.uint8)),
    }
    for name, (t, ne, data) in tensors.items():
        w.add_tensor(name, data, type=t, ne=ne)
    path = tmp_path / "rt.gguf"
    w.write(path)

    with GGUFReader(path) as f:
        a = alignment or 32
        assert f.version == version and f.alignment == a and f.data_offset % a == 0
        for i, (vt, v) in enumerate(_SCALARS):
            got = f.kv[f"s.{i}"]
            assert f.kv_types[f"s.{i}"] == vt and f"s.{i}" not in f.kv_array_types
            assert type(got) is type(v) and got == (float(np.float32(v)) if vt == VT.FLOAT32 else v)
        for i, (vt, v) in enumerate(_ARRAYS):
            got = f.kv[f"a.{i}"]
            assert f.kv_types[f"a.{i}"] == VT.ARRAY and f.kv_array_types[f"a.{i}"] == vt
            if vt == VT.STRING:
                assert got == v
            else:
                assert isinstance(got, np.ndarray) and got.dtype.itemsize == gguf._ARRAY_DTYPE[vt].itemsize
                assert got.tolist() == (np.array(v, dtype=np.float32).tolist() if vt == VT.FLOAT32 else v)
        assert list(f.tensors) == list(tensors)
        for name, (t, ne, data) in tensors.items():
            ti = f.tensors[name]
            assert ti.name == name and ti.type == t and ti.ne == ne and ti.path == str(path)
            assert ti.offset % a == 0 and ti.nbytes == data.nbytes
            assert ti.data.dtype == np.uint8 and not ti.data.flags.writeable
            assert ti.data.tobytes() == data.tobytes()


def test_non_utf8_string_value_survives_a_round_trip(tmp_path):
    raw = b"\xff\xfeok\x80"
    w = GGUFWriter()
    w.add_kv("bytes.scalar", raw)
    w.add_kv("bytes.array", [raw, b"plain"])
    w.write(tmp_path / "b.gguf")
    f = GGUFReader(tmp_path / "b.gguf")
    assert f.kv["bytes.scalar"].encode("utf-8", "surrogateescape") == raw
    assert [s.encode("utf-8", "surrogateescape") for s in f.kv["bytes.array"]] == [raw, b"plain"]
    w2 = GGUFWriter()
    for k, v in f.kv.items():
        w2.add_kv(k, v, vtype=f.kv_types[k], array_type=f.kv_array_types.get(k))
    w2.write(tmp_path / "b2.gguf")
    assert (tmp_path / "b2.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_lazy_string_arrays(tmp_path):
    """lazy_strings keeps a large string array as a StringArray that decodes to the eager list
    (non-UTF-8 bytes included); small arrays stay lists; a truncated large array fails at open
    with the same error either way; ModelLoader's get_arr reads it as a list."""
    from llm.arch import LLMKV
    from llm.loader import GGUFMeta
    words = [f"tok{i}\u0120" for i in range(3000)] + ["\xff".encode("latin-1").decode("utf-8", "surrogateescape")]
    w = GGUFWriter()
    w.add_kv(LLMKV.TOKENIZER_LIST.value, words)
    w.add_kv("small", ["a", "b"])
    w.write(tmp_path / "s.gguf")
    eager, lazy = GGUFReader(tmp_path / "s.gguf"), GGUFReader(tmp_path / "s.gguf", lazy_strings=True)
    big = LLMKV.TOKENIZER_LIST.value
    # its length (hparams' n_vocab without a vocab_size key) leaves it undecoded
    assert GGUFMeta(lazy.kv).get_arr_len(LLMKV.TOKENIZER_LIST, str) == len(words)
    assert lazy.kv[big]._strings is None
    assert GGUFMeta(eager.kv).get_arr_len(LLMKV.TOKENIZER_LIST, str) == len(words)
    assert isinstance(lazy.kv[big], gguf.StringArray) and isinstance(lazy.kv["small"], list)
    assert len(lazy.kv[big]) == len(words) and lazy.kv[big][5] == words[5]
    assert lazy.kv[big] == eager.kv[big] == words and lazy.kv[big].tolist() == list(lazy.kv[big])
    assert GGUFMeta(lazy.kv).get_arr(LLMKV.TOKENIZER_LIST, str) == words
    lazy.close()
    eager.close()
    data = (tmp_path / "s.gguf").read_bytes()
    cut = data.index(b"tok2999") + 2
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    messages = []
    for lazy_strings in (False, True):
        with pytest.raises(GGUFError) as info:
            GGUFReader(tmp_path / "cut.gguf", lazy_strings=lazy_strings)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "string 2999 of 3001" in messages[0]


@pytest.mark.parametrize("value,vtype,etype", [
    (True, VT.BOOL, None), (7, VT.UINT32, None), (-7, VT.INT32, None), (2 ** 40, VT.INT64, None),
    (-2 ** 40, VT.INT64, None), (2 ** 63, VT.UINT64, None), (0.25, VT.FLOAT32, None),
    ("s", VT.STRING, None), (np.float64(2.5), VT.FLOAT64, None), (np.uint16(3), VT.UINT16, None),
    ([1, 2], VT.ARRAY, VT.UINT32), ([-1, 2], VT.ARRAY, VT.INT32), ([1, 2 ** 40], VT.ARRAY, VT.INT64),
    ([1.0, 2], VT.ARRAY, VT.FLOAT32), (["a"], VT.ARRAY, VT.STRING), ([True], VT.ARRAY, VT.BOOL),
    (np.array([1, 2], dtype=np.int16), VT.ARRAY, VT.INT16),
])
def test_inferred_value_types(tmp_path, value, vtype, etype):
    w = GGUFWriter()
    w.add_kv("k", value)
    w.write(tmp_path / "i.gguf")
    f = GGUFReader(tmp_path / "i.gguf")
    assert f.kv_types["k"] == vtype and f.kv_array_types.get("k") == etype


@pytest.mark.parametrize("call,fragment", [
    (lambda w: w.add_kv("", 1), "non-empty"),
    (lambda w: (w.add_kv("k", 1), w.add_kv("k", 2)), "duplicate GGUF key 'k'"),
    (lambda w: w.add_kv("k", 256, vtype=VT.UINT8), "out of range for UINT8"),
    (lambda w: w.add_kv("k", [1, 300], array_type=VT.UINT8), "out of range for UINT8"),
    (lambda w: w.add_kv("k", "x", vtype=VT.INT32), "must be an int"),
    (lambda w: w.add_kv("k", []), "empty array"),
    (lambda w: w.add_kv("k", [[1]], array_type=VT.ARRAY), "arrays of arrays"),
    (lambda w: w.add_kv("k", {"a": 1}), "no GGUF value type"),
    (lambda w: w.add_tensor("n" * 64, np.zeros(4, np.float32)), "must be under 64"),
    (lambda w: w.add_tensor("t", np.zeros(10, np.uint8), type=GGMLType.Q4_0, ne=(32,)), "needs 18"),
    (lambda w: w.add_tensor("t", np.zeros(2, np.uint8), type=GGMLType.Q4_0, ne=(33,)), "not a multiple"),
    (lambda w: w.add_tensor("t", np.zeros(4, np.uint8)), "pass type"),
    (lambda w: w.add_tensor("t", np.zeros((1,) * 5, np.float32)), "5 dimensions"),
])
def test_writer_rejects_bad_input(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call(GGUFWriter())


def test_writer_rejects_bad_alignment(tmp_path):
    w = GGUFWriter()
    w.add_kv("general.alignment", 24)
    with pytest.raises(ValueError, match="power of two"):
        w.write(tmp_path / "x.gguf")


def test_close_and_context_manager(tmp_path):
    path = _small_model(tmp_path / "m.gguf")
    with GGUFReader(path) as f:
        kept = f.tensors["token_embd.weight"].data
    assert f.tensors == {}
    # A view held past close keeps its mapping alive and readable.
    assert kept.view(np.float32).tolist() == list(range(16))


# ---------------------------------------------------------------------------------------------
# Split models


def _write_split(tmp_path, n_split=3, per_shard=2, prefix="model", skip_no=None, tensors_count=None):
    names = []
    for i in range(n_split):
        w = GGUFWriter()
        if i == 0:
            w.add_kv("general.architecture", "llama")
        w.add_kv("split.no", i if skip_no is None or i != skip_no[0] else skip_no[1], vtype=VT.UINT16)
        w.add_kv("split.count", n_split, vtype=VT.UINT16)
        w.add_kv("split.tensors.count", tensors_count or n_split * per_shard, vtype=VT.INT32)
        for j in range(per_shard):
            name = f"t.{i}.{j}"
            names.append(name)
            w.add_tensor(name, np.full((2, 3), i * 10 + j, dtype=np.float32))
        w.write(gguf.split_path(tmp_path / prefix, i, n_split))
    return tmp_path / f"{prefix}-00001-of-{n_split:05d}.gguf", names


def test_split_model_opens_all_shards(tmp_path):
    first, names = _write_split(tmp_path)
    with GGUFReader(first) as f:
        assert len(f.shards) == 3 and list(f.tensors) == names
        assert f.kv["general.architecture"] == "llama"
        for name, ti in f.tensors.items():
            i, j = (int(x) for x in name.split(".")[1:])
            assert ti.shard == i and ti.path == gguf.split_path(tmp_path / "model", i, 3)
            assert ti.data.view(np.float32).tolist() == [i * 10 + j] * 6


def test_split_missing_shard(tmp_path):
    first, _ = _write_split(tmp_path)
    (tmp_path / "model-00002-of-00003.gguf").unlink()
    _error(first, "missing shard 2 of 3", bad_file=tmp_path / "model-00002-of-00003.gguf")


def test_split_wrong_split_no(tmp_path):
    first, _ = _write_split(tmp_path, skip_no=(2, 1))
    _error(first, "key 'split.no'", "is 1, expected 2", bad_file=tmp_path / "model-00003-of-00003.gguf")


def test_split_must_open_first_shard(tmp_path):
    _write_split(tmp_path)
    _error(tmp_path / "model-00002-of-00003.gguf", "open the first shard")


def test_split_tensor_count_mismatch(tmp_path):
    first, _ = _write_split(tmp_path, tensors_count=7)
    _error(first, "key 'split.tensors.count'", "says 7 tensors")


def test_split_duplicate_tensor_across_shards(tmp_path):
    first, _ = _write_split(tmp_path, n_split=2)
    w = GGUFWriter()
    w.add_kv("split.no", 1, vtype=VT.UINT16)
    w.add_kv("split.count", 2, vtype=VT.UINT16)
    w.add_tensor("t.0.1", np.zeros(4, dtype=np.float32))
    w.write(tmp_path / "model-00002-of-00002.gguf")
    _error(first, "tensor 't.0.1'", "duplicated in another shard",
           bad_file=tmp_path / "model-00002-of-00002.gguf")


def test_split_keys_must_have_llama_cpp_types(tmp_path):
    w = GGUFWriter()
    w.add_kv("split.no", 0, vtype=VT.UINT16)
    w.add_kv("split.count", 2, vtype=VT.UINT32)
    path = tmp_path / "model-00001-of-00002.gguf"
    w.write(path)
    _error(path, "key 'split.count'", "must be UINT16, not UINT32")


def test_split_shard_without_split_no(tmp_path):
    first, _ = _write_split(tmp_path, n_split=2)
    w = GGUFWriter()
    w.add_kv("split.count", 2, vtype=VT.UINT16)
    w.write(tmp_path / "model-00002-of-00002.gguf")
    _error(first, "key 'split.no'", "missing", bad_file=tmp_path / "model-00002-of-00002.gguf")


def test_split_bad_file_name(tmp_path):
    first, _ = _write_split(tmp_path)
    renamed = tmp_path / "renamed.gguf"
    first.rename(renamed)
    _error(renamed, "file name does not end in -00001-of-00003.gguf")


# ---------------------------------------------------------------------------------------------
# Parity with gguf-py on the real models, and a reader -> writer -> reader round trip


def _assert_same_as_gguf_py(path):
    import gguf as gguf_py
    theirs = gguf_py.GGUFReader(path)
    with GGUFReader(path) as ours:
        fields = {k: v for k, v in theirs.fields.items() if not k.startswith("GGUF.")}
        assert list(fields) == list(ours.kv)
        for key, field in fields.items():
            assert int(field.types[0]) == ours.kv_types[key], key
            value = ours.kv[key]
            if ours.kv_types[key] == VT.ARRAY:
                assert int(field.types[1]) == ours.kv_array_types[key], key
                if ours.kv_array_types[key] == VT.STRING:
                    assert value == [bytes(field.parts[i]).decode("utf-8", "surrogateescape")
                                     for i in field.data], key
                else:
                    expected = np.concatenate([field.parts[i] for i in field.data])
                    assert np.array_equal(value, expected.astype(value.dtype)), key
            else:
                assert value == field.contents(), key
        assert [t.name for t in theirs.tensors] == list(ours.tensors)
        for t in theirs.tensors:
            o = ours.tensors[t.name]
            assert int(t.tensor_type) == o.type, t.name
            assert tuple(int(d) for d in t.shape) == o.ne, t.name
            assert int(t.data_offset) == o.offset and int(t.n_bytes) == o.nbytes, t.name
            assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), o.data), t.name


def test_same_as_gguf_py_smollm2(smollm2_path):
    _assert_same_as_gguf_py(smollm2_path)


def test_same_as_gguf_py_gemma3(gemma3_path):
    _assert_same_as_gguf_py(gemma3_path)


def test_real_model_metadata_round_trip(smollm2_path, tmp_path):
    with GGUFReader(smollm2_path) as f:
        w = GGUFWriter(version=f.version)
        for k, v in f.kv.items():
            w.add_kv(k, v, vtype=f.kv_types[k], array_type=f.kv_array_types.get(k))
        some = list(f.tensors.values())[:4]
        for t in some:
            w.add_tensor(t.name, t.data, type=t.type, ne=t.ne)
        w.write(tmp_path / "copy.gguf")
        with GGUFReader(tmp_path / "copy.gguf") as g:
            assert g.kv_types == f.kv_types and g.kv_array_types == f.kv_array_types
            for k, v in f.kv.items():
                assert (np.array_equal(g.kv[k], v) if isinstance(v, np.ndarray) else g.kv[k] == v), k
            for t in some:
                u = g.tensors[t.name]
                assert (u.type, u.ne) == (t.type, t.ne) and np.array_equal(u.data, t.data)


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_prints_metadata_and_tensors(tmp_path, capsys):
    path = _small_model(tmp_path / "m.gguf")
    assert gguf.main([str(path)]) == 0
    out = capsys.readouterr().out
    for text in ["general.architecture = 'llama'", "[STRING]", "tokenizer.ggml.tokens",
                 "token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "Q4_0", "32 x 2"]:
        assert text in out, text


def test_cli_reports_bad_file(tmp_path, capsys):
    path = _write(tmp_path, _file(magic=b"XXXX"))
    assert gguf.main([str(path)]) == 1
    assert "bad magic" in capsys.readouterr().err


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_release_drops_a_tensors_pages_and_keeps_its_bytes(tmp_path):
    """release() takes the tensor's read pages out of the process's RSS (madvise DONTNEED);
    its bytes read the same afterwards (the pages come back from the file), the other
    tensor's too."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1024, 1024)).astype(np.float32)       # 4 MiB
    b = rng.standard_normal((3, 5)).astype(np.float32)
    w = GGUFWriter()
    w.add_tensor("a", a)
    w.add_tensor("b", b)
    w.write(tmp_path / "m.gguf")
    f = GGUFReader(tmp_path / "m.gguf")
    ta, tb = f.tensors["a"], f.tensors["b"]
    assert float(np.asarray(ta.data).view(np.float32).sum()) == pytest.approx(float(a.sum()), rel=1e-4)
    before = _rss_file_kb()
    f.release(ta)
    assert before - _rss_file_kb() >= 3 * 1024
    assert np.array_equal(np.asarray(ta.data).view(np.float32).reshape(a.shape), a)
    assert np.array_equal(np.asarray(tb.data).view(np.float32).reshape(b.shape), b)
    # a range of the bytes (a loader packing a tensor slice by slice): at least its pages (the
    # kernel may drop a whole large folio around them; they read back the same)
    before = _rss_file_kb()
    f.release(ta, 1 << 20, 3 << 20)
    assert before - _rss_file_kb() >= 1536
    f.release(ta, 3 << 20, 1 << 30)     # (stop past the end: to the tensor's end)
    f.release(ta, 5, 5)                 # (an empty range: nothing)
    assert np.array_equal(np.asarray(ta.data).view(np.float32).reshape(a.shape), a)
