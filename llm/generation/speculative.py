"""Speculative decoding: a drafter proposes the next few tokens, the target model checks them
all in one multi-token ubatch, and the cells of rejected tokens are removed with seq_rm (a
recurrent state, which cannot forget tokens, goes back to a checkpoint and decodes the kept
ones again: Rollback).

Verification is llama.cpp's `common_sampler_sample_and_accept_n`: the target's sampler
samples at every drafted position, in order, and a drafted token is kept while it equals
the sample; the first mismatch ends the step with the target's own sample. Every emitted
token is therefore a sample of the target's distribution given the tokens before it:
greedy output is token-identical to plain decoding, and with sampling the distribution is
preserved. With a deterministic drafter (prompt lookup, or a greedy draft model) this is
exactly the standard accept/reject rule (accept d with probability p(d), else sample the
renormalized rest); only the RNG stream differs from plain decoding (more draws).

Drafters:
- `PromptLookup`: n-gram lookup in the prompt and the output so far (llama.cpp's lookup
  decoding, llama-cpp-python's LlamaPromptLookupDecoding).
- `DraftModel`: a smaller model sharing the vocabulary, drafting greedily in its own context.
- `DraftPool`: a DraftModel per slot of a batcher (the server's --draft-model).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from llm.batch import Batch
from llm.context import Context, DecodeStatus
from llm.kv_cache import KVCache
from llm.memory_recurrent import RecurrentCheckpoint
from llm.sampling.samplers import SamplerChain


class SpeculativeError(RuntimeError):
    """The target or draft context failed to decode (the status and the context's error)."""


NEAR = 8      # how far from a copy pointer in step a match may lie and still be taken over it


class Drafter(Protocol):
    def draft(self, tokens: list[int], n_max: int) -> list[int]:
        """Up to n_max tokens that may follow `tokens` (the whole sequence so far)."""
        ...


@dataclass
class PromptLookup:
    """Find the last `n` tokens (n from max_ngram_size down to 1) earlier in the sequence and
    propose the tokens that followed one earlier occurrence. Defaults as llama-cpp-python's
    LlamaPromptLookupDecoding (max_ngram_size 2, num_pred_tokens 10).

    Which occurrence: the one nearest the copy pointer, the source position the previous
    draft was taken from advanced by the tokens appended since; without one, the latest.
    While the copy is in step (the last draft's first token was kept), only matches within
    NEAR tokens of the pointer count. When no n-gram of 2 or more tokens matches, the
    pointer's continuation is proposed (without a pointer, a 1-token match). Copying a text
    with edits keeps its place this way: after an edited word the pointer still points
    just past the original word, where a short n-gram (".", "(") has many other matches."""
    max_ngram_size: int = 2
    num_pred_tokens: int = 10
    _src: int = field(default=-1, init=False, repr=False)     # where the last draft was taken from
    _seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_ngram_size < 1 or self.num_pred_tokens < 1:
            raise ValueError(f"PromptLookup: max_ngram_size ({self.max_ngram_size}) and num_pred_tokens "
                             f"({self.num_pred_tokens}) must be >= 1")

    def draft(self, tokens: list[int], n_max: int) -> list[int]:
        n_max = min(n_max, self.num_pred_tokens)
        seq = np.asarray(tokens, np.int64)
        L = len(seq)
        at = len(self._seen)            # the pointer holds only while the sequence extends that one
        follows = self._src >= 0 and L > at and np.array_equal(seq[:at], self._seen)
        expect = self._src + L - at if follows and self._src + L - at < L else -1
        # in step: the last draft's first token was kept, so the copy is going on from there
        in_step = expect >= 0 and seq[at] == seq[self._src]
        start = -1
        for n in range(min(self.max_ngram_size, L - 1), 0, -1):
            if n == 1 and expect >= 0:      # a lone token's matches are weaker than the pointer
                break
            tail = seq[-n:]
            # windows starting at i < len - n, so the match is strictly earlier than the tail
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1)) + n
            if expect >= 0:
                hits = hits[np.abs(hits - expect) <= NEAR] if in_step else hits
                if hits.size:
                    start = int(hits[np.argmin(np.abs(hits - expect))])
                    break
            elif hits.size:
                start = int(hits[-1])
                break
        if start < 0:
            start = expect
        if start < 0 or n_max < 1:
            return []
        self._src, self._seen = start, seq
        return [int(t) for t in seq[start:start + n_max]]


class DraftModel:
    """A draft model in a context of its own: it re-uses the prefix it already holds, decodes
    the rest, then drafts greedily one token at a time."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.cached: list[int] = []          # the tokens in the draft context's sequence 0

    def _decode(self, batch: Batch) -> bool:
        status = self.ctx.decode(batch)
        if status == DecodeStatus.NO_KV_SLOT:
            return False
        if status != DecodeStatus.OK:
            raise SpeculativeError(f"draft decode returned {status.name}: {self.ctx.last_error}")
        return True

    def draft(self, tokens: list[int], n_max: int) -> list[int]:
        n_keep = 0
        for a, b in zip(self.cached, tokens[:-1], strict=False):
            if a != b:
                break
            n_keep += 1
        self.ctx.memory.seq_rm(0, n_keep, -1)
        self.cached = self.cached[:n_keep]
        rest = tokens[n_keep:]
        for i in range(0, len(rest), self.ctx.n_batch):
            chunk = rest[i:i + self.ctx.n_batch]
            pos = list(range(len(self.cached), len(self.cached) + len(chunk)))
            if not self._decode(Batch(chunk, pos=pos, logits=[j == len(chunk) - 1 for j in range(len(chunk))])):
                return []
            self.cached += chunk
        out: list[int] = []
        while len(out) < n_max:
            tok = int(np.argmax(self.ctx.get_logits_ith(-1)))
            out.append(tok)
            if len(out) == n_max or not self._decode(Batch([tok], pos=[len(self.cached)], logits=[True])):
                break
            self.cached.append(tok)
        return out


class DraftPool:
    """Draft models for a batcher's slots, as llama-server gives each slot a draft context of
    its own: one DraftModel per sequence id, each in its own Context on the one loaded draft
    model (`contexts`, built by the caller with the slot's size)."""

    def __init__(self, contexts: list[Context]):
        if not contexts:
            raise ValueError("DraftPool needs a draft context per slot, got none")
        self.drafts = [DraftModel(c) for c in contexts]

    @property
    def model(self):
        return self.drafts[0].ctx.model

    def for_seq(self, seq_id: int) -> DraftModel:
        if not 0 <= seq_id < len(self.drafts):
            raise ValueError(f"DraftPool: sequence {seq_id} has no draft context (the pool has {len(self.drafts)})")
        return self.drafts[seq_id]


@dataclass
class SpecStats:
    n_steps: int = 0        # verification ubatches
    n_drafted: int = 0      # drafted tokens checked
    n_accepted: int = 0     # drafted tokens kept

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


def draft_lengths(n_max: int) -> list[int]:
    """Draft lengths d whose verification ubatch 1 + d is a power of two (1, 3, 7, 15, ...),
    up to n_max: ubatches are padded to a power of two, so other lengths pay for rows that
    verify nothing, and these few shapes are all the verification graphs there are."""
    out = []
    d = 1
    while d <= n_max:
        out.append(d)
        d = 2 * d + 1
    return out


def sample_and_accept_n(sample: Callable[[int], int], draft: list[int],
                        is_eog: Callable[[int], bool]) -> list[int]:
    """common_sampler_sample_and_accept_n: sample row i (the target's logits after the pending
    token and draft[:i]) for i = 0, 1, ..; a drafted token is kept while it equals the sample.
    Returns the samples: the kept drafts, then the target's own next token (unless a kept draft
    ends the generation). The kept drafts are the prefix where samples[i] == draft[i]."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        tok = sample(i)
        out.append(tok)
        if i == len(draft) or tok != draft[i] or is_eog(tok):
            break
    return out


def n_kept(samples: list[int], draft: list[int]) -> int:
    """How many drafted tokens sample_and_accept_n kept (their cells stay in the cache)."""
    n = 0
    while n < min(len(samples), len(draft)) and samples[n] == draft[n]:
        n += 1
    return n


class DraftPolicy:
    """How long the next draft is. A multi-token step costs more than a one-token step (on a
    CPU about 1.5x for 2 tokens, 2x for 8, 3x for 16), so drafting pays only while most of the
    draft is kept. A fully kept draft moves one length up, one kept less than half moves one
    length down, and a rejected single token stops drafting for 1, 2, 4, ... 16 steps (reset by
    the next kept token). Lengths are draft_lengths(n_draft)."""

    def __init__(self, n_draft: int):
        self.lengths = draft_lengths(n_draft)
        self.level = min(2, len(self.lengths) - 1)        # start at 7 tokens
        self.pause = 0            # steps left without drafting
        self.backoff = 1          # the next pause
        self.stats = SpecStats()

    def draft(self, drafter: Drafter, seq: list[int], room: int) -> list[int]:
        """The drafter's proposal after seq, cut to a length in `lengths` and to `room`."""
        if not self.lengths or room < 1:
            return []
        if self.pause:
            self.pause -= 1
            return []
        draft = drafter.draft(seq, min(self.lengths[self.level], room))
        fit = [d for d in self.lengths if d <= min(len(draft), room)]
        return draft[:fit[-1]] if fit else []

    def adapt(self, n_drafted: int, n_accepted: int) -> None:
        """After a verification: count it and move the length."""
        self.stats.n_steps += 1
        self.stats.n_drafted += n_drafted
        self.stats.n_accepted += n_accepted
        if n_drafted == 0:
            return
        if n_accepted:
            self.backoff = 1
        if n_accepted == n_drafted:
            self.level = min(self.level + 1, len(self.lengths) - 1)
        elif 2 * n_accepted < n_drafted:
            if self.level == 0:
                self.pause, self.backoff = self.backoff, min(2 * self.backoff, 16)
            self.level = max(self.level - 1, 0)


def check_rollback(ctx: Context, spec) -> None:
    """ValueError when a draft model keeps a recurrent state: it drops the tokens it drafted
    past a mismatch by removing their cells, which a state cannot (the target model can: see
    Rollback)."""
    draft = spec.drafts[0] if isinstance(spec, DraftPool) else spec
    draft_ctx = draft.ctx if isinstance(draft, DraftModel) else None
    if draft_ctx is not None and draft_ctx.recurrent:
        raise ValueError(f"speculative decoding: the draft model ({draft_ctx.model.arch}) keeps a recurrent state, "
                         f"which cannot drop the tokens it drafted past a mismatch; use a draft model with a KV "
                         f"cache or prompt-lookup")


@dataclass
class Rollback:
    """How a sequence drops the rejected drafts of a verification decode. A KV cache removes
    their cells. A recurrent state cannot forget tokens (llama.cpp keeps per-token snapshots
    for this; here): the sequence's state is checkpointed before the verification, restored
    after it, and the tokens kept are decoded again (`replay`)."""
    seq_id: int
    n_past: int                         # the sequence's tokens before the verification batch
    tokens: list[int]                   # the batch: the pending token and the draft
    checkpoint: RecurrentCheckpoint | None

    @classmethod
    def before(cls, ctx: Context, seq_id: int, n_past: int, tokens: list[int]) -> Rollback:
        mem = ctx.memory
        return cls(seq_id, n_past, tokens, None if isinstance(mem, KVCache) else mem.seq_checkpoint(seq_id))

    def drop(self, ctx: Context, kept: int) -> Rollback | None:
        """Remove what followed the kept drafts; self when its kept tokens must be decoded
        again (`replay`)."""
        if self.checkpoint is None:
            ctx.memory.seq_rm(self.seq_id, self.n_past + 1 + kept, -1)
            return None
        mem = ctx.memory
        assert not isinstance(mem, KVCache)      # a checkpoint comes from a recurrent memory
        mem.seq_restore(self.checkpoint)
        self.tokens = self.tokens[:1 + kept]
        return self


def replay(ctx: Context, again: list[Rollback]) -> None:
    """Decode the kept tokens of restored sequences again, all in one batch, no outputs."""
    if not again:
        return
    toks = [t for r in again for t in r.tokens]
    pos = [r.n_past + j for r in again for j in range(len(r.tokens))]
    seq_id = [r.seq_id for r in again for _ in r.tokens]
    status = ctx.decode(Batch(toks, pos=pos, seq_id=seq_id, logits=[False] * len(toks)))
    if status != DecodeStatus.OK:
        raise SpeculativeError(f"decoding the kept drafts again returned {status.name}: {ctx.last_error}")


def make_drafter(spec, seq_id: int = 0) -> Drafter:
    """A fresh drafter for sequence seq_id from a request's `speculative`: "prompt-lookup", a
    PromptLookup (copied: it keeps per-sequence state), a DraftModel (used as is) or a
    DraftPool (the sequence's own draft model)."""
    if spec == "prompt-lookup":
        return PromptLookup()
    if isinstance(spec, PromptLookup):
        return PromptLookup(spec.max_ngram_size, spec.num_pred_tokens)
    if isinstance(spec, DraftModel):
        return spec
    if isinstance(spec, DraftPool):
        return spec.for_seq(seq_id)
    raise ValueError(f"speculative must be 'prompt-lookup', a PromptLookup, a DraftModel or a DraftPool, got {spec!r}")


class Speculative:
    """Token source for a context whose sequence 0 holds `tokens` and whose last decode put
    the logits of tokens[-1] in output row -1 (what evaluating a prompt leaves): one sequence
    alone, with the DraftPolicy and verification the batcher uses for each of its sequences."""

    def __init__(self, ctx: Context, sampler: SamplerChain, drafter: Drafter, n_draft: int = 16,
                 is_eog: Callable[[int], bool] = lambda t: False):
        if n_draft < 1:
            raise ValueError(f"n_draft must be >= 1, got {n_draft}")
        check_rollback(ctx, drafter)
        self.ctx, self.sampler, self.drafter = ctx, sampler, drafter
        self.policy = DraftPolicy(max_draft(ctx, n_draft))
        self.lengths = self.policy.lengths
        self.is_eog = is_eog
        self.stats = self.policy.stats
        self.n_past = 0       # tokens of the sequence held in the KV cache

    def tokens(self, tokens: list[int]) -> Iterator[int]:
        """Sampled tokens, several per target decode when drafts are accepted. Stops at
        end-of-generation (after yielding it) or when the context is full."""
        ctx, sampler = self.ctx, self.sampler
        seq = list(tokens)
        self.n_past = len(seq)
        last = sampler.sample(ctx, -1)
        while True:
            yield last
            if self.is_eog(last):
                return
            seq.append(last)
            draft = self.policy.draft(self.drafter, seq, self.ctx.n_ctx - self.n_past - 1)
            batch = Batch([last] + draft, pos=list(range(self.n_past, self.n_past + 1 + len(draft))),
                          logits=[True] * (1 + len(draft)))
            rollback = Rollback.before(ctx, 0, self.n_past, [last] + draft)
            status = ctx.decode(batch)
            if status == DecodeStatus.NO_KV_SLOT:
                return
            if status != DecodeStatus.OK:
                raise SpeculativeError(f"verification decode returned {status.name}: {ctx.last_error}")
            samples = sample_and_accept_n(lambda i: sampler.sample(ctx, i), draft, self.is_eog)
            kept = n_kept(samples, draft)
            self.policy.adapt(len(draft), kept)
            self.n_past += 1 + kept
            if kept < len(draft):
                again = rollback.drop(ctx, kept)
                replay(ctx, [] if again is None else [again])
            for t in samples[:-1]:
                yield t
                seq.append(t)
            last = samples[-1]
            if kept == len(samples):          # the last sample was a kept draft: it ended the generation
                yield last
                return


def max_draft(ctx, n_draft: int = 16) -> int:
    """The longest draft a context verifies in one ubatch (0: drafting is off)."""
    return min(n_draft, ctx.n_batch - 1, ctx.n_ubatch - 1) if ctx.n_ubatch > 1 else 0
