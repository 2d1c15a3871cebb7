"""ggmlx.quants: numpy and JAX dequantization and the quantizers, against gguf-py as the oracle.

gguf-py's dequantizers agree bit for bit with ggml's dequantize_row_* (see
reference/README.md), so every comparison here is on the float32 bit patterns.
"""
from __future__ import annotations

import functools

import gguf
import jax
import numpy as np
import pytest
from gguf import quants as gq
from reference import reference_dir

from ggmlx import quants, weights
from ggmlx.gguf import GGUFReader
from ggmlx.quants import iq_tables
from ggmlx.types import GGMLType, TypeSizeError, block_size, type_size

# gguf-py warns where ggml silently gives inf (huge MXFP4 exponents, f16 overflow of a scale).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

SYNTHETIC_MODELS = reference_dir() / "synthetic" / "models"

FLOAT_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]
BLOCK_TYPES = [t for t in quants.SUPPORTED_TYPES if t not in FLOAT_TYPES]
LEGACY_QUANT_TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1]

# Byte offsets of the f16 scale fields in each block type (IQ1_M spreads its scale over
# four words, MXFP4 has an 8-bit exponent: both are handled in random_blocks).
F16_FIELDS = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
    GGMLType.IQ2_XXS: (0,), GGMLType.IQ2_XS: (0,), GGMLType.IQ2_S: (0,), GGMLType.IQ3_XXS: (0,),
    GGMLType.IQ3_S: (0,), GGMLType.IQ1_S: (0,), GGMLType.IQ1_M: (), GGMLType.TQ1_0: (52,),
    GGMLType.TQ2_0: (64,), GGMLType.MXFP4: (),
}


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def oracle(data: np.ndarray, t: GGMLType, ne: tuple[int, ...]) -> np.ndarray:
    """gguf-py's dequantization of a tensor, in numpy order."""
    rows = data.reshape(-1, data.size // int(np.prod(ne[1:], dtype=np.int64)))
    y = gq.dequantize(rows, gguf.GGMLQuantizationType(int(t)))
    return np.asarray(y, dtype=np.float32).reshape(ne[::-1])


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 scales of both signs over many magnitudes, subnormals and zeros included."""
    v = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-7, 2, n)
    v[rng.random(n) < 0.02] = 0.0
    return v.astype(np.float16)


def random_blocks(rng: np.random.Generator, t: GGMLType, n_blocks: int) -> np.ndarray:
    """Random block bytes [n_blocks * type_size] whose scale fields are finite f16 values."""
    b = rng.integers(0, 256, (n_blocks, type_size(t)), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        b[:, off:off + 2] = random_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if t == GGMLType.IQ1_M:
        d = random_f16(rng, n_blocks).view(np.uint16)
        words = b[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = words.view(np.uint8)
    return b.reshape(-1)


def random_float_data(rng: np.random.Generator, t: GGMLType, n: int) -> np.ndarray:
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
    if t == GGMLType.F32:
        return x.view(np.uint8)
    if t == GGMLType.F16:
        return x.astype(np.float16).view(np.uint8)
    return quants.quantize(x, GGMLType.BF16).reshape(-1)


def random_tensor(t: GGMLType, seed: int) -> tuple[np.ndarray, tuple[int, int]]:
    """(bytes, ne) of a random tensor of a few rows."""
    rng = np.random.default_rng(seed)
    ne = (block_size(t) * 8, 96) if t not in FLOAT_TYPES else (64, 24)
    n_blocks = ne[0] * ne[1] // block_size(t)
    if t in FLOAT_TYPES:
        return random_float_data(rng, t, ne[0] * ne[1]), ne
    return random_blocks(rng, t, n_blocks), ne


def on_device_f32(data: np.ndarray, t: GGMLType, ne: tuple[int, ...]) -> jax.Array:
    """A tensor's bytes as the engine holds them ("native" weight format) and reads them
    inside jit (weights.materialize), as f32 in shape ne[::-1]."""
    return jax.jit(weights.materialize)(weights.to_device(data, t, ne, weight_format="native")).reshape(ne[::-1])


# --- tables -----------------------------------------------------------------------------


def test_tables_match_gguf_py():
    for ours, cls in [(iq_tables.IQ2XXS_GRID, gq.IQ2_XXS), (iq_tables.IQ2XS_GRID, gq.IQ2_XS),
                      (iq_tables.IQ2S_GRID, gq.IQ2_S), (iq_tables.IQ3XXS_GRID, gq.IQ3_XXS),
                      (iq_tables.IQ3S_GRID, gq.IQ3_S), (iq_tables.IQ1S_GRID, gq.IQ1_S)]:
        cls.init_grid()
        assert np.array_equal(ours, cls.grid.reshape(cls.grid_shape)), cls.__name__
    assert iq_tables.KSIGNS_IQ2XS.tobytes() == gq.IQ2_XXS.ksigns
    assert iq_tables.KVALUES_IQ4NL.tolist() == list(gq.IQ4_NL.kvalues)
    assert iq_tables.KVALUES_MXFP4.tolist() == list(gq.MXFP4.kvalues)
    # Every ksigns entry has an even number of set bits; the table of signs follows the bits.
    assert all(bin(v).count("1") % 2 == 0 for v in iq_tables.KSIGNS_IQ2XS.tolist())
    assert iq_tables.SIGNS_FROM_BYTE[0b10000001].tolist() == [-1, 1, 1, 1, 1, 1, 1, -1]


# --- numpy dequantization vs gguf-py ------------------------------------------------------


@pytest.mark.parametrize("t", BLOCK_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_py(t):
    data, ne = random_tensor(t, seed=int(t))
    got = quants.dequantize(data, t, ne)
    assert got.dtype == np.float32 and got.shape == ne[::-1]
    assert np.array_equal(bits(got), bits(oracle(data, t, ne)))


@pytest.mark.parametrize("t", [GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
def test_every_half_precision_bit_pattern_matches_gguf_py(t):
    data = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    ne = (256, 256)
    assert np.array_equal(bits(quants.dequantize(data, t, ne)), bits(oracle(data, t, ne)))


def test_real_models_every_tensor_matches_gguf_py(smollm2_path, gemma3_path):
    seen = set()
    for path in (smollm2_path, gemma3_path):
        reader = GGUFReader(path)
        for info in reader.tensors.values():
            got = quants.dequantize(info.data, info.type, info.ne)
            want = oracle(info.data, info.type, info.ne)
            assert np.array_equal(bits(got), bits(want)), f"{path.name}: {info.name} ({info.type.name})"
            seen.add(info.type)
        reader.close()
    assert seen == {GGMLType.F32, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K}


@pytest.mark.skipif(not SYNTHETIC_MODELS.is_dir(), reason="needs the llama.cpp reference models (--reference)")
def test_synthetic_models_every_tensor_matches_gguf_py():
    seen = set()
    for path in sorted(SYNTHETIC_MODELS.glob("*.gguf")):
        reader = GGUFReader(path)
        for info in reader.tensors.values():
            got = quants.dequantize(info.data, info.type, info.ne)
            assert np.array_equal(bits(got), bits(oracle(info.data, info.type, info.ne))), f"{path.name}: {info.name}"
            seen.add(info.type.name)
        reader.close()
    assert seen == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                    "Q6_K", "IQ4_NL", "IQ4_XS"}


# --- JAX dequantization vs numpy -------------------------------------------------------------


@pytest.mark.parametrize("t", BLOCK_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
@pytest.mark.slow
def test_jax_matches_numpy_inside_jit(t):
    data, ne = random_tensor(t, seed=1000 + int(t))
    if t == GGMLType.MXFP4:
        # XLA flushes float32 subnormals to zero: exponents 0 and 1 (scales 2^-128, 2^-127) differ.
        np.maximum(data.reshape(-1, 17)[:, 0], 2, out=data.reshape(-1, 17)[:, 0])
    got = np.asarray(on_device_f32(data, t, ne))
    assert got.dtype == np.float32 and got.shape == ne[::-1]
    assert np.array_equal(bits(got), bits(quants.dequantize(data, t, ne)))


def test_jax_real_model_tensors_match_numpy(gemma3_path):
    """The smallest tensor of each type in Gemma 3, dequantized on device under jit."""
    reader = GGUFReader(gemma3_path)
    smallest = {}
    for info in reader.tensors.values():
        if info.type not in smallest or info.nbytes < smallest[info.type].nbytes:
            smallest[info.type] = info
    for info in smallest.values():
        got = np.asarray(on_device_f32(info.data, info.type, info.ne))
        assert np.array_equal(bits(got), bits(quants.dequantize(info.data, info.type, info.ne))), info.name
    reader.close()


def test_jax_dequantizes_gathered_rows():
    """Rows gathered from the packed layout dequantize like the same rows of the whole tensor."""
    t = GGMLType.Q4_K
    data, ne = random_tensor(t, seed=7)
    rows = np.array([5, 0, 95, 5])
    picked = weights.to_device(data, t, ne, weight_format="native").array[rows]
    got = jax.jit(lambda b: quants.dequantize_jax(b, t, (ne[0], len(rows))))(picked)
    assert np.array_equal(bits(np.asarray(got)), bits(quants.dequantize(data, t, ne)[rows]))


@pytest.mark.slow
def test_jax_accepts_rows_of_bytes():
    t = GGMLType.Q5_0
    data, ne = random_tensor(t, seed=8)
    rows = jax.device_put(data.reshape(ne[1], -1))
    assert np.array_equal(bits(np.asarray(quants.dequantize_jax(rows, t, ne))), bits(quants.dequantize(data, t, ne)))


# --- device layout ---------------------------------------------------------------------------


def test_native_weights_hold_rows_of_blocks():
    """What dequantize_jax gets in the engine: a "native" weight's rows of packed bytes."""
    data, ne = random_tensor(GGMLType.Q6_K, seed=9)
    w = weights.to_device(data, GGMLType.Q6_K, (ne[0], 4, ne[1] // 4), weight_format="native")
    assert w.array.shape == (ne[1], ne[0] // 256 * 210) and w.array.dtype == np.uint8
    f16 = np.zeros(6 * 4, dtype=np.float16).view(np.uint8)
    assert weights.to_device(f16, GGMLType.F16, (6, 4)).array.dtype == np.float16


# --- quantizers ------------------------------------------------------------------------------


def quantizer_input(seed: int) -> np.ndarray:
    """Rows of 256 with blocks at many scales plus the edge cases of ggml's rounding rules."""
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-4, 3, (64, 8, 1)).repeat(32, 1).reshape(64, 256)
    x = rng.standard_normal((64, 256)).astype(np.float32) * scales
    x = x.astype(np.float32)
    special = np.zeros((8, 256), dtype=np.float32)
    special[1] = 3.0                                              # constant block (d = 0 for Q4_1)
    special[2, :32] = np.arange(-16, 16) + 0.5                     # halfway values
    special[2, 32:64] = np.linspace(-127, 127, 32).round()         # Q8_0 with d = 1
    special[3, :32] = np.linspace(0, 15, 32)                       # Q4_1 with d = 1
    special[3, 32:64] = -np.abs(rng.standard_normal(32))           # largest magnitude negative
    special[4, :32] = rng.standard_normal(32)
    special[4, 5] = special[4, 9] = 4.0                            # tie between +max and +max
    special[4, 40] = -5.0
    special[4, 41] = 5.0                                           # ties in |max| with opposite signs
    special[5] = 1e-30 * rng.standard_normal(256)                  # scale underflows f16
    special[6] = 7e4 * rng.standard_normal(256)                    # scale overflows f16
    special[7] = np.float32(0.1) * np.arange(256) - 12.8
    return np.concatenate([x, special])


@pytest.mark.parametrize("t", LEGACY_QUANT_TYPES, ids=lambda t: t.name)
def test_quantize_matches_gguf_py(t):
    x = quantizer_input(seed=int(t))
    got = quants.quantize(x, t)
    want = gq.quantize(x, gguf.GGMLQuantizationType(int(t)))
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want)


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_quantize_float_types_match_gguf_py(t):
    x = quantizer_input(seed=3)
    x[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    want = np.ascontiguousarray(gq.quantize(x, gguf.GGMLQuantizationType(int(t)))).view(np.uint8)
    assert np.array_equal(quants.quantize(x, t), want.reshape(x.shape[0], -1))


@pytest.mark.parametrize("t", LEGACY_QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.slow
def test_quantize_jax_matches_numpy_inside_jit(t):
    x = quantizer_input(seed=100 + int(t))
    got = jax.jit(functools.partial(quants.quantize_jax, type=t))(x)
    assert got.shape == (x.shape[0], x.shape[1] // 32, type_size(t))
    assert np.array_equal(np.asarray(got).reshape(x.shape[0], -1), quants.quantize(x, t))
    back = jax.jit(functools.partial(quants.dequantize_jax, type=t, ne=x.shape[::-1]))(got)
    assert np.array_equal(bits(np.asarray(back)), bits(quants.dequantize(quants.quantize(x, t), t, x.shape[::-1])))


@pytest.mark.parametrize("t", LEGACY_QUANT_TYPES, ids=lambda t: t.name)
def test_quantize_round_trip_error_is_bounded(t):
    """|x - y| <= steps * d + |q| * |d - d_f16| + |min - min_f16| per block (y = dequantize(quantize(x)))."""
    rng = np.random.default_rng(int(t))
    x = (rng.standard_normal((32, 256)) * 10.0 ** rng.uniform(-3, 3, (32, 1))).astype(np.float32)
    packed = quants.quantize(x, t)
    y = quants.dequantize(packed, t, x.shape[::-1])
    xb, yb = x.reshape(-1, 32).astype(np.float64), y.reshape(-1, 32)
    stored = packed.reshape(xb.shape[0], -1)[:, :4].copy().view(np.float16).astype(np.float64)
    amax, lo = np.abs(xb).max(axis=1), xb.min(axis=1)
    span = xb.max(axis=1) - lo
    # Q4_0 / Q5_0: the positive end of the range maps to 2^(bits-1) - 1, up to a full step short.
    d, steps, qmax = {GGMLType.Q8_0: (amax / 127, 0.5, 127), GGMLType.Q4_0: (amax / 8, 1.0, 8),
                      GGMLType.Q5_0: (amax / 16, 1.0, 16), GGMLType.Q4_1: (span / 15, 0.5, 15),
                      GGMLType.Q5_1: (span / 31, 0.5, 31)}[t]
    bound = steps * d + qmax * np.abs(d - np.abs(stored[:, 0]))
    if t in (GGMLType.Q4_1, GGMLType.Q5_1):
        bound += np.abs(lo - stored[:, 1])
    assert (np.abs(xb - yb).max(axis=1) <= bound * (1 + 1e-5)).all()


# --- errors ------------------------------------------------------------------------------------


def test_wrong_byte_count_names_type_and_shape():
    data = np.zeros(34 * 2 - 1, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"Q8_0.*\(64, 1\).*68 bytes, got 67"):
        quants.dequantize(data, GGMLType.Q8_0, (64, 1))
    with pytest.raises(ValueError, match=r"Q8_0.*\(64, 1\).*68 bytes, got 67"):
        weights.to_device(data, GGMLType.Q8_0, (64, 1))
    with pytest.raises(ValueError, match=r"Q8_0.*\(64, 1\).*uint8\[1, 2, 34\], got uint8\[67\]"):
        quants.dequantize_jax(jax.numpy.asarray(data), GGMLType.Q8_0, (64, 1))


def test_bad_shape_and_data_type():
    with pytest.raises(TypeSizeError, match="Q4_K block size 256"):
        quants.dequantize(np.zeros(144, dtype=np.uint8), GGMLType.Q4_K, (128, 2))
    with pytest.raises(ValueError, match="at least one dimension"):
        quants.dequantize(np.zeros(18, dtype=np.uint8), GGMLType.Q4_0, ())
    with pytest.raises(TypeError, match="Q4_0 tensor data must be a numpy uint8 array, got numpy float32"):
        quants.dequantize(np.zeros(9, dtype=np.float32), GGMLType.Q4_0, (32,))
    with pytest.raises(TypeError, match="got bytes"):
        quants.dequantize(bytes(18), GGMLType.Q4_0, (32,))


def test_unsupported_and_unknown_types():
    with pytest.raises(NotImplementedError, match="Q8_K"):
        quants.dequantize(np.zeros(292, dtype=np.uint8), GGMLType.Q8_K, (256,))
    with pytest.raises(NotImplementedError, match="I32"):
        quants.dequantize_jax(np.zeros(4, dtype=np.int32), GGMLType.I32, (4,))
    with pytest.raises(ValueError, match="unknown ggml type id 99"):
        quants.dequantize(np.zeros(4, dtype=np.uint8), 99, (1,))
    with pytest.raises(NotImplementedError, match="quantizing to Q8_K"):
        quants.quantize(np.zeros(256, dtype=np.float32), GGMLType.Q8_K)
    with pytest.raises(ValueError, match="IQ2_XXS requires an importance matrix"):
        quants.quantize(np.zeros(256, dtype=np.float32), GGMLType.IQ2_XXS)
    with pytest.raises(NotImplementedError, match="quantizing to F16"):
        quants.quantize_jax(np.zeros(32, dtype=np.float32), GGMLType.F16)


def test_dequantize_jax_checks_blocks():
    msg = r"Q4_0 tensor of ne=\(64, 2\) needs blocks uint8\[2, 2, 18\], got uint8\[70\]"
    with pytest.raises(ValueError, match=msg):
        quants.dequantize_jax(np.zeros(70, dtype=np.uint8), GGMLType.Q4_0, (64, 2))
    with pytest.raises(ValueError, match=r"needs blocks float16\[2, 64\], got float32"):
        quants.dequantize_jax(np.zeros((2, 64), dtype=np.float32), GGMLType.F16, (64, 2))


def test_quantize_rejects_bad_rows_and_non_finite_input():
    with pytest.raises(TypeSizeError, match="Q8_0 block size 32"):
        quants.quantize(np.zeros((2, 48), dtype=np.float32), GGMLType.Q8_0)
    x = np.zeros(64, dtype=np.float32)
    x[40] = np.nan
    with pytest.raises(ValueError, match="Q4_0 input contains NaN"):
        quants.quantize(x, GGMLType.Q4_0)


def test_empty_tensor():
    assert quants.dequantize(np.zeros(0, dtype=np.uint8), GGMLType.Q4_K, (256, 0)).shape == (0, 256)
