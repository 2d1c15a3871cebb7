"""The sliding-window cache (llama_kv_cache_iswa) on a tiny Gemma 3 (window 4, 5 of 6 layers
sliding): the SWA layers get n_swa + n_ubatch cells reused as the window slides, and the
logits equal those of the full-size cache (swa_full=True) at every position, beyond the
window included, token by token and in ubatches."""
from __future__ import annotations

import numpy as np
import pytest
from tiny_model import TinySpec, prompt_tokens, write_model

import llm
from llm.kv_cache import estimate_bytes

SPEC = TinySpec(arch="gemma3", n_layer=6, n_head_kv=1, n_swa=4, seed=2)
N_CTX, BUCKET, UBATCH = 64, 8, 8
TOKENS = prompt_tokens(40)
TOL = 1e-4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> llm.Model:
    return llm.load_model(write_model(tmp_path_factory.mktemp("swa") / "tiny-gemma3.gguf", SPEC))


def ctx_of(model, swa_full: bool) -> llm.Context:
    return llm.Context(model, n_ctx=N_CTX, n_batch=UBATCH, n_ubatch=UBATCH, kv_bucket=BUCKET, swa_full=swa_full)


def run(ctx: llm.Context, steps: list[int]) -> np.ndarray:
    """Decode TOKENS in chunks of the given sizes; the logits of every token."""
    rows, i = [], 0
    for n in steps:
        chunk = TOKENS[i:i + n]
        assert ctx.decode(llm.Batch(chunk, pos=list(range(i, i + n)), logits=[True] * n)) == 0, ctx.last_error
        rows.append(ctx.get_logits().copy())
        i += n
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def ref(gemma) -> np.ndarray:
    return run(ctx_of(gemma, swa_full=True), [8] * 5)


def test_window_cache_is_small(gemma):
    ctx = ctx_of(gemma, swa_full=False)
    kv = ctx.memory
    assert kv.n_ctx_swa == 16 and kv.cells_swa is not None     # n_swa 4 + ubatch 8, padded to 8
    assert [kv.k_l[il].shape[-2] for il in range(6)] == [16, 16, 16, 16, 16, N_CTX]
    assert kv.nbytes == estimate_bytes(gemma.hparams, N_CTX, n_ubatch=UBATCH, kv_bucket=BUCKET)
    assert kv.nbytes < ctx_of(gemma, swa_full=True).memory.nbytes


@pytest.mark.parametrize("steps", [
    pytest.param([8] * 5, id="ubatch8"),
    pytest.param([1] * 40, id="token", marks=pytest.mark.slow),          # many KV-length shapes to compile
    pytest.param([3, 8, 1, 8, 7, 5, 8], id="mixed", marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_logits_equal_full_cache_beyond_the_window(gemma, ref, steps):
    ctx = ctx_of(gemma, swa_full=False)
    out = run(ctx, steps)
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    # the window cells were reused: the SWA cache holds only the last positions
    assert ctx.memory.cells_swa.get_used() <= 16 and ctx.memory.seq_pos_max(0) == 39
    assert ctx.memory.seq_pos_min(0) > 39 - 16


@pytest.mark.slow
def test_rewind_inside_the_window_and_can_keep(gemma, ref):
    ctx = ctx_of(gemma, swa_full=False)
    run(ctx, [8] * 5)
    kv = ctx.memory
    assert kv.can_keep(0, 38) and not kv.can_keep(0, 10) and kv.can_keep(0, 0)
    kv.seq_rm(0, 38, -1)
    assert ctx.decode(llm.Batch(TOKENS[38:40], pos=[38, 39], logits=[True, True])) == 0
    np.testing.assert_allclose(ctx.get_logits(), ref[38:40], atol=TOL, rtol=0)


@pytest.mark.slow
def test_seq_add_shifts_both_caches(gemma):
    """A shifted sequence decodes like one decoded at the shifted positions, with the window
    cache re-roped too."""
    ctx = ctx_of(gemma, swa_full=False)
    first = TOKENS[:12]
    assert ctx.decode(llm.Batch(first[:8], pos=list(range(8)), logits=[False] * 8)) == 0
    assert ctx.decode(llm.Batch(first[8:], pos=list(range(8, 12)), logits=[False] * 4)) == 0
    ctx.memory.seq_add(0, 0, -1, 5)
    assert ctx.decode(llm.Batch([TOKENS[12]], pos=[17], logits=[True])) == 0
    full = ctx_of(gemma, swa_full=True)
    assert full.decode(llm.Batch(first[:8], pos=list(range(8)), logits=[False] * 8)) == 0
    assert full.decode(llm.Batch(first[8:], pos=list(range(8, 12)), logits=[False] * 4)) == 0
    full.memory.seq_add(0, 0, -1, 5)
    assert full.decode(llm.Batch([TOKENS[12]], pos=[17], logits=[True])) == 0
    np.testing.assert_allclose(ctx.get_logits(), full.get_logits(), atol=TOL, rtol=0)
