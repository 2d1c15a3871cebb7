"""The native int8 and int4 matvecs (ggmlx/native): exact dequantized values, sums within f32
rounding of a float64 reference and of the pure-XLA path, for both int8 sub-block lengths,
with and without offsets, and for each type the int4 format holds; and the dispatch in
weights.mul_mat. Checks of the kernel itself skip when
it is not built; the checks of mul_mat's results run either way."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ggmlx import native, types, weights
from ggmlx.types import GGMLType

needs_native = pytest.mark.skipif(
    native.load_error() is not None,
    reason=f"the native int8 matvec cannot be used: {native.load_error()}")


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    """Every test here runs with the kernel switched on (GGMLX_NATIVE=1) unless it says otherwise."""
    monkeypatch.setenv("GGMLX_NATIVE", "1")

# One block type per (sub-block, offset) case of the int8 format, and every type of int4.
CASES = {(GGMLType.Q8_0, "int8"): (32, False), (GGMLType.Q4_1, "int8"): (32, True),
         (GGMLType.Q6_K, "int8"): (16, False), (GGMLType.Q2_K, "int8"): (16, True),
         (GGMLType.Q4_0, "int4"): (32, True), (GGMLType.Q4_1, "int4"): (32, True),
         (GGMLType.Q4_K, "int4"): (32, True)}
case_params = pytest.mark.parametrize("t,fmt", list(CASES), ids=lambda c: getattr(c, "name", c))

# Max |y - y64| / (|x| @ |w|.T) measured on these cases: native 3e-8..6e-8 (AVX2 int4, which
# sums scale * sum(x q) + offset * sum(x), up to 2.2e-7 on Q4_0), the pure-XLA path
# 5e-8..2.2e-7 (f32 rounding of the products and sums, summed in different orders).
REL_BOUND = 4e-7


def _weight(t: GGMLType, n_rows: int, ne0: int, seed: int, fmt: str = "int8") -> weights.DeviceWeight:
    """An int8 or int4 weight from random packed blocks whose f16 fields have capped exponents."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n_rows * ne0 // types.block_size(t), types.type_size(t)), dtype=np.uint8)
    data[:, 1::2] &= 0xBF
    w = weights.to_device(data.reshape(-1), t, (ne0, n_rows), weight_format=fmt)
    assert w.spec.format == fmt and (w.spec.sub_block, w.offset is not None) == CASES[t, fmt]
    return w


def _dequantized(w: weights.DeviceWeight) -> np.ndarray:
    """The weight's values [M, K] in float64, from its int8 or int4 arrays (exact)."""
    q, scale = np.asarray(w.array), np.asarray(w.scale)
    if w.spec.format == weights.FORMAT_INT4:
        q = q.reshape(q.shape[0], -1, 1, 16)
        q = np.concatenate([q & 15, q >> 4], axis=2)
    y = q.astype(np.float64).reshape(q.shape[0], -1, w.spec.sub_block) * scale[..., None]
    if w.offset is not None:
        y = y + np.asarray(w.offset)[..., None]
    return y.reshape(q.shape[0], -1)


def _kernel(w: weights.DeviceWeight, x: np.ndarray) -> np.ndarray:
    """The native kernel of w's format, called directly."""
    q, scale, offset = weights._row_arrays(w)
    if w.spec.format == weights.FORMAT_INT4:
        return np.asarray(jax.jit(native.int4_matvec)(jnp.asarray(x), q, scale, offset))
    return np.asarray(jax.jit(native.int8_matvec)(jnp.asarray(x), q, scale, offset))


def _rel_err(y: np.ndarray, ref: np.ndarray, x: np.ndarray, wd: np.ndarray) -> float:
    """Max error relative to the sum of |products| of each output (the scale of f32 rounding)."""
    return float(np.max(np.abs(y - ref) / (np.abs(x.astype(np.float64)) @ np.abs(wd).T)))


def _mul_mat(w, x, native_ok=True):
    return np.asarray(jax.jit(lambda w, x: weights.mul_mat(w, x, native_ok=native_ok))(w, jnp.asarray(x)))


@pytest.mark.parametrize("n", [1, 2, 5])
@case_params
def test_mul_mat_small_n_matches_float64(t, fmt, n):
    """Whichever path runs (native when built), mul_mat is within f32 rounding of float64."""
    w = _weight(t, 37, 512, seed=int(t) * 10 + n, fmt=fmt)
    x = np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32)
    wd = _dequantized(w)
    assert _rel_err(_mul_mat(w, x), x.astype(np.float64) @ wd.T, x, wd) < REL_BOUND


@needs_native
@pytest.mark.parametrize("n", [1, 2, 5, 8, 12, 33, native.MAX_N])   # 33, 64: int4's panel kernel (N >= 32)
@case_params
@pytest.mark.slow
def test_native_matches_float64_and_xla_path(t, fmt, n):
    w = _weight(t, 37, 512, seed=int(t) * 10 + n, fmt=fmt)
    x = np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32)
    wd = _dequantized(w)
    ref = x.astype(np.float64) @ wd.T
    y = _kernel(w, x)
    y_xla = _mul_mat(w, x, native_ok=False)
    assert y.shape == (n, 37) and y.dtype == np.float32
    assert _rel_err(y, ref, x, wd) < REL_BOUND
    assert _rel_err(y, y_xla, x, wd) < 2 * REL_BOUND
    np.testing.assert_array_equal(_mul_mat(w, x), y)   # mul_mat dispatches to the kernel


@needs_native
@pytest.mark.parametrize("n", [32, 47, native.MAX_N])
def test_int4_panel_kernel_chunks_and_slabs(n):
    """int4's kernel for N >= 32 (x transposed, weight panels per slab of k) over several
    chunks of rows with ragged tiles (M = 299) and several slabs of k with a short last one
    (K = 320): within f32 rounding of float64 and of the pure-XLA path."""
    w = _weight(GGMLType.Q4_1, 299, 320, seed=n, fmt="int4")
    x = np.random.default_rng(n).standard_normal((n, 320)).astype(np.float32)
    wd = _dequantized(w)
    y = _kernel(w, x)
    assert _rel_err(y, x.astype(np.float64) @ wd.T, x, wd) < REL_BOUND
    assert _rel_err(y, _mul_mat(w, x, native_ok=False), x, wd) < 2 * REL_BOUND


@needs_native
@pytest.mark.parametrize("extra", [0, 33], ids=["few-rows", "panel"])   # 40 rows: int4's panel kernel
@case_params
def test_native_dequantizes_exactly(t, fmt, extra):
    """x = unit rows picks single weight columns: every product but one is an exact zero, so
    the result is the dequantized weight itself, bit for bit (for int4, the low and high
    nibbles of the first and last bytes of sub-blocks, and ggml's own values: quants.dequantize)."""
    w = _weight(t, 37, 256, seed=int(t), fmt=fmt)
    cols = [0, 15, 16, 31, 32, 100, 255] + list(range(40, 40 + 5 * extra, 5))
    x = np.zeros((len(cols), 256), np.float32)
    x[np.arange(len(cols)), cols] = 1.0
    y = _kernel(w, x)
    np.testing.assert_array_equal(y, _dequantized(w)[:, cols].T.astype(np.float32))
    np.testing.assert_array_equal(y, np.asarray(jax.jit(weights.materialize)(w)).reshape(37, 256)[:, cols].T)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_large_m_split_over_threads(fmt):
    """Enough rows for several chunks on the thread pool, M not a multiple of anything."""
    w = _weight(GGMLType.Q4_1, 4099, 256, seed=1, fmt=fmt)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    wd = _dequantized(w)
    assert _rel_err(_mul_mat(w, x), x.astype(np.float64) @ wd.T, x, wd) < REL_BOUND


def _hlo(w, n: int) -> str:
    x = jnp.zeros((1, n, w.spec.ne[0]), jnp.float32)
    return jax.jit(lambda w, x: weights.mul_mat(w, x)).lower(w, x).as_text()   # a fresh trace


@needs_native
def test_dispatch_small_n_only():
    w = _weight(GGMLType.Q8_0, 37, 64, seed=0)
    assert native.TARGET in _hlo(w, native.MIN_N) and native.TARGET in _hlo(w, native.MAX_N)
    assert native.MIN_N == 1 and native.TARGET not in _hlo(w, native.MAX_N + 1)
    w1 = _weight(GGMLType.Q4_1, 37, 64, seed=0)
    assert native.TARGET_OFFSET in _hlo(w1, native.MIN_N)


@needs_native
def test_dispatch_int4_1_to_16_rows():
    w = _weight(GGMLType.Q4_K, 37, 256, seed=0, fmt="int4")
    for n in range(native.MIN_N, native.MAX_N + 1):
        assert native.TARGET_INT4 in _hlo(w, n), n
    assert native.TARGET_INT4 not in _hlo(w, native.MAX_N + 1)


def test_flag_turns_it_off(monkeypatch):
    monkeypatch.setenv("GGMLX_NATIVE", "0")
    assert not native.available()
    w = _weight(GGMLType.Q8_0, 37, 64, seed=0)
    assert "ggmlx_int8" not in _hlo(w, native.MIN_N)
    w4 = _weight(GGMLType.Q4_0, 37, 64, seed=0, fmt="int4")
    assert "ggmlx_int4" not in _hlo(w4, native.MIN_N)



@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gradient_through_the_kernel_takes_the_xla_path(fmt):
    """An FFI call has no derivative: jax.grad and jax.jvp through mul_mat (saliency, llm.trace
    gradients) use the XLA path's, so they equal the gradient with the kernel off."""
    w = _weight(GGMLType.Q4_1, 37, 256, seed=3, fmt=fmt)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32))
    probe = jnp.asarray(np.random.default_rng(4).standard_normal((4, 37)).astype(np.float32))

    def loss(x, native_ok):
        return jnp.sum(weights.mul_mat(w, x, native_ok=native_ok) * probe)

    target = native.TARGET_INT4 if fmt == "int4" else native.TARGET_OFFSET
    assert target in jax.jit(lambda x: weights.mul_mat(w, x)).lower(x).as_text()
    g = jax.jit(jax.grad(lambda x: loss(x, True)))(x)
    g_xla = jax.jit(jax.grad(lambda x: loss(x, False)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_xla), rtol=1e-6, atol=1e-6)
    _, t = jax.jvp(lambda x: weights.mul_mat(w, x), (x,), (x,))
    np.testing.assert_allclose(np.asarray(t), _mul_mat(w, np.asarray(x), native_ok=False), rtol=1e-5, atol=1e-5)
