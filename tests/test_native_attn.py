"""The native decode attention (ggmlx/native attn_decode): within f32 rounding of a float64
reference over strided K/V caches (f32, f16 and Q8_0 blocks, grouped heads, offsets, masked
cells, soft cap), and the same logits as the XLA path when the flash_attn_ext lowering
dispatches to it in decode steps of tiny llama and gemma3 models (sliding-window caches and a
rotated Q8_0 cache included)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llm
from ggmlx import compile, lower, native, quants
from ggmlx.types import GGMLType
from tests import tiny_model

needs_native = pytest.mark.skipif(
    native.load_error() is not None,
    reason=f"the native kernels cannot be used: {native.load_error()}")


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    monkeypatch.setenv("GGMLX_NATIVE", "1")


def _reference(q, k, v, mask, scale, softcap):
    """float64 attention: q [n_q, H, D], k/v [n_kv, Hkv, D], mask [n_q, n_kv] -> [n_q, H, Dv]."""
    n_q, H, _ = q.shape
    g = np.arange(H) // (H // k.shape[1])
    s = np.einsum("qhd,khd->qhk", q, k[:, g]) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    s = s + mask[:, None, :]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("qhk,khd->qhd", p, v[:, g])


def _held(kc: np.ndarray, vc: np.ndarray, cache: GGMLType):
    """f32 K and V cache rows [cells, Hkv * D] as the cache holds them (f32, f16, or a block type's
    bytes) and the values they hold (float64, same shape)."""
    if cache in (GGMLType.F32, GGMLType.F16):
        dtype = np.float16 if cache == GGMLType.F16 else np.float32
        held = [c.astype(dtype) for c in (kc, vc)]
        return held, [c.astype(np.float64) for c in held]
    held = [quants.quantize(c, cache) for c in (kc, vc)]
    return held, [quants.dequantize(h, cache, kc.shape[::-1]).astype(np.float64) for h in held]


def _attend_whole_cache(q, kc, vc, mask, cache: GGMLType, n_head_kv: int, dv: int, scale: float = 0.125):
    """attn_decode over every cell of the caches kc, vc [cells, Hkv * row] (no offset)."""
    row = kc.shape[1] * kc.dtype.itemsize
    return np.asarray(native.attn_decode(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(mask),
                                         kv_type=int(cache), n_kv=kc.shape[0], n_head_kv=n_head_kv, k_off=0,
                                         k_cell=row, k_head=row // n_head_kv, v_off=0, v_cell=row,
                                         v_head=row // n_head_kv, dv=dv, scale=scale, softcap=0.0))


@needs_native
@pytest.mark.parametrize("cache", [GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1,
                                   GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.IQ4_NL], ids=lambda t: t.name)
@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize("n_q,H,Hkv,D", [(1, 4, 2, 32), (3, 9, 3, 64), (2, 4, 1, 256), (1, 3, 3, 24)])
def test_attn_decode_matches_float64(cache, softcap, n_q, H, Hkv, D):
    """The cache is [kv_size, Hkv * D] (ggml's K cache; a block type: its rows of blocks), read from
    cell 5 on for n_kv cells; the reference reads the values the cache holds."""
    quantized = cache not in (GGMLType.F32, GGMLType.F16)
    if quantized and D % 32:
        pytest.skip("block rows are whole blocks of 32")
    rng = np.random.default_rng(D + n_q)
    kv_size, first, n_kv = 48, 5, 30
    (kc, vc), kv = _held(*(rng.standard_normal((kv_size, Hkv * D)).astype(np.float32) for _ in range(2)), cache)
    row = kc.shape[1] * kc.dtype.itemsize          # bytes of a cell's row
    head = row // Hkv
    q = rng.standard_normal((n_q, H, D)).astype(np.float32)
    mask = np.zeros((n_q, n_kv), np.float32)
    mask[:, rng.random(n_kv) < 0.3] = -np.inf
    mask[:, 0] = 0.0
    mask[-1, 1:4] = -1.5
    scale = 1.0 / np.sqrt(D)
    f = jax.jit(lambda q, k, v, m: native.attn_decode(
        q, k, v, m, kv_type=int(cache), n_kv=n_kv, n_head_kv=Hkv, k_off=first * row, k_cell=row, k_head=head,
        v_off=first * row, v_cell=row, v_head=head, dv=D, scale=scale, softcap=softcap))
    out = np.asarray(f(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(mask)))
    cells = slice(first, first + n_kv)
    ref = _reference(q.astype(np.float64), kv[0][cells].astype(np.float64).reshape(n_kv, Hkv, D),
                     kv[1][cells].astype(np.float64).reshape(n_kv, Hkv, D), mask.astype(np.float64), scale, softcap)
    assert out.shape == (n_q, H, D) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


@needs_native
@pytest.mark.parametrize("cache", [GGMLType.F32, GGMLType.F16, GGMLType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n_prompt", [0, 9, 40])
def test_attn_decode_interleaved_sequences(cache, n_prompt):
    """A batched step as the server makes it: 5 sequences whose cells interleave in the cache (each
    decoded its tokens in the same steps), a decode row per sequence and a prompt chunk of a sixth
    with a causal mask; each row lets through its own scattered cells only."""
    rng = np.random.default_rng(n_prompt)
    H, Hkv, D, n_seq, n_each = 6, 2, 64, 5, 37
    n_kv = n_seq * n_each + n_prompt + 3
    owner = np.full(n_kv, -1)
    owner[:n_seq * n_each] = np.arange(n_seq * n_each) % n_seq       # cells 0, 5, 10, ... are sequence 0's
    owner[n_seq * n_each:n_seq * n_each + n_prompt] = n_seq
    rows = [owner == s for s in range(n_seq)]
    first_prompt = n_seq * n_each
    rows += [(owner == n_seq) & (np.arange(n_kv) <= first_prompt + j) for j in range(n_prompt)]
    mask = np.where(np.stack(rows), 0.0, -np.inf).astype(np.float32)
    (kc, vc), kv = _held(*(rng.standard_normal((n_kv, Hkv * D)).astype(np.float32) for _ in range(2)), cache)
    q = rng.standard_normal((len(rows), H, D)).astype(np.float32)
    out = _attend_whole_cache(q, kc, vc, mask, cache, Hkv, D)
    ref = _reference(q.astype(np.float64), kv[0].reshape(n_kv, Hkv, D), kv[1].reshape(n_kv, Hkv, D),
                     mask.astype(np.float64), 0.125, 0.0)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


@needs_native
@pytest.mark.parametrize("cache", [GGMLType.F32, GGMLType.F16, GGMLType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n_q", [1, 2])
def test_attn_decode_long_rows_split_into_runs(cache, n_q):
    """Rows of hundreds of cells split into runs across threads (flash-decoding) and into blocks
    within a run: the scores rise along the cells in one row (each block a new maximum, what was
    summed before rescaled) and fall in the other, a run of masked cells lies inside the row, and a
    row of fewer live cells than a block ends the batch; the merged softmax is the float64 one."""
    rng = np.random.default_rng(n_q)
    H, Hkv, D, n_kv = 8, 2, 64, 1000
    kc, vc = (rng.standard_normal((n_kv, Hkv * D)).astype(np.float32) for _ in range(2))
    kc *= np.linspace(0.2, 3.0, n_kv, dtype=np.float32)[:, None]       # later cells score further from 0
    (kc, vc), kv = _held(kc, vc, cache)
    k64 = kv[0].reshape(n_kv, Hkv, D)
    q = np.empty((n_q + 1, H, D), np.float32)
    q[0] = k64[-1, np.arange(H) // (H // Hkv)]                          # row 0 aligned with the last cells
    q[1:] = -q[0] if n_q > 1 else rng.standard_normal((1, H, D))
    q *= 0.2
    mask = np.zeros((n_q + 1, n_kv), np.float32)
    mask[:, 300:420] = -np.inf
    mask[-1, 40:] = -np.inf
    out = _attend_whole_cache(q, kc, vc, mask, cache, Hkv, D)
    ref = _reference(q.astype(np.float64), k64, kv[1].reshape(n_kv, Hkv, D), mask.astype(np.float64), 0.125, 0.0)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


@needs_native
def test_attn_decode_fully_masked_row_is_zero():
    q = np.ones((2, 2, 16), np.float32)
    kc = np.ones((8, 32), np.float32)
    mask = np.zeros((2, 8), np.float32)
    mask[1] = -np.inf
    out = np.asarray(native.attn_decode(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(kc), jnp.asarray(mask),
                                        kv_type=0, n_kv=8, n_head_kv=2, k_off=0, k_cell=128, k_head=64, v_off=0,
                                        v_cell=128, v_head=64, dv=16, scale=1.0, softcap=0.0))
    np.testing.assert_allclose(out[0], 1.0, rtol=1e-6)
    assert np.all(out[1] == 0.0)


@needs_native
def test_attn_decode_rejects_strides_outside_the_cache():
    kc = jnp.ones((8, 32), jnp.float32)
    with pytest.raises(Exception, match="outside the K or V buffer"):
        native.attn_decode(jnp.ones((1, 2, 16), jnp.float32), kc, kc, jnp.zeros((1, 9), jnp.float32),
                           kv_type=0, n_kv=9, n_head_kv=2, k_off=0, k_cell=128, k_head=64, v_off=0, v_cell=128,
                           v_head=64, dv=16, scale=1.0, softcap=0.0).block_until_ready()
    with pytest.raises(Exception, match="the bytes of one block type"):
        native.attn_decode(jnp.ones((1, 2, 16), jnp.float32), kc, kc, jnp.zeros((1, 8), jnp.float32),
                           kv_type=8, n_kv=8, n_head_kv=2, k_off=0, k_cell=128, k_head=64, v_off=0, v_cell=128,
                           v_head=64, dv=16, scale=1.0, softcap=0.0).block_until_ready()


def _decode_logits(path, type_k: str, swa_full: bool = True) -> np.ndarray:
    """Logits of a 12-token prompt's last position, then of 6 one-token steps and one
    3-token step (the dispatch's range: 1..native.ATTN_MAX_N query rows), compiled afresh."""
    compile.get_default_cache().clear()
    model = llm.load_model(path)
    ctx = llm.Context(model, n_ctx=64, n_ubatch=16, kv_bucket=32, type_k=type_k, type_v=type_k, swa_full=swa_full)
    assert ctx.decode(llm.Batch(tiny_model.prompt_tokens(12))) == 0, ctx.last_error
    rows = [ctx.get_logits_ith(-1).copy()]
    for k in range(6):
        assert ctx.decode(llm.Batch.get_one([7 + k])) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1).copy())
    assert ctx.decode(llm.Batch([20, 21, 22], pos=[18, 19, 20], logits=np.ones(3, bool))) == 0, ctx.last_error
    rows.extend(ctx.get_logits_ith(i).copy() for i in range(3))
    return np.stack(rows)


@needs_native
@pytest.mark.parametrize("arch,type_k,swa_full", [("llama", "f32", True), ("llama", "f16", True),
                                                  ("llama", "q8_0", True), ("llama", "q5_1", True),
                                                  ("gemma3", "f32", True), ("gemma3", "f32", False)])
@pytest.mark.slow
def test_decode_logits_match_the_xla_path(tmp_path, monkeypatch, arch, type_k, swa_full):
    """q8_0, q5_1: head size 64, so Q, K and V are turned by Hadamard matrices (KVCache.n_rot_k/v)."""
    spec = tiny_model.TinySpec(arch=arch, n_layer=6 if arch == "gemma3" else 2,
                               n_head_kv=1 if arch == "gemma3" else 2, seed=3,
                               n_embd=256 if type_k in ("q8_0", "q5_1") else 64)
    path = tiny_model.write_model(tmp_path / f"{arch}.gguf", spec)
    monkeypatch.setenv("GGMLX_EXE_CACHE", "0")
    calls = []
    real = lower._flash_attn_native

    def counting(n, env):
        out = real(n, env)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(lower, "_flash_attn_native", counting)
    ours = _decode_logits(path, type_k, swa_full)
    assert any(calls), "the decode graphs never took the native attention"
    monkeypatch.setattr(lower, "_flash_attn_native", lambda n, env: None)
    xla = _decode_logits(path, type_k, swa_full)
    np.testing.assert_allclose(ours, xla, rtol=0, atol=2e-5 * np.abs(xla).max())
