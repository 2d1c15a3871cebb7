"""KV sharing across layers (Gemma 3n, issue 29): layers past n_layer_kv_from_start write no
KV cache and attend to an earlier layer's (llama.cpp's layer_reuse). On the gemma3n fixture
of benchmarks/reference/make_fixture.py (22 layers, every 2nd dense): layers 20 (SWA) and 21
(full) read the buffers of 18 and 19, the cache holds 20 layers, and a token-by-token decode
(the shared layers reading tokens cached by earlier ubatches) gives llama.cpp's logits."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llm
from llm import kv_cache

FIXTURES = Path(__file__).resolve().parent / "data" / "fixtures"
GELU_TOL = 1e-2     # llama.cpp's fp16 GELU table, as in test_arch_fixtures


@pytest.fixture(scope="module")
def model():
    return llm.load_model(FIXTURES / "gemma3n-F32.gguf")


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURES / "gemma3n.npz") as f:
        return {k: f[k] for k in f.files}


def test_shared_layers_and_their_sources(model):
    hp = model.hparams
    assert [il for il in range(hp.n_layer) if not hp.has_kv(il)] == [20, 21]
    assert (hp.kv_layer(20), hp.kv_layer(21), hp.kv_layer(5)) == (18, 19, 5)
    assert hp.is_swa(20) and hp.is_swa(18) and not hp.is_swa(21) and not hp.is_swa(19)


def test_cache_holds_only_the_layers_with_kv(model):
    hp = model.hparams
    ctx = llm.Context(model, n_ctx=64, n_ubatch=32)
    kv = ctx.memory
    assert kv.k_l[20] is kv.k_l[18] and kv.v_l[21] is kv.v_l[19]
    per_layer = 64 * (hp.n_embd_k_gqa() + hp.n_embd_v_gqa()) * 4
    assert kv.nbytes == 20 * per_layer == kv_cache.estimate_bytes(hp, 64)
    assert sum(kv_cache.kv_bytes_per_device(model, 64, kv.k_l[0].type, kv.v_l[0].type).values()) == kv.nbytes


@pytest.mark.slow
def test_token_by_token_decode_matches_llamacpp(model, ref):
    toks = ref["tokens_1"]
    ctx = llm.Context(model, n_ctx=64, n_ubatch=32)
    rows = []
    for i, t in enumerate(toks):
        assert ctx.decode(llm.Batch(np.array([t]), pos=np.array([i], np.int32))) == 0, ctx.last_error
        rows.append(ctx.get_logits_ith(-1).copy())
    diff = np.abs(np.stack(rows) - ref["logits_1"]).max()
    print(f"gemma3n token by token: max |diff| {diff:.3g}")
    assert diff <= GELU_TOL


@pytest.mark.slow
def test_trace_names(ref):
    """LLM.trace finds Gemma 3n's nodes by llama.cpp's names, in the shared layers too."""
    m = llm.LLM(str(FIXTURES / "gemma3n-F32.gguf"), n_ctx=64)
    toks = [int(t) for t in ref["tokens_2"]]
    tr = m.trace(toks, capture=["inp_per_layer", "predictions-0", "laurel_out-3", "Qcur_pos-21",
                                "kq_soft_max-20", "corrected-21", "l_out-21", "unembd_merged", "result_output"])
    hp = m.model.hparams
    n = len(toks)
    assert tr["inp_per_layer"].shape == (n, hp.n_layer, hp.n_embd_altup)
    assert tr["predictions-0"].shape == tr["l_out-21"].shape == (hp.n_altup, n, hp.n_embd)
    assert tr["kq_soft_max-20"].shape == (hp.n_head(20), n, n)
    np.testing.assert_allclose(tr["kq_soft_max-20"].sum(-1), 1.0, atol=1e-5)
    assert np.abs(tr["result_output"] - ref["logits_2"]).max() <= GELU_TOL
