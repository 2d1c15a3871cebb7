"""Lowering: what each op computes, in JAX.

A value is a jax array in numpy order: shape `tuple(reversed(t.ne))`, i.e. [ne3, ne2, ne1,
ne0]; of a block type (a quantized KV cache, its views) the rows of block bytes
(`tensor.buffer_layout`), which views, permutes and set_rows move as bytes and every other
op reads dequantized (`_value`): attention over a view of the cache dequantizes only the
cells it reads. Each op's lowering is one function registered in `LOWERINGS` by `@lowers(Op.X)`
(docs/adding-an-op.md). `run_nodes` evaluates a list of nodes in order, each inside
`jax.named_scope(name)`, and is called only while tracing: after compilation no Python runs
per op.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import ops as ops_mod
from ggmlx import quants, types, weights
from ggmlx.ops import GLU_GEGLU, GLU_REGLU, GLU_SWIGLU, GLU_SWIGLU_OAI, ROPE_TYPE_NORMAL, SORT_DESC
from ggmlx.tensor import VIEW_OPS, Flag, Op, Tensor, buffer_layout, np_dtype
from ggmlx.types import GGMLType


def jnp_dtype(t: GGMLType):
    return jnp.dtype(np_dtype(t))


def _f32(x):
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


def _tile_to(b, shape):
    """Repeat b into shape the way ggml repeats src1 (tiling, not only broadcasting)."""
    if b.shape == tuple(shape):
        return b
    if all(bd == 1 or bd == sd for bd, sd in zip(b.shape, shape, strict=False)):
        return jnp.broadcast_to(b, shape)
    return jnp.tile(b, [sd // bd for sd, bd in zip(shape, b.shape, strict=False)])


def _value(env, t: Tensor):
    """A source's value; a weight leaf is read where it is used: plain types keep their
    dtype, block-quantized ones are dequantized to f32 (so are block-typed nodes: a window
    of a quantized KV cache)."""
    if t.flags & Flag.WEIGHT:
        w = env[t]
        return w.array if w.spec.format == weights.FORMAT_PLAIN else weights.materialize(w)
    if _holds_blocks(t):
        return quants.dequantize_jax(env[t], t.type, t.ne)
    return env[t]


def _holds_blocks(t: Tensor) -> bool:
    """Is t's value the bytes of its blocks: a block-typed state (a quantized KV cache) and
    the views of it? (A block-typed weight and its views are dequantized where read.)"""
    return types.traits(t.type).is_quantized and not _view_base(t)[0].flags & Flag.WEIGHT


def _memory(env, t: Tensor):
    """A source's value as the ops that only move memory see it: block bytes where t holds
    them (tensor.buffer_layout), else _value."""
    return env[t] if _holds_blocks(t) else _value(env, t)


def _value_f32(env, t: Tensor):
    """A source's value as f32."""
    return _f32(_value(env, t))


# ---- views -----------------------------------------------------------------------------

def _view_base(t: Tensor) -> tuple[Tensor, int]:
    """The tensor whose memory a chain of views reads, and the total byte offset into it."""
    offs = 0
    while t.op in VIEW_OPS:
        offs += t.view_offs
        t = t.src[0]
    return t, offs


def strided_window(flat, esz: int, ne, nb, offset: int):
    """Elements of flat memory at offset + sum(i_k * nb_k), as an array of numpy shape
    reversed(ne). Uses reshape + static slices when the strides nest (every real view in
    llama graphs), else a gather."""
    s = [n // esz for n in nb]
    o = offset // esz
    dims = sorted((d for d in range(4) if ne[d] > 1), key=lambda d: -s[d])
    out_shape = tuple(reversed(ne))
    if not dims:
        return flat[o].reshape(out_shape)
    nested = all(s[a] % s[b] == 0 and s[a] >= ne[b] * s[b] for a, b in zip(dims, dims[1:], strict=False))
    if nested:
        length = ne[dims[0]] * s[dims[0]]
        window = jax.lax.slice(flat, (o,), (min(o + length, flat.shape[0]),))
        if window.shape[0] < length:
            window = jnp.pad(window, (0, length - window.shape[0]))
        shape = [ne[dims[0]]] + [s[a] // s[b] for a, b in zip(dims, dims[1:], strict=False)] + [s[dims[-1]]]
        x = window.reshape(shape)
        x = x[tuple(slice(0, ne[d]) for d in dims) + (0,)]
        order = sorted(range(len(dims)), key=lambda k: -dims[k])
        return jnp.transpose(x, order).reshape(out_shape)
    idx = np.full(out_shape, o, dtype=np.int64)
    for d in range(4):
        axis_shape = [1, 1, 1, 1]
        axis_shape[3 - d] = ne[d]
        idx = idx + (np.arange(ne[d], dtype=np.int64) * s[d]).reshape(axis_shape)
    return jnp.take(flat, jnp.asarray(idx))


def _view(env, t: Tensor):
    base, offs = _view_base(t)
    flat = _memory(env, base).reshape(-1)
    if _holds_blocks(t):        # rows of block bytes
        ne = (types.row_size(t.type, t.ne[0]), *t.ne[1:])
        return strided_window(flat, 1, ne, (1, *t.nb[1:]), offs)
    return strided_window(flat, types.type_size(t.type), t.ne, t.nb, offs)


# ---- math ops --------------------------------------------------------------------------

def _mul_mat(a, b):
    """a [A3, A2, M, K], b [B3, B2, N, K] -> [B3, B2, N, M] with ggml's channel broadcast."""
    A3, A2, M, K = a.shape
    B3, B2, N, _ = b.shape
    r3, r2 = B3 // A3, B2 // A2
    if r2 == 1 and r3 == 1:
        return jnp.einsum("xymk,xynk->xynm", a, b, precision=weights.matmul_precision())
    bb = b.reshape(A3, r3, A2, r2, N, K)
    out = jnp.einsum("xzmk,xyzwnk->xyzwnm", a, bb, precision=weights.matmul_precision())
    return out.reshape(B3, B2, N, M)


def _rope_cache(pos, ff, p):
    """ggml's rope cache as the two factors of x * c + swap(x) * s, both [1, T, 1, n_dims]:
    c holds cos of each rotated pair at both of its elements, s -sin at the first and sin at
    the second (swap exchanges the two elements of every pair, see _rope)."""
    n_dims, mode, n_ctx_orig, base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = p[:9]
    half = ops_mod.rope_pairs(n_dims, mode)
    theta_scale = np.float32(base) ** np.float32(-2.0 / n_dims)
    # ggml advances theta = pos by repeated f32 multiplication by theta_scale. Here pos times
    # the f32 powers of theta_scale (each made by that same recurrence): within 17 ULP of ggml's
    # for positions < 4096 (the traced chain came to 65 ULP, XLA folding its constants, and 128
    # small kernels per rope cache: 0.6 ms of a Gemma3 decode step)
    powers = np.ones(half, np.float32)
    for i in range(1, half):
        powers[i] = powers[i - 1] * theta_scale
    if mode == ops_mod.ROPE_TYPE_VISION:
        # each section's thetas start again from its first frequency (ggml's indep_sects)
        sections = p[9:13]
        starts = np.cumsum((0,) + tuple(sections[:3]))[ops_mod.mrope_streams(n_dims, sections, mode)]
        powers = powers[np.arange(half) % sum(sections) - starts]
    pos = _f32(pos)
    theta_extrap = (pos if pos.ndim == 2 else pos[:, None]) * powers[None, :]      # [T, half]
    if ff is not None:
        theta_extrap = theta_extrap / _f32(ff).reshape(-1)[:half]
    theta_interp = freq_scale * theta_extrap
    mscale = attn_factor
    if ext_factor != 0.0:
        def corr_dim(n_rot):
            return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(0.0, math.floor(corr_dim(beta_fast)))
        high = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
        y = (np.arange(half, dtype=np.float32) - low) / max(0.001, high - low)
        ramp = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
        theta = theta_interp * (1 - ramp) + theta_extrap * ramp
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    else:
        theta = theta_interp
    cos = (jnp.cos(theta) * mscale)[None, :, None, :]          # [1, T, 1, half]
    sin = (jnp.sin(theta) * mscale)[None, :, None, :]
    if mode != ROPE_TYPE_NORMAL:                                 # pair i: elements i and i + half
        return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)
    shape = cos.shape[:-1] + (n_dims,)                           # pair i: elements 2i and 2i + 1
    return (jnp.stack([cos, cos], axis=-1).reshape(shape), jnp.stack([-sin, sin], axis=-1).reshape(shape))


def _rope(x, c, s, p):
    """Each pair (x0, x1) becomes (x0 cos - x1 sin, x0 sin + x1 cos), as x * c + swap(x) * s:
    the same terms (a - b is a + -b) in one elementwise kernel, where the two halves written
    apart took two (0.4 ms each per Gemma3 prefill rope; the prefill ubatch 315 -> 297 ms).
    XLA may contract either form into FMAs: results agree within 1 ULP."""
    n_dims, mode = p[:2]
    half = ops_mod.rope_pairs(n_dims, mode)
    x = _f32(x)
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    if mode != ROPE_TYPE_NORMAL:
        swapped = jnp.concatenate([rot[..., half:], rot[..., :half]], axis=-1)
    else:
        swapped = rot.reshape(rot.shape[:-1] + (half, 2))[..., ::-1].reshape(rot.shape)
    out = rot * c + swapped * s
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """Per-head ALiBi slopes as ggml's soft_max computes them; ones when max_bias is 0."""
    if max_bias <= 0.0:
        return np.ones(n_head, np.float32)
    n_head_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    h = np.arange(n_head)
    return np.where(h < n_head_log2, m0 ** (h + 1), m1 ** (2 * (h - n_head_log2) + 1)).astype(np.float32)


def _mask_for(mask, rows: int, shape):
    """Trim mask padding rows and tile it over the head and batch dims of shape."""
    m = _f32(mask)[:, :, :rows, :]
    return _tile_to(m, shape)


def _soft_max(a, mask, scale, max_bias):
    x = _f32(a) * scale
    if mask is not None:
        m = _mask_for(mask, x.shape[2], x.shape)
        slopes = alibi_slopes(x.shape[1], max_bias)[None, :, None, None]
        x = x + (m * slopes if max_bias > 0 else m)
    return jax.nn.softmax(x, axis=-1)


def _flash_attn(q, k, v, mask, scale, max_bias, softcap, sinks=None):
    """q [B, H, n_q, D], k [B, Hkv, n_kv, D], v [B, Hkv, n_kv, Dv] -> [B, n_q, H, Dv];
    sinks [H]: an extra softmax term exp(sink - max) per head, with no value."""
    n_q, n_kv = q.shape[2], k.shape[2]
    if n_q == 1 and k.shape[1] == 1:
        return _flash_attn_one_query(q, k, v, mask, scale, max_bias, softcap, sinks)
    if mask is not None and n_q >= 2 * CAUSAL_BLOCK and n_q % CAUSAL_BLOCK == 0 and n_kv >= n_q:
        return _flash_attn_causal(q, k, v, mask, scale, max_bias, softcap, sinks)
    return _flash_attn_dense(q, k, v, mask, scale, max_bias, softcap, sinks)


def _flash_attn_dense(q, k, v, mask, scale, max_bias, softcap, sinks=None):
    """_flash_attn over every one of the n_kv cells."""
    B, H, n_q, D = q.shape
    Hkv, n_kv = k.shape[1], k.shape[2]
    r = H // Hkv
    qq = _f32(q).reshape(B, Hkv, r, n_q, D)
    s = jnp.einsum("bgrqd,bgkd->bgrqk", qq, _f32(k), precision=weights.matmul_precision()) * scale
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    if mask is not None:
        m = _mask_for(mask, n_q, (B, H, n_q, n_kv)).reshape(B, Hkv, r, n_q, n_kv)
        slopes = alibi_slopes(H, max_bias).reshape(1, Hkv, r, 1, 1)
        s = s + (m * slopes if max_bias > 0 else m)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sk = _f32(sinks).reshape(1, Hkv, r, 1, 1)
        mx = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sk)
        e = jnp.exp(s - mx)
        p = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sk - mx))
    o = jnp.einsum("bgrqk,bgkd->bgrqd", p, _f32(v), precision=weights.matmul_precision())
    return o.reshape(B, H, n_q, -1).transpose(0, 2, 1, 3)


# Query rows per block of the causal path: a prefill ubatch of 512 rows in 4 blocks reads 62.5%
# of the score matrix (Gemma3-270M pp512: the attention's dots 191 -> 121 ms of a 1150 ms ubatch).
CAUSAL_BLOCK = 128


def _flash_attn_causal(q, k, v, mask, scale, max_bias, softcap, sinks=None):
    """_flash_attn for a ubatch of many query rows, skipping the cells a causal mask hides.

    A ubatch's tokens usually sit in the last n_q of the n_kv cells, in order (a prompt
    appended to the cache), so query block i (CAUSAL_BLOCK rows) sees no cell past
    n_kv - (n_blocks - 1 - i) * CAUSAL_BLOCK. When the mask says so for every block, each block
    attends to that prefix of the cells only; otherwise (cells reused out of order, several
    sequences) the dense path runs. The skipped cells are -inf in the mask, so they add exactly
    nothing to the softmax: the two paths differ only in the order of the f32 sums. ggml's CPU
    kernel likewise skips each cell the mask hides."""
    n_q, n_kv = q.shape[2], k.shape[2]
    m = _f32(mask)[:, :, :n_q, :]
    ends = causal_block_ends(n_q, n_kv)

    def blocks(q, k, v, m):
        outs = []
        for i, end in enumerate(ends):
            rows = slice(i * CAUSAL_BLOCK, (i + 1) * CAUSAL_BLOCK)
            outs.append(_flash_attn_dense(q[:, :, rows], k[:, :, :end], v[:, :, :end], m[:, :, rows, :end],
                                          scale, max_bias, softcap, sinks))
        return jnp.concatenate(outs, axis=1)

    def dense(q, k, v, m):
        return _flash_attn_dense(q, k, v, m, scale, max_bias, softcap, sinks)

    return jax.lax.cond(causal_blocks_apply(m, ends), blocks, dense, q, k, v, m)


def causal_block_ends(n_q: int, n_kv: int) -> list[int]:
    """The cells [0, end) query block i of the causal path may see, one end per block."""
    n_blocks = n_q // CAUSAL_BLOCK
    return [n_kv - (n_blocks - 1 - i) * CAUSAL_BLOCK for i in range(n_blocks)]


def causal_blocks_apply(m, ends: list[int]):
    """True (a traced bool) when the mask m [.., .., n_q, n_kv] hides every cell at or past
    ends[i] from every row of query block i: then the blocks give the dense result."""
    return jnp.all(jnp.stack([jnp.all(m[:, :, i * CAUSAL_BLOCK:(i + 1) * CAUSAL_BLOCK, end:] == -jnp.inf)
                              for i, end in enumerate(ends[:-1])]))


def _flash_attn_one_query(q, k, v, mask, scale, max_bias, softcap, sinks=None):
    """_flash_attn for one query row per head over one KV head (a Gemma3 decode step), with
    K and V read in the cache's own layout [n_kv, D]: the batched form made XLA:CPU copy K
    transposed to [D, n_kv] before the dot (145 us per Gemma3 layer at n_kv 256). Here the
    heads are the columns of one matrix product, and only the n_kv rows are sliced. With
    several KV heads the same trick needs a block-diagonal q, into which XLA fuses the rope
    and recomputes it per KV head: measured no faster for SmolLM2 (3 KV heads)."""
    B, H, _, D = q.shape
    n_kv = k.shape[2]
    kf, vf = _f32(k).reshape(B, n_kv, D), _f32(v).reshape(B, n_kv, -1)
    s = jnp.einsum("bkd,bhd->bkh", kf, _f32(q).reshape(B, H, D), precision=weights.matmul_precision()) * scale
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    if mask is not None:
        m = _mask_for(mask, 1, (B, H, 1, n_kv)).reshape(B, H, n_kv).transpose(0, 2, 1)
        s = s + (m * alibi_slopes(H, max_bias)[None, None, :] if max_bias > 0 else m)
    if sinks is None:
        p = jax.nn.softmax(s, axis=1)
    else:
        sk = _f32(sinks).reshape(1, 1, H)
        mx = jnp.maximum(jnp.max(s, axis=1, keepdims=True), sk)
        e = jnp.exp(s - mx)
        p = e / (jnp.sum(e, axis=1, keepdims=True) + jnp.exp(sk - mx))
    o = jnp.einsum("bkh,bkd->bhd", p, vf, precision=weights.matmul_precision())
    return o.reshape(B, 1, H, -1)


def _gelu(x):
    """The tanh approximation, computed exactly. ggml-cpu reads it from an fp16 table instead;
    emulating the table moves synthetic Gemma logits 4x closer to llama.cpp but makes them
    jump with the last bit of x, so results would depend on the ubatch size."""
    return jax.nn.gelu(x, approximate=True)


def _glu(n: Tensor, env):
    op, swapped = n.op_params[:2]
    a = _value_f32(env, n.src[0])
    if op == GLU_SWIGLU_OAI:
        alpha, limit = n.op_params[2:]
        x = jnp.minimum(a, limit)
        y = jnp.clip(_value_f32(env, n.src[1]), -limit, limit)
        return x / (1.0 + jnp.exp(alpha * -x)) * (y + 1.0)
    act = {GLU_SWIGLU: jax.nn.silu, GLU_GEGLU: _gelu, GLU_REGLU: jax.nn.relu}[op]
    if len(n.src) == 2:
        x, g = a, _value_f32(env, n.src[1])
    else:
        half = a.shape[-1] // 2
        x, g = a[..., :half], a[..., half:]
    if swapped:
        x, g = g, x
    return act(x) * g


def _mul_mat_id(as_, b, ids):
    """as_ [1, E, M, K]; b [1, T, n_b, K]; ids [1, 1, T, n_used] -> [1, T, n_used, M]."""
    w = as_[0]                                                 # [E, M, K]
    idx = ids[0, 0]                                            # [T, n_used]
    bb = jnp.broadcast_to(b[0], (idx.shape[0], idx.shape[1], b.shape[-1]))
    picked = jnp.take(w, idx, axis=0)                          # [T, n_used, M, K]
    return jnp.einsum("tumk,tuk->tum", picked, bb, precision=weights.matmul_precision())[None]


def _get_rows(env, n: Tensor):
    a, b = n.src
    idx = env[b]                                               # [1, b2, b1, n] numpy order
    if a.flags & Flag.WEIGHT and a.ne[2] == 1 and a.ne[3] == 1 and b.ne[1] == 1 and b.ne[2] == 1:
        rows = weights.get_rows(env[a], idx.reshape(-1))
        return rows.reshape(n.shape)
    src = _value_f32(env, a) if a.type != GGMLType.I32 else _value(env, a)
    # src [A3, A2, R, ne0]; per (i3, i2) channel pick rows idx[0, i3, i2]
    return jax.vmap(jax.vmap(lambda m, i: jnp.take(m, i, axis=0)))(src, idx[0])


def _set_rows(env, n: Tensor):
    dst, src, idx = n.src
    d = _memory(env, dst)
    v = _value_f32(env, src)
    if types.traits(dst.type).is_quantized:     # ggml's from_float of each row
        v = quants.quantize_jax(v, dst.type).reshape(*v.shape[:-1], -1)
    v = v.astype(d.dtype)
    if idx.ne[1] > 1:           # per ne2 slice j: its own rows c[:, j] (ne3 = 1)
        rows2 = _value(env, idx).reshape(idx.ne[1], idx.ne[0]).astype(jnp.int32)
        slices = jnp.arange(idx.ne[1])[:, None]
        return d.at[0, slices, rows2, :].set(v[0], mode="drop", wrap_negative_indices=False)
    rows = _value(env, idx).reshape(-1).astype(jnp.int32)
    # negative indices must be dropped too, not wrapped to the last rows as numpy indexing would
    return d.at[:, :, rows, :].set(v, mode="drop", wrap_negative_indices=False)


def _argsort(a, order):
    a = _f32(a)
    return jnp.argsort(-a if order == SORT_DESC else a, axis=-1, stable=True).astype(jnp.int32)


# ---- the lowering table ----------------------------------------------------------------

Lowering = Callable[[Tensor, dict], jax.Array]

LOWERINGS: dict[Op, Lowering] = {}
"""Op -> fn(node, env) giving the node's value from its sources' values in env."""


def lowers(*ops: Op) -> Callable[[Lowering], Lowering]:
    """Register fn as the lowering of ops (one entry per op; a second registration is a bug)."""
    def register(fn: Lowering) -> Lowering:
        for op in ops:
            if op in LOWERINGS:
                raise ValueError(f"op {op.value} already lowered by {LOWERINGS[op].__name__}")
            LOWERINGS[op] = fn
        return fn
    return register


_BINARY: dict[Op, Callable[..., jax.Array]] = {
    Op.ADD: jnp.add, Op.SUB: jnp.subtract, Op.MUL: jnp.multiply, Op.DIV: jnp.divide}


@lowers(Op.ADD, Op.SUB, Op.MUL, Op.DIV)
def lower_binary(n: Tensor, env):
    a = _value_f32(env, n.src[0])
    b = _tile_to(_value_f32(env, n.src[1]), a.shape)
    return _BINARY[n.op](a, b)


def _mul_mat_fused(env, w: weights.DeviceWeight, b: Tensor):
    """mul_mat of a member of a fused weight (weights.fuse_rows: wq/wk/wv, ffn_gate/ffn_up):
    the first member that meets input b computes the whole fused product, kept in env under
    the group and b, and every member takes its own rows of it. The graph keeps llama.cpp's
    nodes (Qcur, Kcur, Vcur, ffn_gate, ffn_up); the compiled step makes one weight pass."""
    assert w.spec.rows is not None
    key = ("fused mul_mat", w.spec.rows[0], b.id)
    if key not in env:
        env[key] = weights.mul_mat(weights.fused_parent(w), _value_f32(env, b))
    return weights.member_rows(w, env[key], env[key].ndim - 1)


@lowers(Op.MUL_MAT)
def lower_mul_mat(n: Tensor, env):
    a, b = n.src
    if a.flags & Flag.WEIGHT and a.ne[2] == 1 and a.ne[3] == 1:
        w = env[a]
        if w.spec.rows is not None:
            return _mul_mat_fused(env, w, b)
        return weights.mul_mat(w, _value_f32(env, b))
    return _mul_mat(_value_f32(env, a), _value_f32(env, b))


@lowers(Op.MUL_MAT_ID)
def lower_mul_mat_id(n: Tensor, env):
    as_, b, ids = n.src
    return _mul_mat_id(_value_f32(env, as_), _value_f32(env, b), _value(env, ids))


@lowers(Op.GET_ROWS)
def lower_get_rows(n: Tensor, env):
    return _get_rows(env, n)


@lowers(Op.SET_ROWS)
def lower_set_rows(n: Tensor, env):
    return _set_rows(env, n)


@lowers(Op.SCALE)
def lower_scale(n: Tensor, env):
    s, b = n.op_params
    return _value_f32(env, n.src[0]) * s + b


@lowers(Op.SQR)
def lower_sqr(n: Tensor, env):
    x = _value_f32(env, n.src[0])
    return x * x


@lowers(Op.SQRT)
def lower_sqrt(n: Tensor, env):
    return jnp.sqrt(_value_f32(env, n.src[0]))


@lowers(Op.TANH)
def lower_tanh(n: Tensor, env):
    return jnp.tanh(_value_f32(env, n.src[0]))


@lowers(Op.CLAMP)
def lower_clamp(n: Tensor, env):
    lo, hi = n.op_params
    return jnp.clip(_value_f32(env, n.src[0]), lo, hi)


@lowers(Op.SIGMOID)
def lower_sigmoid(n: Tensor, env):
    return jax.nn.sigmoid(_value_f32(env, n.src[0]))


@lowers(Op.XIELU)
def lower_xielu(n: Tensor, env):
    an, ap, beta, eps = n.op_params
    x = _value_f32(env, n.src[0])
    return jnp.where(x > 0.0, ap * x * x + beta * x, (jnp.expm1(jnp.minimum(x, eps)) - x) * an + beta * x)


@lowers(Op.SOFTPLUS)
def lower_softplus(n: Tensor, env):
    return _softplus(_value_f32(env, n.src[0]))


@lowers(Op.RELU)
def lower_relu(n: Tensor, env):
    return jnp.maximum(_value_f32(env, n.src[0]), 0.0)


@lowers(Op.SILU)
def lower_silu(n: Tensor, env):
    return jax.nn.silu(_value_f32(env, n.src[0]))


@lowers(Op.GELU)
def lower_gelu(n: Tensor, env):
    return _gelu(_value_f32(env, n.src[0]))


@lowers(Op.GELU_QUICK)
def lower_gelu_quick(n: Tensor, env):
    x = _value_f32(env, n.src[0])
    return x * jax.nn.sigmoid(1.702 * x)


@lowers(Op.GELU_ERF)
def lower_gelu_erf(n: Tensor, env):
    return jax.nn.gelu(_value_f32(env, n.src[0]), approximate=False)


@lowers(Op.GLU)
def lower_glu(n: Tensor, env):
    return _glu(n, env)


@lowers(Op.RMS_NORM)
def lower_rms_norm(n: Tensor, env):
    x = _value_f32(env, n.src[0])
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + n.op_params[0])


@lowers(Op.NORM)
def lower_norm(n: Tensor, env):
    x = _value_f32(env, n.src[0])
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + n.op_params[0])


@lowers(Op.ROPE)
def lower_rope(n: Tensor, env):
    s = n.src
    key = ("rope cache", s[1].id, s[2].id if len(s) > 2 else None, n.op_params)
    if key not in env:
        # once per graph for the positions and parameters, not per layer and per Q and K: 17
        # kernels per Gemma3 layer were the theta recurrence recomputed (llm bench --profile);
        # the barrier keeps XLA from fusing (and so recomputing) it into every rope
        ff = _value_f32(env, s[2]) if len(s) > 2 else None
        pos = _value(env, s[1]).reshape(-1)
        p = n.op_params
        if len(p) > 9:          # rope_multi: each pair's position from its stream of [t; h; w; e]
            streams = ops_mod.mrope_streams(p[0], p[9:13], p[1])
            pos = pos.reshape(4, -1)[streams].T                     # [T, half]
        env[key] = jax.lax.optimization_barrier(_rope_cache(pos, ff, p))
    c, sn = env[key]
    return _rope(_value(env, s[0]), c, sn, n.op_params)


@lowers(Op.SOFT_MAX)
def lower_soft_max(n: Tensor, env):
    s = n.src
    mask = _value(env, s[1]) if len(s) > 1 else None
    return _soft_max(_value_f32(env, s[0]), mask, *n.op_params)


# Cache types the native decode attention reads in place (the block types block by block).
NATIVE_ATTN_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
                     GGMLType.Q5_1, GGMLType.IQ4_NL)


def _cache_strides(t: Tensor) -> tuple[Tensor, int, int, int] | None:
    """For K or V as attention reads them (ne [D, n_kv, n_head_kv, 1], a view of a cache):
    the cache tensor and, in bytes, the view's offset, cell stride and head stride; None
    unless the features of a head are contiguous elements (or blocks) of NATIVE_ATTN_TYPES."""
    base, offs = _view_base(t)
    if base.flags & Flag.WEIGHT or base.type != t.type or t.type not in NATIVE_ATTN_TYPES:
        return None
    if t.ne[3] != 1 or t.nb[0] != types.type_size(t.type):
        return None
    return base, offs, t.nb[1], t.nb[2]


def _cache_window(buf, t: Tensor, offs: int):
    """K or V (t, a view of the cache buffer buf at byte offset offs) as XLA attends to it."""
    if _holds_blocks(t):
        rows = strided_window(buf.reshape(-1), 1, (types.row_size(t.type, t.ne[0]), *t.ne[1:]), (1, *t.nb[1:]), offs)
        return quants.dequantize_jax(rows, t.type, t.ne)
    return strided_window(buf.reshape(-1), types.type_size(t.type), t.ne, t.nb, offs)


def _flash_attn_native(n: Tensor, env) -> jax.Array | None:
    """flash_attn_ext through native.attn_decode on the CPU for up to native.ATTN_MAX_N query
    rows (decode steps, prompt chunks), K and V read in place from the cache tensors their views start from; None
    when it does not apply (ALiBi, sinks, no mask, a quantized or non-contiguous cache, more
    rows, the kernel off). Gradients (llm.trace) take the XLA path (custom_jvp), over the n_kv
    cells' window (dequantized, for a block type)."""
    from ggmlx import native
    q_t, k_t, v_t = n.src[:3]
    scale, max_bias, softcap = n.op_params
    n_q, n_kv = q_t.ne[1], k_t.ne[1]
    if (len(n.src) != 4 or max_bias != 0.0 or not 1 <= n_q <= native.ATTN_MAX_N or q_t.ne[3] != 1
            or n.src[3].type != GGMLType.F32 or n.src[3].ne[0] != n_kv or n.src[3].ne[2] * n.src[3].ne[3] != 1
            or not native.available()):
        return None
    ks, vs = _cache_strides(k_t), _cache_strides(v_t)
    if ks is None or vs is None or k_t.type != v_t.type:
        return None
    (k_base, k_off, k_cell, k_head), (v_base, v_off, v_cell, v_head) = ks, vs
    n_head_kv, dv = k_t.ne[2], v_t.ne[0]

    def xla(q, kb, vb, mask):
        k, v = _cache_window(kb, k_t, k_off), _cache_window(vb, v_t, v_off)
        return _flash_attn(q, k, v, mask, scale, max_bias, softcap)

    def cpu(q, kb, vb, mask):
        out = native.attn_decode(_f32(q)[0].transpose(1, 0, 2), kb, vb, mask[0, 0, :n_q], kv_type=int(k_t.type),
                                 n_kv=n_kv, n_head_kv=n_head_kv, k_off=k_off, k_cell=k_cell, k_head=k_head,
                                 v_off=v_off, v_cell=v_cell, v_head=v_head, dv=dv, scale=scale, softcap=softcap)
        return out[None]

    @jax.custom_jvp
    def f(q, kb, vb, mask):
        return jax.lax.platform_dependent(q, kb, vb, mask, cpu=cpu, default=xla)

    @f.defjvp
    def f_jvp(primals, tangents):
        return f(*primals), jax.jvp(xla, primals, tangents)[1]

    return f(_value(env, q_t), env[k_base], env[v_base], _value(env, n.src[3]))


@lowers(Op.FLASH_ATTN_EXT)
def lower_flash_attn_ext(n: Tensor, env):
    native_out = _flash_attn_native(n, env)
    if native_out is not None:
        return native_out
    s = n.src
    mask = _value(env, s[3]) if len(s) > 3 else None
    sinks = _value(env, s[4]).reshape(-1) if len(s) > 4 else None
    scale, max_bias, softcap = n.op_params
    return _flash_attn(_value(env, s[0]), _value(env, s[1]), _value(env, s[2]), mask, scale, max_bias, softcap,
                       sinks=sinks)


@lowers(Op.VIEW)
def lower_view(n: Tensor, env):
    return _view(env, n)


@lowers(Op.RESHAPE)
def lower_reshape(n: Tensor, env):
    return _memory(env, n.src[0]).reshape(buffer_layout(n)[0] if _holds_blocks(n) else n.shape)


@lowers(Op.PERMUTE)
def lower_permute(n: Tensor, env):
    # ggml dim i -> dim axes[i]; in numpy order dim d is axis 3 - d
    order = [0] * 4
    for i, ax in enumerate(n.op_params):
        order[3 - ax] = 3 - i
    return jnp.transpose(_memory(env, n.src[0]), order)


@lowers(Op.CONT)
def lower_cont(n: Tensor, env):
    return _value(env, n.src[0])


@lowers(Op.CPY)
def lower_cpy(n: Tensor, env):
    return _value(env, n.src[0]).reshape(n.shape).astype(jnp_dtype(n.type))


@lowers(Op.CONCAT)
def lower_concat(n: Tensor, env):
    a, b = n.src
    return jnp.concatenate([_value(env, a), _value(env, b)], axis=3 - n.op_params[0])


@lowers(Op.REPEAT)
def lower_repeat(n: Tensor, env):
    a = n.src[0]
    return jnp.tile(_value(env, a), tuple(m // k for m, k in zip(n.shape, a.shape, strict=True)))


@lowers(Op.IM2COL)
def lower_im2col(n: Tensor, env):
    """1-D: b [1, N, IC, L] -> [1, N, OL, IC K], column (c, k) of output o = b[c, o s0 + k d0 - p0]."""
    s0, _, p0, _, d0 = n.op_params[:5]
    k, ol = n.src[0].ne[0], n.ne[1]
    b = jnp.pad(_value_f32(env, n.src[1])[0], ((0, 0), (0, 0), (p0, p0)))
    taps = [b[:, :, i * d0:i * d0 + (ol - 1) * s0 + 1:s0] for i in range(k)]       # each [N, IC, OL]
    cols = jnp.stack(taps, axis=-1).transpose(0, 2, 1, 3)                          # [N, OL, IC, K]
    return cols.reshape(n.shape).astype(jnp_dtype(n.type))


@lowers(Op.PAD)
def lower_pad(n: Tensor, env):
    return jnp.pad(_value_f32(env, n.src[0]), [(0, p) for p in reversed(n.op_params)])


@lowers(Op.SUM_ROWS)
def lower_sum_rows(n: Tensor, env):
    return jnp.sum(_value_f32(env, n.src[0]), axis=-1, keepdims=True)


@lowers(Op.ARGSORT)
def lower_argsort(n: Tensor, env):
    return _argsort(_value(env, n.src[0]), n.op_params[0])


@lowers(Op.TOP_K)
def lower_top_k(n: Tensor, env):
    return jax.lax.top_k(_value_f32(env, n.src[0]), n.op_params[0])[1].astype(jnp.int32)


@lowers(Op.MAP_CUSTOM1)
def lower_map_custom1(n: Tensor, env):
    """The user function of a MAP_CUSTOM1 node; a result of another shape or dtype is an
    error naming the node, as no consumer could read it."""
    x = _value_f32(env, n.src[0])
    y = jnp.asarray(n.op_params[0](x))
    if y.shape != x.shape or y.dtype != x.dtype:
        raise ValueError(f"map_custom1 {n.name!r}: fn returned {y.dtype}{list(y.shape)}, "
                         f"the node is {x.dtype}{list(x.shape)}")
    return y


def eval_node(n: Tensor, env):
    """The value of one node given the values of its sources in env."""
    fn = LOWERINGS.get(n.op)
    if fn is None:
        raise NotImplementedError(f"no lowering for op {n.op.value} (node {n.name!r})")
    return fn(n, env)


def scope_name(n: Tensor) -> str:
    """The named scope a node's HLO carries: its name, or for an unnamed node (a view, a
    permute, a cont) its op and the first named tensor it reads from, so that profiles and
    HLO dumps can tell which layer's K view a transpose belongs to."""
    if n.name:
        return n.name
    src = n.src[0] if n.src else None
    while src is not None and not src.name and src.src:
        src = src.src[0]
    op = n.op.value.lower()
    return f"{op}<{src.name}" if src is not None and src.name else op


def run_nodes(nodes: list[Tensor], env: dict) -> dict:
    """Evaluate nodes in order into env (tensor -> value; also the values that nodes share:
    fused products, rope caches); returns env."""
    for n in nodes:
        with jax.named_scope(scope_name(n)):
            env[n] = eval_node(n, env)
    return env



# ---- state-space models ----------------------------------------------------------------

def _softplus(x):
    """ggml_compute_softplus_f32: log(1 + e^x), x itself above 20."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _apart(a):
    """a, computed on its own: a product with the identity, which XLA:CPU does not fuse. Without
    it a decode step's state update (and the conv and exps before it) is fused into the write of
    the state and evaluated once per state element, unvectorized: 0.7 ms of a Mamba2-130M
    layer's step. Exact in f32 for finite values (an inf becomes NaN across its row)."""
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    return jnp.einsum("...i,ij->...j", a, eye, precision=jax.lax.Precision.HIGHEST)


@lowers(Op.SSM_CONV)
def lower_ssm_conv(n: Tensor, env):
    sx = _value_f32(env, n.src[0])[0]              # [n_s, d_inner, d_conv - 1 + n_t]
    c = _value_f32(env, n.src[1])[0, 0]            # [d_inner, d_conv]
    d_conv, n_t = c.shape[1], n.ne[1]
    out = sx[:, :, 0:n_t] * c[:, 0:1]
    for k in range(1, d_conv):                     # ggml's order: one tap after the other
        out = out + sx[:, :, k:k + n_t] * c[:, k:k + 1]
    return jnp.swapaxes(out, 1, 2)[None]           # [1, n_s, n_t, d_inner]


@lowers(Op.SSM_SCAN)
def lower_ssm_scan(n: Tensor, env):
    """A compiled loop over the tokens (lax.scan), all sequences and heads at once; the state
    stays [n_seqs, n_head, head_dim, d_state] in the carry, so memory does not grow with the
    prompt."""
    s_t, x_t, dt_t, a_t, b_t, c_t, ids_t = n.src
    s = _value_f32(env, s_t)                       # [n_slots, n_head, head_dim, d_state]
    x = _value_f32(env, x_t)                       # [n_seqs, n_tok, n_head, head_dim]
    dt = _value_f32(env, dt_t)[0]                  # [n_seqs, n_tok, n_head]
    a = _value_f32(env, a_t)[0, 0]                 # [n_head, d_state or 1]
    b = _value_f32(env, b_t)                       # [n_seqs, n_tok, n_group, d_state]
    c = _value_f32(env, c_t)
    ids = _value(env, ids_t).reshape(-1).astype(jnp.int32)
    n_head, n_group = x.shape[2], b.shape[2]
    group = jnp.arange(n_head) // (n_head // n_group)
    h0 = jnp.take(s, ids, axis=0)                  # [n_seqs, n_head, head_dim, d_state]

    single = x.shape[1] == 1                       # a decode step: XLA unrolls the one-step loop

    def step(h, t):
        x_i, dt_i, b_i, c_i = t                    # [n_seqs, n_head, head_dim], [n_seqs, n_head], ...
        dt_sp = _softplus(dt_i)
        d_a = jnp.exp(dt_sp[:, :, None] * a[None])[:, :, None, :]     # [n_seqs, n_head, 1, d_state or 1]
        bh = b_i[:, group, None, :]                                    # [n_seqs, n_head, 1, d_state]
        xdt = x_i * dt_sp[:, :, None]
        if single:
            d_a, bh, xdt = _apart(d_a), _apart(bh), _apart(xdt)
        h = h * d_a + bh * xdt[..., None]
        # y = C . h as a contraction: XLA:CPU runs it 17x faster than sum(h * c) inside the loop
        return h, jnp.einsum("shpn,shn->shp", h, c_i[:, group, :], precision=weights.matmul_precision())

    seq = (jnp.swapaxes(x, 0, 1), jnp.swapaxes(dt, 0, 1), jnp.swapaxes(b, 0, 1), jnp.swapaxes(c, 0, 1))
    h, y = jax.lax.scan(step, h0, seq)             # y [n_tok, n_seqs, n_head, head_dim]
    return jnp.concatenate([jnp.swapaxes(y, 0, 1).reshape(-1), h.reshape(-1)]).reshape(n.shape)


@lowers(Op.GATED_DELTA_NET)
def lower_gated_delta_net(n: Tensor, env):
    """All sequences and heads at once, the state [n_seqs, H_v, S_v, S_v] in ggml's order
    (M[j, i] = S[i, j]). The tokens before the last K: chunk by chunk (_gdn_chunked) where
    there are at least GDN_CHUNK_MIN of them and the gate is a scalar, else a compiled loop
    token by token; the last K tokens always step, keeping each state for the snapshots."""
    q_t, k_t, v_t, g_t, b_t, s_t = n.src
    K = n.op_params[0]
    q = _value_f32(env, q_t)                       # [n_seqs, n_tok, H_k, S]
    k = _value_f32(env, k_t)
    v = _value_f32(env, v_t)                       # [n_seqs, n_tok, H_v, S]
    g = _value_f32(env, g_t)                       # [n_seqs, n_tok, H_v, 1 or S]
    beta = _value_f32(env, b_t)[..., 0]            # [n_seqs, n_tok, H_v]
    m0 = _value_f32(env, s_t)                      # [n_seqs, H_v, S (j), S (i)]
    n_seqs, n_tok, H_v, S = v.shape
    heads = jnp.arange(H_v) % q.shape[2]           # tiled, as ggml broadcasts q and k heads
    q, k = q[:, :, heads], k[:, :, heads]
    scale = 1.0 / math.sqrt(S)
    prec = weights.matmul_precision()

    def step(m, t):
        q_i, k_i, v_i, g_i, b_i = t                # [n_seqs, H_v, S], ..., [n_seqs, H_v, 1 or S], [n_seqs, H_v]
        m = m * jnp.exp(g_i)[:, :, None, :]
        d = (v_i - jnp.einsum("shji,shi->shj", m, k_i, precision=prec)) * b_i[..., None]
        m = m + d[..., :, None] * k_i[..., None, :]
        return m, jnp.einsum("shji,shi->shj", m, q_i, precision=prec) * scale

    def step_keep(m, t):
        m, o = step(m, t)
        return m, (o, m)

    def scan(m, lo, hi, fn):
        return jax.lax.scan(fn, m, tuple(jnp.swapaxes(a[:, lo:hi], 0, 1) for a in (q, k, v, g, beta)))

    n_keep = min(K, n_tok)
    n_pre = n_tok - n_keep
    if n_pre >= GDN_CHUNK_MIN and g.shape[-1] == 1:
        o1, s_pre = _gdn_chunked(q[:, :n_pre], k[:, :n_pre], v[:, :n_pre], g[:, :n_pre, :, 0], beta[:, :n_pre],
                                 jnp.swapaxes(m0, -1, -2), prec)
        m, o1 = jnp.swapaxes(s_pre, -1, -2), jnp.swapaxes(o1, 0, 1) * scale
    else:
        m, o1 = scan(m0, 0, n_pre, step) if n_pre else (m0, None)
    m, (o2, snaps) = scan(m, n_tok - n_keep, n_tok, step_keep)
    o = o2 if o1 is None else jnp.concatenate([o1, o2])            # [n_tok, n_seqs, H_v, S]
    snaps = snaps[::-1]                                              # most recent first
    if K > n_keep:
        snaps = jnp.concatenate([snaps, jnp.zeros((K - n_keep,) + m.shape, snaps.dtype)])
    return jnp.concatenate([jnp.swapaxes(o, 0, 1).reshape(-1), snaps.reshape(-1)]).reshape(n.shape)


GDN_CHUNK_MIN = 8      # tokens before the chunked form of the delta rule pays for its triangular solves
# tokens per chunk: on XLA:CPU a 512-token S=128 H=16 layer takes 40 ms in chunks of 16 or 32, 52 ms in
# chunks of 64 (llama.cpp's), 111 ms in 128, 59 ms token by token
GDN_CHUNK = 32


def _unit_lower_inverse(n, prec):
    """(I + n)^-1 for strictly lower triangular n [..., c, c] (c a power of two): n is
    nilpotent, so the inverse is the finite series sum (-n)^i = prod_j (I + (-n)^(2^j)), log2 c
    matrix products (XLA:CPU's batched triangular_solve is 150x slower here)."""
    eye = jnp.eye(n.shape[-1], dtype=n.dtype)
    p, m = eye - n, -n
    for _ in range(n.shape[-1].bit_length() - 2):
        m = jnp.matmul(m, m, precision=prec)
        p = jnp.matmul(p, eye + m, precision=prec)
    return p


def _gdn_chunked(q, k, v, g, beta, s0, prec, chunk: int = GDN_CHUNK):
    """The delta rule with a scalar gate over chunks of tokens (the WY form of Gated DeltaNet,
    as llama.cpp's build_delta_net_chunking): within a chunk with cumulative log-decay G, the
    corrections D = U - W S0 solve one unit-lower-triangular system,
    (I + diag(beta) A) [U | W] = diag(beta) [V | diag(e^G) K], A[t, s] = e^(G_t - G_s) k_t.k_s
    for s < t; outputs diag(e^G) Q S0 + M D with M[t, s] = e^(G_t - G_s) q_t.k_s (s <= t);
    the state goes to e^(G_C) S0 + K^T diag(e^(G_C - G)) D. Only the [S_k, S_v] state crosses
    chunks (a compiled loop over them); the rest is matrix products. Padding tokens carry
    beta = g = 0: they neither write nor decay. q, k [B, T, H, S_k], v [B, T, H, S_v],
    g, beta [B, T, H], s0 [B, H, S_k, S_v] -> (o [B, T, H, S_v] unscaled, state)."""
    B, T, H, _ = q.shape
    c = min(chunk, 1 << (T - 1).bit_length())
    n_c = -(-T // c)
    pad = n_c * c - T

    def split(a):                                  # [B, T, H, ...] -> [B, H, n_c, c, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((B, n_c, c, H) + a.shape[3:])
        return jnp.moveaxis(a, 3, 1)

    q, k, v, g, beta = (split(a) for a in (q, k, v, g, beta))
    G = jnp.cumsum(g, axis=-1)                                   # [B, H, n_c, c]
    diff = G[..., :, None] - G[..., None, :]                     # G_t - G_s
    t_ge_s = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(t_ge_s, diff, -jnp.inf))
    strict = decay * (1.0 - jnp.eye(c, dtype=decay.dtype))
    A = strict * jnp.einsum("bhntd,bhnsd->bhnts", k, k, precision=prec)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(G))[..., None] * k], axis=-1)
    UW = jnp.einsum("bhnts,bhnsd->bhntd", _unit_lower_inverse(beta[..., :, None] * A, prec), rhs, precision=prec)
    U, W = UW[..., :v.shape[-1]], UW[..., v.shape[-1]:]
    M = decay * jnp.einsum("bhntd,bhnsd->bhnts", q, k, precision=prec)
    Gq = jnp.exp(G)[..., None] * q
    G_last = G[..., -1]                                          # [B, H, n_c]
    kd = jnp.exp(G_last[..., None] - G)[..., None] * k

    def step(s, t):
        U_i, W_i, M_i, Gq_i, kd_i, gl_i = t
        d = U_i - jnp.einsum("bhtk,bhkv->bhtv", W_i, s, precision=prec)
        o = jnp.einsum("bhtk,bhkv->bhtv", Gq_i, s, precision=prec) + jnp.einsum("bhts,bhsv->bhtv", M_i, d,
                                                                                    precision=prec)
        s = jnp.exp(gl_i)[..., None, None] * s + jnp.einsum("bhtk,bhtv->bhkv", kd_i, d, precision=prec)
        return s, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (U, W, M, Gq, kd, G_last))
    s, o = jax.lax.scan(step, s0, xs)                            # o [n_c, B, H, c, S_v]
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, n_c * c, -1)[:, :, :T]
    return jnp.swapaxes(o, 1, 2), s
