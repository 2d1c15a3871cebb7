"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet hybrids) beyond their llama.cpp parity
(test_arch_fixtures) and the memory tests (test_recurrent): bad files name the key or tensor,
LLM.trace reads the linear-attention nodes by llama.cpp's names, gradients flow through the
delta rule, and token-by-token decoding continues a prefill exactly."""
from __future__ import annotations

import numpy as np
import pytest
from test_arch_fixtures import FIXTURES, rewrite

import llm


@pytest.mark.parametrize("arch, change, match", [
    ("qwen35", {"kv": {"qwen35.ssm.inner_size": 48}}, r"inner_size' = 48 must be the state size 16 x the value"),
    ("qwen35", {"kv": {"qwen35.ssm.group_count": 3}}, r"value heads 4 .*whose count the key heads 3"),
    ("qwen35", {"kv": {"qwen35.full_attention_interval": 0}}, r"full_attention_interval' = 0 must be >= 1"),
    ("qwen35", {"drop_key": "qwen35.rope.dimension_sections"}, r"qwen35\.rope\.dimension_sections"),
    ("qwen35", {"drop_tensor": "blk.1.ssm_alpha.weight"}, r"blk\.1\.ssm_alpha\.weight"),
    ("qwen35", {"drop_tensor": "blk.3.attn_q_norm.weight"}, r"blk\.3\.attn_q_norm\.weight"),
    ("qwen35", {"kv": {"qwen35.full_attention_interval": 2}}, r"blk\.1\.(attn_q|attn_qkv)\.weight"),
    ("qwen35moe", {"kv": {"qwen35moe.expert_count": 0}}, r"expert_count' and .*must be > 0 for qwen35moe"),
    ("qwen35moe", {"drop_tensor": "blk.0.ffn_gate_inp_shexp.weight"}, r"blk\.0\.ffn_gate_inp_shexp\.weight"),
    ("qwen3next", {"drop_tensor": "blk.2.ssm_ba.weight"}, r"blk\.2\.ssm_ba\.weight"),
    ("qwen3next", {"drop_tensor": "blk.0.ssm_in.weight"}, r"blk\.0\.attn_qkv\.weight"),
    ("qwen3next", {"drop_key": "qwen3next.ssm.state_size"}, r"qwen3next\.ssm\.state_size"),
])
def test_bad_file_names_the_key_or_tensor(arch, change, match, tmp_path):
    bad = rewrite(FIXTURES / f"{arch}-F32.gguf", tmp_path / "bad.gguf", **change)
    with pytest.raises(llm.ModelLoadError, match=r"bad\.gguf.*" + match):
        llm.load_model(bad)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_trace_finds_llamacpp_names(arch):
    """The linear-attention and gated-attention nodes by llama.cpp's names, with llama.cpp's
    logits; qwen3next's q and k arrive at the delta rule spread over the value heads, qwen35's
    tile over them inside the op."""
    ref = np.load(FIXTURES / f"{arch}.npz")
    m = llm.LLM(str(FIXTURES / f"{arch}-F32.gguf"), n_ctx=64)
    toks = [int(t) for t in ref["tokens_0"]]
    nodes = ["q_conv_predelta-0", "a_softplus-1", "gate-2", "linear_attn_out-0", "gate_sigmoid-3",
             "attn_gated-3", "l_out-*"]
    tr = m.trace(toks, capture=nodes + ["result_output"])
    hp = m.model.hparams
    n_heads = hp.ssm_dt_rank if arch == "qwen3next" else hp.ssm_n_group
    assert tr["q_conv_predelta-0"].shape == (len(toks), n_heads, hp.ssm_d_state)
    # q and k are L2-normed per head
    np.testing.assert_allclose(np.linalg.norm(tr["q_conv_predelta-0"], axis=-1), 1.0, atol=1e-4)
    assert (tr["gate-2"] <= 0).all()          # the log-decay: -exp(A_log) * softplus(.)
    assert ((tr["gate_sigmoid-3"] > 0) & (tr["gate_sigmoid-3"] < 1)).all()
    assert [n for n in tr.names if n.startswith("l_out")] == [f"l_out-{il}" for il in range(hp.n_layer)]
    assert np.abs(tr["result_output"] - ref["logits_0"]).max() <= 1e-4


@pytest.mark.slow
def test_decoding_token_by_token_continues_the_prefill():
    """The state after a prefill and after the same tokens one at a time are the same state:
    the next logits agree (the stepwise path of the delta rule against the prefill's loop)."""
    ref = np.load(FIXTURES / "qwen35.npz")
    toks = ref["tokens_0"]
    model = llm.load_model(FIXTURES / "qwen35-F32.gguf")
    one = llm.Context(model, n_ctx=64)
    assert one.decode(llm.Batch(toks, logits=np.ones(len(toks), bool))) == 0
    step = llm.Context(model, n_ctx=64)
    rows = []
    for i, t in enumerate(toks):
        assert step.decode(llm.Batch([int(t)], pos=[i])) == 0
        rows.append(step.get_logits_ith(-1).copy())
    np.testing.assert_allclose(np.stack(rows), one.get_logits(), atol=1e-4)
    np.testing.assert_allclose(np.stack(rows), ref["logits_0"], atol=1e-4)


@pytest.mark.slow
def test_gradient_flows_through_the_delta_rule():
    """The gradient of a logit with respect to a linear-attention layer's input is finite and
    nonzero at earlier positions: it flows back through the recurrent state."""
    m = llm.LLM(str(FIXTURES / "qwen35-F32.gguf"), n_ctx=64)
    toks = [int(t) for t in np.load(FIXTURES / "qwen35.npz")["tokens_1"]]
    g = m.gradient(toks, (len(toks) - 1, 7), wrt="attn_norm-1")["attn_norm-1"]
    assert g.shape[0] == len(toks)
    assert np.isfinite(g).all()
    assert np.abs(g[0]).max() > 0


@pytest.mark.slow
def test_fused_gate_up_experts_equal_separate_ones(tmp_path):
    """A qwen35moe file whose experts' gate and up are one tensor (convert_hf_to_gguf
    --fuse-gate-up-exps: gate rows, then up rows) gives the separate file's logits."""
    from ggmlx import gguf

    src = FIXTURES / "qwen35moe-F32.gguf"
    with gguf.GGUFReader(src) as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            w.add_kv(k, v, f.kv_types[k], f.kv_array_types.get(k))
        for name, ti in f.tensors.items():
            if name.endswith("ffn_up_exps.weight"):
                continue
            data = np.array(ti.data)
            if name.endswith("ffn_gate_exps.weight"):      # numpy order [n_expert, n_ff, n_embd]
                up = np.array(f.tensors[name.replace("gate_exps", "up_exps")].data)
                gate_up = [a.view(np.float32).reshape(tuple(reversed(ti.ne))) for a in (data, up)]
                w.add_tensor(name.replace("gate_exps", "gate_up_exps"), np.concatenate(gate_up, axis=1))
            else:
                w.add_tensor(name, data, ti.type, ti.ne)
    w.write(tmp_path / "fused.gguf")
    toks = np.load(FIXTURES / "qwen35moe.npz")["tokens_1"]
    out = []
    for path in (src, tmp_path / "fused.gguf"):
        ctx = llm.Context(llm.load_model(path), n_ctx=64)
        assert ctx.decode(llm.Batch(toks, logits=np.ones(len(toks), bool))) == 0
        out.append(ctx.get_logits().copy())
    np.testing.assert_allclose(out[1], out[0], atol=1e-5)
