"""Weight formats: the exact int8 and int4 conversions of every supported block type, and
mul_mat / get_rows giving the same results whichever format a weight is held in."""
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from tiny_model import TinySpec, prompt_tokens, write_model

import llm
from ggmlx import gguf, native, quants, types, weights
from ggmlx.quants import int4, int8
from ggmlx.types import GGMLType

INT8_TYPES = list(int8.INT8_CONVERTERS)
INT4_TYPES = list(int4.INT4_CONVERTERS)
FORMATS = ("native", "int8", "int4", "f32")


def _random_blocks(t: GGMLType, n_rows: int, ne0: int, seed: int) -> np.ndarray:
    """Random packed bytes. Every f16 field sits at an even offset; clearing bit 6 of each odd
    byte caps its exponent, so every scale is finite (and so is every value)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n_rows * ne0 // types.block_size(t), types.type_size(t)), dtype=np.uint8)
    data[:, 1::2] &= 0xBF
    return data.reshape(-1)


def _nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum((a.astype(np.float64) - b) ** 2) / np.sum(b.astype(np.float64) ** 2))


@pytest.mark.parametrize("t", INT8_TYPES, ids=lambda t: t.name)
def test_int8_conversion_exact_on_random_blocks(t):
    ne = (512, 6)
    data = _random_blocks(t, ne[1], ne[0], seed=int(t))
    ref = quants.dequantize(data, t, ne)
    q, scale, offset = int8.to_int8(data.reshape(ne[1], -1), t, ne[1])
    sub = int8.INT8_CONVERTERS[t][0]
    y = q.astype(np.float32).reshape(ne[1], -1, sub) * scale[..., None]
    if offset is not None:
        y = y + offset[..., None]
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(y.reshape(ref.shape), ref)
    w = weights.to_device(data, t, ne, weight_format="int8")
    assert w.spec.format == weights.FORMAT_INT8 and w.spec.sub_block == sub
    np.testing.assert_array_equal(np.asarray(jax.jit(weights.materialize)(w)).reshape(ref.shape), ref)


@pytest.mark.parametrize("t", INT4_TYPES, ids=lambda t: t.name)
def test_int4_conversion_exact_on_random_blocks(t):
    """scale * nibble + offset is ggml's value bit for bit: ggmlx's dequantize and gguf-py's."""
    ne = (512, 6)
    data = _random_blocks(t, ne[1], ne[0], seed=int(t))
    ref = quants.dequantize(data, t, ne)
    q, scale, offset = int4.to_int4(data.reshape(ne[1], -1), t, ne[1])
    assert q.dtype == np.uint8 and q.shape == (ne[1], ne[0] // 2) and scale.shape == offset.shape == (ne[1], 16)
    u = q.reshape(ne[1], -1, 1, 16)
    u = np.concatenate([u & 15, u >> 4], axis=2).reshape(ne[1], -1, 32)
    y = (u.astype(np.float32) * scale[..., None] + offset[..., None]).reshape(ref.shape)
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(y, ref)
    gguf_py = pytest.importorskip("gguf.quants")
    np.testing.assert_array_equal(y, gguf_py.dequantize(data.reshape(ne[1], -1), int(t)).reshape(ref.shape))
    w = weights.to_device(data, t, ne, weight_format="int4")
    # nibbles, and a scale and offset per 32: f16 where they are the block's f16 fields (Q4_1)
    esz = 2 if t in weights.F16_SCALES_INT4 else 4
    assert w.scale.dtype == w.offset.dtype == (np.float16 if esz == 2 else np.float32)
    assert w.spec.format == weights.FORMAT_INT4 and w.spec.sub_block == 32
    assert w.nbytes == ne[0] * ne[1] // 2 + 2 * esz * ne[0] * ne[1] // 32
    np.testing.assert_array_equal(np.asarray(jax.jit(weights.materialize)(w)).reshape(ref.shape), ref)
    idx = np.array([5, 0, 2, 5], np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(weights.get_rows)(w, idx)), ref[idx])


def test_int4_concat_rows():
    """Fused QKV / gate+up of int4 weights: one weight with the rows of each, same values."""
    t = GGMLType.Q4_K
    parts = [(_random_blocks(t, m, 256, seed=m), (256, m)) for m in (8, 3, 5)]
    ws = [weights.to_device(d, t, ne, weight_format="int4") for d, ne in parts]
    cat = weights.concat_rows(ws)
    assert cat is not None and cat.spec.format == weights.FORMAT_INT4 and cat.spec.ne == (256, 16, 1, 1)
    ref = np.concatenate([quants.dequantize(d, t, ne) for d, ne in parts])
    np.testing.assert_array_equal(np.asarray(jax.jit(weights.materialize)(cat)).reshape(ref.shape), ref)
    assert weights.concat_rows([ws[0], weights.to_device(parts[1][0], t, parts[1][1], weight_format="int8")]) is None


@pytest.mark.parametrize("hp", ["1", "0"])
def test_large_weights_held_in_huge_pages(monkeypatch, hp):
    """A CPU weight of a 2 MiB page or more (placed, or joined by concat_rows) is held in place in
    a mapping that starts on a 2 MiB boundary, its bytes unchanged; a smaller one, and every one
    under GGMLX_HUGE_PAGES=0, is left to jax.device_put."""
    monkeypatch.setenv("GGMLX_HUGE_PAGES", hp)
    t = GGMLType.Q8_0
    row = types.row_size(t, 1024)
    rows = weights.HUGE_PAGE // row + 3                                  # just over one page
    data = _random_blocks(t, rows, 1024, seed=1)
    w = weights.to_device(data, t, (1024, rows), numerics="ggml")
    small = weights.to_device(data[:4 * row], t, (1024, 4), numerics="ggml")
    cat = weights.concat_rows([w, small])
    np.testing.assert_array_equal(np.asarray(w.array).reshape(-1), data)
    np.testing.assert_array_equal(np.asarray(cat.array).reshape(-1), np.concatenate([data, data[:4 * row]]))
    if hp == "1":
        assert [a.unsafe_buffer_pointer() % weights.HUGE_PAGE for a in (w.array, cat.array)] == [0, 0]


needs_lanes = pytest.mark.skipif(not weights.lanes_ok(GGMLType.Q4_K, (256, 16, 1, 1)),
                                 reason="the lanes format needs the native kernels and AVX-512 VNNI")


@needs_lanes
@pytest.mark.parametrize("t", [t if t in (GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K) else
                               pytest.param(t, marks=pytest.mark.slow) for t in weights.LANE_FIELDS],
                         ids=lambda t: t.name)   # three layouts in the quick tier, every one in the slow
def test_lanes_format_reads_as_the_blocks(t):
    """A weight held in the lanes format (numerics "ggml", to_device(lanes=True)): the same
    values (materialize, get_rows by gathering its rows from the groups) and products as the
    GGUF blocks; pack_lanes is a permutation of each group's bytes, undone by unpack_lanes."""
    ne = (512, 48)
    values = np.random.default_rng(int(t)).standard_normal((ne[1], ne[0])).astype(np.float32)
    data = np.asarray(quants.quantize(values, t)).reshape(-1)
    blocks = weights.to_device(data, t, ne, numerics="ggml")
    lanes = weights.to_device(data, t, ne, numerics="ggml", lanes=True)
    assert (blocks.spec.format, lanes.spec.format) == (weights.FORMAT_BLOCKS, weights.FORMAT_LANES)
    packed = np.asarray(lanes.array).reshape(ne[1], -1)
    assert np.array_equal(np.asarray(weights.unpack_lanes(jax.numpy.asarray(packed), t)).reshape(-1), data)
    assert np.array_equal(np.sort(packed[:16], None), np.sort(data.reshape(ne[1], -1)[:16], None))
    np.testing.assert_array_equal(np.asarray(jax.jit(weights.materialize)(lanes)),
                                  np.asarray(jax.jit(weights.materialize)(blocks)))
    idx = jax.numpy.asarray([47, 0, 16, 5, 16], np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(weights.get_rows)(lanes, idx)),
                                  np.asarray(jax.jit(weights.get_rows)(blocks, idx)))
    x = np.random.default_rng(0).standard_normal((3, ne[0])).astype(np.float32)
    want = np.asarray(jax.jit(weights.mul_mat)(blocks, x))
    np.testing.assert_allclose(np.asarray(jax.jit(weights.mul_mat)(lanes, x)), want, rtol=0,
                               atol=2e-6 * np.abs(want).max())


@needs_lanes
def test_lanes_packing_in_slices_tells_each_range(monkeypatch):
    """With `release`, to_device packs a lanes weight a slice of whole 16-row groups at a time
    (PACK_SLICE_BYTES) and tells each packed range of the source once, in order (the loader drops
    its file pages); the packed bytes are those of one whole pack."""
    t, ne = GGMLType.Q8_0, (512, 80)
    values = np.random.default_rng(3).standard_normal((ne[1], ne[0])).astype(np.float32)
    data = np.asarray(quants.quantize(values, t)).reshape(-1)
    row = data.size // ne[1]
    monkeypatch.setattr(weights, "PACK_SLICE_BYTES", 32 * row + 5)     # slices of 32, 32, 16 rows
    ranges: list[tuple[int, int]] = []
    sliced = weights.to_device(data, t, ne, numerics="ggml", lanes=True, release=lambda a, b: ranges.append((a, b)))
    whole = weights.to_device(data, t, ne, numerics="ggml", lanes=True)
    assert ranges == [(0, 32 * row), (32 * row, 64 * row), (64 * row, 80 * row)]
    assert sliced.spec.format == weights.FORMAT_LANES
    np.testing.assert_array_equal(np.asarray(sliced.array), np.asarray(whole.array))


def test_lanes_types_are_the_laid_out_types():
    """native.LANE_TYPES (what block_matmul reads in the lanes format) and weights.LANE_FIELDS
    (their layouts) name the same types."""
    assert native.LANE_TYPES == frozenset(int(t) for t in weights.LANE_FIELDS)


@needs_lanes
def test_lanes_format_only_where_it_applies(monkeypatch):
    """Whole 16-row groups of a lane type, 2-d, numerics "ggml", GGMLX_LANES on; otherwise the blocks."""
    t = GGMLType.Q4_K
    def fmt(ne, t=t, **kw):
        data = _random_blocks(t, int(np.prod(ne[1:])), ne[0], seed=0)
        return weights.to_device(data, t, ne, **kw).spec.format
    assert fmt((256, 32), numerics="ggml", lanes=True) == weights.FORMAT_LANES
    assert fmt((256, 40), numerics="ggml", lanes=True) == weights.FORMAT_BLOCKS     # 2.5 groups
    assert fmt((256, 16, 2), numerics="ggml", lanes=True) == weights.FORMAT_BLOCKS  # 3-d
    assert fmt((256, 32), t=GGMLType.IQ4_XS, numerics="ggml", lanes=True) == weights.FORMAT_BLOCKS
    assert fmt((256, 32), numerics="ggml") == weights.FORMAT_BLOCKS
    assert fmt((256, 32), weight_format="int4", lanes=True) == weights.FORMAT_INT4   # exact numerics
    monkeypatch.setenv("GGMLX_LANES", "0")
    assert fmt((256, 32), numerics="ggml", lanes=True) == weights.FORMAT_BLOCKS


@needs_lanes
def test_model_in_the_lanes_format(tmp_path, monkeypatch):
    """Under numerics "ggml" a model holds its projections, output and token embedding in the
    lanes format (norms stay plain); decoding gives the logits it gives from the GGUF blocks."""
    path = write_model(tmp_path / "m.gguf", TinySpec(wtype="Q8_0"))
    toks = prompt_tokens(12)
    logits = {}
    for on in ("1", "0"):
        monkeypatch.setenv("GGMLX_LANES", on)
        model = llm.load_model(path, numerics="ggml")
        layer = model.layers[0]
        formats = {t.data.spec.format for t in (layer.wq, layer.wo, layer.ffn_down, model.tok_embd)}
        assert formats == {weights.FORMAT_LANES if on == "1" else weights.FORMAT_BLOCKS}
        assert layer.attn_norm.data.spec.format == weights.FORMAT_PLAIN
        ctx = llm.Context(model, n_ctx=64)
        assert ctx.decode(llm.Batch(toks[:8], logits=np.ones(8, bool))) == 0
        rows = [ctx.get_logits()]
        for i, tok in enumerate(toks[8:]):
            assert ctx.decode(llm.Batch([tok], pos=[8 + i])) == 0
            rows.append(ctx.get_logits())
        logits[on] = np.concatenate([np.asarray(r).reshape(-1, model.n_vocab) for r in rows])
    np.testing.assert_allclose(logits["1"], logits["0"], rtol=0, atol=1e-4 * np.abs(logits["0"]).max())


def test_cache_type_follows_the_numerics(tmp_path):
    """A context that names no cache type takes DEFAULT_KV_TYPE of its model's numerics: f16 under
    "ggml" (llama.cpp's default), f32 under "exact"; a type it names wins either way."""
    from llm.context import DEFAULT_KV_TYPE
    path = write_model(tmp_path / "m.gguf", TinySpec(wtype="Q8_0"))
    assert DEFAULT_KV_TYPE == {"exact": "f32", "ggml": "f16"}
    for numerics, want in (("ggml", np.float16), ("exact", np.float32)):
        model = llm.load_model(path, numerics=numerics)
        ctx = llm.Context(model, n_ctx=64)
        assert (ctx.params.type_k, ctx.params.type_v) == (DEFAULT_KV_TYPE[numerics],) * 2
        assert {t.data.dtype for t in ctx.memory.mem_attn.k_l + ctx.memory.mem_attn.v_l} == {np.dtype(want)}
        assert ctx.decode(llm.Batch(prompt_tokens(4))) == 0
        named = llm.Context(model, n_ctx=64, type_k="bf16", type_v="f32")
        assert (named.params.type_k, named.params.type_v) == ("bf16", "f32")


def _real_tensors(path) -> dict[GGMLType, tuple[str, np.ndarray, tuple[int, int]]]:
    """One tensor per block type in a GGUF file, cut to its first 64 rows."""
    r = gguf.GGUFReader(str(path))
    out = {}
    try:
        for name, info in r.tensors.items():
            t = GGMLType(info.type)
            if t in out or not types.traits(t).is_quantized or len(info.ne) != 2:
                continue
            rows = min(64, info.ne[1])
            data = np.array(np.asarray(info.data).reshape(info.ne[1], -1)[:rows])
            out[t] = (name, data.reshape(-1), (info.ne[0], rows))
    finally:
        r.close()
    return out


def _check_formats(tensors):
    rng = np.random.default_rng(0)
    for t, (name, data, ne) in tensors.items():
        ref = quants.dequantize(data, t, ne)                          # [rows, ne0]
        held = {f: weights.to_device(data, t, ne, weight_format=f) for f in FORMATS}
        assert held["int8"].spec.format == weights.FORMAT_INT8, name
        assert held["int4"].spec.format == (weights.FORMAT_INT4 if t in INT4_TYPES else weights.FORMAT_INT8), name
        for f in ("int8", "int4"):
            np.testing.assert_array_equal(np.asarray(weights.materialize(held[f])).reshape(ref.shape), ref,
                                          err_msg=f"{name} {f}")
        x = rng.standard_normal((3, ne[0])).astype(np.float32)
        want = x.astype(np.float64) @ ref.astype(np.float64).T
        idx = np.array([5, 0, ne[1] - 1], np.int32)
        for f, w in held.items():
            got = np.asarray(jax.jit(weights.mul_mat)(w, x))
            assert _nmse(got, want) <= 1e-7, (name, f)
            np.testing.assert_array_equal(np.asarray(jax.jit(weights.get_rows)(w, idx)), ref[idx],
                                          err_msg=f"{name} {f}")


def test_formats_agree_on_smollm2_tensors(smollm2_path):
    tensors = _real_tensors(smollm2_path)
    assert {GGMLType.Q4_1, GGMLType.Q8_0} <= set(tensors)
    _check_formats(tensors)


def test_formats_agree_on_gemma3_tensors(gemma3_path):
    tensors = _real_tensors(gemma3_path)
    assert {GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K} <= set(tensors)
    _check_formats(tensors)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mul_mat_in_row_chunks(monkeypatch, fmt):
    """A weight bigger than one chunk is multiplied chunk by chunk, the last chunk ending at
    the last row even when the row count is not a multiple of the chunk."""
    monkeypatch.setattr(weights, "CHUNK_ELEMENTS", 8 * 64)
    t, ne = GGMLType.Q4_K, (256, 37)
    data = _random_blocks(t, ne[1], ne[0], seed=1)
    ref = quants.dequantize(data, t, ne)
    w = weights.to_device(data, t, ne, weight_format=fmt)
    x = np.random.default_rng(2).standard_normal((2, 4, ne[0])).astype(np.float32)
    got = np.asarray(jax.jit(weights.mul_mat)(w, x))
    assert got.shape == (2, 4, ne[1])
    assert _nmse(got, x.astype(np.float64) @ ref.astype(np.float64).T) <= 1e-7


def test_format_choice():
    assert weights.resolve_format("int8", GGMLType.Q4_K) == weights.FORMAT_INT8
    assert weights.resolve_format("int8", GGMLType.IQ2_XXS) == weights.FORMAT_BLOCKS
    assert weights.resolve_format("int8", GGMLType.F16) == weights.FORMAT_PLAIN
    for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K):
        assert weights.resolve_format("int4", t) == weights.FORMAT_INT4
    for t in (GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q6_K):     # a Q4_K_M model's other types
        assert weights.resolve_format("int4", t) == weights.FORMAT_INT8
    assert weights.resolve_format("int4", GGMLType.IQ2_XXS) == weights.FORMAT_BLOCKS
    assert weights.resolve_format("int4", GGMLType.F16) == weights.FORMAT_PLAIN
    assert weights.resolve_format("native", GGMLType.Q4_K) == weights.FORMAT_BLOCKS
    assert weights.resolve_format("f32", GGMLType.Q4_K) == weights.FORMAT_PLAIN
    assert weights.AUTO_FORMAT == "int4"
    cpu = jax.devices("cpu")
    assert weights.auto_format(cpu) == ("int4" if native.available() else "int8")


def test_auto_is_int8_without_the_native_kernel(monkeypatch):
    """XLA's own int4 matvec is slower than its int8 one: "auto" is int8 when no kernel reads int4."""
    monkeypatch.setenv("GGMLX_NATIVE", "0")
    assert weights.auto_format(jax.devices("cpu")) == "int8"
    model = llm.load_model(SYNTHETIC / "synth-llama-Q4_0.gguf")
    assert model.weight_format == "int8"
    with pytest.raises(ValueError, match="weight_format"):
        weights.check_format("q4")
    with pytest.raises(ValueError, match="weight_format"):
        weights.to_device(np.zeros(34, np.uint8), GGMLType.Q8_0, (32,), weight_format="auto")


# Row and column splits of int4 weights over 4 simulated CPU devices (a subprocess: the device
# count is fixed before JAX's first use): mul_mat and get_rows equal the one-device results.
_MESH_CHECK = """
import jax, numpy as np, ggmlx
ggmlx.init()
jax.config.update("jax_num_cpu_devices", 4)
from ggmlx import quants, weights
from ggmlx.types import GGMLType
from test_weight_formats import _random_blocks
mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), (weights.MESH_AXIS,))
rng = np.random.default_rng(0)
for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K):
    ne = (1024, 16)
    data = _random_blocks(t, ne[1], ne[0], seed=int(t))
    ref = quants.dequantize(data, t, ne).astype(np.float64)
    x = rng.standard_normal((3, ne[0])).astype(np.float32)
    idx = np.array([3, 0, 15, 8], np.int32)
    for split in (weights.WeightSplit(1), weights.WeightSplit(1, gather=True), weights.WeightSplit(0)):
        w = weights.to_mesh(data, t, ne, mesh, split, "int4", "w")
        assert w.spec.format == weights.FORMAT_INT4 and w.array.shape == (16, 512), w.array.shape
        assert all(s.data.nbytes == 16 * 512 // 4 for s in w.array.addressable_shards)
        y = np.asarray(jax.jit(weights.mul_mat)(w, x))
        err = np.max(np.abs(y - x @ ref.T) / (np.abs(x) @ np.abs(ref).T))
        assert err < 4e-7, (t, split, err)
        np.testing.assert_array_equal(np.asarray(jax.jit(weights.get_rows)(w, idx)), ref[idx])
print("ok")
"""


@pytest.mark.slow   # a subprocess with simulated devices
def test_int4_split_over_a_mesh():
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), str(root / "tests"),
                                                                    os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", _MESH_CHECK], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]


SYNTHETIC = Path(__file__).parent / "data" / "synthetic"


@pytest.mark.parametrize("model", ["tiny-Q4_1", "synth-llama-Q4_0", "synth-gemma3-Q4_K_M"])
@pytest.mark.slow
def test_int4_model_logits_match_int8(tmp_path, model):
    """A model's logits under int4 equal int8's within f32 rounding: a 20-token prefill (the
    chunked XLA path) then one-token steps (the native kernel where built). The Q4_K_M model
    holds its Q6_K tensors as int8 under both."""
    if model.startswith("tiny"):
        path = write_model(tmp_path / "tiny.gguf", TinySpec(n_embd=256, n_ff=512, wtype="Q4_1", seed=3))
    else:
        path = SYNTHETIC / f"{model}.gguf"
    logits, n_bytes = {}, {}
    for fmt in ("int8", "int4"):
        model = llm.load_model(path, weight_format=fmt)
        n_bytes[fmt] = sum(t.data.nbytes for t in model.weight_tensors())
        ctx = llm.Context(model, n_ctx=64)
        tokens = prompt_tokens(22)
        assert ctx.decode(llm.Batch(tokens[:20])) == 0
        out = [ctx.get_logits_ith(-1).copy()]
        for tok in tokens[20:]:
            assert ctx.decode(llm.Batch.get_one([tok])) == 0
            out.append(ctx.get_logits_ith(-1).copy())
        logits[fmt] = np.stack(out)
    assert n_bytes["int4"] < n_bytes["int8"]
    scale = np.abs(logits["int8"]).max()
    np.testing.assert_allclose(logits["int4"], logits["int8"], atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.Q4_K])
def test_int8_scales_are_f16_where_the_block_holds_f16(t):
    """Q8_0/Q4_1/Q5_0 keep their f16 fields as f16 scales (half the scale bytes); a K-quant's
    scale d * sc is no f16 value and stays f32. Both dequantize to ggml's values exactly."""
    ne = (256, 4)
    data = _random_blocks(t, ne[1], ne[0], seed=7)
    w = weights.to_device(data, t, ne, weight_format="int8")
    assert w.scale.dtype == (np.float16 if t in weights.F16_SCALES else np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(weights.materialize)(w)).reshape(ne[1], ne[0]),
                                  quants.dequantize(data, t, ne).reshape(ne[1], ne[0]))


def test_f16_scales_refuse_values_that_would_change():
    with pytest.raises(ValueError, match="not f16 values"):
        weights._as_f16(np.array([[1.0, 1.0 + 2.0 ** -20]], np.float32))
    assert weights._as_f16(np.array([[np.nan, -0.5]], np.float32)).dtype == np.float16


def test_trim_heap_finds_glibc_malloc_trim():
    """trim_heap calls glibc's malloc_trim where the C library is glibc (Linux here), and is a
    no-op elsewhere; heap pages freed by a load go back to the OS (fewer resident pages)."""
    glibc = sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION") is not None
    assert (weights._malloc_trim() is not None) == glibc
    if not glibc:
        return

    def rss_kb() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    # many blocks below the mmap threshold, touched, all but the last freed: heap pages glibc keeps
    blocks = [bytearray(b"x" * 60000) for _ in range(600)]
    keep = blocks[-1]
    del blocks
    before = rss_kb()
    weights.trim_heap()
    assert rss_kb() < before - 8 * 1024, (before, rss_kb())
    assert keep[0] == ord("x")
