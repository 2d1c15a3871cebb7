"""native.block_matmul, the numerics="ggml" product: activations quantized to the weight
type's vec_dot_type as ggml-cpu does (Q8_0, Q8_1, Q8_K, written again here in numpy from
ggml's definitions), integer dots, against that quantized product in float64; the weights'
dispatch under numerics "ggml"; and a model loaded with it against the exact one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ggmlx import native, quants, types, weights
from ggmlx.types import GGMLType as T

needs_native = pytest.mark.skipif(native.load_error() is not None,
                                  reason=f"the native kernels cannot be used: {native.load_error()}")

KQUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)      # Q8_K activations
TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.MXFP4) + KQUANTS


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    monkeypatch.setenv("GGMLX_NATIVE", "1")


def _f16(v):
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float64)


def q8_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref then dequantized: d = max / -127 by the element of largest
    magnitude, values rounded to nearest (even), capped at 127."""
    x = x.astype(np.float32).reshape(-1, 256)
    mx = x[np.arange(len(x)), np.argmax(np.abs(x), axis=1)]
    safe = np.where(mx != 0, mx, np.float32(1))
    iscale = (np.float32(-127.0) / safe).astype(np.float32)
    q = np.minimum(127, np.rint((iscale[:, None] * x).astype(np.float32)))
    d = np.where(mx != 0, (np.float32(1) / iscale).astype(np.float32), 0)
    return (q * d[:, None].astype(np.float64)).reshape(-1)


def q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml-cpu's x86 quantize_row_q8_0 / q8_1: per 32, d = amax / 127 (kept as f16), values
    rounded to nearest even by 127 / amax. Returns qs [nb, 32], f16 d [nb] and f16 s = d * sum(qs)."""
    x = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(x).max(1)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    q = np.rint((x * inv[:, None]).astype(np.float32)).astype(np.float64)
    return q, _f16(d), _f16(d * q.sum(1).astype(np.float32))


def reference(t: T, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ggml's quantized product in float64: the exact weight values times the quantized x; for
    Q4_1 / Q5_1 the min's term is min * s, s the f16 field of Q8_1 (ggml's vec_dot)."""
    M, K = blocks.shape[0], x.shape[1]
    w = quants.dequantize(blocks.reshape(-1), t, (K, M)).reshape(M, K).astype(np.float64)
    out = np.zeros((x.shape[0], M))
    for n in range(x.shape[0]):
        if t in KQUANTS:
            out[n] = w @ q8_k(x[n])
            continue
        q, d, s = q8_0(x[n])
        if t in (T.Q4_1, T.Q5_1):
            mins = _f16(blocks.reshape(M, -1, 20 if t == T.Q4_1 else 24)[:, :, 2:4].copy().view(np.float16)[..., 0])
            w_no_min = w.reshape(M, -1, 32) - mins[..., None]
            out[n] = np.einsum("mbj,bj->m", w_no_min, q * d[:, None]) + mins @ s
        else:
            out[n] = w @ (q * d[:, None]).reshape(-1)
    return out


def _blocks(t: T, M: int, K: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.asarray(quants.quantize(rng.standard_normal((M, K)).astype(np.float32), t)).reshape(M, -1)


@needs_native
@pytest.mark.parametrize("isa", native.BLOCK_ISAS)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("N,M,K", [(1, 37, 256), (3, 61, 512), (16, 64, 768), (21, 50, 512), (40, 70, 1024)])
def test_block_matmul_is_ggmls_quantized_product(t, N, M, K, isa, monkeypatch):
    """Every row count (the few-row kernels and the tiled ones for prefill), M not a multiple of
    the tiles, every instruction set GGMLX_BLOCK_ISA allows (capped by this CPU's); the error
    is the f32 rounding of the per-block float sums only."""
    monkeypatch.setenv("GGMLX_BLOCK_ISA", isa)
    if t not in KQUANTS and K == 768:
        K = 576      # a 32-element type whose rows end in half a 64-element chunk
    blocks = _blocks(t, M, K, seed=K + N)
    x = (np.random.default_rng(N).standard_normal((N, K)) * 3).astype(np.float32)
    y = np.asarray(native.block_matmul(jnp.asarray(x), jnp.asarray(blocks), int(t)))
    ref = reference(t, blocks, x)
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max()


# Where each type keeps its f16 scales (d, and dmin / m) and MXFP4 its exponent byte, by byte offset.
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}


def _random_blocks(t: T, M: int, K: int, seed: int) -> np.ndarray:
    """Blocks of random bytes (every bit pattern of the values, scales and high bits, which a
    quantizer of smooth data rarely writes: Q3_K's and IQ4_XS's extreme scales, say), their
    float fields set to moderate values."""
    rng = np.random.default_rng(seed)
    row = types.row_size(t, K)
    b = rng.integers(0, 256, (M, row), dtype=np.uint8)
    per = types.traits(t).type_size
    nb = row // per
    blk = b.reshape(M, nb, per)
    if t == T.MXFP4:
        blk[:, :, 0] = rng.integers(118, 130, (M, nb))
    for off in F16_FIELDS.get(t, ()):
        h = (rng.uniform(0.001, 0.02, (M, nb)) * rng.choice([-1, 1], (M, nb))).astype(np.float16)
        blk[:, :, off:off + 2] = h.view(np.uint8).reshape(M, nb, 2)
    return b


@needs_native
@pytest.mark.parametrize("isa", native.BLOCK_ISAS)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_block_matmul_reads_every_bit_pattern(t, isa, monkeypatch):
    """Random block bytes, the few-row kernels (1, 5 rows) and the tiled ones (21, 40 rows)."""
    monkeypatch.setenv("GGMLX_BLOCK_ISA", isa)
    M, K = 45, 512
    blocks = _random_blocks(t, M, K, seed=int(t))
    for N in (1, 5, 21, 40):
        x = (np.random.default_rng(N).standard_normal((N, K)) * 3).astype(np.float32)
        y = np.asarray(native.block_matmul(jnp.asarray(x), jnp.asarray(blocks), int(t)))
        ref = reference(t, blocks, x)
        assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max(), N


LANE_TYPES = [t for t in TYPES if t in weights.LANE_FIELDS]


@needs_native
@pytest.mark.parametrize("isa", [pytest.param(i, marks=pytest.mark.slow) if i in ("plain", "avx2") else i
                                 for i in native.BLOCK_ISAS])   # (their paths unpack the groups: slow tier)
@pytest.mark.parametrize("t", LANE_TYPES, ids=lambda t: t.name)
def test_lanes_format_is_the_same_product(t, isa, monkeypatch):
    """A weight in the lanes format (16-row groups packed across the lanes): the kernels that
    read it in place (AVX-512: 1-16 rows, any row count for Q4_0, Q4_1, Q8_0 and Q4_K) and the
    paths that take its groups back (the lane tiles from 17 rows for the other types; AVX2 and
    plain loops) give ggml's product, on quantized and random-byte blocks; off AVX-512 the same
    bits as from the GGUF blocks."""
    monkeypatch.setenv("GGMLX_BLOCK_ISA", isa)
    K = 512 if t in KQUANTS else 576      # 576: rows ending in half a 64-element chunk
    for seed, blocks in enumerate((_blocks(t, 48, K, 5), _random_blocks(t, 48, K, int(t)))):
        packed = weights.pack_lanes(blocks, t)
        assert not np.array_equal(packed, blocks) and np.array_equal(np.sort(packed, None), np.sort(blocks, None))
        for N in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 21, 40):
            x = (np.random.default_rng(N + seed).standard_normal((N, K)) * 3).astype(np.float32)
            y = np.asarray(native.block_matmul(jnp.asarray(x), jnp.asarray(packed), int(t), lanes=True))
            ref = reference(t, blocks, x)
            assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max(), (N, seed)
            if isa in ("plain", "avx2") or native.block_cpu_isa() < native.BLOCK_ISAS.index("avx512"):
                y0 = np.asarray(native.block_matmul(jnp.asarray(x), jnp.asarray(blocks), int(t)))
                np.testing.assert_array_equal(y, y0)


@needs_native
@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_lanes_format_rows_wider_than_a_cache_block(t):
    """Rows so long that one 16-row group exceeds the bytes the in-place kernels keep in L2 across
    their passes over the activation rows (block_matmul.cc's kPackedBlockBytes): the groups are
    taken one at a time, every pass over each, and the product is still ggml's."""
    M, K = 64, 12288       # a Q8_0 group: 16 x 13056 bytes
    blocks = _blocks(t, M, K, 3)
    packed = weights.pack_lanes(blocks, t)
    for N in (3, 21):
        x = (np.random.default_rng(N).standard_normal((N, K)) * 3).astype(np.float32)
        y = np.asarray(native.block_matmul(jnp.asarray(x), jnp.asarray(packed), int(t), lanes=True))
        ref = reference(t, blocks, x)
        assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max(), N


@needs_native
def test_lanes_format_takes_whole_groups_of_a_lane_type():
    x = jnp.ones((1, 256), jnp.float32)
    with pytest.raises(Exception, match="lanes format takes 16-row groups"):
        native.block_matmul(x, jnp.asarray(_blocks(T.Q4_K, 40, 256, 0)), int(T.Q4_K), lanes=True)
    with pytest.raises(Exception, match="lanes format takes 16-row groups"):
        native.block_matmul(x, jnp.asarray(_blocks(T.IQ4_XS, 48, 256, 0)), int(T.IQ4_XS), lanes=True)


@needs_native
def test_zero_activations_give_zero():
    blocks = _blocks(T.Q4_K, 8, 256, 0)
    y = native.block_matmul(jnp.zeros((2, 256), jnp.float32), jnp.asarray(blocks), int(T.Q4_K))
    assert np.all(np.asarray(y) == 0)


@needs_native
def test_mul_mat_dispatch_under_ggml_numerics():
    """numerics "ggml" holds the type as its blocks and mul_mat runs the kernel for any row
    count (a prefill too); "exact" keeps the int4 format; types the kernel does not read keep
    the exact path."""
    K, M = 512, 48
    blocks = _blocks(T.Q4_K, M, K, 1)
    wg = weights.to_device(blocks.reshape(-1), T.Q4_K, (K, M), weight_format="int4", numerics="ggml")
    we = weights.to_device(blocks.reshape(-1), T.Q4_K, (K, M), weight_format="int4")
    assert (wg.spec.format, wg.spec.numerics) == (weights.FORMAT_BLOCKS, "ggml")
    assert (we.spec.format, we.spec.numerics) == (weights.FORMAT_INT4, "exact")
    for n in (1, 7, 100):
        x = np.random.default_rng(n).standard_normal((n, K)).astype(np.float32)
        y = np.asarray(jax.jit(weights.mul_mat)(wg, jnp.asarray(x)))
        np.testing.assert_allclose(y, reference(T.Q4_K, blocks, x), rtol=0, atol=2e-6 * np.abs(y).max())
        exact = np.asarray(jax.jit(weights.mul_mat)(we, jnp.asarray(x)))
        assert 0 < np.abs(y - exact).max() < 0.05 * np.abs(exact).max()   # quantized x: close, not equal
    iq = _blocks(T.TQ2_0, M, K, 2)
    wx = weights.to_device(iq.reshape(-1), T.TQ2_0, (K, M), weight_format="int4", numerics="ggml")
    assert wx.spec.numerics == "exact"


@needs_native
def test_gradient_takes_the_exact_path():
    K, M = 256, 16
    blocks = _blocks(T.Q6_K, M, K, 3)
    w = weights.to_device(blocks.reshape(-1), T.Q6_K, (K, M), numerics="ggml")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, K)).astype(np.float32))
    g = jax.grad(lambda x: weights.mul_mat(w, x).sum())(x)
    dense = quants.dequantize(blocks.reshape(-1), T.Q6_K, (K, M)).reshape(M, K)
    np.testing.assert_allclose(np.asarray(g), np.broadcast_to(dense.sum(0), (2, K)), rtol=1e-5, atol=1e-5)


def test_bad_block_isa_is_a_value_error(monkeypatch):
    monkeypatch.setenv("GGMLX_BLOCK_ISA", "sse2")
    with pytest.raises(ValueError, match="GGMLX_BLOCK_ISA must be one of plain, avx2, avx512, amx, got 'sse2'"):
        native.block_isa()


def test_bad_numerics_is_a_value_error():
    with pytest.raises(ValueError, match="numerics must be one of exact, ggml"):
        weights.check_format("auto", "fast")


FIXTURES = __import__("pathlib").Path(__file__).parent / "data" / "fixtures"


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["apertus", "exaone4", "falcon-h1", "smollm3", "mamba2"])
def test_ggml_numerics_follow_llamacpps_quantized_run(arch):
    """On Q8_0 fixtures whose exact-mode top-1 differs from llama.cpp's quantized run at some
    positions (0.93-0.97), numerics "ggml" agrees at every position: the product is
    llama.cpp's own (Q8_0 activations, integer dots). The fixtures' runs used an F32 cache, so
    both modes name it (a "ggml" context otherwise takes llama.cpp's default, f16)."""
    import llm
    ref = np.load(FIXTURES / f"{arch}.npz")
    n_seq = len([n for n in ref.files if n.startswith("tokens_")])
    agree = {}
    for numerics in ("exact", "ggml"):
        ctx = llm.Context(llm.load_model(FIXTURES / f"{arch}-Q8_0.gguf", numerics=numerics), n_ctx=64, n_ubatch=32,
                          type_k="f32", type_v="f32")
        hits = []
        for k in range(n_seq):
            ctx.memory_clear()
            toks = ref[f"tokens_{k}"]
            assert ctx.decode(llm.Batch(toks, logits=np.ones(len(toks), bool))) == 0
            hits.append(ctx.get_logits().argmax(1) == ref[f"q_top1_{k}"])
        agree[numerics] = float(np.concatenate(hits).mean())
    assert agree["exact"] < 1.0
    assert agree["ggml"] == 1.0


def test_load_model_refuses_bad_numerics():
    import llm
    path = FIXTURES / "smollm3-Q8_0.gguf"
    with pytest.raises(ValueError, match="numerics must be one of exact, ggml, got 'fast'"):
        llm.load_model(path, numerics="fast")
    with pytest.raises(ValueError, match="numerics 'ggml' works with split_mode 'layer' only"):
        llm.load_model(path, numerics="ggml", split_mode="row")
