"""Multi-head latent attention (deepseek2, issue 29): the KV cache holds each token's latent
only (kv_lora_rank + n_rot values in one KV head, no V buffer), and the fused and unfused
attention paths and token-by-token decoding all give llama.cpp's logits (stored in the
deepseek2 fixture by benchmarks/reference/make_fixture.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import llm
from llm.batch import Batch
from llm.kv_cache import estimate_bytes

FIXTURES = Path(__file__).parent / "data" / "fixtures"


@pytest.fixture(scope="module")
def model():
    return llm.load_model(FIXTURES / "deepseek2-F32.gguf")


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURES / "deepseek2.npz") as f:
        return {k: f[k] for k in ("tokens_0", "logits_0")}


def test_the_cache_holds_the_latent_only(model):
    hp = model.hparams
    assert hp.is_mla and hp.n_head_kv(0) == 1 and hp.n_embd_head_k == hp.n_lora_kv + hp.n_rot
    ctx = llm.Context(model, n_ctx=64, n_batch=64, n_ubatch=64)
    latent = hp.n_layer * 64 * (hp.n_lora_kv + hp.n_rot) * 4
    assert ctx.memory.nbytes == latent == estimate_bytes(hp, 64)
    per_head = hp.n_layer * 64 * hp.n_head(0) * (hp.n_embd_head_k_mla + hp.n_embd_head_v_mla) * 4
    assert latent < per_head / 3


@pytest.mark.slow
@pytest.mark.parametrize("flash_attn", [True, False])
def test_both_attention_paths_match_llamacpp(model, ref, flash_attn):
    toks = ref["tokens_0"]
    ctx = llm.Context(model, n_ctx=64, n_batch=64, n_ubatch=64, flash_attn=flash_attn)
    assert ctx.decode(Batch(np.asarray(toks, np.int32), logits=np.ones(len(toks), bool))) == 0
    assert np.abs(ctx.get_logits() - ref["logits_0"]).max() < 1e-4


@pytest.mark.slow
def test_token_by_token_decoding_reads_the_latent_cache(model, ref):
    toks = ref["tokens_0"]
    ctx = llm.Context(model, n_ctx=64, n_batch=64, n_ubatch=64)
    rows = []
    for i, t in enumerate(toks):
        assert ctx.decode(Batch(np.asarray([t], np.int32), pos=np.asarray([i], np.int32),
                                logits=np.ones(1, bool))) == 0
        rows.append(ctx.get_logits()[-1].copy())
    assert np.abs(np.stack(rows) - ref["logits_0"]).max() < 1e-4


def test_info_reports_the_latent_against_a_per_head_cache(capsys):
    """`python -m llm info -c 32768` on an MLA model: the latent cache's bytes and what per-head
    K and V would need (2 layers x 32768 x 4 heads x (16 + 16) x 4 bytes, 3.2x the latent)."""
    from llm.cli import main
    assert main(["info", str(FIXTURES / "deepseek2-F32.gguf"), "-c", "32768"]) == 0
    out = capsys.readouterr().out
    assert "10.0 MiB (10485760 bytes) at n_ctx 32768" in out
    assert "MLA: the cache holds the latent (32 + 8 rope values" in out
    assert "would need 32.0 MiB (33554432 bytes), 3.2x" in out
