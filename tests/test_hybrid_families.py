"""LFM2 / LFM2-MoE, Falcon-H1 and Jamba beyond their llama.cpp parity (test_arch_fixtures):
bad files name the key or tensor at fault, and LLM.trace reads their nodes by llama.cpp's
names."""
from __future__ import annotations

import numpy as np
import pytest
from test_arch_fixtures import FIXTURES, rewrite

import llm


@pytest.mark.parametrize("arch, change, match", [
    ("lfm2", {"drop_key": "lfm2.shortconv.l_cache"}, r"lfm2\.shortconv\.l_cache"),
    ("lfm2", {"kv": {"lfm2.shortconv.l_cache": 1}}, r"lfm2\.shortconv\.l_cache' = 1 must be at least 2"),
    ("lfm2", {"kv": {"lfm2.shortconv.l_cache": 4}}, r"blk\.0\.shortconv\.conv\.weight.*shape"),
    ("lfm2", {"drop_tensor": "token_embd_norm.weight"}, r"token_embd_norm\.weight"),
    ("lfm2moe", {"drop_key": "lfm2moe.expert_gating_func"}, r"lfm2moe\.expert_gating_func"),
    ("lfm2moe", {"kv": {"lfm2moe.expert_gating_func": 3}}, r"expert_gating_func' = 3: only softmax"),
    ("lfm2moe", {"kv": {"lfm2moe.leading_dense_block_count": 5}}, r"leading_dense_block_count' = 5 must be in"),
    ("lfm2moe", {"drop_tensor": "blk.2.exp_probs_b.bias"}, r"blk\.2\.exp_probs_b\.bias"),
    ("falcon-h1", {"kv": {"falcon-h1.attention.head_count_kv": 0}}, r"every Falcon-H1 layer has attention"),
    ("falcon-h1", {"drop_tensor": "blk.1.ffn_norm"}, r"blk\.1\.ffn_norm\b"),
    ("falcon-h1", {"kv": {"falcon-h1.ssm.time_step_rank": 5}}, r"time_step_rank' = 5 heads must divide"),
    ("jamba", {"kv": {"jamba.ssm.inner_size": 96}}, r"jamba\.ssm\.inner_size' = 96: only an expansion factor"),
    ("jamba", {"drop_tensor": "blk.0.ssm_dt_norm.weight"}, r"blk\.0\.ssm_dt_norm\.weight"),
])
def test_bad_file_names_the_key_or_tensor(arch, change, match, tmp_path):
    bad = rewrite(FIXTURES / f"{arch}-F32.gguf", tmp_path / "bad.gguf", **change)
    with pytest.raises(llm.ModelLoadError, match=r"bad\.gguf.*" + match):
        llm.load_model(bad)


@pytest.mark.slow
@pytest.mark.parametrize("arch, nodes", [
    ("lfm2", ["model.layers.{}.conv.in_proj-0", "model.layers.{}.conv.conv-2",
              "model.layers.{}.self_attn.q_layernorm-1", "l_out-*"]),
    ("falcon-h1", ["attn_out-0", "ssm_out-1", "mamba2_y_add_d-0", "l_out-*"]),
    ("jamba", ["ffn_moe_out-1", "ffn_out-0", "l_out-*"]),
])
def test_trace_finds_llamacpp_names(arch, nodes):
    """The recurrent and hybrid graphs' nodes by llama.cpp's names (diff-llamacpp matched them
    node by node when the fixtures were made), with llama.cpp's logits."""
    ref = np.load(FIXTURES / f"{arch}.npz")
    m = llm.LLM(str(FIXTURES / f"{arch}-F32.gguf"), n_ctx=64)
    toks = [int(t) for t in ref["tokens_0"]]
    tr = m.trace(toks, capture=nodes + ["result_output"])
    hp = m.model.hparams
    assert [name for name in tr.names if name.startswith("l_out")] == [f"l_out-{il}" for il in range(hp.n_layer)]
    for name in nodes[:-1]:
        assert tr[name].shape[0] == len(toks), name
    assert np.abs(tr["result_output"] - ref["logits_0"]).max() <= 1e-4


def test_info_reports_both_memories_of_falcon_h1(capsys):
    """Every Falcon-H1 layer is recurrent and attends: llm info says hybrid (as
    llama_model::create_memory chooses), with the states and the KV cache."""
    from llm.cli import main
    assert main(["info", str(FIXTURES / "falcon-h1-F32.gguf")]) == 0
    out = capsys.readouterr().out
    assert "memory: hybrid" in out
    assert "over 2 layers (conv 480 + SSM 1536 values each)" in out and "KV cache" in out
