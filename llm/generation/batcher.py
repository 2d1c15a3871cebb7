"""Many generations on one Context at once: llama-server's slots, as a library. This is the
generation loop of every caller: `LLM.generate/stream/chat` (one job or several), the server's
`Engine` and speculative decoding.

`Batcher` is the scheduler core. Each `Job` (a prompt and n samples of it) gets n slots;
a slot is a KV sequence id. Every `step()` builds one batch: the pending token of every
decoding sequence (with its draft, for speculative decoding), then chunks of waiting prompts
up to n_batch tokens, so a long prompt shares steps with the sequences already generating.
After the decode each sequence samples its own token with its own sampler chain (its own
seed, built by llm.generation.core.build_sampler) and its SeqState checks stop strings and
limits; a sequence that finishes frees its cells at once. A prompt with n > 1 is evaluated
once and its cells shared with the other samples through seq_cp, as llama.cpp's `batched`
example does. A sequence with a drafter decodes its pending token and the draft in one step and
keeps the drafts its sampler agrees with (common_sampler_sample_and_accept_n).

Each slot owns n_ctx // n_slots cells (llama-server's per-slot context), so the sequences
running together can never exhaust the cache: a prompt that does not fit a slot is refused,
and generation stops with finish reason "length" when its slot is full. A job with
cache_prompt leaves its cells in its slot when it ends (done or cancelled), and the next job
takes the free slot that shares the longest prefix with its prompt.

A job may hold images (`media`, from an mtmd prompt's chunks: `media_prompt`): its tokens have a
placeholder at each image position, and when its prefill reaches an image, the Batcher's
MtmdContext decodes the image into the job's sequence before the step's batch (llama-server's
process_mtmd_chunk); the text around the images is prefilled in the steps' batches as any
prompt's. A slot's kept cells record their images by chunk key, and a prefix is shared through
an image only when the next prompt has the same image there (server_tokens::get_common_prefix):
a placeholder never matches a text token, nor another image.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from llm.batch import Batch
from llm.context import DecodeStatus
from llm.errors import StateError
from llm.generation.core import (
    FINISH_LENGTH,
    Delta,
    GenParams,
    SeqState,
    build_sampler,
)
from llm.generation.speculative import (
    Drafter,
    DraftModel,
    DraftPolicy,
    Rollback,
    SpeculativeError,
    check_rollback,
    make_drafter,
    max_draft,
    n_kept,
    replay,
    sample_and_accept_n,
)
from llm.hparams import RopeType
from llm.params import ParamError
from llm.sampling.samplers import SamplerChain, TokenDataArray

if TYPE_CHECKING:
    from llm.mtmd import InputChunk, MtmdContext

log = logging.getLogger(__name__)

# the token a job holds at an image's positions (never decoded: those cells hold the image)
MEDIA_PLACEHOLDER = 0


def media_prompt(chunks: Sequence[InputChunk]) -> tuple[list[int], dict[int, InputChunk]]:
    """An mtmd prompt's chunks as a Job's `tokens` (MEDIA_PLACEHOLDER at an image's positions)
    and `media` (each image chunk by the position it starts at)."""
    tokens: list[int] = []
    media: dict[int, InputChunk] = {}
    for c in chunks:
        if c.image is None:
            tokens += c.tokens
        else:
            media[len(tokens)] = c
            tokens += [MEDIA_PLACEHOLDER] * c.n_pos
    return tokens, media


def extra_cells(media: Mapping[int, InputChunk]) -> int:
    """The KV cells a prompt's images take beyond their positions: an M-RoPE image's n_tokens
    cells sit at max(nx, ny) positions, so a slot (counted in positions) holds that many less."""
    return sum(c.n_tokens - c.n_pos for c in media.values())

# Steps up to this many tokens take their whole prompt chunk, padded or not (Batcher._prompt_budget).
FILL_MIN = 32


class SlotNotFound(LookupError):
    """No slot has this id."""


class SlotBusy(RuntimeError):
    """The slot is running a request."""


class EngineError(RuntimeError):
    """A failure inside the engine while running one request (not a problem with its input)."""


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
                 cache_prompt: bool = False, media: Mapping[int, InputChunk] | None = None):
        self.id = next(_job_ids)
        self.cache_prompt = cache_prompt   # keep the cells when done, to reuse their prefix
        self.tokens = [int(t) for t in tokens]
        self.media = dict(media or {})     # position -> image chunk (media_prompt)
        self.n_extra_cells = extra_cells(self.media)
        self.params = params
        self.sink = sink
        self.seqs: list[_Seq] = []
        self.n_prefilled = 0           # prompt tokens of the first sample already decoded
        self.n_cached = 0              # prompt tokens its slot already held (cache_prompt): never decoded
        self.n_done = 0
        self.state = "queued"          # queued -> running -> done | failed | cancelled
        self.t_submit = time.perf_counter()
        self.t_start = self.t_first = self.t_end = 0.0

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled")


class _Seq:
    """One sample of a job, in one slot (= KV sequence id)."""

    def __init__(self, job: Job, index: int, seq_id: int, sampler: SamplerChain, state: SeqState,
                 drafter: Drafter | None, policy: DraftPolicy | None):
        self.job = job
        self.index = index
        self.seq_id = seq_id
        self.sampler = sampler
        self.state = state
        self.drafter, self.policy = drafter, policy
        self.n_past = 0                    # cells of this sequence in the cache
        self.n_shifted = 0                 # tokens after n_keep that context shifts discarded
        self.n_keep = 0                    # ... the tokens kept at the start (the first shift's n_keep)
        self.pending: int | None = None    # sampled token to decode next step
        self.done = False
        self.rollback: Rollback | None = None     # how this step's draft is dropped, if rejected

    @property
    def tokens(self) -> list[int]:
        return self.state.tokens

    def cells_tokens(self) -> list[int]:
        """The tokens this sequence's cells hold, in order: its prompt and output, less what
        context shifts discarded (always the oldest tokens after the first n_keep)."""
        seq = self.job.tokens + self.tokens
        return seq[:self.n_keep] + seq[self.n_keep + self.n_shifted:] if self.n_shifted else seq


def check_context_shift(ctx) -> None:
    """ValueError when a full slot of ctx cannot discard tokens and shift the rest back: a
    recurrent state cannot forget the discarded tokens, and M-RoPE positions cannot be
    shifted by one number (llama_kv_cache::get_can_shift)."""
    hp = ctx.model.hparams
    if ctx.recurrent:
        raise ValueError(f"context_shift: the recurrent state of {hp.arch.value} cannot drop the discarded tokens")
    if hp.rope_type in (RopeType.MROPE, RopeType.IMROPE, RopeType.VISION):
        raise ValueError(f"context_shift: the multi-section rope positions of {hp.arch.value} cannot be shifted")


class Batcher:
    """Continuous batching over one Context (see the module docstring). Not thread-safe:
    one thread calls submit/cancel/step (Engine does that for servers)."""

    def __init__(self, ctx, vocab, n_slots: int | None = None, mtmd: MtmdContext | None = None, *,
                 context_shift: bool = False, n_draft: int = 16):
        """context_shift: a sequence whose slot is full discards half of its tokens after
        n_keep and goes on (llama-server's --context-shift), instead of ending with "length".
        n_draft: the longest draft of a speculative job."""
        self.ctx = ctx
        self.vocab = vocab
        self.mtmd = mtmd        # decodes the images of jobs with media (llm.mtmd)
        if context_shift:
            check_context_shift(ctx)
        self.context_shift = context_shift
        self.n_draft = n_draft
        self.n_slots = ctx.n_seq_max if n_slots is None else n_slots
        if not 1 <= self.n_slots <= ctx.n_seq_max:
            raise ValueError(f"n_slots = {self.n_slots} is outside [1, n_seq_max = {ctx.n_seq_max}]")
        self.n_ctx_slot = ctx.n_ctx // self.n_slots
        self.n_ctx_train = ctx.model.hparams.n_ctx_train
        self.free = list(range(self.n_slots))
        # a finished job with cache_prompt (one sample) leaves its cells in its slot, and such a job
        # takes the free slot that shares the longest prefix with it (llama-server's cache_prompt)
        self.cached: dict[int, list[int]] = {}     # free slot -> the tokens its cells hold
        self.cached_lora: dict[int, tuple[float, ...]] = {}   # ... and the adapter scales they were computed with
        self.cached_media: dict[int, dict[int, tuple[str, int]]] = {}   # ... and its images: start -> (key, n_pos)
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self.n_steps = 0
        self._replays: list[tuple[_Seq, Rollback]] = []     # see _replay

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
        self.forget()
        return ctx.perf()["n_compiles"] - n0

    # ---- jobs --------------------------------------------------------------------------

    def check(self, tokens: Sequence[int], params: GenParams, media: Mapping[int, InputChunk] | None = None) -> None:
        """A ParamError (a ValueError) naming the field that is wrong ("prompt", "n", a sampler's
        "repeat_penalty", ...) if the job can never run here."""
        params.check()
        if not tokens:
            raise ParamError("prompt", "the prompt is empty (no tokens)")
        if media:
            self._check_media(len(tokens), params, media)
        n_vocab = self.vocab.n_tokens
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise ParamError("prompt", f"prompt token {bad[0]} is out of range [0, {n_vocab})")
        n_extra = extra_cells(media) if media else 0
        if len(tokens) + n_extra >= self.n_ctx_slot:
            cells = f" ({len(tokens) + n_extra} cells with its images)" if n_extra else ""
            raise ParamError("prompt", f"the prompt has {len(tokens)} tokens{cells}; a slot holds {self.n_ctx_slot} "
                                       f"(n_ctx {self.ctx.n_ctx} / {self.n_slots} slots)")
        if params.n > self.n_slots:
            raise ParamError("n", f"n = {params.n} is more than the {self.n_slots} slots")
        n_adapters = len(self.ctx.lora.adapters)
        if params.lora is not None and len(params.lora) != n_adapters:
            raise ParamError("lora", f"lora gives {len(params.lora)} scales; the context has {n_adapters} adapters")
        if params.speculative is not None:
            try:
                make_drafter(params.speculative)      # names a wrong one now
                check_rollback(self.ctx, params.speculative)
            except ValueError as e:
                raise ParamError("speculative", str(e)) from None
            if isinstance(params.speculative, DraftModel) and params.n != 1:
                raise ParamError("speculative", f"a DraftModel drafts for one sequence (its own context); "
                                                f"n = {params.n}")
        # the chain is built here, in the request's own error path, and a grammar computes its first
        # mask: a bad value or a grammar llguidance cannot run ($ref cycles) fails this request, not a step
        chain = build_sampler(params, vocab=self.vocab, n_ctx=self.n_ctx_slot, n_ctx_train=self.n_ctx_train)
        if params.constraint is not None:
            chain.samplers[0].apply(TokenDataArray.from_logits(np.zeros(n_vocab, np.float32)))

    def _check_media(self, n_tokens: int, params: GenParams, media: Mapping[int, InputChunk]) -> None:
        if self.mtmd is None:
            raise ParamError("prompt", "the prompt holds images but no vision projector (mmproj) is loaded")
        if params.speculative is not None:
            raise ParamError("speculative", "speculative decoding cannot be combined with images yet")
        end = 0
        for start in sorted(media):
            chunk = media[start]
            if chunk.image is None or start < end or start + chunk.n_pos >= n_tokens:
                raise ParamError("prompt", f"the image chunk at position {start} overlaps another, is not an image "
                                           f"or is not followed by text (the prompt has {n_tokens} positions)")
            end = start + chunk.n_pos

    def submit(self, job: Job) -> None:
        """Queue a checked job; its max_tokens is capped by what its slot can hold after the prompt."""
        self.check(job.tokens, job.params, job.media)
        room = self.n_ctx_slot - len(job.tokens) - job.n_extra_cells
        if job.params.max_tokens is not None and job.params.max_tokens > room and not self._shifts(job):
            job.params = dataclasses.replace(job.params, max_tokens=room)
        self.waiting.append(job)

    def cancel(self, job: Job) -> None:
        """Stop a job (its cells are freed, or kept for its prefix with cache_prompt); no further
        events are sent."""
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
                self._free(s, keep=state != "failed" and job.cache_prompt and len(job.seqs) == 1)
        job.state = state
        job.t_end = time.perf_counter()
        if job in self.running:
            self.running.remove(job)

    def _free(self, s: _Seq, keep: bool = False) -> None:
        if keep and not s.n_shifted:    # the cells hold the prompt and the output but its last (pending) token
            media = s.job.media
            n = min(s.n_past, len(s.job.tokens) + len(s.tokens))
            n = min([n] + [p for p, c in media.items() if p < n < p + c.n_pos])     # never part of an image
            self.cached[s.seq_id] = (s.job.tokens + s.tokens)[:n]
            self.cached_lora[s.seq_id] = self.lora_key(s.job.params)
            self._set_cached_media(s.seq_id, {p: (c.key, c.n_pos) for p, c in media.items()}, n)
            self.ctx.memory.seq_rm(s.seq_id, n, -1)
        else:
            self.ctx.memory.seq_rm(s.seq_id, -1, -1)
            self.cached.pop(s.seq_id, None)
            self.cached_lora.pop(s.seq_id, None)
            self.cached_media.pop(s.seq_id, None)
        self.ctx.set_adapter_scales_seq(s.seq_id, None)
        self.free.append(s.seq_id)

    def _set_cached_media(self, slot: int, images: dict[int, tuple[str, int]], n: int) -> None:
        """Record the images within a slot's first n cells."""
        kept = {p: v for p, v in images.items() if p + v[1] <= n}
        if kept:
            self.cached_media[slot] = kept
        else:
            self.cached_media.pop(slot, None)

    def lora_key(self, params: GenParams) -> tuple[float, ...]:
        """The adapter scales a job's cells are computed with (its own, or the context's)."""
        return self.ctx.lora.scales if params.lora is None else tuple(params.lora)

    def set_adapters_lora(self, adapters, scales) -> None:
        """Change the context's adapters or scales between steps; the cached prefixes of free
        slots were computed under the old ones, so they are dropped."""
        self.ctx.set_adapters_lora(adapters, scales)
        for slot in self.free:
            self.ctx.memory.seq_rm(slot, -1, -1)
        self.forget()

    def _idle_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.n_slots:
            raise SlotNotFound(f"slot {slot!r} does not exist (slots 0..{self.n_slots - 1})")
        if slot not in self.free:
            raise SlotBusy(f"slot {slot} is processing a request")

    def save_slot(self, slot: int, path) -> int:
        """Write an idle slot's cells and the tokens they hold (llama-server's slot save);
        returns the number of tokens saved. The cells are there after a cache_prompt job. A
        slot whose cells hold an image is a StateError: the file would keep its placeholders only."""
        self._idle_slot(slot)
        if self.cached_media.get(slot):
            raise StateError(f"slot {slot} holds an image: its cells cannot be saved to a file")
        tokens = self.cached.get(slot, [])
        self.ctx.state_seq_save_file(path, slot, tokens)
        return len(tokens)

    def restore_slot(self, slot: int, path) -> int:
        """Load a saved slot into an idle slot, whose cells it replaces; the next cache_prompt job
        with that prefix reuses them. StateError for a bad file or one larger than a slot."""
        self._idle_slot(slot)
        tokens = self.ctx.state_seq_load_file(path, slot)
        self.cached.pop(slot, None)
        self.cached_lora.pop(slot, None)
        self.cached_media.pop(slot, None)
        if len(tokens) >= self.n_ctx_slot:
            self.ctx.memory.seq_rm(slot, -1, -1)
            raise StateError(f"{path}: {len(tokens)} tokens do not fit a slot of {self.n_ctx_slot}")
        self.cached[slot] = [int(t) for t in tokens]
        return len(tokens)

    def forget(self) -> None:
        """Drop the prompt cache's bookkeeping (after the cache itself was cleared)."""
        self.cached.clear()
        self.cached_lora.clear()
        self.cached_media.clear()

    def best_slot(self, tokens: Sequence[int], lora: tuple[float, ...] | None = None,
                  media: Mapping[int, InputChunk] | None = None) -> tuple[int, int]:
        """The free slot whose cells share the longest prefix with tokens[:-1] (with images
        `media`; that the cache can still keep: a sliding-window cache may have dropped what the
        next token needs) and were computed with the adapter scales `lora` (default: the
        context's), and its length; the lowest free slot and 0 when none shares any."""
        self.free.sort()
        best, n_keep = self.free[0], 0
        key = self.ctx.lora.scales if lora is None else tuple(lora)
        for seq_id in self.free:
            if self.cached_lora.get(seq_id, self.ctx.lora.scales) != key:
                continue
            n = self._common_prefix(seq_id, tokens, media or {})
            if n > n_keep and self.ctx.memory.can_keep(seq_id, n):
                best, n_keep = seq_id, n
        return best, n_keep

    def _common_prefix(self, slot: int, tokens: Sequence[int], media: Mapping[int, InputChunk]) -> int:
        """How many of tokens[:-1] a slot's cells hold: text token by token, an image whole when
        both have it at the same place (its chunk key and size)."""
        held, images = self.cached.get(slot, []), self.cached_media.get(slot, {})
        end = min(len(held), len(tokens) - 1)
        n = 0
        while n < end:
            mine, theirs = images.get(n), media.get(n)
            if mine is not None or theirs is not None:
                if theirs is None or mine != (theirs.key, theirs.n_pos) or n + theirs.n_pos > end:
                    break
                n += theirs.n_pos
            elif held[n] != tokens[n]:
                break
            else:
                n += 1
        return n

    def keep_prefix(self, slot: int, n: int) -> None:
        """Cut a free slot's cells (and what it is known to hold) to their first n tokens."""
        self.ctx.memory.seq_rm(slot, n, -1)
        if slot in self.cached:
            self.cached[slot] = self.cached[slot][:n]
        self._set_cached_media(slot, self.cached_media.get(slot, {}), n)

    def _take_slot(self, job: Job) -> tuple[int, int]:
        """A free slot for the job and how many of its prompt tokens the slot already holds."""
        if job.cache_prompt and job.params.n == 1:
            best, n_keep = self.best_slot(job.tokens, job.params.lora, job.media)
        else:
            self.free.sort()
            best, n_keep = self.free[0], 0
        self.ctx.set_adapter_scales_seq(best, job.params.lora)     # first: it checks the scales
        self.free.remove(best)
        self.ctx.memory.seq_rm(best, n_keep, -1)
        self.cached.pop(best, None)
        self.cached_lora.pop(best, None)
        self.cached_media.pop(best, None)
        return best, n_keep

    def _admit(self) -> None:
        """Give waiting jobs their slots, first come first served; a job whose setup fails fails alone."""
        while self.waiting and len(self.free) >= self.waiting[0].params.n:
            job = self.waiting.popleft()
            job.state = "running"
            job.t_start = time.perf_counter()
            self.running.append(job)
            try:
                self._start(job)
            except Exception as e:
                log.exception("job %d failed at admission", job.id)
                self._fail(job, f"{type(e).__name__}: {e}")

    def _start(self, job: Job) -> None:
        """Build each sample's sampler chain and drafter and give it a slot."""
        p = job.params
        n_draft = max_draft(self.ctx, self.n_draft)
        for i in range(p.n):
            sampler = build_sampler(p, vocab=self.vocab, n_ctx=self.n_ctx_slot, n_ctx_train=self.n_ctx_train, index=i)
            state = SeqState(p, self.vocab, i)
            seq_id, n_keep = self._take_slot(job)       # nothing below can fail with the slot taken
            # check() made this drafter once already
            drafter = make_drafter(p.speculative, seq_id) if p.speculative is not None and n_draft else None
            job.seqs.append(_Seq(job, i, seq_id, sampler, state, drafter,
                                 DraftPolicy(n_draft) if drafter is not None else None))
            if i == 0:
                job.n_prefilled = job.n_cached = job.seqs[0].n_past = n_keep

    # ---- one step ----------------------------------------------------------------------

    def _plan(self) -> tuple[dict[int, _Part], list[int], list[int], list[tuple[int, ...]], list[bool]]:
        """This step's batch: the decoding sequences' pending tokens (and drafts) first, then
        prompt chunks in the budget left."""
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

        decoding = [s for job in self.running for s in job.seqs if s.pending is not None]
        for s in decoding:
            if s.n_past + 1 >= self.n_ctx_slot and self._shifts(s.job):   # (else it ended with "length")
                self._shift(s)
        budget = self.ctx.n_batch - len(decoding)
        for s in decoding:
            assert s.pending is not None
            draft = self._draft(s, budget) if s.drafter is not None else []
            s.rollback = Rollback.before(self.ctx, s.seq_id, s.n_past, [s.pending, *draft]) if draft else None
            budget -= len(draft)
            part = plan.setdefault(s.job.id, _Part(s.job))
            part.reads.append(([s], len(tokens), draft))
            part.decoding.append(s)
            for j, t in enumerate([s.pending, *draft]):
                add(part, t, s.n_past + j, s.seq_id, True)
        budget = self._prompt_budget(len(tokens), budget)
        for job in self.running:
            n_left = len(job.tokens) - job.n_prefilled
            if budget <= 0 or n_left == 0:
                continue
            images = [p for p in job.media if p >= job.n_prefilled]
            k = min(budget, n_left, min(images, default=len(job.tokens)) - job.n_prefilled)   # up to the next image
            part = plan.setdefault(job.id, _Part(job))
            part.n_prompt = k
            for j in range(job.n_prefilled, job.n_prefilled + k):
                add(part, job.tokens[j], j, job.seqs[0].seq_id, j == len(job.tokens) - 1)
            if k == n_left:
                part.reads.append((job.seqs, len(tokens) - 1, []))
            budget -= k
        return plan, tokens, pos, seq_ids, wants

    def _prompt_budget(self, n_decode: int, budget: int) -> int:
        """The prompt tokens to add to a step's n_decode decoding tokens: all that wait (up to
        `budget`), or fewer where that fills the graph instead of padding it, and still takes at
        least half of them (8 decodes and a 64-token prompt as 72 tokens pay for a 128-token
        graph; 64 then 16 are done at less than 2/3 the cost, the 8 tokens left a step later).
        Steps of up to FILL_MIN tokens are not cut: the prompt's tail would only come later."""
        n_wait = sum(len(job.tokens) - job.n_prefilled for job in self.running)
        n_want = min(budget, n_wait)
        if not n_decode or n_want <= 0 or n_decode + n_want <= FILL_MIN:
            return budget
        n_fill = self.ctx.n_tokens_unpadded(n_decode + n_want) - n_decode
        return n_fill if 2 * n_fill >= n_want else budget

    def _shifts(self, job: Job) -> bool:
        """Whether the job's sequences shift their context when their slot fills (not with
        images: a shift cannot cut an image's positions; llama-server turns it off for them)."""
        return self.context_shift and not job.media

    def _shift(self, s: _Seq) -> None:
        """llama-server's context shift of a full slot: keep the first n_keep tokens (the
        request's; -1: the whole prompt; plus the BOS), discard half of the rest (or n_discard)
        and move the later cells back by as many positions (their keys re-rotated)."""
        p = s.job.params
        if not s.n_shifted:
            n_keep = len(s.job.tokens) if p.n_keep < 0 else p.n_keep
            s.n_keep = min(self.n_ctx_slot - 4, n_keep + (1 if self.vocab.add_bos else 0))
        n_left = s.n_past - s.n_keep
        n_discard = max(0, min(p.n_discard or n_left // 2, n_left - 1))
        log.info("slot %d: context shift, n_keep = %d, n_left = %d, n_discard = %d", s.seq_id, s.n_keep, n_left,
                 n_discard)
        mem = self.ctx.memory
        mem.seq_rm(s.seq_id, s.n_keep, s.n_keep + n_discard)
        mem.seq_add(s.seq_id, s.n_keep + n_discard, s.n_past, -n_discard)
        s.n_past -= n_discard
        s.n_shifted += n_discard

    def _draft(self, s: _Seq, budget: int) -> list[int]:
        """Draft tokens to verify after s's pending token, within the slot, the batch and max_tokens."""
        assert s.drafter is not None and s.policy is not None
        room = min(self.n_ctx_slot - s.n_past - 2, budget)
        if s.job.params.max_tokens is not None:
            room = min(room, s.job.params.max_tokens - len(s.tokens))
        return s.policy.draft(s.drafter, s.cells_tokens(), room)

    def step(self) -> int:
        """Admit waiting jobs, decode one batch and sample; returns the number of tokens decoded."""
        self._admit()
        self._eval_media()
        plan, tokens, pos, seq_ids, wants = self._plan()
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
            self._replay()
            return len(tokens)
        if len(plan) == 1:        # nothing to isolate: the one job fails with the decode's error
            part = next(iter(plan.values()))
            self._rollback(part)
            self._fail(part.job, f"decode failed: {self.ctx.last_error}")
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
            self._replay()
        return len(tokens)

    def _eval_media(self) -> None:
        """Decode the images that running prompts' prefills have reached into their first
        sequences (mtmd's eval_chunks: encoded, or read from the encoder's cache), before the
        step's batch. A failure fails that job only."""
        for job in list(self.running):
            while job.n_prefilled in job.media and job.state == "running":
                assert self.mtmd is not None            # check() made sure
                chunk, first = job.media[job.n_prefilled], job.seqs[0]
                try:
                    self.mtmd.eval_chunks(self.ctx, [chunk], n_past=job.n_prefilled, seq_id=first.seq_id,
                                          n_batch=self.ctx.n_batch, logits_last=False)
                except Exception as e:
                    log.exception("job %d: its image at position %d failed", job.id, job.n_prefilled)
                    self._fail(job, f"{type(e).__name__}: {e}")
                    break
                job.n_prefilled += chunk.n_pos
                first.n_past = job.n_prefilled

    def _replay(self) -> None:
        """After a step's sampling: decode again the kept drafts of the recurrent sequences
        that went back to their checkpoints (one batch; a failure fails their jobs). A sequence
        that finished meanwhile is replayed too while its slot keeps its cells (cache_prompt),
        not once they were freed."""
        mem = self.ctx.memory
        todo = [(s, r) for s, r in self._replays if mem.seq_pos_max(s.seq_id) == r.n_past - 1]
        self._replays = []
        try:
            replay(self.ctx, [r for _, r in todo])
        except SpeculativeError as e:
            for s, _ in todo:
                self._fail(s.job, str(e))

    def _rollback(self, part: _Part) -> None:
        """Remove the cells a failed decode may have filled for this part."""
        for s in part.decoding:
            self.ctx.memory.seq_rm(s.seq_id, s.n_past, -1)
        if part.n_prompt:
            self.ctx.memory.seq_rm(part.job.seqs[0].seq_id, part.job.n_prefilled, -1)

    def _advance(self, part: _Part, row: Callable[[int], int]) -> None:
        """After a decode: move the job's sequences forward and sample where logits came out
        (`row`: step batch index -> index in the decoded batch). Any exception here fails this job only."""
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
            for seqs, i, draft in part.reads:
                for s in seqs:
                    if s.done:
                        continue
                    if job.params.max_tokens == 0:
                        self._finish(s, s.state.finish(FINISH_LENGTH))
                    else:
                        self._sample(s, [row(i + k) for k in range(1 + len(draft))], draft,
                                     verify=s in part.decoding)
        except Exception as e:  # one job's failure (sampler, sink, ...) must not stop the others
            log.exception("job %d failed", job.id)
            self._fail(job, f"{type(e).__name__}: {e}")

    def _sample(self, s: _Seq, rows: list[int], draft: list[int], verify: bool) -> None:
        """Sample s's next token from output row rows[0] or, after a draft, verify it row by row
        and keep the drafted cells its sampler agrees with; each sampled token goes through the
        sequence's SeqState (which may end it), the last one becomes the pending token."""
        job = s.job
        logits_of: list[np.ndarray] = []

        def sample(k: int) -> int:
            logits = self.ctx.get_logits_ith(rows[k])
            cur = TokenDataArray.view_logits(logits)
            s.sampler.apply(cur)
            token = int(cur.ids[cur.selected])
            s.sampler.accept(token)
            logits_of.append(logits)
            return token

        samples = sample_and_accept_n(sample, draft, self.vocab.is_eog)
        if not job.t_first:
            job.t_first = time.perf_counter()
        kept = n_kept(samples, draft)
        if s.policy is not None and verify:
            s.policy.adapt(len(draft), kept)
        s.n_past += kept
        if kept < len(draft):               # the rejected drafts' cells, or back to the checkpoint
            assert s.rollback is not None
            again = s.rollback.drop(self.ctx, kept)
            if again is not None:
                self._replays.append((s, again))
        for k, token in enumerate(samples):
            full = s.n_past - kept + k + 1 + job.n_extra_cells >= self.n_ctx_slot and not self._shifts(job)
            delta = s.state.push(token, logits_of[k], full=full)
            if s.state.done:
                self._finish(s, delta)
                return
            job.sink(delta)
        s.pending = samples[-1]

    def _finish(self, s: _Seq, delta: Delta) -> None:
        """End one sample: free its cells now, send its last delta, and end the job with it."""
        job = s.job
        s.done = True
        s.pending = None
        self._free(s, keep=job.cache_prompt and len(job.seqs) == 1)
        job.sink(delta)
        job.n_done += 1
        if job.n_done == len(job.seqs):
            self._release(job, "done")
            job.sink(Done(len(job.tokens), sum(len(x.tokens) for x in job.seqs), self._timings(job)))

    @staticmethod
    def _timings(job: Job) -> dict:
        n_gen = sum(len(x.tokens) for x in job.seqs)
        t_prompt = (job.t_first or job.t_end) - job.t_start
        t_gen = job.t_end - (job.t_first or job.t_end)
        out = {"queue_s": job.t_start - job.t_submit, "prompt_s": t_prompt, "gen_s": t_gen, "cache_n": job.n_cached,
               "prompt_tok_s": len(job.tokens) / t_prompt if t_prompt > 0 else 0.0,
               "gen_tok_s": n_gen / t_gen if t_gen > 0 else 0.0}
        n_shifted = sum(x.n_shifted for x in job.seqs)
        if n_shifted:
            out["n_shifted"] = n_shifted        # tokens context shifts discarded (llama-server's truncated)
        policies = [x.policy for x in job.seqs if x.policy is not None]
        if policies:
            out.update(spec_steps=sum(p.stats.n_steps for p in policies),
                       spec_drafted=sum(p.stats.n_drafted for p in policies),
                       spec_accepted=sum(p.stats.n_accepted for p in policies))
        return out

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
    # who samples from which batch index, and the draft verified after it
    reads: list[tuple[list[_Seq], int, list[int]]] = dataclasses.field(default_factory=list)
