"""The server's engine: a Batcher (llm.generation.batcher) in one thread that owns the Context.

Other threads (the HTTP handlers) submit jobs and cancel them through a queue and get results
through each job's sink callback, called once the step that made them is over (a sink wakes
an HTTP handler's thread, which would contend for the GIL with the rest of the step: sampling
the other sequences). The queue of jobs waiting for slots is bounded: `submit`
raises QueueFull at once when it is full. The engine thread also keeps the counters of
/metrics (`metrics`, llm.serving.metrics): each job's Done event and each decode step.
With an MtmdContext (`mtmd`), jobs may hold images: the Batcher decodes them on this thread too.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from llm.generation.batcher import Batcher, Done, Event, Job
from llm.serving.metrics import Metrics

if TYPE_CHECKING:
    from llm.mtmd import MtmdContext

log = logging.getLogger(__name__)


def slot_context(n_slots: int, n_ctx: int, kv_bucket: int = 0) -> dict:
    """The ContextParams fields a server of n_slots slots sets: a sequence per slot, every graph
    outputting n_slots rows (one output size per ubatch size) and KV lengths padded to kv_bucket
    (0: a quarter of the context, at least 256, so few shapes get compiled)."""
    return {"n_seq_max": n_slots, "n_outputs_min": n_slots, "kv_bucket": kv_bucket or max(256, n_ctx // 4)}


class QueueFull(RuntimeError):
    """The engine's queue of waiting requests is full; try again later."""


class Engine:
    """A Batcher in its own thread, which alone touches the Context. `submit` and `cancel`
    are thread-safe; events reach each job's sink from the engine thread."""

    def __init__(self, ctx, vocab, *, n_slots: int | None = None, max_queue: int = 16,
                 mtmd: MtmdContext | None = None, context_shift: bool = False, speculative=None, n_draft: int = 16):
        """speculative: the drafter of every job that names none (a DraftPool of the slots,
        "prompt-lookup"; llama-server's --model-draft / --lookup); context_shift, n_draft: the Batcher's."""
        self.batcher = Batcher(ctx, vocab, n_slots, mtmd, context_shift=context_shift, n_draft=n_draft)
        self.speculative = speculative
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued: set[Job] = set()      # submitted, not yet given slots
        self._outbox: list[tuple[Callable[[Event], None], Event]] = []   # this step's events, sent after it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self.n_failed_steps = 0
        self.metrics = Metrics()
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
        if job.params.speculative is None and self.speculative is not None and not job.media:
            job.params = dataclasses.replace(job.params, speculative=self.speculative)
        self.batcher.check(job.tokens, job.params, job.media)
        with self._lock:
            if len(self._queued) >= self.max_queue:
                raise QueueFull(f"the queue holds {self.max_queue} waiting requests")
            self._queued.add(job)
        job.sink = self._counted(job, job.sink)
        self._inbox.put(("submit", job))

    def _counted(self, job: Job, sink: Callable[[Event], None]) -> Callable[[Event], None]:
        """The job's sink, which first counts its Done in the metrics (on the engine thread, so
        the counters include a request before its client has the answer), then holds the event
        for `_flush`."""
        def count_then_send(ev: Event) -> None:
            if isinstance(ev, Done):
                self.metrics.on_done(ev, max(len(job.tokens) + len(s.tokens) for s in job.seqs))
            self._outbox.append((sink, ev))
        return count_then_send

    def _flush(self) -> None:
        """Send the events held since the last flush, in their order; a failing sink (its
        handler's loop closed) loses its own events only."""
        out, self._outbox = self._outbox, []
        for sink, ev in out:
            try:
                sink(ev)
            except Exception:
                log.exception("a job's sink failed")

    def cancel(self, job: Job) -> None:
        """Stop a job; a job still waiting gives its queue place back at once (its client left),
        not after the engine's current step."""
        with self._lock:
            self._queued.discard(job)
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
                self._flush()
                b._admit()
                self.snapshot = self._snapshot()   # new requests show as processing before the step runs
                if b.step():
                    self.metrics.on_decode(self.snapshot["slots_processing"])
            except Exception:  # keep serving: fail the running jobs, not the loop
                self.n_failed_steps += 1
                log.exception("engine step failed")
                for job in list(b.running):
                    b._fail(job, "internal error in the engine step")
            with self._lock:
                self._queued = {j for j in self._queued if j.state == "queued"}
            # the state after the step first, then its events: a client that has its answer finds
            # its slot free in /health and /slots (sent first, a read could still see it processing)
            self.snapshot = self._snapshot()
            self._flush()

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
