"""Many generations on one Context at once: llama-server's slots, as a library.

`Batcher` is the scheduler core. Each `Job` (a prompt and n samples of it) gets n slots;
a slot is a KV sequence id. Every `step()` builds one batch: the pending token of every
decoding sequence, then chunks of waiting prompts up to n_batch tokens, so a long prompt
shares steps with the sequences already generating. After the decode each sequence samples
its own token with its own sampler chain (its own seed), checks its own stop strings and
limits, and a sequence that finishes frees its cells at once. A prompt with n > 1 is
evaluated once and its cells shared with the other samples through seq_cp, as llama.cpp's
`batched` example does. `LLM.generate([...])` drives a Batcher synchronously.

`Engine` runs a Batcher in one thread that owns the Context. Other threads (the HTTP
server) submit jobs and cancel them through a queue and get results through each job's
sink callback. The queue of jobs waiting for slots is bounded: `submit` raises QueueFull at
once when it is full.

Each slot owns n_ctx // n_slots cells (llama-server's per-slot context), so the sequences
running together can never exhaust the cache: a prompt that does not fit a slot is refused,
and generation stops with finish reason "length" when its slot is full.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from llm.batch import Batch
from llm.context import DecodeStatus
from llm.errors import StateError
from llm.sampling import structured as grammar_mod
from llm.sampling.samplers import LLAMA_DEFAULT_SEED, SamplerChain, SamplingParams, TokenDataArray

log = logging.getLogger(__name__)

FINISH_EOG, FINISH_LENGTH, FINISH_STOP = "eog", "length", "stop"
MAX_TOP_LOGPROBS = 20


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests is full; try again later."""


class SlotNotFound(LookupError):
    """No slot has this id."""


class SlotBusy(RuntimeError):
    """The slot is running a request."""


class EngineError(RuntimeError):
    """A failure inside the engine while running one request (not a problem with its input)."""


@dataclasses.dataclass
class GenParams:
    """What one request asks for, besides its prompt."""

    max_tokens: int | None = 128       # None: until end-of-generation or the slot is full
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: grammar_mod.GrammarSpec | None = None   # a checked grammar, first in each sample's chain

    def check(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be non-empty strings")


@dataclasses.dataclass
class TokenLogprob:
    """One generated token's log-probability under the model's distribution before sampling
    (log-softmax of the raw logits), with the `top` most likely tokens (id, logprob)."""

    token: int
    piece: bytes
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class Delta:
    """New output of sample `index` of a job. The last delta of a sample has its finish reason."""

    index: int
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclasses.dataclass
class Done:
    """The job is complete: every sample finished."""

    n_prompt_tokens: int
    n_completion_tokens: int
    timings: dict


@dataclasses.dataclass
class Failed:
    """The job failed inside the engine; its cells are freed, other jobs go on."""

    message: str


Event = Delta | Done | Failed
_job_ids = itertools.count()


class Job:
    """A prompt, what to generate from it and where the events go (`sink`, called from the
    thread that runs the Batcher; it must not block). Without cache_prompt, every cell of the
    job is freed the moment it finishes."""

    def __init__(self, tokens: Sequence[int], params: GenParams, sink: Callable[[Event], None], *,
                 cache_prompt: bool = False):
        self.id = next(_job_ids)
        self.cache_prompt = cache_prompt   # keep the cells when done, to reuse their prefix
        self.tokens = [int(t) for t in tokens]
        self.params = params
        self.sink = sink
        self.seqs: list[_Seq] = []
        self.n_prefilled = 0           # prompt tokens of the first sample already decoded
        self.n_done = 0
        self.state = "queued"          # queued -> running -> done | failed | cancelled
        self.t_submit = time.perf_counter()
        self.t_start = self.t_first = self.t_end = 0.0

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled")


class _Seq:
    """One sample of a job, in one slot (= KV sequence id)."""

    def __init__(self, job: Job, index: int, seq_id: int, sampler: SamplerChain, decoder):
        self.job = job
        self.index = index
        self.seq_id = seq_id
        self.sampler = sampler
        self.decoder = decoder
        self.n_past = 0                    # cells of this sequence in the cache
        self.pending: int | None = None    # sampled token to decode next step
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0
        self.done = False


def logprobs_of(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """log-softmax of a logits row (float64): the token's value and the k best (id, value),
    best first (ties: lower id first)."""
    x = logits.astype(np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    top: list[tuple[int, float]] = []
    if k > 0:
        part = np.argpartition(-x, k - 1)[:k]
        part = part[np.lexsort((part, -x[part]))]
        top = [(int(i), float(x[i] - lse)) for i in part]
    return float(x[token] - lse), top


class Batcher:
    """Continuous batching over one Context (see the module docstring). Not thread-safe:
    one thread calls submit/cancel/step (Engine does that for servers)."""

    def __init__(self, ctx, vocab, n_slots: int | None = None):
        self.ctx = ctx
        self.vocab = vocab
        self.n_slots = ctx.n_seq_max if n_slots is None else n_slots
        if not 1 <= self.n_slots <= ctx.n_seq_max:
            raise ValueError(f"n_slots = {self.n_slots} is outside [1, n_seq_max = {ctx.n_seq_max}]")
        self.n_ctx_slot = ctx.n_ctx // self.n_slots
        self.free = list(range(self.n_slots))
        # a finished job with cache_prompt (one sample) leaves its cells in its slot, and such a job
        # takes the free slot that shares the longest prefix with it (llama-server's cache_prompt)
        self.cached: dict[int, list[int]] = {}     # free slot -> the tokens its cells hold
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self.n_steps = 0
        self._gvocab: grammar_mod.GrammarVocab | None = None   # built on the first constrained job

    def grammar_vocab(self) -> grammar_mod.GrammarVocab:
        """The vocabulary as llguidance wants it (built once: about a second for 262144 tokens)."""
        if self._gvocab is None:
            self._gvocab = grammar_mod.GrammarVocab(self.vocab)
        return self._gvocab

    def warmup(self) -> int:
        """Compile ahead the graphs the steps will need (decode steps of 1, 2, 4, .. n_slots
        sequences; mixed steps of each ubatch size with one or two output blocks), so the first
        requests do not wait for compiles. Leaves the cache empty; returns the number compiled."""
        ctx = self.ctx
        n0 = ctx.perf()["n_compiles"]
        sizes = []
        n = 1
        while n < self.n_slots:
            sizes.append((n, n))
            n *= 2
        sizes.append((self.n_slots, self.n_slots))
        n_out = min(self.n_slots, ctx.n_ubatch)
        n = 2 * n_out
        while n <= ctx.n_ubatch:
            sizes += [(n, 1), (n, min(n_out + 1, n - 1))]
            n *= 2
        for n_tokens, n_outputs in sizes:
            n_seqs = min(n_outputs, self.n_slots)
            seq_ids = [(i % n_seqs,) for i in range(n_tokens)]
            pos = [i // n_seqs for i in range(n_tokens)]
            wants = np.zeros(n_tokens, bool)
            wants[n_tokens - n_outputs:] = True
            ctx.memory_clear()
            status = ctx.decode(Batch(np.full(n_tokens, self.vocab.bos if self.vocab.bos >= 0 else 0, np.int32),
                                      pos=np.asarray(pos, np.int32), seq_id=seq_ids, logits=wants))
            if status != DecodeStatus.OK:
                raise EngineError(f"warmup decode of {n_tokens} tokens failed: {ctx.last_error}")
        ctx.memory_clear()
        return ctx.perf()["n_compiles"] - n0

    # ---- jobs --------------------------------------------------------------------------

    def check(self, tokens: Sequence[int], params: GenParams) -> None:
        """ValueError naming what is wrong if the job can never run here."""
        params.check()
        if not tokens:
            raise ValueError("the prompt is empty (no tokens)")
        n_vocab = self.vocab.n_tokens
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise ValueError(f"prompt token {bad[0]} is out of range [0, {n_vocab})")
        if len(tokens) >= self.n_ctx_slot:
            raise ValueError(f"the prompt has {len(tokens)} tokens; a slot holds {self.n_ctx_slot} "
                             f"(n_ctx {self.ctx.n_ctx} / {self.n_slots} slots)")
        if params.n > self.n_slots:
            raise ValueError(f"n = {params.n} is more than the {self.n_slots} slots")

    def submit(self, job: Job) -> None:
        self.check(job.tokens, job.params)
        self.waiting.append(job)

    def cancel(self, job: Job) -> None:
        """Stop a job and free its cells; no further events are sent."""
        if job.finished:
            return
        if job in self.waiting:
            self.waiting.remove(job)
        self._release(job, "cancelled")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _release(self, job: Job, state: str) -> None:
        for s in job.seqs:
            if not s.done:
                s.done = True
                self._free(s)
        job.state = state
        job.t_end = time.perf_counter()
        if job in self.running:
            self.running.remove(job)

    def _free(self, s: _Seq, keep: bool = False) -> None:
        if keep:
            self.cached[s.seq_id] = (s.job.tokens + s.tokens)[:s.n_past]
        else:
            self.ctx.memory.seq_rm(s.seq_id, -1, -1)
            self.cached.pop(s.seq_id, None)
        self.free.append(s.seq_id)

    def _idle_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.n_slots:
            raise SlotNotFound(f"slot {slot!r} does not exist (slots 0..{self.n_slots - 1})")
        if slot not in self.free:
            raise SlotBusy(f"slot {slot} is processing a request")

    def save_slot(self, slot: int, path) -> int:
        """Write an idle slot's cells and the tokens they hold (llama-server's slot save);
        returns the number of tokens saved. The cells are there after a cache_prompt job."""
        self._idle_slot(slot)
        tokens = self.cached.get(slot, [])
        self.ctx.state_seq_save_file(path, slot, tokens)
        return len(tokens)

    def restore_slot(self, slot: int, path) -> int:
        """Load a saved slot into an idle slot, whose cells it replaces; the next cache_prompt job
        with that prefix reuses them. StateError for a bad file or one larger than a slot."""
        self._idle_slot(slot)
        tokens = self.ctx.state_seq_load_file(path, slot)
        self.cached.pop(slot, None)
        if len(tokens) >= self.n_ctx_slot:
            self.ctx.memory.seq_rm(slot, -1, -1)
            raise StateError(f"{path}: {len(tokens)} tokens do not fit a slot of {self.n_ctx_slot}")
        self.cached[slot] = [int(t) for t in tokens]
        return len(tokens)

    def forget(self) -> None:
        """Drop the prompt cache's bookkeeping (after the cache itself was cleared)."""
        self.cached.clear()

    def _take_slot(self, job: Job) -> tuple[int, int]:
        """A free slot for the job and how many of its prompt tokens the slot already holds."""
        self.free.sort()
        best, n_keep = self.free[0], 0
        if job.cache_prompt and job.params.n == 1:
            for seq_id in self.free:
                n = 0
                for a, b in zip(self.cached.get(seq_id, ()), job.tokens[:-1], strict=False):
                    if a != b:
                        break
                    n += 1
                if n > n_keep:
                    best, n_keep = seq_id, n
        self.free.remove(best)
        self.ctx.memory.seq_rm(best, n_keep, -1)
        self.cached.pop(best, None)
        return best, n_keep

    def _admit(self) -> None:
        """Give waiting jobs their slots, first come first served."""
        while self.waiting and len(self.free) >= self.waiting[0].params.n:
            job = self.waiting.popleft()
            p = job.params
            seed = p.sampling.seed
            for i in range(p.n):
                sp = p.sampling if seed == LLAMA_DEFAULT_SEED or i == 0 else \
                    dataclasses.replace(p.sampling, seed=(seed + i) & 0xFFFFFFFF)
                sampler = SamplerChain.from_params(sp, n_vocab=self.ctx.n_vocab)
                if p.constraint is not None:    # the grammar goes first, as in llama.cpp
                    sampler.samplers.insert(0, p.constraint.sampler(self.grammar_vocab()))
                seq_id, n_keep = self._take_slot(job)
                job.seqs.append(_Seq(job, i, seq_id, sampler, self.vocab.stream_decoder()))
                if i == 0:
                    job.n_prefilled = job.seqs[0].n_past = n_keep
            job.state = "running"
            job.t_start = time.perf_counter()
            self.running.append(job)

    # ---- one step ----------------------------------------------------------------------

    def step(self) -> int:
        """Admit waiting jobs, decode one batch and sample; returns the number of tokens decoded."""
        self._admit()
        tokens: list[int] = []
        pos: list[int] = []
        seq_ids: list[tuple[int, ...]] = []
        wants: list[bool] = []
        plan: dict[int, _Part] = {}

        def add(part: _Part, token: int, p: int, seq_id: int, want: bool) -> None:
            part.idx.append(len(tokens))
            tokens.append(token)
            pos.append(p)
            seq_ids.append((seq_id,))
            wants.append(want)

        for job in self.running:
            for s in job.seqs:
                if s.pending is not None:
                    part = plan.setdefault(job.id, _Part(job))
                    part.reads.append(([s], len(tokens)))
                    part.decoding.append(s)
                    add(part, s.pending, s.n_past, s.seq_id, True)
        budget = self.ctx.n_batch - len(tokens)
        for job in self.running:
            n_left = len(job.tokens) - job.n_prefilled
            if budget <= 0 or n_left == 0:
                continue
            k = min(budget, n_left)
            part = plan.setdefault(job.id, _Part(job))
            part.n_prompt = k
            for j in range(job.n_prefilled, job.n_prefilled + k):
                add(part, job.tokens[j], j, job.seqs[0].seq_id, j == len(job.tokens) - 1)
            if k == n_left:
                part.reads.append((job.seqs, len(tokens) - 1))
            budget -= k
        if not tokens:
            return 0
        self.n_steps += 1
        tokens_a, pos_a, wants_a = np.asarray(tokens, np.int32), np.asarray(pos, np.int32), np.asarray(wants)
        n_compiles = self.ctx.perf()["n_compiles"]
        t0 = time.perf_counter()
        status = self.ctx.decode(Batch(tokens_a, pos=pos_a, seq_id=seq_ids, logits=wants_a))
        if self.ctx.perf()["n_compiles"] > n_compiles:
            log.info("step of %d tokens (%d outputs) compiled a new graph: %.1f s", len(tokens), int(wants_a.sum()),
                     time.perf_counter() - t0)
        if status == DecodeStatus.OK:
            for part in plan.values():
                self._advance(part, lambda i: i)
            return len(tokens)
        # isolate the failure: undo this step's cells, then decode each job's part alone
        log.warning("batched decode failed (%s); retrying its %d jobs one by one", self.ctx.last_error, len(plan))
        for part in plan.values():
            self._rollback(part)
        for part in plan.values():
            idx = np.asarray(part.idx)
            status = self.ctx.decode(Batch(tokens_a[idx], pos=pos_a[idx], seq_id=[seq_ids[i] for i in idx],
                                           logits=wants_a[idx]))
            if status != DecodeStatus.OK:
                self._rollback(part)
                self._fail(part.job, f"decode failed: {self.ctx.last_error}")
                continue
            row = {int(i): j for j, i in enumerate(idx)}
            self._advance(part, row.__getitem__)
        return len(tokens)

    def _rollback(self, part: _Part) -> None:
        """Remove the cells a failed decode may have filled for this part."""
        for s in part.decoding:
            self.ctx.memory.seq_rm(s.seq_id, s.n_past, -1)
        if part.n_prompt:
            self.ctx.memory.seq_rm(part.job.seqs[0].seq_id, part.job.n_prefilled, -1)

    def _advance(self, part: _Part, row: Callable[[int], int]) -> None:
        """After a decode: move the job's sequences forward and sample where logits came out.
        Any exception here fails this job only."""
        job = part.job
        try:
            for s in part.decoding:
                s.n_past += 1
                s.pending = None
            if part.n_prompt:
                first = job.seqs[0]
                job.n_prefilled += part.n_prompt
                first.n_past = job.n_prefilled
                if job.n_prefilled == len(job.tokens):
                    for s in job.seqs[1:]:
                        self.ctx.memory.seq_cp(first.seq_id, s.seq_id, -1, -1)
                        s.n_past = first.n_past
            for seqs, i in part.reads:
                logits = self.ctx.get_logits_ith(row(i))
                for s in seqs:
                    if s.done:
                        continue
                    if job.params.max_tokens == 0:
                        self._finish(s, FINISH_LENGTH, [], [])
                    else:
                        self._sample(s, logits)
        except Exception as e:  # one job's failure (sampler, sink, ...) must not stop the others
            log.exception("job %d failed", job.id)
            self._fail(job, f"{type(e).__name__}: {e}")

    def _sample(self, s: _Seq, logits: np.ndarray) -> None:
        job, p = s.job, s.job.params
        cur = TokenDataArray.from_logits(logits)
        s.sampler.apply(cur)
        token = int(cur.ids[cur.selected])
        s.sampler.accept(token)
        if not job.t_first:
            job.t_first = time.perf_counter()
        if self.vocab.is_eog(token):
            self._finish(s, FINISH_EOG, [], [])
            return
        lps = []
        if p.logprobs:
            lp, top = logprobs_of(logits, token, p.top_logprobs)
            lps.append(TokenLogprob(token, self.vocab.token_to_piece(token), lp, top))
        s.tokens.append(token)
        s.text += s.decoder.push(token)
        cut = min((i for i in (s.text.find(x) for x in p.stop) if i >= 0), default=-1)
        if cut >= 0:
            s.text = s.text[:cut]
            self._finish(s, FINISH_STOP, [token], lps)
            return
        if (p.max_tokens is not None and len(s.tokens) >= p.max_tokens) or s.n_past + 1 >= self.n_ctx_slot:
            self._finish(s, FINISH_LENGTH, [token], lps)
            return
        s.pending = token
        hold = max((len(x) for x in p.stop), default=0)
        safe = max(len(s.text) - hold, s.emitted)
        job.sink(Delta(s.index, s.text[s.emitted:safe], [token], lps))
        s.emitted = safe

    def _finish(self, s: _Seq, reason: str, tokens: list[int], lps: list[TokenLogprob]) -> None:
        """End one sample: free its cells now, send its last delta, and end the job with it."""
        job = s.job
        if reason != FINISH_STOP:
            s.text += s.decoder.flush()
        s.done = True
        s.pending = None
        self._free(s, keep=job.cache_prompt and len(job.seqs) == 1)
        job.sink(Delta(s.index, s.text[s.emitted:], tokens, lps, reason))
        s.emitted = len(s.text)
        job.n_done += 1
        if job.n_done == len(job.seqs):
            self._release(job, "done")
            n_gen = sum(len(x.tokens) for x in job.seqs)
            t_prompt = (job.t_first or job.t_end) - job.t_start
            t_gen = job.t_end - (job.t_first or job.t_end)
            job.sink(Done(len(job.tokens), n_gen, {
                "queue_s": job.t_start - job.t_submit, "prompt_s": t_prompt, "gen_s": t_gen,
                "prompt_tok_s": len(job.tokens) / t_prompt if t_prompt > 0 else 0.0,
                "gen_tok_s": n_gen / t_gen if t_gen > 0 else 0.0}))

    def _fail(self, job: Job, message: str) -> None:
        if job.finished:
            return
        self._release(job, "failed")
        try:
            job.sink(Failed(message))
        except Exception:
            log.exception("job %d: the sink failed while reporting a failure", job.id)


@dataclasses.dataclass
class _Part:
    """One job's share of a step's batch."""

    job: Job
    idx: list[int] = dataclasses.field(default_factory=list)       # its batch indices
    decoding: list[_Seq] = dataclasses.field(default_factory=list)  # samples whose pending token is in
    n_prompt: int = 0                                                # prompt tokens in the batch
    reads: list[tuple[list[_Seq], int]] = dataclasses.field(default_factory=list)  # who samples which row


class Engine:
    """A Batcher in its own thread, which alone touches the Context. `submit` and `cancel`
    are thread-safe; events reach each job's sink from the engine thread."""

    def __init__(self, ctx, vocab, *, n_slots: int | None = None, max_queue: int = 16):
        self.batcher = Batcher(ctx, vocab, n_slots)
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued: set[Job] = set()      # submitted, not yet given slots
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self.n_failed_steps = 0
        self.snapshot: dict = self._snapshot()

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue a job: ValueError if it can never run, QueueFull if the queue is full."""
        self.batcher.check(job.tokens, job.params)
        with self._lock:
            if len(self._queued) >= self.max_queue:
                raise QueueFull(f"the queue holds {self.max_queue} waiting requests")
            self._queued.add(job)
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self._inbox.put(("cancel", job))

    def call(self, fn: Callable[[Batcher], object], timeout: float = 300.0):
        """Run fn(batcher) on the engine thread, which alone touches the Context, between two
        steps; returns its result or raises its exception here."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, fut)))
        return fut.result(timeout)

    def _handle(self, kind: str, job) -> None:
        if job is None:        # a wake-up
            return
        if kind == "call":
            fn, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.batcher))
                except Exception as e:
                    fut.set_exception(e)
        elif kind == "submit":
            self.batcher.submit(job)
        elif kind == "cancel":
            self.batcher.cancel(job)
            if job.state == "cancelled":
                log.info("job %d cancelled", job.id)

    def _loop(self) -> None:
        b = self.batcher
        while not self._stop.is_set():
            try:
                if b.idle:
                    self._handle(*self._inbox.get())
                while True:
                    try:
                        self._handle(*self._inbox.get_nowait())
                    except queue.Empty:
                        break
                b._admit()
                self.snapshot = self._snapshot()   # new requests show as processing before the step runs
                b.step()
            except Exception:  # keep serving: fail the running jobs, not the loop
                self.n_failed_steps += 1
                log.exception("engine step failed")
                for job in list(b.running):
                    b._fail(job, "internal error in the engine step")
            with self._lock:
                self._queued = {j for j in self._queued if j.state == "queued"}
            self.snapshot = self._snapshot()

    def _snapshot(self) -> dict:
        b = self.batcher
        slots = [{"id": i, "state": "idle", "job": None, "n_past": 0} for i in range(b.n_slots)]
        for job in b.running:
            for s in job.seqs:
                if not s.done:
                    slots[s.seq_id] = {"id": s.seq_id, "state": "processing", "job": job.id, "n_past": s.n_past,
                                       "n_prompt": len(job.tokens), "n_decoded": len(s.tokens)}
        n_busy = sum(1 for s in slots if s["state"] != "idle")
        return {"slots_idle": b.n_slots - n_busy, "slots_processing": n_busy, "queue": len(b.waiting),
                "kv_cells_used": b.ctx.memory.cells.get_used(), "n_ctx": b.ctx.n_ctx, "n_ctx_slot": b.n_ctx_slot,
                "n_steps": b.n_steps, "slots": slots}
