"""Gemma 4 (issue 29) on the fixtures of benchmarks/reference/make_fixture.py: gemma4 (7 layers
S S F S F S F; full layers with 32-wide heads and 1 KV head, SWA layers 16-wide with 2; the
last two layers read the caches of layers 3 and 4 and have a double-wide FFN; per-layer
embeddings) and gemma4-moe (4 layers, a dense FFN beside 4 experts, V from K in the full
layer). Their logits against llama.cpp are in test_arch_fixtures; here the per-layer sizes,
the cache they give, a token-by-token decode and the refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llm
from ggmlx import gguf
from llm import kv_cache

FIXTURES = Path(__file__).resolve().parent / "data" / "fixtures"
GELU_TOL = 1e-2     # llama.cpp's fp16 GELU table, as in test_arch_fixtures


@pytest.fixture(scope="module")
def model():
    return llm.load_model(FIXTURES / "gemma4-F32.gguf")


def test_per_layer_sizes(model):
    hp = model.hparams
    assert [hp.n_embd_head_k_l(il) for il in range(hp.n_layer)] == [16, 16, 32, 16, 32, 16, 32]
    assert [hp.n_embd_k_gqa(il) for il in range(hp.n_layer)] == [32, 32, 32, 32, 32, 32, 32]
    assert [hp.n_rot_l(il) for il in range(hp.n_layer)] == [16, 16, 32, 16, 32, 16, 32]
    assert [hp.n_ff(il) for il in range(hp.n_layer)] == [128] * 5 + [256] * 2
    assert [hp.kv_layer(il) for il in range(hp.n_layer)] == [0, 1, 2, 3, 4, 3, 4]
    assert hp.n_embd_per_layer == 32 and hp.f_attention_scale == 1.0
    layers = model.layers
    assert layers[5].wk is None and layers[5].attn_k_norm is None and layers[2].rope_freqs is not None
    assert layers[1].rope_freqs is None


def test_cache_holds_only_the_layers_with_kv(model):
    hp = model.hparams
    ctx = llm.Context(model, n_ctx=64, n_ubatch=32)
    kv = ctx.memory
    assert kv.k_l[5] is kv.k_l[3] and kv.v_l[6] is kv.v_l[4]
    per_layer = [64 * (hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il)) * 4 for il in range(5)]
    assert kv.nbytes == sum(per_layer) == kv_cache.estimate_bytes(hp, 64)


def test_moe_layers():
    hp = llm.load_model(FIXTURES / "gemma4-moe-F32.gguf").hparams
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.n_embd_per_layer) == (4, 2, 32, 0)
    assert all(hp.has_kv(il) for il in range(hp.n_layer))


@pytest.mark.slow
def test_token_by_token_decode_matches_llamacpp(model):
    """One token per ubatch: the shared layers read tokens that earlier ubatches cached, the
    sliding-window layers lose the oldest ones (window 4)."""
    with np.load(FIXTURES / "gemma4.npz") as ref:
        toks, want = ref["tokens_0"], ref["logits_0"]
    ctx = llm.Context(model, n_ctx=64, n_ubatch=32)
    rows = []
    for i, t in enumerate(toks):
        assert ctx.decode(llm.Batch(np.array([t]), pos=np.array([i], np.int32))) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1).copy())
    diff = np.abs(np.stack(rows) - want).max()
    print(f"gemma4 token by token: max |diff| {diff:.3g}")
    assert diff <= GELU_TOL


def rewrite(dst: Path, *, drop_key: str | None = None, kv: dict | None = None) -> Path:
    with gguf.GGUFReader(FIXTURES / "gemma4-F32.gguf") as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            if k == drop_key:
                continue
            if kv and k in kv:
                w.add_kv(k, kv[k])
            else:
                w.add_kv(k, v, f.kv_types[k], f.kv_array_types.get(k))
        for k, v in (kv or {}).items():
            if k not in f.kv:
                w.add_kv(k, v)
        for name, ti in f.tensors.items():
            w.add_tensor(name, np.array(ti.data), ti.type, ti.ne)
    w.write(dst)
    return dst


@pytest.mark.parametrize("change,match", [
    (dict(drop_key="gemma4.attention.key_length_swa"), r"gemma4\.attention\.key_length_swa"),
    (dict(drop_key="gemma4.embedding_length_per_layer_input"), r"gemma4\.embedding_length_per_layer_input"),
    (dict(kv={"gemma4.attention.shared_kv_layers": 6}), r"gemma4\.attention\.shared_kv_layers.*\[0, 5\]"),
    (dict(kv={"gemma4.attention.sliding_window_pattern": [True] * 6}), r"sliding_window_pattern.*6 values"),
    (dict(kv={"gemma4.attention.value_length_swa": 8}), r"equal key and value head sizes"),
    (dict(kv={"gemma4.attention.causal": False}), r"gemma4\.attention\.causal.*not supported"),
])
def test_bad_metadata_names_the_key(tmp_path, change, match):
    with pytest.raises(llm.ModelLoadError, match=match):
        llm.load_model(rewrite(tmp_path / "bad.gguf", **change))


def test_shared_layer_of_the_wrong_kind(tmp_path):
    """Layer 5 (SWA) would read layer 4's cache if layer 3 and 4 swapped kinds."""
    pattern = [True, True, False, False, True, True, False]
    with pytest.raises(llm.ModelLoadError, match=r"layer 5 shares the KV cache of layer 3"):
        llm.load_model(rewrite(tmp_path / "bad.gguf", kv={"gemma4.attention.sliding_window_pattern": pattern}))


@pytest.mark.slow
def test_trace_names():
    """LLM.trace finds Gemma 4's nodes by llama.cpp's names, with each layer's own head size,
    in the shared layers and the MoE block too."""
    with np.load(FIXTURES / "gemma4.npz") as ref:
        toks, want = [int(t) for t in ref["tokens_2"]], ref["logits_2"]
    m = llm.LLM(str(FIXTURES / "gemma4-F32.gguf"), n_ctx=64)
    tr = m.trace(toks, capture=["inp_per_layer", "Qcur_pos-0", "Qcur_pos-6", "kq_soft_max-5", "attn_out-5",
                                "per_layer_embd_out-6", "l_out-6", "result_output"])
    hp, n = m.model.hparams, len(toks)
    assert tr["inp_per_layer"].shape == (n, hp.n_layer, hp.n_embd_per_layer)
    assert tr["Qcur_pos-0"].shape == (n, hp.n_head(0), 16) and tr["Qcur_pos-6"].shape == (n, hp.n_head(6), 32)
    assert tr["kq_soft_max-5"].shape == (hp.n_head(5), n, n)
    np.testing.assert_allclose(tr["kq_soft_max-5"].sum(-1), 1.0, atol=1e-5)
    assert tr["attn_out-5"].shape == tr["l_out-6"].shape == (n, hp.n_embd)
    assert np.abs(tr["result_output"] - want).max() <= GELU_TOL

    moe = llm.LLM(str(FIXTURES / "gemma4-moe-F32.gguf"), n_ctx=64)
    tr = moe.trace(toks, capture=["ffn_moe_logits-0", "ffn_moe_probs-0", "ffn_mlp-3", "ffn_moe-3",
                                  "ffn_moe_combined-3"])
    assert tr["ffn_moe_probs-0"].shape == (n, moe.model.hparams.n_expert)
    np.testing.assert_allclose(tr["ffn_moe_combined-3"], tr["ffn_mlp-3"] + tr["ffn_moe-3"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_row_split_gives_one_device_logits(tmp_path):
    """split_mode="row" over 2 and 4 simulated CPU devices (tests/row_split_check.py): the
    per-layer head sizes and KV head counts keep the attention gathered; one device's logits
    within 1e-4 (measured 1.3e-5 dense, 3.8e-6 MoE)."""
    from test_row_split import run_check
    stems = ["gemma4-F32", "gemma4-moe-F32"]
    _, arrays = run_check(tmp_path, [str(FIXTURES / f"{s}.gguf") for s in stems])
    for stem in stems:
        one = arrays[f"{stem}/1"]
        for n in (2, 4):
            assert np.abs(arrays[f"{stem}/{n}"] - one).max() <= 1e-4, (stem, n)
