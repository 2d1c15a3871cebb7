"""llm.profile on a tiny generated model: the tables name real ggml nodes, the shares add
up, the host split adds up to the step, and the HLO label parser follows dots to their weight."""
from __future__ import annotations

import re

import numpy as np
import pytest
from tiny_model import TinySpec, model_kv, model_tensors, write_gguf, write_model

import llm
from ggmlx import ops, weights
from llm.research.profiler import hlo_labels, token_costs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> llm.Model:
    spec = TinySpec(arch="llama", n_layer=2, seed=3, wtype="Q8_0")
    return llm.load_model(write_model(tmp_path_factory.mktemp("prof") / "tiny.gguf", spec))


@pytest.mark.slow
def test_profile_tables_name_nodes_and_add_up(tiny):
    steps = llm.profile(tiny, n_ctx=64, n_prompt=16, n_decode=4, n_prefill=1, n_ubatch=16)
    assert [s.label.split(" ")[0] for s in steps] == ["prefill", "decode"]
    for s in steps:
        assert s.n_kernels > 10 and s.op_ms > 0
        assert sum(r.share for r in s.ops) == pytest.approx(1.0)
        assert sum(r.share for r in s.by_label) == pytest.approx(1.0)
        labels = {r.label for r in s.by_label}
        # ffn_gate/ffn_up are one fused product, under the first member's name
        assert {"ffn_gate-*", "ffn_out-*", "result_output"} <= labels, labels
        assert s.python_ms + s.input_ms + s.wait_ms == pytest.approx(s.wall_ms)
        text = s.format(top=5)
        assert "top 5 HLO ops" in text and "top 5 ggml nodes" in text
        assert len(re.findall(r"^\| \d+ \|", text, re.M)) == 10


def test_token_costs_count_a_tied_output_once(tmp_path):
    """A tied output matrix is listed as token_embd and as output; a step reads it once."""
    spec = TinySpec(arch="llama", n_layer=2, seed=3, wtype="Q8_0")
    tensors = model_tensors(spec)
    del tensors["output.weight"]
    model = llm.load_model(write_gguf(tmp_path / "tied.gguf", model_kv(spec), tensors, spec.wtype))
    assert model.output is model.tok_embd
    w_bytes, _, _ = token_costs(model, 64)
    assert w_bytes == sum({id(t): t.data.nbytes for t in model.weight_tensors()}.values())


def test_hlo_labels_follow_dots_and_skip_loops():
    hlo = "\n".join([
        '  %w = f32[4,8]{1,0} fusion(%p0), kind=kLoop, calls=%c, metadata={op_name="jit(fn)/ffn_up-3/mul"}',
        "  %dot.1 = f32[1,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}",
        '  %while.2 = (s32[], f32[2]) while(%t), body=%b, metadata={op_name="jit(fn)/result_output/while"}',
        '  %ffi_call.3 = f32[1,4]{1,0} custom-call(%x, %q), custom_call_target="ggmlx_int8_matvec", '
        'metadata={op_name="jit(fn)/Qcur-0/ffi_call"}',
    ])
    labels, containers = hlo_labels(hlo)
    assert labels == {"w": "ffn_up-*", "dot.1": "ffn_up-*", "while.2": "result_output", "ffi_call.3": "Qcur-*"}
    assert containers == {"while.2"}      # a custom call is a kernel of its own, not a container


def _dot_precisions(monkeypatch, value: str | None) -> set[str]:
    import re as _re

    from ggmlx.compile import GraphCache, compute
    from ggmlx.graph import Graph
    from ggmlx.tensor import new_input, new_weight
    from ggmlx.types import GGMLType
    from ggmlx.weights import to_device

    if value is None:
        monkeypatch.delenv("GGMLX_MATMUL_PRECISION", raising=False)
    else:
        monkeypatch.setenv("GGMLX_MATMUL_PRECISION", value)
    rng = np.random.default_rng(0)
    w = new_weight(GGMLType.F32, (32, 8), "w")
    w.data = to_device(rng.standard_normal((8, 32), np.float32), GGMLType.F32, (32, 8))
    x = new_input(GGMLType.F32, (32, 2), "x")
    gf = Graph()
    gf.build_forward_expand(ops.mul_mat(w, x).set_output())
    cache = GraphCache()
    compute(gf, {x: rng.standard_normal((2, 32), np.float32)}, cache=cache)
    (entry,) = cache._entries.values()
    return set(_re.findall(r"operand_precision=\{(\w+),", entry.executable.as_text()))


def test_matmuls_run_at_highest_precision_unless_asked(monkeypatch):
    assert _dot_precisions(monkeypatch, None) == {"highest"}
    assert _dot_precisions(monkeypatch, "default") <= {"default"}
    monkeypatch.setenv("GGMLX_MATMUL_PRECISION", "tf32")
    with pytest.raises(ValueError, match="GGMLX_MATMUL_PRECISION"):
        weights.matmul_precision()
