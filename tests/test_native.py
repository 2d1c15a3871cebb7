"""The native int8 matvec (ggmlx/native): exact dequantized values, sums within f32 rounding
of a float64 reference and of the pure-XLA path, for both sub-block lengths, with and
without offsets; and the dispatch in weights.mul_mat. Checks of the kernel itself skip when
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

# One block type per (sub-block, offset) case of the int8 format.
CASES = {GGMLType.Q8_0: (32, False), GGMLType.Q4_1: (32, True), GGMLType.Q6_K: (16, False),
         GGMLType.Q2_K: (16, True)}

# Max |y - y64| / (|x| @ |w|.T) measured on these cases: native 3e-8..6e-8, the pure-XLA
# path 5e-8..1.1e-7 (f32 rounding of the products and sums, summed in different orders).
REL_BOUND = 4e-7


def _weight(t: GGMLType, n_rows: int, ne0: int, seed: int) -> weights.DeviceWeight:
    """An int8 weight from random packed blocks whose f16 fields have capped exponents."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n_rows * ne0 // types.block_size(t), types.type_size(t)), dtype=np.uint8)
    data[:, 1::2] &= 0xBF
    w = weights.to_device(data.reshape(-1), t, (ne0, n_rows), weight_format="int8")
    assert w.spec.format == weights.FORMAT_INT8 and (w.spec.sub_block, w.offset is not None) == CASES[t]
    return w


def _dequantized(w: weights.DeviceWeight) -> np.ndarray:
    """The weight's values [M, K] in float64, from its int8 arrays (exact)."""
    q, scale = np.asarray(w.array), np.asarray(w.scale)
    y = q.astype(np.float64).reshape(q.shape[0], -1, w.spec.sub_block) * scale[..., None]
    if w.offset is not None:
        y = y + np.asarray(w.offset)[..., None]
    return y.reshape(q.shape)


def _rel_err(y: np.ndarray, ref: np.ndarray, x: np.ndarray, wd: np.ndarray) -> float:
    """Max error relative to the sum of |products| of each output (the scale of f32 rounding)."""
    return float(np.max(np.abs(y - ref) / (np.abs(x.astype(np.float64)) @ np.abs(wd).T)))


def _mul_mat(w, x, native_ok=True):
    return np.asarray(jax.jit(lambda w, x: weights.mul_mat(w, x, native_ok=native_ok))(w, jnp.asarray(x)))


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("t", list(CASES), ids=lambda t: t.name)
def test_mul_mat_int8_small_n_matches_float64(t, n):
    """Whichever path runs (native when built), mul_mat is within f32 rounding of float64."""
    w = _weight(t, 37, 512, seed=int(t) * 10 + n)
    x = np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32)
    wd = _dequantized(w)
    assert _rel_err(_mul_mat(w, x), x.astype(np.float64) @ wd.T, x, wd) < REL_BOUND


@needs_native
@pytest.mark.parametrize("n", [1, 2, 5, 8, 12, native.MAX_N])
@pytest.mark.parametrize("t", list(CASES), ids=lambda t: t.name)
def test_native_matches_float64_and_xla_path(t, n):
    w = _weight(t, 37, 512, seed=int(t) * 10 + n)
    x = np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32)
    wd = _dequantized(w)
    ref = x.astype(np.float64) @ wd.T
    q, scale, offset = weights._row_arrays(w)
    y = np.asarray(jax.jit(native.int8_matvec)(jnp.asarray(x), q, scale, offset))
    y_xla = _mul_mat(w, x, native_ok=False)
    assert y.shape == (n, 37) and y.dtype == np.float32
    assert _rel_err(y, ref, x, wd) < REL_BOUND
    assert _rel_err(y, y_xla, x, wd) < 2 * REL_BOUND
    np.testing.assert_array_equal(_mul_mat(w, x), y)   # mul_mat dispatches to the kernel


@needs_native
@pytest.mark.parametrize("t", list(CASES), ids=lambda t: t.name)
def test_native_dequantizes_exactly(t):
    """x = unit rows picks single weight columns: every product but one is an exact zero, so
    the result is the dequantized weight itself, bit for bit."""
    w = _weight(t, 37, 256, seed=int(t))
    cols = [0, 15, 16, 31, 100, 255]
    x = np.zeros((len(cols), 256), np.float32)
    x[np.arange(len(cols)), cols] = 1.0
    q, scale, offset = weights._row_arrays(w)
    y = np.asarray(jax.jit(native.int8_matvec)(jnp.asarray(x), q, scale, offset))
    np.testing.assert_array_equal(y, _dequantized(w)[:, cols].T.astype(np.float32))


@needs_native
def test_large_m_split_over_threads():
    """Enough rows for several chunks on the thread pool, M not a multiple of anything."""
    w = _weight(GGMLType.Q4_1, 4099, 256, seed=1)
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


def test_flag_turns_it_off(monkeypatch):
    monkeypatch.setenv("GGMLX_NATIVE", "0")
    assert not native.available()
    w = _weight(GGMLType.Q8_0, 37, 64, seed=0)
    assert "ggmlx_int8" not in _hlo(w, native.MIN_N)



@needs_native
def test_gradient_through_the_kernel_takes_the_xla_path():
    """An FFI call has no derivative: jax.grad and jax.jvp through mul_mat (saliency, llm.trace
    gradients) use the XLA path's, so they equal the gradient with the kernel off."""
    w = _weight(GGMLType.Q4_1, 37, 256, seed=3)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32))
    probe = jnp.asarray(np.random.default_rng(4).standard_normal((4, 37)).astype(np.float32))

    def loss(x, native_ok):
        return jnp.sum(weights.mul_mat(w, x, native_ok=native_ok) * probe)

    assert native.TARGET_OFFSET in jax.jit(lambda x: weights.mul_mat(w, x)).lower(x).as_text()
    g = jax.jit(jax.grad(lambda x: loss(x, True)))(x)
    g_xla = jax.jit(jax.grad(lambda x: loss(x, False)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_xla), rtol=1e-6, atol=1e-6)
    _, t = jax.jvp(lambda x: weights.mul_mat(w, x), (x,), (x,))
    np.testing.assert_allclose(np.asarray(t), _mul_mat(w, np.asarray(x), native_ok=False), rtol=1e-5, atol=1e-5)
