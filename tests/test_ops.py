"""Per-op tests: each ggmlx op against a numpy float64 reference written from ggml's
definition of the op (ggml-cpu/ops.cpp), with test-backend-ops' error measure
NMSE = sum((ref - out)^2) / sum(ref^2) and its thresholds. Every output is also checked
for NaN. Several outputs share one graph where they can, so compilations stay few.
`TESTED_OPS` names the test of every op; a test checks that it and `lower.LOWERINGS` cover
the whole `Op` enum.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from ggmlx import lower, ops, types, weights
from ggmlx.compile import GraphCache, compute
from ggmlx.graph import Graph
from ggmlx.ops import ShapeError
from ggmlx.tensor import Op, Tensor, new_input, new_state, new_weight
from ggmlx.types import GGMLType as T

NMSE_DEFAULT = 1e-7
NMSE_SOFT_MAX = 1e-6
NMSE_QUANT_MUL_MAT = 5e-4
NMSE_FLASH_ATTN = 5e-4

CACHE = GraphCache()

# op -> the test in this file that checks it against its float64 reference
TESTED_OPS: dict[Op, str] = {
    Op.GET_ROWS: "test_get_rows_weight",
    Op.MUL_MAT: "test_mul_mat_weight_types",
    Op.MUL_MAT_ID: "test_mul_mat_id",
    Op.ADD: "test_binary_tiling",
    Op.SUB: "test_binary_tiling",
    Op.MUL: "test_binary_tiling",
    Op.DIV: "test_binary_tiling",
    Op.SCALE: "test_unary",
    Op.SQR: "test_unary",
    Op.SQRT: "test_unary",
    Op.CLAMP: "test_unary",
    Op.TANH: "test_unary",
    Op.SILU: "test_unary",
    Op.RELU: "test_unary",
    Op.SIGMOID: "test_unary",
    Op.GELU: "test_unary",
    Op.GELU_QUICK: "test_unary",
    Op.GLU: "test_glu",
    Op.RMS_NORM: "test_norms",
    Op.NORM: "test_norms",
    Op.ROPE: "test_rope_ext",
    Op.SOFT_MAX: "test_soft_max_ext",
    Op.FLASH_ATTN_EXT: "test_flash_attn_ext",
    Op.VIEW: "test_views",
    Op.RESHAPE: "test_reshape_permute_transpose_cont",
    Op.PERMUTE: "test_reshape_permute_transpose_cont",
    Op.CONT: "test_reshape_permute_transpose_cont",
    Op.CPY: "test_cpy_and_cast",
    Op.SET_ROWS: "test_set_rows",
    Op.CONCAT: "test_concat",
    Op.SUM_ROWS: "test_sum_rows",
    Op.ARGSORT: "test_argsort_and_top_k",
    Op.TOP_K: "test_argsort_and_top_k",
    Op.MAP_CUSTOM1: "test_map_custom1",
    Op.SSM_CONV: "test_ssm_conv",
    Op.SSM_SCAN: "test_ssm_scan",
    Op.SOFTPLUS: "test_unary",
    Op.XIELU: "test_unary",
    Op.GATED_DELTA_NET: "test_gated_delta_net",
    Op.REPEAT: "test_repeat_4d",
    Op.GELU_ERF: "test_unary",
    Op.IM2COL: "test_im2col",
    Op.PAD: "test_pad",
}

ROUND = {T.F32: np.float32, T.F16: np.float16, T.BF16: ml_dtypes.bfloat16}


# ---- helpers ---------------------------------------------------------------------------

def type_name(t: T) -> str:
    return t.name


def shape_of(ne) -> tuple[int, ...]:
    """numpy order of a ggml ne (padded to 4 dims)."""
    ne = tuple(ne) + (1,) * (4 - len(ne))
    return tuple(reversed(ne))


def rand(rng, ne, lo=-1.0, hi=1.0) -> np.ndarray:
    return rng.uniform(lo, hi, size=shape_of(ne))


def rounded(x: np.ndarray, t: T) -> np.ndarray:
    """x as the type t holds it, back in float64 (the reference works on the stored values)."""
    return np.asarray(x).astype(ROUND[t]).astype(np.float64)


def weight(name: str, t: T, x: np.ndarray) -> Tensor:
    ne = tuple(reversed(x.shape))
    return new_weight(t, ne, name, weights.to_device(x.astype(ROUND[t]), t, ne))


def run(outputs: list[Tensor], inputs: dict[Tensor, np.ndarray]) -> list[np.ndarray]:
    """Compute outputs in one graph; values in numpy order [ne3, ne2, ne1, ne0]."""
    g = Graph()
    for i, o in enumerate(outputs):
        o.set_output()
        if not o.name:
            o.set_name(f"out{i}")
        g.build_forward_expand(o)
    outs, _ = compute(g, inputs, cache=CACHE)
    vals = [np.asarray(outs[o]) for o in outputs]
    for o, v in zip(outputs, vals, strict=False):
        assert v.shape == o.shape, f"{o.name}: value shape {v.shape} != {o.shape}"
    return vals


def nmse(ref: np.ndarray, out: np.ndarray) -> float:
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    den = np.sum(ref * ref)
    return float(np.sum((ref - out) ** 2) / den) if den else float(np.sum(out * out))


def check(name: str, out: np.ndarray, ref: np.ndarray, max_nmse: float = NMSE_DEFAULT) -> None:
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), f"{name}: NaN in output"
    assert out.shape == ref.shape, f"{name}: shape {out.shape} != reference {ref.shape}"
    err = nmse(ref, out)
    assert err <= max_nmse, f"{name}: NMSE {err:.3e} > {max_nmse:.0e}"


def tile_index(b: np.ndarray, shape) -> np.ndarray:
    """b repeated into shape the way ggml reads src1: element i of the result is b[i % b.shape]."""
    idx = np.ix_(*[np.arange(n) % bn for n, bn in zip(shape, b.shape, strict=False)])
    return b[idx]


# ---- get_rows --------------------------------------------------------------------------

def ref_get_rows(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """a [A3, A2, R, ne0], idx [1, A3, A2, n] -> [A3, A2, n, ne0]: row idx[i3, i2, j] of channel (i3, i2)."""
    A3, A2, _, ne0 = a.shape
    n = idx.shape[-1]
    out = np.zeros((A3, A2, n, ne0))
    for i3 in range(A3):
        for i2 in range(A2):
            for j in range(n):
                out[i3, i2, j] = a[i3, i2, idx[0, i3, i2, j]]
    return out


@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16], ids=type_name)
def test_get_rows_weight(t):
    rng = np.random.default_rng(1)
    a = rand(rng, (10, 7))
    w = weight("tok_embd", t, a)
    ids = new_input(T.I32, (5,), "ids")
    idv = np.array([6, 0, 3, 3, 1], np.int32).reshape(1, 1, 1, 5)
    a3 = rand(rng, (9, 6, 3, 2))
    w3 = weight("w3", t, a3)
    ids3 = new_input(T.I32, (4, 3, 2), "ids3")
    idv3 = rng.integers(0, 6, size=shape_of((4, 3, 2))).astype(np.int32)
    (out, out3) = run([ops.get_rows(w, ids), ops.get_rows(w3, ids3)], {ids: idv, ids3: idv3})
    check("get_rows 2d", out, ref_get_rows(rounded(a, t), idv))
    check("get_rows 4d", out3, ref_get_rows(rounded(a3, t), idv3))


def test_get_rows_input_and_i32_source():
    rng = np.random.default_rng(2)
    src = new_input(T.F32, (6, 8, 2), "src")
    sv = rand(rng, (6, 8, 2))
    ids = new_input(T.I32, (3, 2), "ids")
    idv = np.array([[7, 0, 7], [2, 5, 1]], np.int32).reshape(1, 1, 2, 3)
    isrc = new_input(T.I32, (4, 8, 2), "isrc")
    iv = rng.integers(-1000, 1000, size=shape_of((4, 8, 2))).astype(np.int32)
    out, iout = run([ops.get_rows(src, ids), ops.get_rows(isrc, ids)], {src: sv, ids: idv, isrc: iv})
    check("get_rows f32 input", out, ref_get_rows(sv, idv))
    assert iout.dtype == np.int32
    np.testing.assert_array_equal(iout, ref_get_rows(iv, idv))


# ---- mul_mat ---------------------------------------------------------------------------

def ref_mul_mat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [A3, A2, M, K], b [B3, B2, N, K] -> [B3, B2, N, M]; channel (i3, i2) of b reads
    channel (i3 // (B3/A3), i2 // (B2/A2)) of a."""
    A3, A2, M, _ = a.shape
    B3, B2, N, _ = b.shape
    r3, r2 = B3 // A3, B2 // A2
    out = np.zeros((B3, B2, N, M))
    for i3 in range(B3):
        for i2 in range(B2):
            out[i3, i2] = b[i3, i2] @ a[i3 // r3, i2 // r2].T
    return out


@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16], ids=type_name)
def test_mul_mat_weight_types(t):
    rng = np.random.default_rng(3)
    cases = [((32, 7), (32, 5)),              # plain matrix-vector batch
             ((33, 3), (33, 1)),              # odd K, one column
             ((16, 4, 2), (16, 3, 6)),        # broadcast over dim 2 (GQA: 6 heads over 2)
             ((8, 5, 2, 2), (8, 3, 4, 6))]    # broadcast over dims 2 and 3
    outs, refs, feed = [], [], {}
    for k, (ane, bne) in enumerate(cases):
        a = rand(rng, ane)
        b = new_input(T.F32, bne, f"b{k}")
        feed[b] = rand(rng, bne)
        outs.append(ops.mul_mat(weight(f"a{k}", t, a), b))
        refs.append(ref_mul_mat(rounded(a, t), rounded(feed[b], T.F32)))
    for k, (out, ref) in enumerate(zip(run(outs, feed), refs, strict=False)):
        check(f"mul_mat {t.name} case {k}", out, ref)


def test_mul_mat_attention_layout_non_contiguous():
    """KQ = mul_mat(K, Q) with K and Q permuted from [D, n_head, n_tokens] as llama builds
    attention, and KQV with a transposed V made contiguous: non-contiguous operands."""
    rng = np.random.default_rng(4)
    D, H, Hkv, n_q, n_kv = 8, 6, 2, 3, 5
    q = new_input(T.F32, (D, H, n_q), "Qcur")
    k = new_input(T.F16, (D, Hkv, n_kv), "Kcur")
    v = new_input(T.F32, (D, Hkv, n_kv), "Vcur")
    qv, kv, vv = rand(rng, (D, H, n_q)), rounded(rand(rng, (D, Hkv, n_kv)), T.F16), rand(rng, (D, Hkv, n_kv))
    qp = ops.permute(q, 0, 2, 1, 3)                     # [D, n_q, H]
    kp = ops.permute(k, 0, 2, 1, 3)                     # [D, n_kv, Hkv]
    kq = ops.mul_mat(kp, qp).set_name("kq")             # [n_kv, n_q, H]
    vt = ops.cont(ops.permute(v, 1, 2, 0, 3))           # [n_kv, D, Hkv]
    kqv = ops.mul_mat(vt, kq).set_name("kqv")           # [D, n_q, H]
    out_kq, out_kqv = run([kq, kqv], {q: qv, k: kv, v: vv})
    qn, kn, vn = (x.transpose(0, 2, 1, 3) for x in (qv, kv, vv))   # [1, heads, tokens, D]
    ref_kq = ref_mul_mat(kn, qn)
    check("kq", out_kq, ref_kq)
    check("kqv", out_kqv, ref_mul_mat(vn.transpose(0, 1, 3, 2), ref_kq))


def ref_mul_mat_id(as_: np.ndarray, b: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """as_ [1, E, M, K], b [1, T, n_b, K], ids [1, 1, T, n_used] -> [1, T, n_used, M]."""
    _, n_tok, n_b, _ = b.shape
    n_used = ids.shape[-1]
    out = np.zeros((1, n_tok, n_used, as_.shape[2]))
    for t in range(n_tok):
        for e in range(n_used):
            out[0, t, e] = as_[0, ids[0, 0, t, e]] @ b[0, t, e % n_b]
    return out


@pytest.mark.parametrize("t", [T.F32, T.F16], ids=type_name)
def test_mul_mat_id(t):
    rng = np.random.default_rng(5)
    K, M, E, n_used, n_tok = 16, 6, 4, 2, 5
    a = rand(rng, (K, M, E))
    w = weight("ffn_up_exps", t, a)
    ids = new_input(T.I32, (n_used, n_tok), "ids")
    idv = np.stack([rng.permutation(E)[:n_used] for _ in range(n_tok)]).astype(np.int32).reshape(1, 1, n_tok, n_used)
    b1 = new_input(T.F32, (K, 1, n_tok), "cur")            # one input row per token
    b2 = new_input(T.F32, (K, n_used, n_tok), "cur_used")  # one row per chosen expert
    bv1, bv2 = rand(rng, (K, 1, n_tok)), rand(rng, (K, n_used, n_tok))
    o1, o2 = run([ops.mul_mat_id(w, b1, ids), ops.mul_mat_id(w, b2, ids)], {ids: idv, b1: bv1, b2: bv2})
    check("mul_mat_id n_b=1", o1, ref_mul_mat_id(rounded(a, t), bv1, idv))
    check("mul_mat_id n_b=n_used", o2, ref_mul_mat_id(rounded(a, t), bv2, idv))


# ---- element-wise ----------------------------------------------------------------------

BINARY = {"add": (ops.add, np.add), "sub": (ops.sub, np.subtract),
          "mul": (ops.mul, np.multiply), "div": (ops.div, np.divide)}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_tiling(name):
    """src1 repeats into src0 by tiling (ggml_can_repeat), including ne0 tiling and a
    permuted (non-contiguous) src0."""
    rng = np.random.default_rng(6)
    op, ref_op = BINARY[name]
    ane = (10, 6, 4, 2)
    a = new_input(T.F32, ane, "a")
    av = rand(rng, ane)
    bnes = [(10, 6, 4, 2), (10, 1, 1, 1), (10, 6, 1, 1), (5, 3, 2, 1), (1, 6, 1, 2), (2, 1, 4, 1)]
    outs, feed, bvals = [], {a: av}, []
    for k, bne in enumerate(bnes):
        b = new_input(T.F32, bne, f"b{k}")
        feed[b] = rand(rng, bne, 0.5, 2.0) * rng.choice([-1.0, 1.0], size=shape_of(bne))
        bvals.append(feed[b])
        outs.append(op(a, b))
    ap = ops.permute(a, 1, 0, 2, 3)                         # [6, 10, 4, 2], not contiguous
    bp = new_input(T.F32, (6, 1, 4, 1), "bp")
    feed[bp] = rand(rng, (6, 1, 4, 1), 0.5, 2.0)
    outs.append(op(ap, bp))
    wv = rand(rng, (10,), 0.5, 2.0)
    outs.append(op(a, weight("norm_w", T.F16, wv)))        # an F16 weight row over every row
    vals = run(outs, feed)
    for k, bv in enumerate(bvals):
        check(f"{name} b{bnes[k]}", vals[k], ref_op(av, tile_index(bv, av.shape)))
    apv = av.transpose(0, 1, 3, 2)
    check(f"{name} permuted src0", vals[-2], ref_op(apv, tile_index(feed[bp], apv.shape)))
    check(f"{name} f16 weight", vals[-1], ref_op(av, tile_index(rounded(wv, T.F16), av.shape)))


def gelu_ref(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu_ref(x):
    return x / (1.0 + np.exp(-x))


UNARY = {
    "scale": (lambda t: ops.scale(t, 0.37), lambda x: 0.37 * x),
    "scale_bias": (lambda t: ops.scale(t, -1.5, 0.25), lambda x: -1.5 * x + 0.25),
    "sqr": (ops.sqr, lambda x: x * x),
    "clamp": (lambda t: ops.clamp(t, -0.5, 0.75), lambda x: np.clip(x, -0.5, 0.75)),
    "tanh": (ops.tanh, np.tanh),
    "silu": (ops.silu, silu_ref),
    "relu": (ops.relu, lambda x: np.maximum(x, 0.0)),
    "softplus": (ops.softplus, lambda x: np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))),
    "sigmoid": (ops.sigmoid, lambda x: 1.0 / (1.0 + np.exp(-x))),
    # Apertus' constants: softplus(0.8) = 1.1711, softplus(0.8) + 0.5 = 1.6711
    "xielu": (lambda t: ops.xielu(t, 0.8, 0.8, 0.5, -1e-6),
              lambda x: np.where(x > 0, np.log1p(np.exp(0.8)) * x * x + 0.5 * x,
                                 (np.expm1(np.minimum(x, -1e-6)) - x) * (0.5 + np.log1p(np.exp(0.8))) + 0.5 * x)),
    "gelu": (ops.gelu, gelu_ref),
    "gelu_quick": (ops.gelu_quick, lambda x: x / (1.0 + np.exp(-1.702 * x))),
    "gelu_erf": (ops.gelu_erf, lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))),
}


@pytest.mark.parametrize("ne", [(13, 5, 3), (64, 2)])
def test_unary(ne):
    rng = np.random.default_rng(7)
    x = new_input(T.F32, ne, "x")
    xv = rand(rng, ne, -4.0, 4.0)
    pos = new_input(T.F32, ne, "pos")
    pv = rand(rng, ne, 0.01, 9.0)
    xt = ops.transpose(x)                                   # non-contiguous source
    outs = [f(x) for f, _ in UNARY.values()] + [f(xt) for f, _ in UNARY.values()] + [ops.sqrt(pos)]
    vals = run(outs, {x: xv, pos: pv})
    n = len(UNARY)
    xtv = xv.swapaxes(2, 3)
    for k, (name, (_, ref)) in enumerate(UNARY.items()):
        check(f"{name} {ne}", vals[k], ref(xv))
        check(f"{name} {ne} transposed", vals[n + k], ref(xtv))
    check(f"sqrt {ne}", vals[-1], np.sqrt(pv))


def act_ref(op: str, x):
    return {ops.GLU_SWIGLU: silu_ref, ops.GLU_GEGLU: gelu_ref, ops.GLU_REGLU: lambda v: np.maximum(v, 0)}[op](x)


@pytest.mark.parametrize("op", [ops.GLU_SWIGLU, ops.GLU_GEGLU, ops.GLU_REGLU])
def test_glu(op):
    rng = np.random.default_rng(8)
    ne = (12, 5, 2)
    a = new_input(T.F32, ne, "a")
    g = new_input(T.F32, ne, "g")
    av, gv = rand(rng, ne, -3, 3), rand(rng, ne, -3, 3)
    outs = [ops.glu(a, None, op), ops.glu(a, None, op, swapped=True), ops.glu(a, g, op)]
    if op == ops.GLU_SWIGLU:
        outs += [ops.swiglu(a), ops.swiglu_split(a, g)]
    if op == ops.GLU_GEGLU:
        outs += [ops.geglu(a), ops.geglu_split(a, g)]
    vals = run(outs, {a: av, g: gv})
    x, y = av[..., :6], av[..., 6:]
    check(f"{op} fused", vals[0], act_ref(op, x) * y)
    check(f"{op} fused swapped", vals[1], act_ref(op, y) * x)
    check(f"{op} split", vals[2], act_ref(op, av) * gv)
    if len(vals) > 3:
        check(f"{op} named fused", vals[3], act_ref(op, x) * y)
        check(f"{op} named split", vals[4], act_ref(op, av) * gv)


# ---- normalization ---------------------------------------------------------------------

def ref_rms_norm(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def ref_norm(x, eps):
    d = x - np.mean(x, axis=-1, keepdims=True)
    return d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("ne,eps", [((64, 5, 3), 1e-6), ((7, 3), 1e-5), ((1, 4), 1e-5)])
def test_norms(ne, eps):
    rng = np.random.default_rng(9)
    x = new_input(T.F32, ne, "x")
    xv = rand(rng, ne, -2, 2) + 0.3
    xp = ops.permute(x, 1, 0, 2, 3)           # normalize across a permuted (strided) dim
    outs = [ops.rms_norm(x, eps), ops.norm(x, eps), ops.rms_norm(xp, eps), ops.norm(xp, eps)]
    vals = run(outs, {x: xv})
    xpv = xv.swapaxes(2, 3)
    check("rms_norm", vals[0], ref_rms_norm(xv, eps))
    check("norm", vals[1], ref_norm(xv, eps))
    check("rms_norm permuted", vals[2], ref_rms_norm(xpv, eps))
    check("norm permuted", vals[3], ref_norm(xpv, eps))


# ---- rope ------------------------------------------------------------------------------

def ref_rope(x, pos, ff, n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor,
             attn_factor, beta_fast, beta_slow):
    """x [1, T, H, D] rotated in pairs (NORMAL: (2i, 2i+1); NEOX: (i, i + n_dims/2)) for
    pair index i < n_dims/2 by theta = pos * base^(-2i/n_dims) / ff[i], with YaRN mixing."""
    half = n_dims // 2
    i = np.arange(half, dtype=np.float64)
    pos = pos.astype(np.float64)
    theta_extrap = (pos if pos.ndim == 2 else pos[:, None]) * freq_base ** (-2.0 * i / n_dims)
    if ff is not None:
        theta_extrap = theta_extrap / ff[:half]
    theta_interp = freq_scale * theta_extrap
    mscale = attn_factor
    theta = theta_interp
    if ext_factor != 0.0:
        def corr_dim(n_rot):
            return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))
        low = max(0.0, math.floor(corr_dim(beta_fast)))
        high = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * ext_factor
        theta = theta_interp * (1 - mix) + theta_extrap * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    cos = (np.cos(theta) * mscale)[None, :, None, :]
    sin = (np.sin(theta) * mscale)[None, :, None, :]
    out = x.astype(np.float64).copy()
    if mode == ops.ROPE_TYPE_NEOX:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = 2 * np.arange(half), 2 * np.arange(half) + 1
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    return out


ROPE_CASES = {
    # name: (n_dims, mode, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, ff)
    "normal": (16, ops.ROPE_TYPE_NORMAL, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, False),
    "neox": (16, ops.ROPE_TYPE_NEOX, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, False),
    "normal_partial": (8, ops.ROPE_TYPE_NORMAL, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, False),
    "neox_partial_base_scale": (10, ops.ROPE_TYPE_NEOX, 0, 1e6, 0.25, 0.0, 1.0, 32.0, 1.0, False),
    "normal_yarn": (16, ops.ROPE_TYPE_NORMAL, 64, 10000.0, 0.25, 1.0, 0.9, 32.0, 1.0, False),
    "neox_yarn_partial": (12, ops.ROPE_TYPE_NEOX, 128, 500000.0, 0.125, 0.5, 1.0, 16.0, 2.0, False),
    "neox_freq_factors": (16, ops.ROPE_TYPE_NEOX, 0, 500000.0, 1.0, 0.0, 1.0, 32.0, 1.0, True),
    "normal_freq_factors_yarn": (8, ops.ROPE_TYPE_NORMAL, 64, 10000.0, 0.5, 1.0, 1.0, 32.0, 1.0, True),
}


def test_rope_ext():
    rng = np.random.default_rng(10)
    D, H, n_tok = 16, 3, 5
    x = new_input(T.F32, (D, H, n_tok), "Qcur")
    xv = rand(rng, (D, H, n_tok))
    pos = new_input(T.I32, (n_tok,), "pos")
    pv = np.array([0, 1, 7, 300, 2047], np.int32)
    ff = new_input(T.F32, (D // 2,), "rope_freqs")
    ffv = rand(rng, (D // 2,), 1.0, 8.0).reshape(-1)
    outs = []
    for name, (n_dims, mode, n_ctx_orig, base, fs, ext, attn, bf, bs, use_ff) in ROPE_CASES.items():
        outs.append(ops.rope_ext(x, pos, ff if use_ff else None, n_dims, mode, n_ctx_orig, base, fs,
                                 ext, attn, bf, bs).set_name(name))
    xp = ops.permute(new_input(T.F32, (D, n_tok, H), "Kperm"), 0, 2, 1, 3)   # non-contiguous source
    xpv = rand(rng, (D, n_tok, H))
    outs.append(ops.rope_ext(xp, pos, None, D, ops.ROPE_TYPE_NEOX, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0))
    vals = run(outs, {x: xv, pos: pv.reshape(1, 1, 1, -1), ff: ffv, xp.src[0]: xpv})
    for k, (name, (n_dims, mode, n_ctx_orig, base, fs, ext, attn, bf, bs, use_ff)) in enumerate(ROPE_CASES.items()):
        ref = ref_rope(xv, pv, ffv if use_ff else None, n_dims, mode, n_ctx_orig, base, fs, ext, attn, bf, bs)
        check(f"rope {name}", vals[k], ref)
    ref = ref_rope(xpv.transpose(0, 2, 1, 3), pv, None, D, ops.ROPE_TYPE_NEOX, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    check("rope permuted source", vals[-1], ref)


@pytest.mark.slow
def ref_streams(n_dims, sections, mode):
    """ggml's mrope cache: the position stream of each pair, written out from its definition."""
    total, out = sum(sections), []
    for i in range(n_dims // 2):
        k = i % total
        if mode == ops.ROPE_TYPE_IMROPE:
            choice = [t for t, ok in ((1, k % 3 == 1 and k < 3 * sections[1]), (2, k % 3 == 2 and k < 3 * sections[2]),
                                      (0, k % 3 == 0 and k < 3 * sections[0])) if ok]
            out.append(choice[0] if choice else 3)
        else:
            bounds = np.cumsum(sections)
            out.append(int(np.searchsorted(bounds, k, side="right")))
    return np.asarray(out)


def test_rope_multi():
    """M-RoPE against float64: sections (Qwen2-VL) and interleaved (Qwen3-VL), with YaRN and
    freq factors; pair i rotates by its stream's position."""
    rng = np.random.default_rng(11)
    D, H, n_tok = 16, 2, 4
    x = new_input(T.F32, (D, H, n_tok), "Qcur")
    xv = rand(rng, (D, H, n_tok))
    pos = new_input(T.I32, (4 * n_tok,), "pos")
    pv = np.array([[0, 1, 5, 9], [3, 3, 4, 8], [7, 2, 2, 1], [0, 0, 6, 2]], np.int32)     # t, h, w, e
    ff = new_input(T.F32, (D // 2,), "rope_freqs")
    ffv = rand(rng, (D // 2,), 1.0, 4.0).reshape(-1)
    cases = [(16, (2, 1, 1, 0), ops.ROPE_TYPE_MROPE, 0, 10000.0, 1.0, 0.0, False),
             (16, (1, 2, 1, 1), ops.ROPE_TYPE_MROPE, 64, 1e6, 0.5, 1.0, True),
             (16, (3, 2, 2, 0), ops.ROPE_TYPE_IMROPE, 0, 5e6, 1.0, 0.0, False),
             (12, (2, 2, 1, 0), ops.ROPE_TYPE_IMROPE, 128, 10000.0, 0.25, 1.0, True)]
    outs = [ops.rope_multi(x, pos, ff if use_ff else None, n, sec, mode, n_orig, base, fs, ext, 1.0, 32.0, 1.0)
            for n, sec, mode, n_orig, base, fs, ext, use_ff in cases]
    vals = run(outs, {x: xv, pos: pv.reshape(1, 1, 1, -1), ff: ffv})
    for v, (n, sec, mode, n_orig, base, fs, ext, use_ff) in zip(vals, cases, strict=True):
        streams = ref_streams(n, sec, mode)
        assert (ops.mrope_streams(n, sec, mode) == streams).all()
        per_pair = pv[streams].T                                # [T, n/2]
        ref = ref_rope(xv, per_pair, ffv if use_ff else None, n, ops.ROPE_TYPE_NEOX, n_orig, base, fs, ext, 1.0,
                       32.0, 1.0)
        check(f"rope_multi {sec} mode {mode}", v, ref)


def test_rope_multi_vision():
    """Qwen2-VL's vision rope (GGML_ROPE_TYPE_VISION) against float64: pairs (i, i + D/2) over
    the whole head, the first D/4 at the y position and the rest at x, theta = p base^(-2j /
    n_dims) with j counted from the start of the pair's section."""
    rng = np.random.default_rng(12)
    D, H, n_tok = 16, 2, 5
    x = new_input(T.F32, (D, H, n_tok), "Qcur")
    xv = rand(rng, (D, H, n_tok))
    pos = new_input(T.I32, (4 * n_tok,), "positions")
    pv = rng.integers(0, 40, (4, n_tok)).astype(np.int32)
    n_dims = D // 2
    out = ops.rope_multi(x, pos, None, n_dims, (D // 4,) * 4, ops.ROPE_TYPE_VISION, 32768, 10000.0, 1.0, 0.0, 1.0,
                         32.0, 1.0)
    (v,) = run([out], {x: xv, pos: pv.reshape(1, 1, 1, -1)})
    pair = np.arange(D // 2)
    theta = pv[pair // (D // 4)].T * 10000.0 ** (-2.0 * (pair % (D // 4)) / n_dims)        # [T, D/2]
    c, s = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    x0, x1 = xv[..., :D // 2], xv[..., D // 2:]
    check("rope_multi vision", v, np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1))
    with pytest.raises(ShapeError, match="n_dims 4 must be ne0 / 2"):
        ops.rope_multi(x, pos, None, 4, (2, 2, 0, 0), ops.ROPE_TYPE_VISION, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)


def test_rope_ext_head_dim_128():
    """A real head size at positions up to 4096; theta is an f32 power series as in ggml's
    rope cache, whose error against float64 grows with the position (NMSE ~4e-7 at 32k, the
    f32 resolution of theta itself), so the positions here stay in the range 1e-7 holds."""
    rng = np.random.default_rng(22)
    x = new_input(T.F32, (128, 2, 8), "Qcur")
    xv = rand(rng, (128, 2, 8))
    pos = new_input(T.I32, (8,), "pos")
    pv = np.array([0, 5, 100, 511, 1024, 2048, 3000, 4095], np.int32)
    params = [(128, ops.ROPE_TYPE_NORMAL, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0),
              (64, ops.ROPE_TYPE_NEOX, 4096, 500000.0, 0.25, 1.0, 1.0, 32.0, 1.0)]
    vals = run([ops.rope_ext(x, pos, None, *p) for p in params], {x: xv, pos: pv.reshape(1, 1, 1, -1)})
    for v, p in zip(vals, params, strict=False):
        check(f"rope head 128 {p}", v, ref_rope(xv, pv, None, *p))


# ---- soft_max and attention ------------------------------------------------------------

def alibi_ref(n_head: int, max_bias: float) -> np.ndarray:
    """ggml's ALiBi slope per head h: m0^(h+1) for h < n_head_log2, else m1^(2(h - n_head_log2) + 1)."""
    if max_bias <= 0:
        return np.ones(n_head)
    n_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)])


def softmax_ref(x):
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=-1, keepdims=True)


def ref_soft_max(a, mask, scale, max_bias):
    """a [B, H, n_q, n_kv]: softmax(a*scale + slope_h * mask[row]) with the mask tiled over
    heads and batch and its padding rows ignored."""
    x = a * scale
    if mask is not None:
        m = tile_index(mask[:, :, : a.shape[2], :], a.shape)
        x = x + alibi_ref(a.shape[1], max_bias)[None, :, None, None] * m
    return softmax_ref(x)


def causal_mask(rng, n_kv, n_rows, n_q, shape_prefix=(1, 1)):
    """[.., n_rows, n_kv] with -inf above the diagonal (the last n_q keys are the new tokens)
    and small random biases elsewhere; rows past n_q are padding filled with junk."""
    m = rng.uniform(-0.5, 0.0, size=shape_prefix + (n_rows, n_kv))
    for r in range(n_q):
        m[..., r, n_kv - n_q + r + 1:] = -np.inf
    m[..., n_q:, :] = 123.0
    return m


@pytest.mark.parametrize("mask_type", [T.F32, T.F16], ids=type_name)
def test_soft_max_ext(mask_type):
    rng = np.random.default_rng(11)
    n_kv, n_q, H, B = 10, 4, 6, 2
    a = new_input(T.F32, (n_kv, n_q, H, B), "kq")
    av = rand(rng, (n_kv, n_q, H, B), -5, 5)
    mask = new_input(mask_type, (n_kv, 8), "kq_mask")                 # padded to 8 rows
    mv = rounded(causal_mask(rng, n_kv, 8, n_q), mask_type) if mask_type != T.F32 else causal_mask(rng, n_kv, 8, n_q)
    mask_h = new_input(mask_type, (n_kv, n_q, 3, 1), "kq_mask_heads")  # tiled over 6 heads
    mhv = rounded(causal_mask(rng, n_kv, n_q, n_q, (1, 3)), mask_type)
    cases = [(None, 1.0, 0.0), (mask, 0.125, 0.0), (mask, 1.0, 8.0), (mask_h, 0.3, 0.0), (mask_h, 0.5, 4.0)]
    outs = [ops.soft_max_ext(a, m, s, mb) for m, s, mb in cases] + [ops.soft_max(a)]
    ap = ops.permute(a, 0, 2, 1, 3)                                  # [n_kv, H, n_q, B]
    outs.append(ops.soft_max_ext(ap, None, 2.0, 0.0))
    vals = run(outs, {a: av, mask: mv, mask_h: mhv})
    values = {None: None, mask: mv, mask_h: mhv}
    for k, (m, s, mb) in enumerate(cases):
        check(f"soft_max case {k}", vals[k], ref_soft_max(av, values[m], s, mb), NMSE_SOFT_MAX)
    check("soft_max plain", vals[len(cases)], softmax_ref(av), NMSE_SOFT_MAX)
    check("soft_max permuted", vals[-1], softmax_ref(2.0 * av.transpose(0, 2, 1, 3)), NMSE_SOFT_MAX)


def ref_flash_attn(q, k, v, mask, scale, max_bias, softcap):
    """q [B, H, n_q, D], k [B, Hkv, n_kv, D], v [B, Hkv, n_kv, Dv] -> [B, n_q, H, Dv]."""
    B, H, n_q, _ = q.shape
    Hkv = k.shape[1]
    slopes = alibi_ref(H, max_bias)
    out = np.zeros((B, n_q, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            s = q[b, h] @ k[b, g].T * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            if mask is not None:
                s = s + slopes[h] * mask[b % mask.shape[0], h % mask.shape[1], :n_q]
            out[b, :, h] = softmax_ref(s) @ v[b, g]
    return out


def test_flash_attn_ext():
    """GQA (6 heads over 2 KV heads), an F16 KV cache read through strided views of a
    larger state buffer (n_kv < n_ctx), a padded F16 mask, soft-capping and ALiBi."""
    rng = np.random.default_rng(12)
    D, Dv, H, Hkv, n_q, n_kv, n_ctx = 16, 8, 6, 2, 3, 12, 20
    q = new_input(T.F32, (D, n_q, H), "q")
    qv = rand(rng, (D, n_q, H))
    cache_k = new_input(T.F16, (D * Hkv, n_ctx), "cache_k")
    cache_v = new_input(T.F16, (Dv * Hkv, n_ctx), "cache_v")
    ckv = rounded(rand(rng, (D * Hkv, n_ctx), -2, 2), T.F16)
    cvv = rounded(rand(rng, (Dv * Hkv, n_ctx)), T.F16)
    k = ops.view_3d(cache_k, D, n_kv, Hkv, cache_k.nb[1], 2 * D, 0)      # [D, n_kv, Hkv]
    v = ops.view_3d(cache_v, Dv, n_kv, Hkv, cache_v.nb[1], 2 * Dv, 0)
    mask = new_input(T.F16, (n_kv, 8), "kq_mask")
    mv = rounded(causal_mask(rng, n_kv, 8, n_q), T.F16)
    cases = [(None, 0.25, 0.0, 0.0), (mask, 1 / math.sqrt(D), 0.0, 0.0), (mask, 1.0, 0.0, 5.0),
             (mask, 0.5, 8.0, 0.0)]
    outs = [ops.flash_attn_ext(q, k, v, m, s, mb, cap) for m, s, mb, cap in cases]
    vals = run(outs, {q: qv, cache_k: ckv, cache_v: cvv, mask: mv})
    kn = ckv[0, 0, :n_kv].reshape(n_kv, Hkv, D).transpose(1, 0, 2)[None]
    vn = cvv[0, 0, :n_kv].reshape(n_kv, Hkv, Dv).transpose(1, 0, 2)[None]
    for i, (m, s, mb, cap) in enumerate(cases):
        ref = ref_flash_attn(qv, kn, vn, None if m is None else mv, s, mb, cap)
        check(f"flash_attn_ext case {i}", vals[i], ref, NMSE_FLASH_ATTN)
        assert vals[i].shape == shape_of((Dv, H, n_q, 1))



@pytest.mark.parametrize("n_head_kv", [1, 3, 8])
def test_flash_attn_ext_one_query(n_head_kv):
    """A decode step (one query row): one KV head takes the one-query lowering (K and V read
    in the cache layout, the heads as columns of one dot), more the batched one; both must
    match the reference with a mask, soft-capping, ALiBi and attention sinks."""
    rng = np.random.default_rng(14)
    D, H, n_kv, n_ctx = 16, 2 * n_head_kv, 12, 20
    q = new_input(T.F32, (D, 1, H), "q")
    qv = rand(rng, (D, 1, H))
    cache_k = new_input(T.F32, (D * n_head_kv, n_ctx), "cache_k")
    cache_v = new_input(T.F32, (D * n_head_kv, n_ctx), "cache_v")
    ckv, cvv = rand(rng, (D * n_head_kv, n_ctx), -2, 2), rand(rng, (D * n_head_kv, n_ctx))
    k = ops.view_3d(cache_k, D, n_kv, n_head_kv, cache_k.nb[1], 4 * D, 0)      # [D, n_kv, Hkv]
    v = ops.view_3d(cache_v, D, n_kv, n_head_kv, cache_v.nb[1], 4 * D, 0)
    mask, sinks = new_input(T.F32, (n_kv, 4), "kq_mask"), new_input(T.F32, (H,), "sinks")
    mv, sv = causal_mask(rng, n_kv, 4, 1), rand(rng, (H,), -2, 2)
    cases = [(None, 0.25, 0.0, 0.0), (mask, 1.0, 0.0, 5.0), (mask, 0.5, 8.0, 0.0)]
    outs = [ops.flash_attn_ext(q, k, v, m, s, mb, cap) for m, s, mb, cap in cases]
    outs.append(ops.flash_attn_ext(q, k, v, mask, 0.5, 0.0, 0.0, sinks))
    vals = run(outs, {q: qv, cache_k: ckv, cache_v: cvv, mask: mv, sinks: sv})
    kn = ckv[0, 0, :n_kv].reshape(n_kv, n_head_kv, D).transpose(1, 0, 2)[None]
    vn = cvv[0, 0, :n_kv].reshape(n_kv, n_head_kv, D).transpose(1, 0, 2)[None]
    for i, (m, s, mb, cap) in enumerate(cases):
        check(f"flash_attn_ext one query case {i}", vals[i], ref_flash_attn(qv, kn, vn, None if m is None else mv,
                                                                            s, mb, cap), NMSE_FLASH_ATTN)
    ref = np.zeros((1, 1, H, D))
    for h in range(H):
        sc = qv[0, h] @ kn[0, h // 2].T * 0.5 + mv[0, 0, :1]
        e = np.exp(sc - sc.max(1, keepdims=True))
        ref[0, :, h] = e / (e.sum(1, keepdims=True) + np.exp(sv[0, 0, 0, h] - sc.max(1, keepdims=True))) @ vn[0, h // 2]
    check("flash_attn_ext one query sinks", vals[3], ref, NMSE_FLASH_ATTN)

@pytest.mark.parametrize("layout", ["appended", "out_of_order"])
def test_flash_attn_ext_causal_blocks(layout):
    """A prefill ubatch of 2 x CAUSAL_BLOCK query rows appended after 64 cached cells: block 0
    attends only to the cells its mask lets through (the causal path); when a row of block 0
    sees a later cell (cells reused out of order) the dense path runs. Both match float64,
    with soft-capping, ALiBi and sinks."""
    rng = np.random.default_rng(15)
    D, H, Hkv, n_q = 8, 4, 2, 2 * lower.CAUSAL_BLOCK
    n_kv = n_q + 64
    q = new_input(T.F32, (D, n_q, H), "q")
    k, v = new_input(T.F32, (D, n_kv, Hkv), "k"), new_input(T.F32, (D, n_kv, Hkv), "v")
    mask, sinks = new_input(T.F32, (n_kv, n_q), "mask"), new_input(T.F32, (H,), "sinks")
    qv, kv_, vv = rand(rng, (D, n_q, H)), rand(rng, (D, n_kv, Hkv)), rand(rng, (D, n_kv, Hkv))
    mv = causal_mask(rng, n_kv, n_q, n_q)
    if layout == "out_of_order":
        mv[..., 3, n_kv - 1] = -0.25
    ends = lower.causal_block_ends(n_q, n_kv)
    assert ends == [n_kv - lower.CAUSAL_BLOCK, n_kv]
    assert bool(lower.causal_blocks_apply(np.asarray(mv, np.float32), ends)) == (layout == "appended")
    sv = rand(rng, (H,), -2, 2)
    cases = [(0.5, 0.0, 0.0), (1.0, 0.0, 5.0), (0.5, 8.0, 0.0)]
    outs = [ops.flash_attn_ext(q, k, v, mask, s, mb, cap) for s, mb, cap in cases]
    outs.append(ops.flash_attn_ext(q, k, v, mask, 0.5, 0.0, 0.0, sinks))
    vals = run(outs, {q: qv, k: kv_, v: vv, mask: mv, sinks: sv})
    for i, (s, mb, cap) in enumerate(cases):
        ref = ref_flash_attn(qv, kv_, vv, mv, s, mb, cap)
        check(f"flash_attn_ext causal blocks case {i}", vals[i], ref, NMSE_FLASH_ATTN)
        np.testing.assert_allclose(vals[i], ref, atol=2e-5)
    ref = np.zeros((1, n_q, H, D))
    for h in range(H):
        sc = qv[0, h] @ kv_[0, h // 2].T * 0.5 + mv[0, 0]
        e = np.exp(sc - sc.max(1, keepdims=True))
        ref[0, :, h] = e / (e.sum(1, keepdims=True) + np.exp(sv[0, 0, 0, h] - sc.max(1, keepdims=True))) @ vv[0, h // 2]
    np.testing.assert_allclose(vals[3], ref, atol=2e-5)


def test_swiglu_oai_and_attention_sinks():
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai) and per-head attention sinks: one extra
    softmax term exp(sink) per head with no value (ggml_flash_attn_ext_add_sinks)."""
    rng = np.random.default_rng(13)
    a, g = new_input(T.F32, (16, 5), "a"), new_input(T.F32, (16, 5), "g")
    av, gv = rand(rng, (16, 5), -9, 9), rand(rng, (16, 5), -9, 9)
    D, H, Hkv, n_q, n_kv = 8, 4, 2, 3, 5
    q = new_input(T.F32, (D, n_q, H), "q")
    k, v = new_input(T.F32, (D, n_kv, Hkv), "k"), new_input(T.F32, (D, n_kv, Hkv), "v")
    mask, sinks = new_input(T.F32, (n_kv, n_q), "mask"), new_input(T.F32, (H,), "sinks")
    qv, kv_, vv = rand(rng, (D, n_q, H)), rand(rng, (D, n_kv, Hkv)), rand(rng, (D, n_kv, Hkv))
    mv = causal_mask(rng, n_kv, n_q, n_q).astype(np.float64)
    sv = rand(rng, (H,), -2, 2)
    vals = run([ops.swiglu_oai(a, g, 1.702, 7.0), ops.flash_attn_ext(q, k, v, mask, 0.5, 0.0, 0.0, sinks)],
               {a: av, g: gv, q: qv, k: kv_, v: vv, mask: mv, sinks: sv})
    x, y = np.minimum(av, 7.0), np.clip(gv, -7.0, 7.0)
    check("swiglu_oai", vals[0], x / (1 + np.exp(-1.702 * x)) * (y + 1))
    ref = np.zeros((1, n_q, H, D))
    for h in range(H):
        s = qv[0, h] @ kv_[0, h // 2].T * 0.5 + mv[0, 0, :n_q]
        e = np.exp(s - s.max(1, keepdims=True))
        p = e / (e.sum(1, keepdims=True) + np.exp(sv[0, 0, 0, h] - s.max(1, keepdims=True)))
        ref[0, :, h] = p @ vv[0, h // 2]
    check("flash_attn_ext sinks", vals[1], ref, NMSE_FLASH_ATTN)


# ---- views and shape ops ---------------------------------------------------------------

def ref_view(mem: np.ndarray, esz: int, ne, nb, offset: int) -> np.ndarray:
    """Element (i0..i3) of a view is mem[(offset + sum i_k nb_k) / esz] (ggml's byte strides)."""
    ne = tuple(ne) + (1,) * (4 - len(ne))
    out = np.zeros(shape_of(ne))
    for i3 in range(ne[3]):
        for i2 in range(ne[2]):
            for i1 in range(ne[1]):
                for i0 in range(ne[0]):
                    byte = offset + i0 * nb[0] + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]
                    out[i3, i2, i1, i0] = mem[byte // esz]
    return out


@pytest.mark.parametrize("t", [T.F32, T.F16], ids=type_name)
def test_views(t):
    rng = np.random.default_rng(13)
    ne = (12, 5, 4, 3)
    x = new_input(t, ne, "x")
    xv = rounded(rand(rng, ne), t)
    mem = xv.reshape(-1)
    e = x.nb[0]
    views = [
        ops.view_1d(x, 17, 5 * e),
        ops.view_2d(x, 6, 4, x.nb[1], x.nb[1] * 2 + 3 * e),
        ops.view_3d(x, 4, 3, 2, x.nb[1], x.nb[2], x.nb[2] + 2 * e),
        ops.view_4d(x, 3, 2, 2, 2, x.nb[1] * 2, x.nb[2], x.nb[3], e),
        ops.view_2d(x, 4, 9, 2 * e, 0),                        # overlapping rows (sliding window)
        ops.view_3d(x, 2, 3, 5, 4 * e, x.nb[1], 7 * e),        # strides that do not nest
    ]
    inner = ops.view_2d(x, 12, 8, x.nb[1], x.nb[1])
    views.append(ops.view_2d(inner, 5, 3, 2 * x.nb[1], 2 * e))   # view of a view
    outs = [ops.cont(v) for v in views]
    vals = run(outs, {x: xv})
    for k, v in enumerate(views):
        offs = v.view_offs + (x.nb[1] if k == len(views) - 1 else 0)
        check(f"view {k} ne={v.ne} nb={v.nb}", vals[k], ref_view(mem, e, v.ne, v.nb, offs))


def test_reshape_permute_transpose_cont():
    rng = np.random.default_rng(14)
    ne = (6, 5, 4, 3)
    x = new_input(T.F32, ne, "x")
    xv = rand(rng, ne)
    perms = [(0, 2, 1, 3), (1, 0, 2, 3), (2, 0, 3, 1), (3, 2, 1, 0)]
    outs = [ops.cont(ops.permute(x, *p)) for p in perms]
    outs.append(ops.cont(ops.transpose(x)))
    outs += [ops.reshape_1d(x, 360), ops.reshape_2d(x, 30, 12), ops.reshape_3d(x, 3, 40, 3),
             ops.reshape_4d(x, 2, 3, 4, 15)]
    outs.append(ops.reshape_2d(ops.cont(ops.permute(x, 1, 0, 2, 3)), 20, 18))   # cont before reshape
    outs.append(ops.cont_2d(ops.transpose(x), 5, 72))
    vals = run(outs, {x: xv})
    for k, p in enumerate(perms):
        # ggml dim i goes to dim p[i]; in numpy order, result axis 3 - p[i] is source axis 3 - i
        order = [0] * 4
        for i, ax in enumerate(p):
            order[3 - ax] = 3 - i
        check(f"permute {p}", vals[k], xv.transpose(order))
    check("transpose", vals[4], xv.swapaxes(2, 3))
    for k, o in enumerate(outs[5:9]):
        check(f"reshape {o.ne}", vals[5 + k], xv.reshape(o.shape))
    check("cont then reshape", vals[9], xv.swapaxes(2, 3).reshape(shape_of((20, 18))))
    check("cont_2d", vals[10], xv.swapaxes(2, 3).reshape(shape_of((5, 72))))


@pytest.mark.parametrize("t", [T.F32, T.F16, T.Q8_0], ids=type_name)
def test_shape_ops_on_weight_leaves(t):
    """Weights read through reshape / permute / cont / concat / rope, as some architectures
    reshape or transpose a weight before using it."""
    rng = np.random.default_rng(21)
    ne = (32, 6)
    if t == T.Q8_0:
        blocks = random_blocks(rng, t, ne)
        w = new_weight(t, ne, "w", weights.to_device(blocks, t, ne))
        wv = dequant_ref(blocks, t, ne)
    else:
        wv = rand(rng, ne)
        w = weight("w", t, wv)
        wv = rounded(wv, t)
    x = new_input(T.F32, (64, 2), "x")
    xv = rand(rng, (64, 2))
    outs = [ops.mul_mat(ops.reshape_2d(w, 64, 3), x)]
    if t != T.Q8_0:                       # views and copies of block types are rejected at build time
        outs += [ops.cont(ops.transpose(w)), ops.concat(w, w, 1),
                 ops.rope_ext(ops.reshape_3d(w, 8, 4, 6), new_input(T.I32, (6,), "pos"), None, 8,
                              ops.ROPE_TYPE_NEOX, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)]
    feed = {x: xv}
    pv = np.arange(6, dtype=np.int32) * 3
    if len(outs) > 1:
        feed[outs[-1].src[1]] = pv
    vals = run(outs, feed)
    check(f"mul_mat(reshape(w {t.name}))", vals[0], ref_mul_mat(wv.reshape(shape_of((64, 3))), xv))
    if t != T.Q8_0:
        check("cont(transpose(w))", vals[1], wv.swapaxes(2, 3))
        check("concat(w, w)", vals[2], np.concatenate([wv, wv], axis=2))
        ref = ref_rope(wv.reshape(shape_of((8, 4, 6))), pv, None, 8, ops.ROPE_TYPE_NEOX, 0, 10000.0, 1.0,
                       0.0, 1.0, 32.0, 1.0)
        check("rope(reshape(w))", vals[3], ref)


def test_cpy_and_cast():
    rng = np.random.default_rng(15)
    x = new_input(T.F32, (8, 3), "x")
    xv = rand(rng, (8, 3), -70000, 70000)          # includes values past the f16 range
    xv[0, 0, 0, :3] = [1e-8, -3.0e-5, 65504.0]     # f16 subnormals and the largest finite f16
    dst16 = new_input(T.F16, (24,), "dst16")        # same element count, other shape
    dst_bf = new_input(T.BF16, (8, 3), "dst_bf")
    xp = ops.transpose(x)
    outs = [ops.cpy(x, dst16), ops.cpy(x, dst_bf), ops.cast(x, T.F16), ops.cpy(xp, dst16)]
    vals = run(outs, {x: xv, dst16: np.zeros(24), dst_bf: np.zeros((3, 8))})
    x32 = xv.astype(np.float32)
    with np.errstate(over="ignore"):                # past the f16 range converts to +-inf, as in ggml
        x16, xt16 = x32.astype(np.float16), x32.swapaxes(2, 3).astype(np.float16)
    assert vals[0].dtype == np.float16 and vals[1].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(vals[0], x16.reshape(shape_of((24,))))
    np.testing.assert_array_equal(vals[1].astype(np.float32), x32.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(vals[2], x16)
    np.testing.assert_array_equal(vals[3], xt16.reshape(shape_of((24,))))


@pytest.mark.parametrize("cache_type,idx_type", [(T.F16, T.I32), (T.F32, T.I64)], ids=["F16-I32", "F32-I64"])
def test_set_rows(cache_type, idx_type):
    """Rows idx[i] of the destination get source row i; out-of-range indices (padding) write nothing."""
    rng = np.random.default_rng(16)
    n_rows = 10
    kv = new_state(cache_type, (8, n_rows, 2), "cache_k_l0")
    kvv = rounded(rand(rng, (8, n_rows, 2)), cache_type)
    src = new_input(T.F32, (8, 4, 2), "k_cur")
    sv = rand(rng, (8, 4, 2))
    idx = new_input(idx_type, (4,), "k_idxs")
    iv = np.array([3, 0, n_rows, -1])                       # the last two are padding
    upd = ops.set_rows(kv, src, idx).set_name("k_stored")
    g = Graph().build_forward_expand(upd.set_output())
    outs, state = compute(g, {src: sv, idx: iv}, {kv: kvv.astype(ROUND[cache_type])}, cache=CACHE)
    ref = kvv.copy()
    for i, r in enumerate(iv):
        if 0 <= r < n_rows:
            ref[:, :, r] = rounded(sv[:, :, i], cache_type)
    for name, val in (("output", outs[upd]), ("new state", state[kv])):
        val = np.asarray(val)
        assert val.dtype == ROUND[cache_type], name
        np.testing.assert_array_equal(val.astype(np.float64), ref, err_msg=name)


def test_concat():
    rng = np.random.default_rng(17)
    a = new_input(T.F32, (4, 3, 2, 2), "a")
    av = rand(rng, (4, 3, 2, 2))
    outs, feed, refs = [], {a: av}, []
    for dim in range(4):
        bne = list(a.ne)
        bne[dim] = 3
        b = new_input(T.F32, bne, f"b{dim}")
        feed[b] = rand(rng, bne)
        outs.append(ops.concat(a, b, dim))
        refs.append(np.concatenate([av, feed[b]], axis=3 - dim))
    bt = new_input(T.F32, (3, 4, 2, 2), "bt")              # a permuted second operand
    feed[bt] = rand(rng, (3, 4, 2, 2))
    outs.append(ops.concat(a, ops.transpose(bt), 1))
    refs.append(np.concatenate([av, feed[bt].swapaxes(2, 3)], axis=2))
    for k, (out, ref) in enumerate(zip(run(outs, feed), refs, strict=False)):
        check(f"concat {k}", out, ref)


def test_sum_rows():
    rng = np.random.default_rng(18)
    x = new_input(T.F32, (13, 5, 3, 2), "x")
    xv = rand(rng, (13, 5, 3, 2))
    s, st = run([ops.sum_rows(x), ops.sum_rows(ops.transpose(x))], {x: xv})
    check("sum_rows", s, xv.sum(-1, keepdims=True))
    check("sum_rows transposed", st, xv.swapaxes(2, 3).sum(-1, keepdims=True))


def test_map_custom1():
    """A user function on the node's value (numpy order); consumers read its result; a
    result of another shape or dtype is a ValueError naming the node and both shapes."""
    rng = np.random.default_rng(23)
    x = new_input(T.F32, (6, 4), "x")
    xv = rand(rng, (6, 4))
    y = ops.map_custom1(x, lambda v: v * 2.0 + 1.0).set_name("y")
    out, after = run([y, ops.scale(y, 0.5)], {x: xv})
    check("map_custom1", out, xv * 2.0 + 1.0)
    check("map_custom1 consumer", after, (xv * 2.0 + 1.0) * 0.5)
    bad = ops.map_custom1(x, lambda v: v[..., :3]).set_name("bad")
    with pytest.raises(ValueError, match=r"'bad'.*float32\[1, 1, 4, 3\].*float32\[1, 1, 4, 6\]"):
        run([bad], {x: xv})
    with pytest.raises(ValueError, match="callable"):
        ops.map_custom1(x, 3.0)


def test_argsort_and_top_k():
    """Exact indices (distinct values, as test-backend-ops uses); top_k returns the k
    largest, largest first."""
    rng = np.random.default_rng(19)
    ne = (20, 4, 2)
    x = new_input(T.F32, ne, "x")
    xv = np.stack([rng.permutation(20) for _ in range(8)]).reshape(shape_of(ne)) * 0.5 - 3.0
    asc, desc, top3, top1 = run([ops.argsort(x, ops.SORT_ASC), ops.argsort(x, ops.SORT_DESC),
                                 ops.top_k(x, 3), ops.top_k(x, 1)], {x: xv})
    for name, out, ref in (("asc", asc, np.argsort(xv, axis=-1)), ("desc", desc, np.argsort(-xv, axis=-1)),
                           ("top_k 3", top3, np.argsort(-xv, axis=-1)[..., :3]),
                           ("top_k 1", top1, np.argmax(xv, axis=-1)[..., None])):
        assert out.dtype == np.int32, name
        np.testing.assert_array_equal(out, ref, err_msg=name)


# ---- quantized weights -----------------------------------------------------------------

# byte offsets of the f16 scale fields inside one block (ggml-common.h); every other byte
# of a block is a free quant/sub-scale bit pattern, so random bytes make a valid block
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
              T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,), T.IQ3_S: (0,), T.TQ2_0: (64,)}


def random_blocks(rng, t: T, ne) -> np.ndarray:
    """uint8 [n_rows, row_size] of random blocks with small, finite f16 scales."""
    n_rows = int(np.prod(ne[1:]))
    bs, tsz = types.block_size(t), types.type_size(t)
    n_blocks = n_rows * ne[0] // bs
    blocks = rng.integers(0, 256, size=(n_blocks, tsz), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        scale = rng.uniform(0.002, 0.02, size=n_blocks).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(n_rows, -1)


def dequant_ref(blocks: np.ndarray, t: T, ne) -> np.ndarray:
    """gguf-py's reference dequantization (an independent oracle) in numpy order, float64."""
    import gguf
    vals = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(t)))
    return vals.astype(np.float64).reshape(shape_of(ne))


@pytest.mark.parametrize("t", list(F16_FIELDS), ids=type_name)
@pytest.mark.slow
def test_quantized_weight_ops(t):
    """mul_mat (with channel broadcast), get_rows (2-d fast path and 3-d) and mul_mat_id on a
    block-quantized src0, against float64 math on the dequantized weights."""
    rng = np.random.default_rng(20 + int(t))
    K = max(64, types.block_size(t))
    ne = (K, 6, 4)                                          # 4 experts / channels of 6 rows
    blocks = random_blocks(rng, t, ne)
    w = new_weight(t, ne, "ffn_exps", weights.to_device(blocks, t, ne))
    w2 = new_weight(t, (K, 24), "token_embd", weights.to_device(blocks, t, (K, 24)))
    wref = dequant_ref(blocks, t, ne)
    b = new_input(T.F32, (K, 3, 8), "cur")                  # 8 channels over 4: broadcast
    bv = rand(rng, (K, 3, 8))
    ids = new_input(T.I32, (2, 3), "ids")
    idv = np.array([[0, 3], [2, 2], [1, 0]], np.int32).reshape(1, 1, 3, 2)
    bm = new_input(T.F32, (K, 1, 3), "cur_moe")
    bmv = rand(rng, (K, 1, 3))
    rows = new_input(T.I32, (5,), "inp_tokens")
    rv = np.array([23, 0, 7, 7, 12], np.int32).reshape(1, 1, 1, 5)
    rows3 = new_input(T.I32, (2, 4), "rows3")
    r3v = rng.integers(0, 6, size=(1, 1, 4, 2)).astype(np.int32)
    mm, mmid, gr, gr3 = run([ops.mul_mat(w, b), ops.mul_mat_id(w, bm, ids), ops.get_rows(w2, rows),
                             ops.get_rows(w, rows3)], {b: bv, ids: idv, bm: bmv, rows: rv, rows3: r3v})
    check(f"mul_mat {t.name}", mm, ref_mul_mat(wref, bv), NMSE_QUANT_MUL_MAT)
    check(f"mul_mat_id {t.name}", mmid, ref_mul_mat_id(wref, bmv, idv), NMSE_QUANT_MUL_MAT)
    check(f"get_rows {t.name}", gr, ref_get_rows(wref.reshape(1, 1, 24, K), rv))
    check(f"get_rows 3d {t.name}", gr3, ref_get_rows(wref, r3v))


@pytest.mark.parametrize("t", [T.F16, T.Q4_0], ids=type_name)
def test_mul_mat_large_weight(t):
    """A weight of more than 2^21 elements with an odd row count (8193): big enough that a
    reader may dequantize it a chunk of rows at a time, with a remainder chunk."""
    rng = np.random.default_rng(23)
    ne = (256, 8193)
    if t == T.Q4_0:
        blocks = random_blocks(rng, t, ne)
        w = new_weight(t, ne, "output.weight", weights.to_device(blocks, t, ne))
        wref = dequant_ref(blocks, t, ne)
    else:
        wv = rand(rng, ne)
        w = weight("output.weight", t, wv)
        wref = rounded(wv, t)
    x = new_input(T.F32, (256, 3), "result_norm")
    xv = rand(rng, (256, 3))
    rows = new_input(T.I32, (4,), "inp_tokens")
    rv = np.array([8192, 0, 4097, 8192], np.int32).reshape(1, 1, 1, 4)
    mm, gr = run([ops.mul_mat(w, x), ops.get_rows(w, rows)], {x: xv, rows: rv})
    check(f"mul_mat large {t.name}", mm, ref_mul_mat(wref, xv),
          NMSE_QUANT_MUL_MAT if types.traits(t).is_quantized else NMSE_DEFAULT)
    check(f"get_rows large {t.name}", gr, ref_get_rows(wref, rv))


# ---- shape errors at build time --------------------------------------------------------

def _inp(t, ne, name):
    return new_input(t, ne, name)


SHAPE_ERRORS = {
    "mul_mat K": lambda: (ops.mul_mat, _inp(T.F32, (16, 7), "a"), _inp(T.F32, (15, 5), "b")),
    "mul_mat broadcast": lambda: (ops.mul_mat, _inp(T.F32, (16, 7, 4), "a"), _inp(T.F32, (16, 5, 6), "b")),
    "add repeat": lambda: (ops.add, _inp(T.F32, (10, 6), "a"), _inp(T.F32, (4, 6), "b")),
    "mul repeat": lambda: (ops.mul, _inp(T.F32, (10, 6), "a"), _inp(T.F32, (10, 4), "b")),
    "get_rows dims": lambda: (ops.get_rows, _inp(T.F32, (8, 10, 2), "a"), _inp(T.I32, (3, 3), "b")),
    "concat": lambda: (lambda a, b: ops.concat(a, b, 0), _inp(T.F32, (4, 3), "a"), _inp(T.F32, (4, 2), "b")),
    "glu split": lambda: (lambda a, b: ops.swiglu_split(a, b), _inp(T.F32, (8, 3), "a"), _inp(T.F32, (8, 2), "b")),
    "cpy count": lambda: (ops.cpy, _inp(T.F32, (8, 3), "a"), _inp(T.F16, (8, 2), "b")),
    "soft_max mask": lambda: (lambda a, m: ops.soft_max_ext(a, m, 1.0, 0.0), _inp(T.F32, (10, 4), "a"),
                              _inp(T.F16, (9, 4), "mask")),
    "rope positions": lambda: (lambda a, p: ops.rope_ext(a, p, None, 8, 0, 0, 1e4, 1, 0, 1, 32, 1),
                               _inp(T.F32, (8, 2, 5), "a"), _inp(T.I32, (4,), "pos")),
    "flash_attn heads": lambda: (lambda q, k: ops.flash_attn_ext(q, k, k, None, 1.0, 0.0, 0.0),
                                 _inp(T.F32, (16, 3, 5), "q"), _inp(T.F16, (16, 8, 2), "k")),
    "flash_attn mask heads": lambda: (lambda q, m: ops.flash_attn_ext(q, _inp(T.F16, (16, 8, 2), "k"),
                                                                     _inp(T.F16, (16, 8, 2), "v"), m, 1.0, 0.0, 0.0),
                                      _inp(T.F32, (16, 3, 6), "q"), _inp(T.F16, (8, 3, 4), "mask")),
    "set_rows": lambda: (lambda a, b: ops.set_rows(a, b, _inp(T.I32, (2,), "idx")),
                         _inp(T.F16, (8, 10), "cache"), _inp(T.F32, (6, 2), "src")),
}


@pytest.mark.parametrize("case", list(SHAPE_ERRORS))
def test_shape_errors_name_both_shapes(case):
    op, a, b = SHAPE_ERRORS[case]()
    with pytest.raises(ShapeError) as err:
        op(a, b)
    msg = str(err.value)
    assert str(list(a.ne)) in msg and str(list(b.ne)) in msg, msg


def test_single_operand_errors():
    x = _inp(T.F32, (6, 4), "x")
    with pytest.raises(ShapeError, match=r"\[6, 4, 1, 1\]"):
        ops.reshape_2d(x, 5, 5)
    with pytest.raises(ShapeError, match="contiguous"):
        ops.reshape_1d(ops.transpose(x), 24)
    with pytest.raises(ShapeError, match="ends at byte"):
        ops.view_2d(x, 6, 4, x.nb[1], x.nb[0])
    with pytest.raises(ShapeError, match="k=7"):
        ops.top_k(x, 7)
    with pytest.raises(ShapeError, match="n_dims 5"):
        ops.rope_ext(_inp(T.F32, (6, 2, 3), "q"), _inp(T.I32, (3,), "p"), None, 5, 0, 0, 1e4, 1, 0, 1, 32, 1)
    with pytest.raises(ShapeError, match="Q4_0"):
        ops.cont(new_weight(T.Q4_0, (32, 2), "w"))



# ---- coverage --------------------------------------------------------------------------

def test_every_op_has_a_lowering_and_a_test():
    """A new Op needs a lowering and a test here (docs/adding-an-op.md); Op.NONE is a leaf."""
    ops_ = [op for op in Op if op is not Op.NONE]
    assert [op.value for op in ops_ if op not in lower.LOWERINGS] == [], "ops without a lowering"
    assert [op.value for op in ops_ if op not in TESTED_OPS] == [], "ops without a test in TESTED_OPS"
    assert Op.NONE not in lower.LOWERINGS
    missing = {op.value: name for op, name in TESTED_OPS.items() if not callable(globals().get(name))}
    assert missing == {}, "TESTED_OPS names tests that do not exist"


def test_a_node_without_a_lowering_is_named_in_the_error():
    x = new_input(T.F32, (4,), "x")
    leaf_as_node = Tensor(Op.NONE, (x,), x.ne, x.type, x.nb, name="orphan")
    with pytest.raises(NotImplementedError, match="orphan"):
        lower.eval_node(leaf_as_node, {x: np.zeros(4, np.float32)})


def test_an_op_is_lowered_once():
    with pytest.raises(ValueError, match="already lowered"):
        lower.lowers(Op.ADD)(lambda n, env: None)


def test_set_rows_per_slice_indices():
    """Indices [n, ne2]: each ne2 slice writes its own rows (DeepSeek-V3's group masking)."""
    rng = np.random.default_rng(18)
    dst = new_input(T.F32, (3, 5, 4), "dst")                 # ne0 3, 5 rows, 4 slices
    dv = rand(rng, (3, 5, 4))
    src = new_input(T.F32, (3, 2, 4), "src")
    sv = rand(rng, (3, 2, 4))
    idx = new_input(T.I32, (2, 4), "idx")
    iv = np.array([[0, 4], [1, 1], [3, 2], [4, 0]], np.int32)       # [slice, i]
    (out,) = run([ops.set_rows(dst, src, idx)], {dst: dv, src: sv, idx: iv.reshape(1, 1, 4, 2)})
    ref = dv.copy()                                          # numpy order [1, slice, row, ne0]
    for j in range(4):
        for i in range(2):
            ref[0, j, iv[j, i]] = sv[0, j, i]
    np.testing.assert_array_equal(np.asarray(out), ref.astype(np.float32))


# ---- state-space models ----------------------------------------------------------------

def ref_ssm_conv(sx: np.ndarray, c: np.ndarray) -> np.ndarray:
    """sx [1, n_s, d_inner, d_conv - 1 + n_t], c [1, 1, d_inner, d_conv] -> [1, n_s, n_t, d_inner]."""
    d_conv = c.shape[-1]
    n_t = sx.shape[-1] - d_conv + 1
    out = np.zeros((1, sx.shape[1], n_t, sx.shape[2]))
    for t in range(n_t):
        out[0, :, t, :] = np.einsum("sik,ik->si", sx[0, :, :, t:t + d_conv], c[0, 0])
    return out


def test_ssm_conv():
    rng = np.random.default_rng(31)
    d_conv, d_inner, n_t, n_s = 4, 6, 5, 3
    sx_in = new_input(T.F32, (d_conv - 1 + n_t, d_inner, n_s), "sx")
    c_in = new_input(T.F32, (d_conv, d_inner), "c")
    sx, c = rand(rng, sx_in.ne), rand(rng, c_in.ne)
    (out,) = run([ops.ssm_conv(sx_in, c_in)], {sx_in: sx.astype(np.float32), c_in: c.astype(np.float32)})
    check("ssm_conv", out, ref_ssm_conv(sx, c))
    with pytest.raises(ShapeError, match="ssm_conv"):
        ops.ssm_conv(new_input(T.F32, (d_conv + 1, d_inner + 1, n_s), "bad"), c_in)


def ref_im2col(b, k, s0, p0, d0):
    """ggml-cpu's 1-D im2col loop: b [N, IC, L] -> [N, OL, IC K] (k fastest), zero outside."""
    n_b, ic, length = b.shape
    ol = (length + 2 * p0 - d0 * (k - 1) - 1) // s0 + 1
    out = np.zeros((n_b, ol, ic * k))
    for q in range(n_b):
        for o in range(ol):
            for c in range(ic):
                for i in range(k):
                    j = o * s0 + i * d0 - p0
                    if 0 <= j < length:
                        out[q, o, c * k + i] = b[q, c, j]
    return out


@pytest.mark.parametrize("s0, p0, d0, dst", [(1, 1, 1, T.F32), (2, 1, 1, T.F16), (3, 0, 2, T.F32), (2, 2, 1, T.F16)])
def test_im2col(s0, p0, d0, dst):
    """ggml_conv_1d's columns (Whisper's encoder convolutions: kernel 3, padding 1, stride 1
    and 2); an F16 dst holds the inputs rounded, as ggml_conv_1d's im2col does."""
    rng = np.random.default_rng(37)
    k, ic, length, n_b = 3, 5, 11, 2
    a = new_input(T.F32, (k, ic, 4), "kernel")
    b = new_input(T.F32, (length, ic, n_b), "b")
    bv = rand(rng, b.ne, -2, 2)
    out = ops.im2col(a, b, s0, 0, p0, 0, d0, 0, False, dst)
    assert out.type == dst and out.ne[:2] == (ic * k, ops.conv_output_size(length, k, s0, p0, d0))
    (val,) = run([out], {a: rand(rng, a.ne).astype(np.float32), b: bv.astype(np.float32)})
    check(f"im2col s{s0} p{p0} d{d0} {dst.name}", val, ref_im2col(rounded(bv, dst)[0], k, s0, p0, d0)[None])
    with pytest.raises(ShapeError, match="im2col"):
        ops.im2col(a, new_input(T.F32, (length, ic + 1), "bad"), 1, 0, 1, 0, 1, 0, False, T.F32)
    with pytest.raises(ValueError, match="2-D"):
        ops.im2col(a, b, 1, 1, 0, 0, 1, 1, True, T.F32)


def ref_ssm_scan(s, x, dt, A, B, C, ids):
    """The recurrence token by token in float64, numpy order in and out (y then states)."""
    n_seqs, n_tok, n_head, head_dim = x.shape
    n_group = B.shape[2]
    y = np.zeros(x.shape)
    states = np.zeros((n_seqs, n_head, head_dim, s.shape[-1]))
    for q in range(n_seqs):
        h = s[ids[q]].copy()                                  # [n_head, head_dim, d_state]
        for t in range(n_tok):
            for hd in range(n_head):
                g = hd // (n_head // n_group)
                d = dt[0, q, t, hd]
                sp = d if d > 20 else np.log1p(np.exp(d))
                decay = np.exp(sp * A[0, 0, hd])                # [d_state] or [1]
                h[hd] = h[hd] * decay + np.outer(x[q, t, hd] * sp, B[q, t, g])
                y[q, t, hd] = h[hd] @ C[q, t, g]
        states[q] = h
    return np.concatenate([y.reshape(-1), states.reshape(-1)])


@pytest.mark.parametrize("mamba2", [False, True], ids=["mamba1", "mamba2"])
def test_ssm_scan(mamba2):
    """Mamba-1 (a decay per state element, head_dim 1) and Mamba-2 (a scalar per head, 2 groups),
    two sequences starting from slots 2 and 0 of three."""
    rng = np.random.default_rng(32)
    d_state, n_tok, n_seqs, n_slots = 8, 5, 2, 3
    head_dim, n_head, n_group = (4, 4, 2) if mamba2 else (1, 6, 1)
    shapes = dict(s=(d_state, head_dim, n_head, n_slots), x=(head_dim, n_head, n_tok, n_seqs),
                  dt=(n_head, n_tok, n_seqs), A=(1 if mamba2 else d_state, n_head),
                  B=(d_state, n_group, n_tok, n_seqs), C=(d_state, n_group, n_tok, n_seqs))
    ins = {k: new_input(T.F32, ne, k) for k, ne in shapes.items()}
    vals = {k: rand(rng, ne) for k, ne in shapes.items()}
    vals["dt"] = rand(rng, shapes["dt"], -3.0, 3.0)
    vals["dt"][0, 0, 0, 0] = 25.0                  # softplus's linear branch
    vals["A"] = -np.exp(rand(rng, shapes["A"]))
    ids_in = new_input(T.I32, (n_seqs,), "ids")
    ids = np.array([2, 0], np.int32)
    node = ops.ssm_scan(ins["s"], ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], ids_in)
    feed = {ins[k]: v.astype(np.float32) for k, v in vals.items()} | {ids_in: ids}
    (out,) = run([node], feed)
    ref = ref_ssm_scan(vals["s"], vals["x"], vals["dt"], vals["A"], vals["B"], vals["C"], ids)
    check("ssm_scan", out.reshape(-1), ref)
    with pytest.raises(ShapeError, match="ssm_scan"):
        ops.ssm_scan(ins["s"], ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"],
                     new_input(T.I32, (n_seqs + 1,), "ids_bad"))


def ref_gated_delta_net(q, k, v, g, beta, s0, K):
    """The delta rule token by token in float64 on S[i, j] (k index i, v index j), numpy
    order in (ggml's ne reversed) and out (o, then K snapshots most recent first)."""
    n_seqs, n_tok, H_v, S = v.shape
    H_k = q.shape[2]
    o = np.zeros(v.shape)
    snaps = np.zeros((K, n_seqs, H_v, S, S))
    for sq in range(n_seqs):
        for h in range(H_v):
            st = s0[sq, h].T.copy()                            # stored M[j, i] = S[i, j]
            for t in range(n_tok):
                qi, ki = q[sq, t, h % H_k], k[sq, t, h % H_k]
                st = st * np.exp(g[sq, t, h])[:, None]            # row i by exp(g[i]) (or a scalar)
                d = beta[sq, t, h, 0] * (v[sq, t, h] - st.T @ ki)
                st = st + np.outer(ki, d)
                o[sq, t, h] = st.T @ qi / np.sqrt(S)
                slot = n_tok - 1 - t
                if slot < K:
                    snaps[slot, sq, h] = st.T
    return np.concatenate([o.reshape(-1), snaps.reshape(-1)])


@pytest.mark.parametrize("kda,K,n_tok", [(False, 1, 7), (True, 1, 5), (False, 3, 6), (False, 4, 2),
                                         pytest.param(False, 1, 70, marks=pytest.mark.slow),
                                         (False, 3, 12), (True, 1, 20)],
                         ids=["gdn", "kda", "snapshots", "snapshots-past-tokens", "chunked-2-chunks",
                              "chunked-then-snapshots", "kda-long"])
def test_gated_delta_net(kda, K, n_tok):
    """Scalar gates (Qwen3-Next) and per-channel ones (KDA), 4 value heads over 2 query/key
    heads, two sequences; K snapshots of the last states; from 8 tokens before the last K on,
    scalar gates take the chunked form (70 tokens: two full chunks of 32 and a padded one)."""
    rng = np.random.default_rng(33)
    S, H_k, H_v, n_seqs = 4, 2, 4, 2
    shapes = dict(q=(S, H_k, n_tok, n_seqs), k=(S, H_k, n_tok, n_seqs), v=(S, H_v, n_tok, n_seqs),
                  g=(S if kda else 1, H_v, n_tok, n_seqs), beta=(1, H_v, n_tok, n_seqs), s=(S, S, H_v, n_seqs))
    ins = {name: new_input(T.F32, ne, name) for name, ne in shapes.items()}
    vals = {name: rand(rng, ne) for name, ne in shapes.items()}
    vals["g"] = -np.abs(vals["g"])
    vals["beta"] = 1.0 / (1.0 + np.exp(-vals["beta"]))
    node = ops.gated_delta_net(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], ins["s"], K)
    (out,) = run([node], {ins[n]: val.astype(np.float32) for n, val in vals.items()})
    ref = ref_gated_delta_net(vals["q"], vals["k"], vals["v"], vals["g"], vals["beta"], vals["s"], K)
    check("gated_delta_net", out.reshape(-1), ref)
    with pytest.raises(ShapeError, match="gated_delta_net"):
        ops.gated_delta_net(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"],
                            new_input(T.F32, (S, S, H_v, n_seqs + 1), "s_bad"))


def test_pad():
    """ggml_pad: zeros after a along each dim; here of a view (the 1-D view clip.cpp's
    build_stack pads) and of a 3-D tensor."""
    rng = np.random.default_rng(35)
    a = new_input(T.F32, (5, 3, 2), "a")
    av = rand(rng, a.ne)
    flat = ops.view_1d(a, 30, 0)
    outs = run([ops.pad(a, 2, 0, 1, 0), ops.pad(flat, 6, 0, 0, 0)], {a: av.astype(np.float32)})
    check("pad 3-D", outs[0], np.pad(av, ((0, 0), (0, 1), (0, 0), (0, 2))))
    check("pad view", outs[1], np.pad(av.reshape(1, 1, 1, 30), ((0, 0), (0, 0), (0, 0), (0, 6))))
    with pytest.raises(ValueError, match="pad"):
        ops.pad(a, -1, 0, 0, 0)


def test_repeat_4d():
    rng = np.random.default_rng(34)
    a = new_input(T.F32, (3, 1, 2), "a")
    av = rand(rng, a.ne)
    (out,) = run([ops.repeat_4d(a, 6, 4, 2, 3)], {a: av.astype(np.float32)})
    np.testing.assert_array_equal(np.asarray(out), np.tile(av, (3, 1, 4, 2)).astype(np.float32))
    with pytest.raises(ShapeError, match="repeat_4d"):
        ops.repeat_4d(a, 4, 1, 2, 1)
