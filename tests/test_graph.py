"""Graph building (ggml_build_forward_expand order, leafs vs nodes, lookup by name), the
text and Graphviz dumps, and llm.graph's blocks with their option enums (every member
lowered or refused by name)."""
from __future__ import annotations

import html
import itertools
import os
import re
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from ggmlx import ops, weights
from ggmlx.compile import GraphCache, compute
from ggmlx.graph import Graph, build_graph
from ggmlx.tensor import Tensor, new_input, new_state, new_weight
from ggmlx.types import GGMLType as T
from llm.graph import GraphBuilder, GraphParams, LLMFfnGateType, LLMFfnOpType, LLMNormType
from llm.hparams import ExpertGatingFuncType


def small_block():
    """One llama-style layer: rms_norm * weight, a matmul, rope, attention scores, a KV
    write and a residual add; the tensors by name."""
    x = new_input(T.F32, (16, 4), "inp_embd")
    pos = new_input(T.I32, (4,), "inp_pos")
    norm_w = new_weight(T.F32, (16,), "blk.0.attn_norm.weight",
                        weights.to_device(np.ones(16, np.float32), T.F32, (16,)))
    wq = new_weight(T.F16, (16, 16), "blk.0.attn_q.weight",
                    weights.to_device(np.zeros((16, 16), np.float16), T.F16, (16, 16)))
    cache_k = new_state(T.F16, (16, 32), "cache_k_l0")
    k_idxs = new_input(T.I32, (4,), "k_idxs")
    cur = ops.rms_norm(x, 1e-6).set_name("norm-0")
    cur = ops.mul(cur, norm_w).set_name("attn_norm-0")
    q = ops.mul_mat(wq, cur).set_name("Qcur-0")
    q = ops.reshape_3d(q, 4, 4, 4).set_name("Qcur-0 (reshaped)")
    q = ops.rope_ext(q, pos, None, 4, ops.ROPE_TYPE_NEOX, 0, 1e4, 1.0, 0.0, 1.0, 32.0, 1.0).set_name("Qcur_rope-0")
    k_stored = ops.set_rows(cache_k, cur, k_idxs).set_name("k_stored-0")
    k = ops.view_2d(k_stored, 16, 8, k_stored.nb[1], 0).set_name("k-0")
    kq = ops.mul_mat(k, cur).set_name("kq-0")
    out = ops.add(ops.sum_rows(q).set_name("q_sum-0"), ops.sum_rows(kq).set_name("kq_sum-0")).set_name("l_out-0")
    names = {t.name: t for t in (x, pos, norm_w, wq, cache_k, k_idxs, cur, q, k_stored, k, kq, out)}
    return out, names


def test_build_order_sources_first_no_duplicates():
    out, names = small_block()
    g = Graph().build_forward_expand(out)
    order = {t.id: i for i, t in enumerate(g.nodes)}
    assert len(order) == len(g.nodes), "a node appears twice"
    assert len({t.id for t in g.leafs}) == len(g.leafs), "a leaf appears twice"
    leaf_ids = {t.id for t in g.leafs}
    for i, n in enumerate(g.nodes):
        for s in n.src:
            assert s.id in leaf_ids or order[s.id] < i, f"{s.name} is not before its user {n.name}"
    assert g.nodes[-1] is out
    assert order[g.get_tensor("q_sum-0").id] < order[names["k_stored-0"].id]
    assert g.n_nodes == len(g.nodes) == 11


def test_build_order_is_src_order_not_creation_order():
    """Depth first with src0's whole branch before src1's, as ggml_visit_parents."""
    x = new_input(T.F32, (4,), "x")
    late = ops.silu(ops.sqr(x).set_name("sqr")).set_name("silu")      # created first, used as src1
    early = ops.tanh(x).set_name("tanh")
    out = ops.add(early, late).set_name("out")
    assert [n.name for n in Graph().build_forward_expand(out).nodes] == ["tanh", "sqr", "silu", "out"]


def test_deep_chain_builds_without_recursion():
    x = new_input(T.F32, (4,), "x")
    cur = x
    for i in range(5000):
        cur = ops.scale(cur, 1.0).set_name(f"s{i}")
    g = Graph().build_forward_expand(cur)
    assert g.n_nodes == 5000 and g.nodes[0].name == "s0" and g.leafs == [x]


def test_expand_again_adds_only_new_nodes():
    out, names = small_block()
    g = Graph()
    g.build_forward_expand(names["attn_norm-0"])
    first = list(g.nodes)
    g.build_forward_expand(out)
    assert g.nodes[: len(first)] == first
    g.build_forward_expand(out)
    g.build_forward_expand(names["Qcur_rope-0"])
    assert len(g.nodes) == len({n.id for n in g.nodes}) == 11
    assert build_graph([names["attn_norm-0"], out]).nodes == g.nodes


def test_leafs_and_nodes():
    out, names = small_block()
    g = Graph().build_forward_expand(out)
    assert {t.name for t in g.leafs} == {"inp_embd", "inp_pos", "blk.0.attn_norm.weight",
                                         "blk.0.attn_q.weight", "cache_k_l0", "k_idxs"}
    assert all(t.is_leaf for t in g.leafs) and not any(t.is_leaf for t in g.nodes)
    assert names["k-0"] in g.nodes                  # views are nodes, as in ggml


def test_get_tensor_and_outputs():
    out, names = small_block()
    g = Graph().build_forward_expand(out)
    for t in g.nodes + g.leafs:
        assert g.get_tensor(t.name) is t
    for name in ("inp_embd", "cache_k_l0", "k-0", "l_out-0"):
        assert g.get_tensor(name) is names[name]
    with pytest.raises(KeyError, match="no_such"):
        g.get_tensor("no_such")
    assert g.outputs() == [out]                     # nothing flagged: the last node
    names["kq-0"].set_output()
    out.set_output()
    assert g.outputs() == [names["kq-0"], out]


def _shape_in_line(t: Tensor, line: str) -> bool:
    return [int(v) for v in re.findall(r"-?\d+", line.split("]")[0])][-4:] == list(t.ne)


def test_dump_text_lists_every_node_and_leaf():
    out, _ = small_block()
    g = Graph().build_forward_expand(out)
    text = g.dump_text()
    lines = text.splitlines()
    assert f"n_nodes = {len(g.nodes)}" in lines and f"n_leafs = {len(g.leafs)}" in lines
    for t in g.nodes + g.leafs:
        hits = [ln for ln in lines if re.search(rf" {re.escape(t.name)}( \((weight|state|input|output)\))?$", ln)]
        assert len(hits) == 1, f"{t.name}: {hits}"
        line = hits[0]
        assert t.op.value in line and f" {t.type.name} " in line, line
        assert _shape_in_line(t, line), line
    assert "(weight)" in text and "(state)" in text and "(input)" in text
    placed = g.dump_text(placement=lambda t: "CPU" if t.is_leaf else "JAX0")
    assert all(ln.endswith(("[CPU]", "[JAX0]")) for ln in placed.splitlines() if ln.startswith(" - "))


def _dot_or_skip() -> str:
    dot = shutil.which("dot")
    if dot is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Graphviz 'dot' is missing under CI (install the Debian package graphviz)")
        pytest.skip("Graphviz 'dot' not installed")
    return dot


def test_dump_dot_renders_with_graphviz():
    dot = _dot_or_skip()
    out, _ = small_block()
    odd = ops.scale(out, 2.0).set_name('odd "name" {x} <y> | a\\b')
    g = Graph().build_forward_expand(odd)
    for placement in (None, lambda t: "CPU" if t.is_leaf else "GPU|0"):
        src = g.dump_dot(placement)
        assert src.count(" -> ") == sum(len(n.src) for n in g.nodes)
        assert src.count("shape=box") == len(g.leafs) and src.count("shape=record") == len(g.nodes)
        res = subprocess.run([dot, "-Tsvg"], input=src, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert res.stdout.lstrip().startswith("<?xml") and "</svg>" in res.stdout
        texts = [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", res.stdout)]
        for n in g.nodes:                       # every node's name is one whole record field
            assert n.name in texts, n.name
        assert any("cache_k_l0" in t for t in texts)
        if placement is not None:
            assert "GPU|0" in texts
            assert len(set(re.findall(r'fillcolor="([^"]+)"', src))) == 2


# ---- llm.graph: the blocks' options ------------------------------------------------------

N_EMBD, N_FF, N_TOKENS, N_EXPERT, N_USED = 8, 6, 3, 4, 2
EPS, RMS_EPS = 1e-5, 1e-6
RNG = np.random.default_rng(7)
BLOCK_CACHE = GraphCache()


def _w(name: str, x: np.ndarray) -> Tensor:
    """An F32 weight from numpy order [.., ne1, ne0]."""
    x = x.astype(np.float32)
    ne = tuple(reversed(x.shape))
    return new_weight(T.F32, ne, name, weights.to_device(x, T.F32, ne))


def _builder() -> tuple[GraphBuilder, Tensor, np.ndarray]:
    """A GraphBuilder over a stand-in model (the blocks read only hparams' epsilons and the
    output tensors) and an input x [N_EMBD, N_TOKENS] with its value."""
    hp = SimpleNamespace(f_norm_eps=EPS, f_norm_rms_eps=RMS_EPS, n_expert_groups=0)
    model = SimpleNamespace(hparams=hp, path="stand-in.gguf", arch="test", output_norm=None,
                            output_norm_b=None, output=_w("output.weight", RNG.normal(size=(5, N_EMBD))),
                            output_b=None)
    g = GraphBuilder(model, None, GraphParams(n_tokens=N_TOKENS, n_outputs=N_TOKENS, n_kv=256,
                                               embd_input=False))
    return g, new_input(T.F32, (N_EMBD, N_TOKENS), "x"), RNG.normal(size=(N_TOKENS, N_EMBD)).astype(np.float32)


def _run(g: GraphBuilder, out: Tensor, x: Tensor, xv: np.ndarray) -> np.ndarray:
    out.set_output()
    g.gf.build_forward_expand(out)
    outs, _ = compute(g.gf, {x: xv}, cache=BLOCK_CACHE)
    return np.asarray(outs[out]).reshape(out.ne[1], out.ne[0])


def _name(member) -> str:
    return f"{type(member).__name__}.{member.name}"


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _swiglu_oai(g, u):
    g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    return g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


NORM_REF = {
    LLMNormType.NORM: lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS),
    LLMNormType.RMS: lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + RMS_EPS),
}


@pytest.mark.parametrize("type_norm", list(LLMNormType))
def test_build_norm_lowers_every_type(type_norm):
    g, x, xv = _builder()
    w, b = RNG.normal(size=N_EMBD), RNG.normal(size=N_EMBD)
    out = g.build_norm(x, _w("norm.weight", w), _w("norm.bias", b), type_norm, 0)
    np.testing.assert_allclose(_run(g, out, x, xv), NORM_REF[type_norm](xv) * w + b, rtol=1e-4, atol=1e-5)
    assert g.gf.get_tensor("norm-0") is not None


# (type_op, type_gate) -> the activation node's name, or None where build_ffn refuses the pair
FFN_CASES = {
    (LLMFfnOpType.SILU, LLMFfnGateType.PAR): "ffn_swiglu",
    (LLMFfnOpType.GELU, LLMFfnGateType.PAR): "ffn_geglu",
    (LLMFfnOpType.SWIGLU_OAI_MOE, LLMFfnGateType.PAR): "ffn_swiglu_oai",
    (LLMFfnOpType.SWIGLU, LLMFfnGateType.PAR): None,
    (LLMFfnOpType.GEGLU, LLMFfnGateType.PAR): None,
    (LLMFfnOpType.SILU, LLMFfnGateType.SEQ): "ffn_silu",
    (LLMFfnOpType.GELU, LLMFfnGateType.SEQ): "ffn_gelu",
    (LLMFfnOpType.SWIGLU, LLMFfnGateType.SEQ): "ffn_swiglu",
    (LLMFfnOpType.GEGLU, LLMFfnGateType.SEQ): "ffn_geglu",
    (LLMFfnOpType.SWIGLU_OAI_MOE, LLMFfnGateType.SEQ): None,
    (LLMFfnOpType.RELU_SQR, LLMFfnGateType.PAR): None,
    (LLMFfnOpType.RELU_SQR, LLMFfnGateType.SEQ): "ffn_sqr(relu)",
}
FFN_ACT = {LLMFfnOpType.SILU: _silu, LLMFfnOpType.GELU: _gelu, LLMFfnOpType.SWIGLU: _silu,
           LLMFfnOpType.GEGLU: _gelu, LLMFfnOpType.RELU_SQR: lambda x: np.maximum(x, 0.0) ** 2}


@pytest.mark.parametrize("type_op, type_gate", list(itertools.product(LLMFfnOpType, LLMFfnGateType)))
def test_build_ffn_lowers_or_refuses_every_op_and_gate(type_op, type_gate):
    act_name = FFN_CASES[(type_op, type_gate)]    # a KeyError: a new member this test does not know
    g, x, xv = _builder()
    fused = type_op in (LLMFfnOpType.SWIGLU, LLMFfnOpType.GEGLU)
    wu = RNG.normal(size=(2 * N_FF if fused else N_FF, N_EMBD))
    wg, wd, bd = RNG.normal(size=(N_FF, N_EMBD)), RNG.normal(size=(N_EMBD, N_FF)), RNG.normal(size=N_EMBD)
    gate = _w("ffn_gate.weight", wg) if type_gate is LLMFfnGateType.PAR else None
    args = (x, _w("ffn_up.weight", wu), gate, _w("ffn_down.weight", wd), type_op, type_gate, 0)
    if act_name is None:
        with pytest.raises(ValueError, match=f"build_ffn: type_op={_name(type_op)} "):
            g.build_ffn(*args)
        return
    out = g.build_ffn(*args, down_b=_w("ffn_down.bias", bd))
    u = xv @ wu.T
    if type_op is LLMFfnOpType.SWIGLU_OAI_MOE:
        h = _swiglu_oai(xv @ wg.T, u)
    elif type_gate is LLMFfnGateType.PAR:
        h = FFN_ACT[type_op](xv @ wg.T) * u
    elif fused:
        h = FFN_ACT[type_op](u[:, :N_FF]) * u[:, N_FF:]
    else:
        h = FFN_ACT[type_op](u)
    np.testing.assert_allclose(_run(g, out, x, xv), h @ wd.T + bd, rtol=1e-4, atol=1e-4)
    assert g.gf.get_tensor(f"{act_name}-0") is not None


def test_build_ffn_seq_takes_no_gate():
    g, x, _ = _builder()
    w = _w("ffn_up.weight", RNG.normal(size=(N_FF, N_EMBD)))
    with pytest.raises(ValueError, match="build_ffn: type_gate=LLMFfnGateType.SEQ "):
        g.build_ffn(x, w, w, _w("ffn_down.weight", RNG.normal(size=(N_EMBD, N_FF))),
                    LLMFfnOpType.SILU, LLMFfnGateType.SEQ, 0)


def _moe_ref(xv, wr, wu, wg, wd, type_op, gating_op):
    """build_moe_ffn in numpy, norm_w on; weights in numpy order [n_expert, rows, cols]."""
    logits = xv @ wr.T                                        # [n_tokens, n_expert]
    probs = {ExpertGatingFuncType.SOFTMAX: _softmax, ExpertGatingFuncType.SIGMOID: lambda z: 1 / (1 + np.exp(-z)),
             ExpertGatingFuncType.SOFTMAX_WEIGHT: lambda z: z}[gating_op](logits)
    by = probs if gating_op is ExpertGatingFuncType.SOFTMAX else logits
    out = np.zeros_like(xv)
    for t in range(xv.shape[0]):
        sel = np.argsort(-by[t])[:N_USED]
        w = probs[t, sel]
        if gating_op is ExpertGatingFuncType.SOFTMAX_WEIGHT:
            w = _softmax(w)
        w = w / max(w.sum(), 6.103515625e-5)
        for e, we in zip(sel, w, strict=True):
            gate, up = wg[e] @ xv[t], wu[e] @ xv[t]
            h = _swiglu_oai(gate, up) if type_op is LLMFfnOpType.SWIGLU_OAI_MOE else FFN_ACT[type_op](gate) * up
            out[t] += we * (wd[e] @ h)
    return out


# type_op -> the experts' activation node name, or None where build_moe_ffn refuses it
MOE_OPS = {LLMFfnOpType.SILU: "ffn_moe_swiglu", LLMFfnOpType.GELU: "ffn_moe_geglu",
           LLMFfnOpType.SWIGLU_OAI_MOE: "ffn_moe_swiglu_oai", LLMFfnOpType.SWIGLU: None, LLMFfnOpType.GEGLU: None,
           LLMFfnOpType.RELU_SQR: None}
MOE_GATING = {ExpertGatingFuncType.SOFTMAX: True, ExpertGatingFuncType.SIGMOID: True,
              ExpertGatingFuncType.SOFTMAX_WEIGHT: True, ExpertGatingFuncType.NONE: False}


@pytest.mark.parametrize("type_op, gating_op", list(itertools.product(LLMFfnOpType, ExpertGatingFuncType)))
@pytest.mark.slow
def test_build_moe_ffn_lowers_or_refuses_every_op_and_gating(type_op, gating_op):
    act_name, gating_ok = MOE_OPS[type_op], MOE_GATING[gating_op]
    g, x, xv = _builder()
    wr = RNG.normal(size=(N_EXPERT, N_EMBD))
    wu, wg = RNG.normal(size=(N_EXPERT, N_FF, N_EMBD)), RNG.normal(size=(N_EXPERT, N_FF, N_EMBD))
    wd = RNG.normal(size=(N_EXPERT, N_EMBD, N_FF))
    args = (x, _w("ffn_gate_inp.weight", wr), _w("ffn_up_exps.weight", wu), _w("ffn_gate_exps.weight", wg),
            _w("ffn_down_exps.weight", wd), N_EXPERT, N_USED, type_op, True, gating_op, 0)
    if not gating_ok:
        with pytest.raises(ValueError, match=f"build_moe_ffn: gating_op={_name(gating_op)} "):
            g.build_moe_ffn(*args)
        return
    if act_name is None:
        with pytest.raises(ValueError, match=f"build_moe_ffn: type_op={_name(type_op)} "):
            g.build_moe_ffn(*args)
        return
    out = g.build_moe_ffn(*args)
    np.testing.assert_allclose(_run(g, out, x, xv), _moe_ref(xv, wr, wu, wg, wd, type_op, gating_op),
                               rtol=1e-4, atol=1e-4)
    assert g.gf.get_tensor(f"{act_name}-0") is not None


def _call_with(option: str, value):
    """Each builder called with one option replaced by `value`, the others valid."""
    g, x, _ = _builder()
    w = _w("w", RNG.normal(size=(N_FF, N_EMBD)))
    d = _w("d", RNG.normal(size=(N_EMBD, N_FF)))
    opts = {"type_op": LLMFfnOpType.SILU, "type_gate": LLMFfnGateType.PAR, "type_norm": LLMNormType.RMS,
            "gating_op": ExpertGatingFuncType.SOFTMAX}
    opts[option.split(".")[1]] = value
    builder = option.split(".")[0]
    if builder == "build_norm":
        g.build_norm(x, None, None, opts["type_norm"], 0)
    elif builder == "build_output":
        g.build_output(x, type_norm=opts["type_norm"])
    elif builder == "build_ffn":
        g.build_ffn(x, w, w, d, opts["type_op"], opts["type_gate"], 0)
    else:
        e = _w("e", RNG.normal(size=(N_EXPERT, N_FF, N_EMBD)))
        g.build_moe_ffn(x, _w("r", RNG.normal(size=(N_EXPERT, N_EMBD))), e, e,
                        _w("de", RNG.normal(size=(N_EXPERT, N_EMBD, N_FF))), N_EXPERT, N_USED,
                        opts["type_op"], True, opts["gating_op"], 0)


@pytest.mark.parametrize("option, value", [
    ("build_norm.type_norm", "rms"), ("build_norm.type_norm", LLMFfnGateType.PAR), ("build_norm.type_norm", 1),
    ("build_output.type_norm", "norm"),
    ("build_ffn.type_op", "silu"), ("build_ffn.type_op", LLMNormType.RMS),
    ("build_ffn.type_gate", "par"), ("build_ffn.type_gate", LLMFfnOpType.SILU),
    ("build_moe_ffn.type_op", "swiglu_oai"), ("build_moe_ffn.type_op", ExpertGatingFuncType.SOFTMAX),
    ("build_moe_ffn.gating_op", "softmax"), ("build_moe_ffn.gating_op", 1),
    ("build_moe_ffn.gating_op", LLMNormType.NORM),
])
def test_block_options_must_be_their_enum(option, value):
    """A string, an int (even the value of a llama.cpp member) or another option's member is
    a TypeError naming the argument and the value, never another branch."""
    arg = option.split(".")[1]
    with pytest.raises(TypeError, match=rf"^{arg} must be an \w+, not {re.escape(repr(value))}$"):
        _call_with(option, value)
