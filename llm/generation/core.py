"""The generation core every caller shares: `LLM.generate/stream/chat`, the server's engine and
speculative decoding all run their sequences through `llm.generation.batcher.Batcher`, which
builds each sequence's sampler chain here (`build_sampler`) and turns its sampled tokens into text
with one `SeqState` (stop strings, end of generation, length, UTF-8 hold-back, logprobs), as
mlx-lm's generate_step and BatchGenerator share one stop matcher. A feature lands here once."""
from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from llm.params import ParamError, param
from llm.sampling import structured as grammar_mod
from llm.sampling.samplers import LLAMA_DEFAULT_SEED, SamplerChain, SamplingParams

FINISH_EOG, FINISH_LENGTH, FINISH_STOP = "eog", "length", "stop"
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass
class GenParams:
    """What one request asks for, besides its prompt."""

    max_tokens: int | None = param(128, lo=0, help="tokens to generate at most; None: until end of generation "
                                                   "or the slot is full")
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    n: int = param(1, lo=1, help="samples of the prompt (sharing its cells); with a seed, sample i uses seed + i")
    logprobs: bool = param(False, help="return each generated token's log-probability")
    top_logprobs: int = param(0, lo=0, hi=MAX_TOP_LOGPROBS, help="with logprobs: the most likely tokens per position")
    n_keep: int = param(0, lo=-1, help="with context shift: the prompt tokens a full slot keeps at its start "
                                       "(besides the BOS; -1: the whole prompt)")
    n_discard: int = param(0, lo=0, help="with context shift: the tokens a full slot discards after n_keep "
                                         "(0: half of them)")
    constraint: grammar_mod.GrammarSpec | None = None   # a checked grammar, first in each sample's chain
    # a drafter for speculative decoding: "prompt-lookup", an llm.speculative.PromptLookup (copied per
    # sample) or DraftModel (n = 1)
    speculative: Any = None
    # this request's scales of the context's LoRA adapters, one per adapter (None: the context's)
    lora: tuple[float, ...] | None = None
    # control tokens whose text is part of the output (llama.cpp's preserved_tokens: the markup of
    # a chat format's tool calls, which its parser reads back)
    preserved_tokens: frozenset[int] = frozenset()

    def check(self) -> None:
        """A ParamError naming the field that is wrong."""
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 0):
            raise ParamError("max_tokens", f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ParamError("n", f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ParamError("top_logprobs",
                             f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        for name, lo in (("n_keep", -1), ("n_discard", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ParamError(name, f"{name} must be an integer >= {lo}, got {v!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ParamError("stop", "stop must be non-empty strings")
        if self.lora is not None and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                             and math.isfinite(v) for v in self.lora):
            raise ParamError("lora", f"lora scales must be finite numbers, got {self.lora!r}")


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """stop as a list of non-empty strings (an empty one would end every generation at once)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] = {s!r} is not a string")
        if not s:
            raise ValueError(f"stop[{i}] is an empty string: it would end the generation at once")
    return stops


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
    stop_word: str | None = None        # the stop string that ended the sample (finish reason "stop")


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


# ---- the sampler chain -----------------------------------------------------------------------

_GRAMMAR_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_vocab(vocab) -> grammar_mod.GrammarVocab:
    """The vocabulary as llguidance wants it: built once per model (1-20 s for a large vocabulary)
    and shared by every caller."""
    gv = _GRAMMAR_VOCABS.get(vocab)
    if gv is None:
        gv = _GRAMMAR_VOCABS[vocab] = grammar_mod.GrammarVocab(vocab)
    return gv


_TOKEN_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_pieces(vocab) -> list[bytes]:
    """Every token's text (DRY matches its sequence breakers against them): built once per model,
    not twice per request (the admission check and the job each build a chain)."""
    pieces = _TOKEN_PIECES.get(vocab)
    if pieces is None:
        pieces = _TOKEN_PIECES[vocab] = [vocab.token_to_piece(i, special=True) for i in range(vocab.n_tokens)]
    return pieces


def build_sampler(params: GenParams, *, vocab, n_ctx: int, n_ctx_train: int, index: int = 0) -> SamplerChain:
    """common_sampler_init for sample `index` of a request: its grammar first (as llama.cpp), then
    the chain of its SamplingParams; with a fixed seed, sample i draws with seed + i. `n_ctx` is
    what -1 in the penalties' history lengths means (the slot's size)."""
    sp = params.sampling
    if sp.seed != LLAMA_DEFAULT_SEED and index:
        sp = dataclasses.replace(sp, seed=(sp.seed + index) & 0xFFFFFFFF)
    dry_on = sp.dry_multiplier != 0.0 and "dry" in sp.samplers
    chain = SamplerChain.from_params(
        sp, n_vocab=vocab.n_tokens, n_ctx=n_ctx, n_ctx_train=n_ctx_train,
        token_pieces=token_pieces(vocab) if dry_on else None,
        tokenize=lambda s: vocab.tokenize(s, add_special=False, parse_special=False))
    if params.constraint is not None:
        chain.samplers.insert(0, params.constraint.sampler(grammar_vocab(vocab)))
    return chain


# ---- one sequence's output -------------------------------------------------------------------

class SeqState:
    """The text of one sequence as its tokens are sampled: `push` takes each sampled token and
    returns the Delta to send, holding back text that may still become a stop string and bytes
    of an unfinished UTF-8 character; the Delta that ends the sequence has its finish reason
    (an end-of-generation token is not part of the output; the token that completes a stop
    string is, but the text is cut before the stop string)."""

    def __init__(self, params: GenParams, vocab, index: int = 0):
        self.params = params
        self.vocab = vocab
        self.index = index
        self.decoder = vocab.stream_decoder()
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0
        self.finish_reason: str | None = None
        self.hold = max((len(s) for s in params.stop), default=0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int, logits: np.ndarray | None = None, *, full: bool = False) -> Delta:
        """The Delta for a sampled token; `logits` (the row it was sampled from) gives its
        logprobs, `full`: there is no room to decode another token."""
        p = self.params
        if self.vocab.is_eog(token):
            return self.finish(FINISH_EOG)
        lps = []
        if p.logprobs and logits is not None:
            lp, top = logprobs_of(logits, token, p.top_logprobs)
            lps.append(TokenLogprob(token, self.vocab.token_to_piece(token), lp, top))
        self.tokens.append(token)
        start = max(len(self.text) - self.hold + 1, 0)
        self.text += self.decoder.push(token, special=token in p.preserved_tokens)
        cut = min((i for i in (self.text.find(s, start) for s in p.stop) if i >= 0), default=-1)
        if cut >= 0:
            word = next(s for s in p.stop if self.text.find(s, start) == cut)
            self.text = self.text[:cut]
            delta = self.finish(FINISH_STOP, [token], lps)
            delta.stop_word = word
            return delta
        if (p.max_tokens is not None and len(self.tokens) >= p.max_tokens) or full:
            return self.finish(FINISH_LENGTH, [token], lps)
        safe = max(len(self.text) - self.hold, self.emitted)
        delta = Delta(self.index, self.text[self.emitted:safe], [token], lps)
        self.emitted = safe
        return delta

    def finish(self, reason: str, tokens: list[int] | None = None, lps: list[TokenLogprob] | None = None) -> Delta:
        """End the sequence: the rest of its text (and what the decoder still holds, unless a
        stop string cut it) in the last Delta."""
        if reason != FINISH_STOP:
            self.text += self.decoder.flush()
        self.finish_reason = reason
        delta = Delta(self.index, self.text[self.emitted:], tokens or [], lps or [], reason)
        self.emitted = len(self.text)
        return delta
