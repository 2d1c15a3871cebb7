"""Embeddings: Context(embeddings=True), pooling types, LLM.embed, and their errors.

Parity with llama.cpp's embeddings is checked in tests/test_arch_fixtures.py (encoders and the
new decoders) and here on the committed synthetic models (decoders as embedders)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_model import TinySpec, model_tensors, prompt_tokens, write_model

import llm

DATA = Path(__file__).parent / "data"
SYNTHETIC = DATA / "synthetic"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> llm.Model:
    return llm.load_model(write_model(tmp_path_factory.mktemp("emb") / "tiny.gguf", TinySpec(seed=5)))


def per_token(model: llm.Model, toks: list[int]) -> np.ndarray:
    ctx = llm.Context(model, n_ctx=64, n_ubatch=32, embeddings=True)
    assert ctx.decode(llm.Batch(toks, logits=np.ones(len(toks), bool))) == 0, ctx.last_error
    return ctx.get_embeddings().copy()


@pytest.mark.slow
def test_pooling_types_pool_the_per_token_states(tiny):
    a, b = prompt_tokens(11, seed=2), prompt_tokens(6, seed=3)
    ea, eb = per_token(tiny, a), per_token(tiny, b)
    assert ea.shape == (11, tiny.hparams.n_embd)
    tokens = np.array(a + b, np.int32)
    pos = np.concatenate([np.arange(11), np.arange(6)]).astype(np.int32)
    seq_id = [(0,)] * 11 + [(1,)] * 6
    expect = {"mean": (ea.mean(0), eb.mean(0)), "cls": (ea[0], eb[0]), "last": (ea[-1], eb[-1])}
    for pooling, (va, vb) in expect.items():
        ctx = llm.Context(tiny, n_ctx=64, n_ubatch=32, n_seq_max=2, embeddings=True, pooling_type=pooling)
        assert ctx.decode(llm.Batch(tokens, pos=pos, seq_id=seq_id)) == 0, ctx.last_error
        np.testing.assert_allclose(ctx.get_embeddings_seq(0), va, atol=2e-5, err_msg=pooling)
        np.testing.assert_allclose(ctx.get_embeddings_seq(1), vb, atol=2e-5, err_msg=pooling)
        # pooling makes every token an output, so per-token states are there too
        np.testing.assert_allclose(ctx.get_embeddings_ith(-1), eb[-1], atol=2e-5)
        assert ctx.get_logits().shape == (17, tiny.n_vocab)


@pytest.mark.slow
def test_embeddings_context_keeps_logits(tiny):
    toks = prompt_tokens(9, seed=4)
    plain = llm.Context(tiny, n_ctx=64, n_ubatch=32)
    assert plain.decode(llm.Batch(toks, logits=np.ones(9, bool))) == 0
    ctx = llm.Context(tiny, n_ctx=64, n_ubatch=32, embeddings=True)
    assert ctx.decode(llm.Batch(toks, logits=np.ones(9, bool))) == 0
    np.testing.assert_array_equal(ctx.get_logits(), plain.get_logits())
    # the output projection of the hidden state gives the logits
    out = model_tensors(TinySpec(seed=5))["output.weight"]
    np.testing.assert_allclose(ctx.get_embeddings() @ out.T, plain.get_logits(), atol=1e-3)


@pytest.mark.slow
def test_embed_batches_over_sequences(tiny, tmp_path):
    m = llm.LLM(tiny.path, n_ctx=64, n_ubatch=32)
    seqs = [prompt_tokens(n, seed=n) for n in (12, 5, 9, 3, 20)]
    together = m.embed(seqs, max_seqs=3)
    assert together.shape == (5, tiny.hparams.n_embd) and together.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-6)
    alone = np.concatenate([m.embed([s]) for s in seqs])
    np.testing.assert_allclose(together, alone, atol=2e-6)
    raw = m.embed(seqs[:1], normalize=False, pooling_type="last")
    np.testing.assert_allclose(raw[0], per_token(m.model, seqs[0])[-1], atol=2e-5)
    with pytest.raises(ValueError, match="more than 32 .n_ubatch 32"):
        m.embed([prompt_tokens(40)])


@pytest.mark.slow
def test_pooling_errors_name_what_is_missing(tiny):
    ctx = llm.Context(tiny, n_ctx=32)
    with pytest.raises(ValueError, match="without embeddings=True"):
        ctx.get_embeddings_ith(0)
    ctx = llm.Context(tiny, n_ctx=32, embeddings=True)
    assert ctx.decode(llm.Batch.get_one([1, 5, 7])) == 0
    with pytest.raises(ValueError, match="pooling_type is 'none'"):
        ctx.get_embeddings_seq(0)
    with pytest.raises(ValueError, match="was not an output"):
        ctx.get_embeddings_ith(0)
    with pytest.raises(ValueError, match="classifier head"):
        llm.Context(tiny, n_ctx=32, embeddings=True, pooling_type="rank")
    with pytest.raises(ValueError, match="unknown pooling type 'max'"):
        llm.Context(tiny, n_ctx=32, embeddings=True, pooling_type="max")
    ctx = llm.Context(tiny, n_ctx=32, embeddings=True, pooling_type="mean")
    assert ctx.decode(llm.Batch.get_one([1, 5, 7])) == 0
    with pytest.raises(ValueError, match="sequence 3 was not in the last batch"):
        ctx.get_embeddings_seq(3)


SYNTH_EMBD = sorted(p.name.removesuffix(".llamacpp.npz") for p in SYNTHETIC.glob("*.llamacpp.npz"))


@pytest.mark.slow
@pytest.mark.parametrize("stem", SYNTH_EMBD)
def test_decoder_embeddings_match_llamacpp(stem):
    """The committed synthetic models as embedders vs llama.cpp on their dequantized twins."""
    ref = np.load(SYNTHETIC / f"{stem}.llamacpp.npz")
    model = llm.load_model(SYNTHETIC / f"{stem}.gguf")
    toks = ref["tokens"]
    for pooling in ("none", "mean", "last"):
        ctx = llm.Context(model, n_ctx=64, n_ubatch=32, embeddings=True, pooling_type=pooling)
        assert ctx.decode(llm.Batch(toks, logits=np.ones(len(toks), bool))) == 0, ctx.last_error
        ours = ctx.get_embeddings() if pooling == "none" else ctx.get_embeddings_seq(0)[None]
        theirs = ref[f"twin_embd_{pooling}"].reshape(ours.shape)
        cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
        assert cos.min() >= 0.9999, f"{pooling}: cosine {cos.min():.6f}"
