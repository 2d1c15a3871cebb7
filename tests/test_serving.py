"""llm.serving on a tiny generated model: batched sequences give the same tokens as one at a
time, n samples share their prompt's cells, prompts are prefilled in chunks between decode
steps, finished or cancelled sequences free their cells, one job's failure leaves the others
alone, and the engine thread refuses work at once when its queue is full."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from tiny_model import TinySpec, prompt_tokens, write_model

import llm
from llm.sampling.samplers import SamplingParams
from llm.serving import (
    FINISH_LENGTH,
    FINISH_STOP,
    Batcher,
    Delta,
    Done,
    Engine,
    Failed,
    GenParams,
    Job,
    QueueFull,
    logprobs_of,
)

N_CTX = 128
FIXTURES = Path(__file__).parent / "data" / "fixtures"
GREEDY = SamplingParams(temp=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> llm.Model:
    path = write_model(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", TinySpec(arch="llama", n_layer=2, seed=5))
    return llm.load_model(path)


def new_batcher(model, n_slots=4, n_batch=64) -> Batcher:
    ctx = llm.Context(model, n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_slots, kv_bucket=N_CTX)
    return Batcher(ctx, model.vocab)


class Sink:
    def __init__(self):
        self.events = []

    def __call__(self, ev):
        self.events.append(ev)

    def deltas(self, index=0):
        return [e for e in self.events if isinstance(e, Delta) and e.index == index]

    def tokens(self, index=0):
        return [t for e in self.deltas(index) for t in e.tokens]

    def text(self, index=0):
        return "".join(e.text for e in self.deltas(index))

    def finish(self, index=0):
        return self.deltas(index)[-1].finish_reason


def run_all(b: Batcher) -> int:
    steps = 0
    while not b.idle:
        b.step()
        steps += 1
    return steps


PROMPTS = [prompt_tokens(n, seed=s) for n, s in ((9, 1), (17, 2), (5, 3), (12, 4))]


def greedy_job(tokens, sink, max_tokens=10, **kw) -> Job:
    return Job(tokens, GenParams(max_tokens=max_tokens, sampling=GREEDY, logprobs=True, top_logprobs=2, **kw), sink)


@pytest.mark.slow
def test_batched_greedy_equals_one_at_a_time(model):
    b = new_batcher(model)
    alone = []
    for p in PROMPTS:
        s = Sink()
        b.submit(greedy_job(p, s))
        run_all(b)
        alone.append(s)
    together = [Sink() for _ in PROMPTS]
    for p, s in zip(PROMPTS, together, strict=True):
        b.submit(greedy_job(p, s))
    perf0 = b.ctx.perf()
    steps = run_all(b)
    assert steps == 10          # one prefill step for all four prompts, then 9 batched decode steps
    perf = b.ctx.perf()
    # one graph over the four sequences, built once and reused by the following decode steps
    assert perf["n_graph_builds"] - perf0["n_graph_builds"] == 2 and perf["n_reused"] - perf0["n_reused"] == 8
    for a, t in zip(alone, together, strict=True):
        assert t.tokens() == a.tokens() and len(a.tokens()) == 10
        # how much the batch changes the arithmetic: the log-probabilities agree to float32 noise
        la = np.array([lp.logprob for d in a.deltas() for lp in d.logprobs])
        lt = np.array([lp.logprob for d in t.deltas() for lp in d.logprobs])
        assert np.abs(la - lt).max() < 1e-4
        # and every greedy choice has a clear margin over the runner-up
        margins = [lp.top[0][1] - lp.top[1][1] for d in a.deltas() for lp in d.logprobs]
        assert min(margins) > 1e-3
        assert isinstance(t.events[-1], Done) and t.events[-1].n_completion_tokens == 10
    assert b.ctx.memory.cells.get_used() == 0


@pytest.mark.slow
def test_n_samples_share_the_prompt_cells(model):
    b = new_batcher(model)
    prompt = PROMPTS[1]
    used = []
    sink = Sink()

    def record(ev):
        if isinstance(ev, Delta) and not used:
            used.append(b.ctx.memory.cells.get_used())
        sink(ev)

    params = GenParams(max_tokens=8, sampling=SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7), n=3)
    b.submit(Job(prompt, params, record))
    run_all(b)
    assert used == [len(prompt)]            # after the prompt: its cells only, shared by three sequences
    samples = [sink.tokens(i) for i in range(3)]
    assert all(len(s) == 8 for s in samples)
    assert len({tuple(s) for s in samples}) > 1    # each sample has its own seed
    assert b.ctx.memory.cells.get_used() == 0
    # the same seed gives the same three samples
    again = Sink()
    b.submit(Job(prompt, params, again))
    run_all(b)
    assert [again.tokens(i) for i in range(3)] == samples


@pytest.mark.slow
def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(model):
    b = new_batcher(model, n_slots=2, n_batch=8)
    first, second = Sink(), Sink()
    b.submit(greedy_job(PROMPTS[2], first, max_tokens=12))
    b.step()                                   # prompt of 5 tokens: first token sampled
    b.submit(greedy_job(prompt_tokens(30, seed=9), second, max_tokens=2))
    steps_until_second = 0
    while not second.deltas():
        b.step()
        steps_until_second += 1
    assert steps_until_second == 5             # 30 tokens, 7 per step next to the decoding sequence
    assert len(first.tokens()) == 1 + steps_until_second
    run_all(b)
    alone = Sink()
    b.submit(greedy_job(prompt_tokens(30, seed=9), alone, max_tokens=2))
    run_all(b)
    assert alone.tokens() == second.tokens()


@pytest.mark.slow
def test_stop_strings_and_limits_per_sequence(model):
    b = new_batcher(model)
    ref = Sink()
    b.submit(greedy_job(PROMPTS[0], ref, max_tokens=10))
    run_all(b)
    text = ref.text()
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop
    cut, short = Sink(), Sink()
    b.submit(greedy_job(PROMPTS[0], cut, max_tokens=10, stop=[stop]))
    b.submit(greedy_job(PROMPTS[0], short, max_tokens=3))
    run_all(b)
    assert cut.finish() == FINISH_STOP and cut.text() == text[:text.find(stop)]
    assert short.finish() == FINISH_LENGTH and short.tokens() == ref.tokens()[:3]


def test_slot_full_ends_with_length(model):
    b = new_batcher(model)                      # 4 slots of 32 cells
    s = Sink()
    b.submit(greedy_job(PROMPTS[1], s, max_tokens=None))
    run_all(b)
    assert s.finish() == FINISH_LENGTH and len(PROMPTS[1]) + len(s.tokens()) == b.n_ctx_slot


def test_check_rejects_what_can_never_run(model):
    b = new_batcher(model)
    with pytest.raises(ValueError, match="slot holds 32"):
        b.check(prompt_tokens(32), GenParams())
    with pytest.raises(ValueError, match="n = 5"):
        b.check(PROMPTS[0], GenParams(n=5))
    with pytest.raises(ValueError, match="top_logprobs"):
        b.check(PROMPTS[0], GenParams(top_logprobs=21))
    with pytest.raises(ValueError, match="out of range"):
        b.check([1, 10_000], GenParams())
    with pytest.raises(ValueError, match="max_tokens"):
        b.check(PROMPTS[0], GenParams(max_tokens=-1))


@pytest.mark.slow
def test_a_failing_job_leaves_the_others_running(model):
    b = new_batcher(model)
    ok, ref = Sink(), Sink()
    b.submit(greedy_job(PROMPTS[3], ref))
    run_all(b)
    seen = []

    def broken(ev):                             # a consumer that fails on its third token
        seen.append(ev)
        if len(seen) == 3:
            raise RuntimeError("consumer went away")

    b.submit(greedy_job(PROMPTS[0], broken))
    b.submit(greedy_job(PROMPTS[3], ok))
    run_all(b)
    assert isinstance(seen[-1], Failed) and "consumer went away" in seen[-1].message
    assert ok.tokens() == ref.tokens() and isinstance(ok.events[-1], Done)
    assert b.ctx.memory.cells.get_used() == 0


def test_cancel_frees_cells_at_once(model):
    b = new_batcher(model)
    s, waiting = Sink(), Sink()
    job = greedy_job(PROMPTS[1], s, max_tokens=50)
    b.submit(job)
    for _ in range(3):
        b.step()
    assert b.ctx.memory.cells.get_used() == len(PROMPTS[1]) + 2
    b.cancel(job)
    assert b.ctx.memory.cells.get_used() == 0 and b.idle and job.state == "cancelled"
    queued = greedy_job(PROMPTS[0], waiting)
    b.submit(queued)
    b.cancel(queued)
    assert b.idle and not waiting.events


def wait_for(cond, timeout=120.0) -> None:
    ev = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        ev.wait(0.05)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_engine_thread_and_bounded_queue(model):
    ctx = llm.Context(model, n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=2, kv_bucket=N_CTX)
    engine = Engine(ctx, model.vocab, max_queue=2)
    sinks = [Sink() for _ in range(3)]
    jobs = [greedy_job(p, s) for p, s in zip(PROMPTS, sinks, strict=False)]
    # not started yet: nothing leaves the queue, so the third submission is refused at once
    engine.submit(jobs[0])
    engine.submit(jobs[1])
    with pytest.raises(QueueFull):
        engine.submit(jobs[2])
    engine.start()
    try:
        wait_for(lambda: all(j.state != "queued" for j in jobs[:2]))
        wait_for(lambda: engine.snapshot["queue"] == 0 and not engine._queued)
        engine.submit(jobs[2])
        wait_for(lambda: all(j.state == "done" for j in jobs))
    finally:
        engine.stop()
    ref = new_batcher(model)
    for p, s in zip(PROMPTS, sinks, strict=False):
        alone = Sink()
        ref.submit(greedy_job(p, alone))
        run_all(ref)
        assert s.tokens() == alone.tokens()
    assert engine.snapshot["kv_cells_used"] == 0 and engine.snapshot["slots_idle"] == 2


def test_logprobs_of_matches_log_softmax():
    x = np.array([1.0, 3.0, 3.0, -2.0], np.float32)
    lp, top = logprobs_of(x, 0, 3)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    assert lp == pytest.approx(ref[0])
    assert [t for t, _ in top] == [1, 2, 0] and top[0][1] == pytest.approx(ref[1])


def test_save_restore_slot_refuses_busy_and_unknown_slots(model, tmp_path):
    from llm.serving import SlotBusy, SlotNotFound
    b = new_batcher(model, n_slots=2)
    job = Job(prompt_tokens(6), GenParams(max_tokens=20, sampling=GREEDY), Sink(), cache_prompt=True)
    b.submit(job)
    b.step()
    slot = job.seqs[0].seq_id
    with pytest.raises(SlotBusy, match=f"slot {slot} is processing"):
        b.save_slot(slot, tmp_path / "a.bin")
    with pytest.raises(SlotNotFound, match="does not exist"):
        b.restore_slot(2, tmp_path / "a.bin")
    while not job.finished:
        b.step()
    n = b.save_slot(slot, tmp_path / "a.bin")
    assert n == len(b.cached[slot]) > 6
    assert b.restore_slot(1 - slot, tmp_path / "a.bin") == n
    assert b.cached[1 - slot] == b.cached[slot]
    assert b.ctx.memory.seq_pos_max(1 - slot) == n - 1


@pytest.mark.slow
def test_context_shift_goes_on_past_a_full_slot(model):
    """Batcher(context_shift=True), llama-server's --context-shift: a sample that fills its slot
    of 32 cells keeps n_keep tokens (+ the BOS), discards half of the rest (seq_rm), moves the
    later cells back (seq_add: their keys re-rotated) and goes on; its log-probabilities are
    those of a context that does llama-server's operations by hand, and the shifted cells are
    not kept for cache_prompt. (The state is not a fresh decode of the kept tokens: their
    deeper layers saw the discarded ones, in llama.cpp too.)"""
    ctx = llm.Context(model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=2, kv_bucket=64)
    b = Batcher(ctx, model.vocab, context_shift=True)
    prompt = prompt_tokens(10)
    sink = Sink()
    job = Job(prompt, GenParams(max_tokens=60, sampling=GREEDY, logprobs=True, n_keep=3), sink, cache_prompt=True)
    b.submit(job)
    while b.step():
        pass
    out = [lp for ev in sink.events if isinstance(ev, Delta) for lp in ev.logprobs]
    assert len(out) == 60 and sink.events[-2].finish_reason == FINISH_LENGTH
    assert job.seqs[0].n_shifted == 3 * 13 and b.cached.get(job.seqs[0].seq_id) is None
    ref = llm.Context(model, n_ctx=32, n_batch=32, n_ubatch=32, kv_bucket=32)
    assert ref.decode(llm.Batch(prompt)) == 0
    n_past, n_keep = len(prompt), 3 + 1
    for k in range(len(out) - 1):
        if n_past + 1 >= 32:
            n_discard = (n_past - n_keep) // 2
            ref.memory.seq_rm(0, n_keep, n_keep + n_discard)
            ref.memory.seq_add(0, n_keep + n_discard, n_past, -n_discard)
            n_past -= n_discard
        assert ref.decode(llm.Batch([out[k].token], pos=[n_past], logits=[True])) == 0
        n_past += 1
        want, _ = logprobs_of(ref.get_logits_ith(-1), out[k + 1].token, 0)
        assert abs(out[k + 1].logprob - want) < 1e-5, (k, out[k + 1].logprob, want)


def test_context_shift_is_refused_where_positions_cannot_shift():
    """A recurrent state cannot forget the discarded tokens: a ValueError naming context_shift."""
    ctx = llm.Context(llm.load_model(FIXTURES / "mamba2-F32.gguf"), n_ctx=64, n_seq_max=1)
    with pytest.raises(ValueError, match="context_shift: the recurrent state of mamba2"):
        Batcher(ctx, ctx.model.vocab, context_shift=True)
