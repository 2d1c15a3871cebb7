"""Speculative decoding: a drafter proposes the next few tokens, the target model checks them
all in one multi-token ubatch, and the cells of rejected tokens are removed with seq_rm.

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
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from llm.batch import Batch
from llm.context import Context, DecodeStatus
from llm.sampling import SamplerChain


class SpeculativeError(RuntimeError):
    """The target or draft context failed to decode (the status and the context's error)."""


class Drafter(Protocol):
    def draft(self, tokens: list[int], n_max: int) -> list[int]:
        """Up to n_max tokens that may follow `tokens` (the whole sequence so far)."""
        ...


@dataclass
class PromptLookup:
    """Find the last `n` tokens (n from max_ngram_size down to 1) earlier in the sequence and
    propose the tokens that followed their latest earlier occurrence. Defaults as
    llama-cpp-python's LlamaPromptLookupDecoding (max_ngram_size 2, num_pred_tokens 10)."""
    max_ngram_size: int = 2
    num_pred_tokens: int = 10

    def __post_init__(self) -> None:
        if self.max_ngram_size < 1 or self.num_pred_tokens < 1:
            raise ValueError(f"PromptLookup: max_ngram_size ({self.max_ngram_size}) and num_pred_tokens "
                             f"({self.num_pred_tokens}) must be >= 1")

    def draft(self, tokens: list[int], n_max: int) -> list[int]:
        n_max = min(n_max, self.num_pred_tokens)
        seq = np.asarray(tokens, np.int64)
        for n in range(min(self.max_ngram_size, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            # windows starting at i < len - n, so the match is strictly earlier than the tail
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in seq[start:start + n_max]]
        return []


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


@dataclass
class SpecStats:
    n_steps: int = 0        # verification ubatches
    n_drafted: int = 0      # drafted tokens checked
    n_accepted: int = 0     # drafted tokens kept

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


class Speculative:
    """Token source for a context whose sequence 0 holds `tokens` and whose last decode put
    the logits of tokens[-1] in output row -1 (what evaluating a prompt leaves)."""

    def __init__(self, ctx: Context, sampler: SamplerChain, drafter: Drafter, n_draft: int = 16,
                 is_eog: Callable[[int], bool] = lambda t: False):
        if n_draft < 1:
            raise ValueError(f"n_draft must be >= 1, got {n_draft}")
        self.ctx, self.sampler, self.drafter = ctx, sampler, drafter
        self.n_draft = min(n_draft, ctx.n_batch - 1, ctx.n_ubatch - 1) if ctx.n_ubatch > 1 else 0
        self.is_eog = is_eog
        self.stats = SpecStats()
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
            room = ctx.n_ctx - self.n_past - 1
            draft = self.drafter.draft(seq, min(self.n_draft, room)) if room > 0 and self.n_draft else []
            batch = Batch([last] + draft, pos=list(range(self.n_past, self.n_past + 1 + len(draft))),
                          logits=[True] * (1 + len(draft)))
            status = ctx.decode(batch)
            if status == DecodeStatus.NO_KV_SLOT:
                return
            if status != DecodeStatus.OK:
                raise SpeculativeError(f"verification decode returned {status.name}: {ctx.last_error}")
            self.stats.n_steps += 1
            self.stats.n_drafted += len(draft)
            accepted: list[int] = []
            tok = sampler.sample(ctx, 0)
            for i, d in enumerate(draft):
                if tok != d:
                    break
                accepted.append(d)
                if self.is_eog(d):
                    break
                tok = sampler.sample(ctx, i + 1)
            self.stats.n_accepted += len(accepted)
            self.n_past += 1 + len(accepted)
            ctx.memory.seq_rm(0, self.n_past, -1)         # the rejected drafts' cells
            for t in accepted:
                yield t
                if self.is_eog(t):
                    return
                seq.append(t)
            last = tok
