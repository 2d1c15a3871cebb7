"""Graph building (ggml_build_forward_expand order, leafs vs nodes, lookup by name) and the
text and Graphviz dumps."""
from __future__ import annotations

import html
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from ggmlx import ops, weights
from ggmlx.graph import Graph, build_graph
from ggmlx.tensor import Tensor, new_input, new_state, new_weight
from ggmlx.types import GGMLType as T


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
