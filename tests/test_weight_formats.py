"""Weight formats: the exact int8 conversion of every supported block type, and mul_mat /
get_rows giving the same results whichever format a weight is held in."""
import jax
import numpy as np
import pytest

from ggmlx import gguf, quants, types, weights
from ggmlx.quants import int8
from ggmlx.types import GGMLType

INT8_TYPES = list(int8.INT8_CONVERTERS)


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
        held = {f: weights.to_device(data, t, ne, weight_format=f) for f in ("native", "int8", "f32")}
        assert held["int8"].spec.format == weights.FORMAT_INT8, name
        np.testing.assert_array_equal(np.asarray(weights.materialize(held["int8"])).reshape(ref.shape), ref,
                                      err_msg=name)
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


@pytest.mark.parametrize("fmt", ["native", "int8", "f32"])
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
    assert weights.resolve_format("native", GGMLType.Q4_K) == weights.FORMAT_BLOCKS
    assert weights.resolve_format("f32", GGMLType.Q4_K) == weights.FORMAT_PLAIN
    assert weights.AUTO_FORMAT == "int8"
    with pytest.raises(ValueError, match="weight_format"):
        weights.check_format("q4")
    with pytest.raises(ValueError, match="weight_format"):
        weights.to_device(np.zeros(34, np.uint8), GGMLType.Q8_0, (32,), weight_format="auto")
