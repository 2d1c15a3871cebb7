"""llm.Context on tiny generated models (tests/tiny_model.py): ubatch splitting, graph reuse,
decode return codes, the output buffer and the KV cache's sequence operations.

Every check compares against REF, the logits of all 32 tokens of TOKENS decoded in one ubatch
on a fresh context: by causality, any run over a prefix of TOKENS must reproduce REF's rows.
Shapes are kept few (n_ctx 64, KV bucket 64, prompts of 17-32 tokens) so compiles are shared.
"""
from __future__ import annotations

import numpy as np
import pytest
from tiny_model import TinySpec, model_tensors, prompt_tokens, write_model

import llm

SPECS = {
    "llama": TinySpec(arch="llama", n_layer=2, seed=1),
    # 6 layers: 5 sliding-window (window 4) and 1 global
    "gemma3": TinySpec(arch="gemma3", n_layer=6, n_head_kv=1, n_swa=4, seed=2),
}
N_CTX = 64
TOKENS = prompt_tokens(32)
ALL = np.ones(32, bool)
TOL = 1e-4


def new_ctx(model, **kw) -> llm.Context:
    args = dict(n_ctx=N_CTX, kv_bucket=N_CTX)
    args.update(kw)
    return llm.Context(model, **args)


def decode_ok(ctx: llm.Context, batch: llm.Batch) -> None:
    assert ctx.decode(batch) == 0, ctx.last_error


def all_logits(tokens, **kw) -> llm.Batch:
    return llm.Batch(tokens, logits=np.ones(len(tokens), bool), **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, llm.Model]:
    d = tmp_path_factory.mktemp("tiny")
    return {a: llm.load_model(write_model(d / f"tiny-{a}.gguf", s)) for a, s in SPECS.items()}


@pytest.fixture(scope="module")
def refs(models) -> dict[str, np.ndarray]:
    out = {}
    for a, m in models.items():
        ctx = new_ctx(m)
        decode_ok(ctx, all_logits(TOKENS))
        out[a] = ctx.get_logits().copy()
    return out


@pytest.fixture
def llama(models) -> llm.Model:
    return models["llama"]


@pytest.fixture
def ref(refs) -> np.ndarray:
    return refs["llama"]


def cache_snapshot(ctx: llm.Context) -> list[np.ndarray]:
    """Cell metadata and every K/V buffer, copied to the host."""
    kv = ctx.memory
    return [kv.cells.pos.copy(), kv.cells.seq.copy()] + [np.asarray(t.data).copy() for t in kv.k_l + kv.v_l]


def assert_same_cache(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=False):
        np.testing.assert_array_equal(x, y)


# ---- ubatches --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.slow
def test_prefill_ubatch7_and_token_by_token_agree(models, refs, arch: str):
    model, ref = models[arch], refs[arch]
    ctx7 = new_ctx(model, n_ubatch=7)
    decode_ok(ctx7, all_logits(TOKENS))
    assert np.abs(ctx7.get_logits() - ref).max() <= TOL
    ctx1 = new_ctx(model)
    rows = []
    for t in TOKENS:
        decode_ok(ctx1, llm.Batch.get_one([t]))
        rows.append(ctx1.get_logits_ith(-1).copy())
    assert np.abs(np.array(rows) - ref).max() <= TOL
    assert ctx1.perf()["n_eval"] == 32 and ctx7.perf()["n_p_eval"] == 32


@pytest.mark.slow
def test_outputs_only_for_requested_rows(llama, ref):
    ctx = new_ctx(llama)
    flags = np.zeros(20, bool)
    flags[[5, 19]] = True
    decode_ok(ctx, llm.Batch(TOKENS[:20], logits=flags))
    assert ctx.get_logits().shape == (2, llama.n_vocab)
    assert np.abs(ctx.get_logits_ith(5) - ref[5]).max() <= TOL
    assert np.abs(ctx.get_logits_ith(19) - ref[19]).max() <= TOL
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), ctx.get_logits_ith(19))
    np.testing.assert_array_equal(ctx.get_logits_ith(-2), ctx.get_logits_ith(5))
    for i in (0, 20, -3):
        with pytest.raises(ValueError, match="get_logits_ith"):
            ctx.get_logits_ith(i)




def test_outputs_that_fill_the_padded_graph_are_the_requested_rows(llama, ref):
    """7 tokens wanting 5 outputs: the graph has 8 rows and 8 outputs (no inp_out_ids), and
    the logits are still those of the 5 requested tokens, not of the first 5 (the Batcher's
    decodes beside a prompt's last chunk got a wrong first token this way)."""
    ctx = new_ctx(llama, embeddings=True)
    flags = np.array([1, 1, 0, 1, 0, 1, 1], bool)
    decode_ok(ctx, llm.Batch(TOKENS[:7], logits=flags))
    for i in np.flatnonzero(flags):
        assert np.abs(ctx.get_logits_ith(int(i)) - ref[i]).max() <= TOL, f"token {i}"
    full = new_ctx(llama, embeddings=True)
    decode_ok(full, all_logits(TOKENS[:7]))
    np.testing.assert_allclose(ctx.get_embeddings(), full.get_embeddings()[flags], atol=TOL)
@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.slow
def test_embeddings_input_matches_tokens(models, refs, arch: str):
    """A batch of embeddings skips the token lookup and, as in llama.cpp, gemma3's
    sqrt(n_embd) input scale (raw embeddings are taken as they are)."""
    spec = SPECS[arch]
    embd = model_tensors(spec)["token_embd.weight"][TOKENS]
    if arch == "gemma3":
        embd = embd * np.float32(np.sqrt(spec.n_embd))
    ctx = new_ctx(models[arch])
    decode_ok(ctx, llm.Batch(embd=embd, logits=ALL))
    assert np.abs(ctx.get_logits() - refs[arch]).max() <= TOL


# ---- graph reuse -----------------------------------------------------------------------

def decode_64_steps(model, ref) -> tuple[llm.Context, list[dict], list[int]]:
    """BOS, then 64 single-token steps on a cache read in buckets of 32 cells: perf() after
    each step, and n_kv (the bucketed KV length) of each step."""
    ctx = llm.Context(model, n_ctx=96, kv_bucket=32)
    rng = np.random.default_rng(5)
    tokens = TOKENS + [int(x) for x in rng.integers(3, 512, 33)]
    perfs, n_kv = [], []
    for i, t in enumerate(tokens):
        decode_ok(ctx, llm.Batch.get_one([t]))
        perfs.append(ctx.perf())
        n_kv.append(ctx.memory.n_kv())
        if i < 32:
            assert np.abs(ctx.get_logits_ith(-1) - ref[i]).max() <= TOL
    return ctx, perfs, n_kv


@pytest.mark.slow
def test_decode_64_steps_reuses_the_graph(llama, ref):
    ctx, perfs, n_kv = decode_64_steps(llama, ref)
    assert n_kv == [32] * 32 + [64] * 32 + [96]
    changed = [0] + [i for i in range(1, 65) if n_kv[i] != n_kv[i - 1]]
    assert changed == [0, 32, 64]
    for i in range(1, 65):
        built = perfs[i]["n_graph_builds"] - perfs[i - 1]["n_graph_builds"]
        reused = perfs[i]["n_reused"] - perfs[i - 1]["n_reused"]
        compiled = perfs[i]["n_compiles"] - perfs[i - 1]["n_compiles"]
        if i in changed:
            assert (built, reused) == (1, 0) and compiled <= 1, f"step {i}"
        else:
            assert (built, reused, compiled) == (0, 1, 0), f"step {i}: no compile in steady state"
    p = ctx.perf()
    assert (p["n_graph_builds"], p["n_reused"], p["n_eval"]) == (3, 62, 65)


@pytest.mark.slow


def test_second_context_compiles_nothing(llama, ref):
    decode_64_steps(llama, ref)
    ctx, _, _ = decode_64_steps(llama, ref)
    p = ctx.perf()
    assert p["n_compiles"] == 0
    assert (p["n_graph_builds"], p["n_reused"]) == (3, 62)


@pytest.mark.slow
def test_reserve_compiles_decode_and_prefill_ahead(llama):
    from ggmlx.compile import GraphCache
    ctx = new_ctx(llama, n_ubatch=16)
    ctx.sched.cache = GraphCache()
    assert ctx.reserve((1, 11)) == 2
    decode_ok(ctx, llm.Batch(TOKENS[:11]))          # 11 tokens pad to the reserved 16
    decode_ok(ctx, llm.Batch.get_one([TOKENS[11]]))
    assert ctx.perf()["n_compiles"] == 2
    with pytest.raises(ValueError, match="ubatch size 17"):
        ctx.reserve((17,))


@pytest.mark.slow
def test_reserve_generation_compiles_every_bucket_before_the_first_token(llama):
    """Issue 19 item 11: the KV buckets a generation crosses compile ahead, not mid-stream."""
    from ggmlx.compile import GraphCache
    ctx = new_ctx(llama, n_ubatch=8, kv_bucket=16)
    ctx.sched.cache = GraphCache()
    # prefill of 11: ubatches of 8 and 3 (padded to 4) at n_kv 16; then 29 steps reach
    # 12..40 used cells: decode graphs at n_kv 16, 32 and 48
    assert ctx.reserve_generation(11, 30) == 5
    compiles = ctx.perf()["n_compiles"]
    decode_ok(ctx, llm.Batch(TOKENS[:11]))
    for t in prompt_tokens(29, seed=3):
        decode_ok(ctx, llm.Batch.get_one([t]))
    assert ctx.perf()["n_compiles"] == compiles and ctx.memory.n_kv() == 48
    assert ctx.reserve_generation(1, 100) == 1          # only n_kv 64 is new; capped at n_ctx
    with pytest.raises(ValueError, match="KV length 65 is outside"):
        ctx.reserve((1,), n_kv=(65,))


@pytest.mark.slow
@pytest.mark.parametrize("on_disk", [True, False], ids=["exe_cache", "no_exe_cache"])
def test_a_long_prompt_keeps_only_the_last_large_graphs(llama, ref, monkeypatch, on_disk):
    """A prompt whose big ubatches cross a KV bucket each keeps the graphs of the last
    LARGE_GRAPHS_KEPT of them: the older ones leave the context and the shared cache (XLA holds
    memory per row of a loaded executable), to be read back from disk, never compiled again;
    without the executable cache on disk every graph stays."""
    import llm.context as context_mod
    from ggmlx.compile import GraphCache
    monkeypatch.setattr(context_mod, "LARGE_UBATCH", 8)
    monkeypatch.delenv("GGMLX_NO_PERSISTENT_CACHE", raising=False)
    monkeypatch.setenv("GGMLX_EXE_CACHE", "1" if on_disk else "0")
    ctx = new_ctx(llama, n_ubatch=8, kv_bucket=8)
    ctx.sched.cache = cache = GraphCache()
    kept = [(8, 24), (8, 32)] if on_disk else [(8, 8), (8, 16), (8, 24), (8, 32)]

    def large() -> list:
        return [(p.n_tokens, p.n_kv) for p in ctx._graphs if p.n_tokens >= 8]

    assert ctx.reserve_generation(32, 1) == 4         # 4 ubatches of 8 at n_kv 8, 16, 24 and 32
    assert large() == kept and len(cache._entries) == len(kept)
    compiled = cache.stats.misses - cache.stats.disk_hits
    for _ in range(2):            # each pass reads back the graphs it dropped, compiles none
        disk_hits = cache.stats.disk_hits
        ctx.memory_clear()
        decode_ok(ctx, llm.Batch(TOKENS))              # the last token's logits, as reserved
        np.testing.assert_allclose(ctx.get_logits_ith(-1), ref[-1], atol=TOL)
        assert large() == kept and len(cache._entries) == len(kept)
        assert cache.stats.disk_hits == disk_hits + (4 if on_disk else 0)
        assert cache.stats.misses - cache.stats.disk_hits == compiled


# ---- return codes ----------------------------------------------------------------------

@pytest.mark.parametrize("batch", [
    pytest.param(lambda: llm.Batch([TOKENS[20], 512]), id="token_out_of_range"),
    pytest.param(lambda: llm.Batch([-1]), id="negative_token"),
    pytest.param(lambda: llm.Batch([TOKENS[20]], seq_id=[1]), id="seq_id_ge_n_seq_max"),
    pytest.param(lambda: llm.Batch(TOKENS[20:22], pos=[20, 22]), id="positions_not_continuous"),
    pytest.param(lambda: llm.Batch([TOKENS[20]], pos=[25]), id="position_does_not_continue_cache"),
    pytest.param(lambda: llm.Batch([TOKENS[20]], pos=[3]), id="position_already_cached"),
    pytest.param(lambda: llm.Batch([]), id="empty"),
    pytest.param(lambda: llm.Batch(embd=np.zeros((1, 7), np.float32)), id="embd_wrong_width"),
    pytest.param(lambda: llm.Batch(TOKENS[20:] * 4), id="more_than_n_batch"),
])
def test_bad_batch_returns_minus_1_and_changes_nothing(llama, ref, batch):
    ctx = new_ctx(llama, n_batch=40)
    decode_ok(ctx, all_logits(TOKENS[:20]))
    before = cache_snapshot(ctx)
    status = ctx.decode(batch())
    assert status == llm.DecodeStatus.INVALID_BATCH == -1 and isinstance(status, llm.DecodeStatus)
    assert ctx.last_error and ctx.last_exception is None
    assert_same_cache(before, cache_snapshot(ctx))
    decode_ok(ctx, llm.Batch.get_one([TOKENS[20]]))
    assert np.abs(ctx.get_logits_ith(-1) - ref[20]).max() <= TOL


def test_positions_past_int32_return_minus_1(llama):
    """pos 2**31 - 1 is rejected by the batch check (-1, nothing changed) instead of being
    accepted and making the next decode raise OverflowError; a sequence at the last position
    is full: its next token gets -1 too, and the context keeps working."""
    from llm.batch import POS_MAX
    ctx = new_ctx(llama)
    assert ctx.decode(llm.Batch([5], pos=[2**31 - 1])) == -1 and "past POS_MAX" in ctx.last_error
    assert ctx.memory.cells.get_used() == 0
    decode_ok(ctx, llm.Batch([5], pos=[POS_MAX]))
    assert ctx.decode(llm.Batch([6])) == -1 and "continuing sequence 0" in ctx.last_error
    with pytest.raises(ValueError, match="past POS_MAX"):
        ctx.memory.seq_add(0, 0, -1, 2**40)
    ctx.memory.seq_add(0, 0, -1, -(POS_MAX - 2))   # K re-rotated by -2**31 + 4, then decoding goes on
    decode_ok(ctx, llm.Batch([6]))
    assert ctx.memory.seq_pos_max(0) == 3 and np.isfinite(ctx.get_logits()).all()


class FailingEval:
    """An eval callback that observes one tensor and raises when told to: `when="build"` while
    the graph is planned (before the cache is handed over), `"compute"` after a computation
    took the cache's buffers (donated)."""

    def __init__(self):
        self.when: str | None = None

    def __call__(self, t, ask: bool) -> bool:
        if self.when == ("build" if ask else "compute"):
            raise RuntimeError(f"failure in {self.when}")
        return t.name == "inp_embd" if ask else True


@pytest.mark.slow
def test_failure_before_compute_removes_the_ubatch(llama, ref):
    """A ubatch that fails leaves no cells claiming K/V that were never written (llama_decode's
    rule); the context goes on as if it had not been sent."""
    cb = FailingEval()
    ctx = new_ctx(llama, cb_eval=cb)
    decode_ok(ctx, all_logits(TOKENS[:20]))
    cb.when = "build"
    assert ctx.decode(all_logits(TOKENS[20:24])) == -3      # a new graph shape: planned, fails
    assert "its 4 tokens were removed from the KV cache" in ctx.last_error
    assert ctx.memory.seq_pos_max(0) == 19 and ctx.memory.cells.get_used() == 20
    cb.when = None
    decode_ok(ctx, all_logits(TOKENS[20:]))
    assert np.abs(ctx.get_logits() - ref[20:]).max() <= TOL


@pytest.mark.slow
def test_failure_after_the_cache_was_donated_rebuilds_it(llama, ref):
    """Issue 19 item 3: a computation that fails after taking the donated KV buffers used to
    leave them deleted for good ("Array has been deleted" on every later decode, even after
    memory_clear). Now the buffers are rebuilt empty, the sequences cleared, and it says so."""
    cb = FailingEval()
    ctx = new_ctx(llama, n_seq_max=2, cb_eval=cb)
    decode_ok(ctx, all_logits(TOKENS[:20]))
    decode_ok(ctx, llm.Batch(TOKENS[:3], seq_id=[1, 1, 1]))
    cb.when = "compute"
    assert ctx.decode(llm.Batch([TOKENS[20]])) == -3
    assert "rebuilt empty, sequences [0, 1] cleared" in ctx.last_error
    assert ctx.memory.cells.get_used() == 0 and not ctx.memory.lost()
    cb.when = None
    decode_ok(ctx, all_logits(TOKENS))
    assert np.abs(ctx.get_logits() - ref).max() <= TOL
    # memory_clear (LLM.reset) mends a cache whose buffers are gone, whatever lost them
    ctx.memory.v_l[1].data.delete()
    ctx.memory_clear()
    decode_ok(ctx, all_logits(TOKENS))
    assert np.abs(ctx.get_logits() - ref).max() <= TOL


def test_two_threads_on_one_context_take_turns(llama, ref):
    """Issue 19 item 3: decodes from two threads on one Context used to fail with -3 ("Array
    has been deleted", donated buffers) and corrupt the cache; they now serialise."""
    import threading
    ctx = new_ctx(llama, n_seq_max=2)
    codes: list[int] = []
    start = threading.Barrier(2)

    def run(seq: int) -> None:
        start.wait()
        for i in range(24):
            codes.append(int(ctx.decode(llm.Batch([TOKENS[i]], seq_id=[seq]))))
            ctx.memory.seq_pos_max(seq)

    threads = [threading.Thread(target=run, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [0] * 48
    for seq in (0, 1):
        decode_ok(ctx, llm.Batch([TOKENS[24]], seq_id=[seq]))
        assert np.abs(ctx.get_logits_ith(-1) - ref[24]).max() <= TOL


def test_batch_larger_than_free_cache_returns_1_and_changes_nothing(llama, ref):
    ctx = new_ctx(llama, n_ubatch=7)
    decode_ok(ctx, all_logits(TOKENS[:24]))
    before = cache_snapshot(ctx)
    # 41 tokens in 6 ubatches: the first five fit in the 40 free cells, the last does not
    assert ctx.decode(llm.Batch(prompt_tokens(41, seed=3))) == llm.DecodeStatus.NO_KV_SLOT == 1
    assert_same_cache(before, cache_snapshot(ctx))
    decode_ok(ctx, all_logits(TOKENS[24:]))
    assert np.abs(ctx.get_logits() - ref[24:]).max() <= TOL


def test_abort_returns_2_and_keeps_earlier_ubatches(llama, ref):
    calls = []

    def abort() -> bool:
        calls.append(1)
        return len(calls) == 3      # checked before each ubatch: two ran, the third is aborted

    ctx = new_ctx(llama, n_ubatch=7, abort_callback=abort)
    assert ctx.decode(all_logits(TOKENS[:24])) == llm.DecodeStatus.ABORTED == 2
    assert ctx.memory.seq_pos_min(0) == 0 and ctx.memory.seq_pos_max(0) == 13
    assert ctx.memory.cells.get_used() == 14
    decode_ok(ctx, all_logits(TOKENS[14:]))
    assert np.abs(ctx.get_logits() - ref[14:]).max() <= TOL


def test_engine_failure_is_fatal_logged_and_kept(llama, caplog):
    """An exception inside compute (here from the eval callback) gives FATAL; the exception is
    kept on the context and logged with its traceback; the next decode starts clean."""
    def cb_eval(t, ask):
        if ask:
            return t.name == "result_output"
        raise RuntimeError("observer failed")

    ctx = new_ctx(llama, cb_eval=cb_eval)
    with caplog.at_level("ERROR", logger="llm.context"):
        status = ctx.decode(all_logits(TOKENS[:4]))
    assert status == llm.DecodeStatus.FATAL and status < -1
    assert isinstance(ctx.last_exception, RuntimeError) and "observer failed" in ctx.last_error
    [rec] = [r for r in caplog.records if r.name == "llm.context"]
    assert rec.exc_info and rec.exc_info[1] is ctx.last_exception


# ---- sequence operations ---------------------------------------------------------------

def test_seq_rm_then_redecode_matches_fresh_run(llama, ref):
    ctx = new_ctx(llama)
    decode_ok(ctx, all_logits(TOKENS[:24]))
    assert ctx.memory.seq_rm(0, 12, -1)
    assert ctx.memory.seq_pos_max(0) == 11 and ctx.memory.cells.get_used() == 12
    decode_ok(ctx, all_logits(TOKENS[12:]))
    assert np.abs(ctx.get_logits() - ref[12:]).max() <= TOL
    ctx.memory_clear()
    assert ctx.memory.cells.get_used() == 0 and ctx.memory.seq_pos_max(0) == -1
    decode_ok(ctx, all_logits(TOKENS))
    assert np.abs(ctx.get_logits() - ref).max() <= TOL


def test_seq_cp_then_two_sequences_decode_independently(llama, ref):
    x, y = [7, 9], [300, 301]              # the two continuations after TOKENS[:20]
    ctx_b = new_ctx(llama)
    decode_ok(ctx_b, all_logits(TOKENS[:20] + [x[1], y[1]]))
    ref_b = ctx_b.get_logits()[20:]        # sequence 1 goes TOKENS[:20], x[1], y[1]

    ctx = new_ctx(llama, n_seq_max=2)
    decode_ok(ctx, all_logits(TOKENS[:20]))
    ctx.memory.seq_cp(0, 1)
    assert ctx.memory.seq_pos_max(1) == 19
    # step 1: TOKENS[20] continues sequence 0, x[1] sequence 1 (both at position 20)
    decode_ok(ctx, llm.Batch([TOKENS[20], x[1]], seq_id=[0, 1], logits=[True, True]))
    assert np.abs(ctx.get_logits_ith(0) - ref[20]).max() <= TOL
    assert np.abs(ctx.get_logits_ith(1) - ref_b[0]).max() <= TOL
    decode_ok(ctx, llm.Batch([TOKENS[21], y[1]], seq_id=[0, 1], logits=[True, True]))
    assert np.abs(ctx.get_logits_ith(0) - ref[21]).max() <= TOL
    assert np.abs(ctx.get_logits_ith(1) - ref_b[1]).max() <= TOL
    # drop sequence 0: the shared prompt cells stay, sequence 0's own two cells go
    ctx.memory.seq_keep(1)
    assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.cells.get_used() == 22


def test_two_sequences_in_one_batch(llama, ref):
    """Interleaved tokens of two sequences in one ubatch see only their own cells."""
    other = prompt_tokens(20, seed=9)
    ctx_u = new_ctx(llama)
    decode_ok(ctx_u, all_logits(other))
    ref_u = ctx_u.get_logits()[:16]
    ctx = new_ctx(llama, n_seq_max=2)
    tokens = [t for pair in zip(TOKENS[:16], other[:16], strict=False) for t in pair]
    decode_ok(ctx, all_logits(tokens, seq_id=[0, 1] * 16))
    assert np.abs(ctx.get_logits()[0::2] - ref[:16]).max() <= TOL
    assert np.abs(ctx.get_logits()[1::2] - ref_u).max() <= TOL
    assert ctx.memory.seq_pos_max(0) == 15 and ctx.memory.seq_pos_max(1) == 15


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(SPECS))
def test_seq_add_k_shift_matches_decoding_at_shifted_positions(models, arch: str):
    model = models[arch]
    ctx = new_ctx(model)
    decode_ok(ctx, all_logits(TOKENS[:20]))
    ctx.memory.seq_add(0, 0, -1, 5)         # positions 0..19 -> 5..24
    assert ctx.memory.seq_pos_min(0) == 5 and ctx.memory.seq_pos_max(0) == 24
    decode_ok(ctx, llm.Batch.get_one([TOKENS[20]]))
    assert ctx.memory.seq_pos_max(0) == 25
    fresh = new_ctx(model)
    decode_ok(fresh, all_logits(TOKENS[:21], pos=np.arange(5, 26)))
    assert np.abs(ctx.get_logits_ith(-1) - fresh.get_logits_ith(-1)).max() <= TOL


def test_k_shift_rerotates_cached_keys(llama):
    """Drop positions 4..7 and shift 8..19 down by 4: the first layer's cached K rows must
    equal those of the remaining tokens decoded at their new positions (deeper layers differ,
    as in llama.cpp: their inputs depended on the dropped tokens)."""
    ctx = new_ctx(llama)
    decode_ok(ctx, all_logits(TOKENS[:20]))
    ctx.memory.seq_rm(0, 4, 8)
    ctx.memory.seq_add(0, 8, -1, -4)
    decode_ok(ctx, llm.Batch.get_one([TOKENS[20]]))      # applies the K-shift first
    fresh = new_ctx(llama)
    decode_ok(fresh, all_logits(TOKENS[:4] + TOKENS[8:21]))
    k, k_ref = (np.asarray(c.memory.k_l[0].data).reshape(N_CTX, -1) for c in (ctx, fresh))
    cells = np.flatnonzero(ctx.memory.cells.pos >= 0)
    pos = ctx.memory.cells.pos[cells]
    np.testing.assert_array_equal(np.sort(pos), np.arange(17))
    ref_cells = np.argsort(fresh.memory.cells.pos[:17])     # the fresh run's cell of each position
    assert np.abs(k[cells] - k_ref[ref_cells[pos]]).max() <= TOL


def test_f16_cache_stays_close_to_f32(llama, ref):
    ctx = new_ctx(llama, type_k="f16", type_v="f16")
    decode_ok(ctx, all_logits(TOKENS))
    assert ctx.memory.k_l[0].data.dtype == np.float16
    assert 0 < np.abs(ctx.get_logits() - ref).max() <= 1e-2


# ---- construction ----------------------------------------------------------------------

def test_context_argument_errors(llama, tmp_path):
    with pytest.raises(ValueError, match="n_ctx"):
        llm.Context(llama, n_ctx=0)
    with pytest.raises(ValueError, match="type_k"):
        llm.Context(llama, n_ctx=N_CTX, type_k="q6_k")
    for n_ctx in (2**40, 2**31, True, 2.0):
        with pytest.raises(ValueError, match="n_ctx") as e:
            llm.Context(llama, n_ctx=n_ctx)
        assert "\n" not in str(e.value)
    vocab_only = llm.load_model(write_model(tmp_path / "m.gguf", SPECS["llama"]), vocab_only=True)
    with pytest.raises(ValueError, match="vocab_only"):
        llm.Context(vocab_only)
