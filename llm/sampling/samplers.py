"""Sampler chain: one logits row -> one token, mirroring llama.cpp's src/llama-sampling.cpp.

Step 15 of the pipeline. A chain is built once before generation and applied to every
logits row; each sampler works on a candidate array (`TokenDataArray`, the counterpart of
`llama_token_data_array`) and may reorder it, drop candidates, rewrite logits or compute
probabilities; the last sampler (greedy, dist, mirostat) sets `selected`. After a token is
chosen, `accept(token)` feeds it to every sampler that keeps a history (penalties, DRY).

Conventions (the same as llama.cpp's):
- A sampler that removes candidates shrinks the arrays, as llama.cpp shrinks `size`.
  Only `temp`/`temp_ext` with a temperature <= 0 and `top_n_sigma` keep removed candidates,
  with logit -inf (and p 0 once a softmax runs), because llama.cpp does exactly that.
- `sorted` says the candidates are in descending logit order; samplers that need order
  sort only as much as they need (a partial sort for top-k, a 256-candidate try for top-p).
  Ties keep the lower position first.
- `apply` mutates the arrays of the `TokenDataArray` it is given; `from_logits` copies
  (`view_logits` copies only when a sampler reads the whole row).
- Random numbers: std::mt19937 seeded as llama.cpp does, mapped to uniform doubles/floats
  and discrete draws the way GCC's libstdc++ does, so a seed gives the same draws as a
  llama.cpp built with GCC (and the same tokens in every process). `LLAMA_DEFAULT_SEED`
  means a fresh random seed, as in llama.cpp.
- Float math is float32 where llama.cpp uses float, float64 where it uses double.
"""
from __future__ import annotations

import abc
import collections
import contextlib
import copy
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from llm import params as params_mod
from llm.params import param

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

logger = logging.getLogger(__name__)

_F32 = np.float32
# top-p first tries the best _TOP_P_TRY candidates when more than _TOP_P_SORT_ALL are unsorted
_TOP_P_TRY = 256
_TOP_P_SORT_ALL = 1024
# DRY limits from llama_sampler_init_dry: breaker length in bytes, tail length in tokens
_DRY_MAX_CHAR_LEN = 40
_DRY_MAX_SEQ_LEN = 20
_FLOAT_MAX_LOG = _F32(88.7228391)


class LogitsSource(Protocol):
    """What `sample` reads logits from: `llm.Context` or anything with the same method."""

    def get_logits_ith(self, i: int) -> np.ndarray: ...


# --- candidate array ---------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _token_ids(n: int) -> np.ndarray:
    ids = np.arange(n, dtype=np.int32)
    ids.setflags(write=False)
    return ids


class _Full:
    """A TokenDataArray field (ids, logits, p), read or written after a view's row is expanded
    into the full arrays (held in the slot of the same name with a leading underscore)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, cur, owner=None):
        if cur is None:         # on the class (help(), introspection)
            return self
        if cur._row is not None:
            cur._materialize()
        return getattr(cur, self.slot)

    def __set__(self, cur, value: np.ndarray) -> None:
        cur._materialize()
        setattr(cur, self.slot, value)


class TokenDataArray:
    """Candidates for the next token: llama_token_data_array as parallel numpy arrays.

    ids (int32), logits (float32) and p (float32) have one entry per candidate;
    `selected` is an index into them (not a token id), -1 until a sampler chooses.

    A view of a logits row (`view_logits`) builds the vocabulary-sized arrays only when a
    sampler reads them: a first top-k takes its k candidates from the row itself (the copy,
    the ids and the zero probabilities of 49152 tokens cost more than the top-k, once per
    sequence and step).
    """

    __slots__ = ("_ids", "_logits", "_p", "_row", "sorted", "selected")
    ids = _Full()
    logits = _Full()
    p = _Full()

    def __init__(self, ids: np.ndarray, logits: np.ndarray, p: np.ndarray, sorted: bool = False,
                 selected: int = -1) -> None:
        self._ids, self._logits, self._p = ids, logits, p
        self._row: np.ndarray | None = None
        self.sorted = sorted
        self.selected = selected

    @classmethod
    def from_logits(cls, logits) -> TokenDataArray:
        """All tokens of a vocabulary row, ids 0..n-1, p 0, unsorted (a copy of the row)."""
        row = _checked_row(np.array(logits, dtype=_F32))
        return cls(ids=_token_ids(row.size), logits=row, p=np.zeros(row.size, dtype=_F32))

    @classmethod
    def view_logits(cls, logits) -> TokenDataArray:
        """As from_logits, for a row the caller leaves unchanged while the candidates are used
        (a context's output row): the row is copied only if a sampler needs all of it."""
        cur = cls.__new__(cls)
        cur._row, cur.sorted, cur.selected = _checked_row(np.asarray(logits, dtype=_F32)), False, -1
        return cur

    def _materialize(self) -> None:
        row, self._row = self._row, None
        if row is not None:
            self._ids, self._logits, self._p = _token_ids(row.size), np.array(row), np.zeros(row.size, dtype=_F32)

    @property
    def size(self) -> int:
        return int(self._row.size if self._row is not None else self._ids.size)

    def keep(self, index, *, sorted: bool) -> None:
        """Keep only the candidates at `index` (a slice or positions), in that order."""
        self._materialize()
        self._ids = self._ids[index]
        self._logits = self._logits[index]
        self._p = self._p[index]
        self.sorted = sorted

    def keep_top(self, k: int) -> None:
        """Keep the k highest logits, best first (ties by position): top-k's selection, taken
        from the row of a view without building the full arrays."""
        if self.sorted:
            self.keep(slice(0, k), sorted=True)
        elif self._row is not None:
            order = _top_k_order(self._row, k)
            self._ids, self._logits, self._p = order.astype(np.int32), self._row[order], np.zeros(order.size, _F32)
            self._row, self.sorted = None, True
        else:
            self.keep(_top_k_order(self._logits, k), sorted=True)

    def __repr__(self) -> str:
        return (f"TokenDataArray(ids={self.ids!r}, logits={self.logits!r}, p={self.p!r}, sorted={self.sorted}, "
                f"selected={self.selected})")


def _checked_row(row: np.ndarray) -> np.ndarray:
    """A logits row: ValueError unless it is a non-empty 1-D row without NaN."""
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"logits: expected a non-empty 1-D row, got shape {row.shape}")
    if np.isnan(row.max()):
        raise ValueError("logits: the row contains NaN")
    return row


def _sort_desc(logits: np.ndarray) -> np.ndarray:
    return np.argsort(-logits, kind="stable")


@functools.cache
def _native_top_k():
    """ggmlx.native.top_k, imported on first use: it imports JAX, which this module does not need."""
    from ggmlx import native
    return native.top_k


def _top_k_order(logits: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest logits, largest first, without sorting the whole row.

    A bound is taken from the maxima of groups of logits: the k-th largest group maximum is at
    most the k-th largest logit, so every logit >= bound is a candidate and there are at least k
    of them (typically about k). Only the candidates get sorted. The groups are strided (logit
    i in group i mod n_groups), so their maxima are one vectorized max over rows (contiguous
    groups reduced each on its own took half the sampler's time for SmolLM2's vocabulary).
    """
    n = logits.size
    if k >= n:
        return _sort_desc(logits)
    order = _native_top_k()(logits, k)  # the same positions in C (49152 logits, k 40: 26 -> 14 us a row)
    if order is not None:
        return order
    size = n // (8 * k)
    if size >= 16:
        n_groups = n // size
        maxima = logits[: n_groups * size].reshape(size, n_groups).max(axis=0)
        bound = np.partition(maxima, n_groups - k)[n_groups - k]
    else:
        bound = np.partition(logits, n - k)[n - k]
    cand = np.flatnonzero(logits >= bound)
    return cand[np.argsort(-logits[cand], kind="stable")[:k]]


def _softmax(cur: TokenDataArray, *, do_sort: bool) -> None:
    """llama_sampler_softmax_impl: p from logits (float32), optionally sorting first."""
    if do_sort and not cur.sorted:
        cur.keep(_sort_desc(cur.logits), sorted=True)
    max_l = cur.logits[0] if cur.sorted else cur.logits.max()
    e = np.exp(cur.logits - max_l)
    cur.p = e / e.sum(dtype=_F32)


def _temp_impl(cur: TokenDataArray, temp) -> None:
    """llama_sampler_temp_impl: divide logits by temp; temp <= 0 keeps only the first max."""
    if temp <= 0:
        best = int(np.argmax(cur.logits))
        masked = np.full(cur.size, -np.inf, dtype=_F32)
        masked[best] = cur.logits[best]
        cur.logits = masked
        return
    cur.logits = cur.logits / _F32(temp)


def _positions(cur: TokenDataArray, tokens: np.ndarray) -> np.ndarray:
    """Position of each token in `cur` (-1 where absent) without an O(V) Python loop.

    Like llama.cpp's logit-bias, first try position == id (true until something reorders
    the array), then search the rest.
    """
    pos = np.full(tokens.size, -1, dtype=np.int64)
    direct = (tokens >= 0) & (tokens < cur.size)
    direct[direct] = cur.ids[tokens[direct]] == tokens[direct]
    pos[direct] = tokens[direct]
    rest = np.flatnonzero(~direct)
    if rest.size:
        order = np.argsort(tokens[rest])
        wanted = tokens[rest][order]
        found = np.flatnonzero(np.isin(cur.ids, wanted))
        pos[rest[order[np.searchsorted(wanted, cur.ids[found])]]] = found
    return pos


# --- random numbers ------------------------------------------------------------------------


def _rng_seed(seed: int) -> int:
    """get_rng_seed: LLAMA_DEFAULT_SEED asks for a fresh random seed."""
    if seed == LLAMA_DEFAULT_SEED:
        return secrets.randbits(32)
    return seed


def _check_seed(name: str, seed: int) -> int:
    """A uint32_t seed, converted as C converts an int (so -1 is LLAMA_DEFAULT_SEED: random)."""
    return _int(f"{name}: seed", seed) & 0xFFFFFFFF


class _NoSeedSequence(np.random.bit_generator.ISeedSequence):
    """A seed sequence of zeros: MT19937's constructor draws its state from one, and _Mt19937.seed
    then replaces all of it, so SeedSequence's hashing (~150 us, twice per request with XTC in the
    chain) is skipped: a generator 370 -> 50 us."""

    def generate_state(self, n_words: int, dtype=np.uint32) -> np.ndarray:
        return np.zeros(n_words, dtype)


_NO_SEED = _NoSeedSequence()


class _Mt19937:
    """std::mt19937 with libstdc++'s uniform_real_distribution and discrete_distribution."""

    def __init__(self, seed: int) -> None:
        self.seed(seed)

    def seed(self, seed: int) -> None:
        # std::mt19937(seed): numpy's legacy seeding is the same Knuth initialiser of the 624 words
        self._bits = np.random.MT19937(_NO_SEED)  # type: ignore[arg-type]  # (any ISeedSequence at run time)
        self._bits._legacy_seeding(seed)

    def uniform_double(self) -> float:
        """uniform_real_distribution<double>(0, 1): two 32-bit draws, low word first."""
        lo, hi = self._bits.random_raw(2)
        r = (float(lo) + float(hi) * 4294967296.0) / 18446744073709551616.0
        return r if r < 1.0 else float(np.nextafter(1.0, 0.0))

    def uniform_float(self) -> float:
        """uniform_real_distribution<float>(0, 1): one 32-bit draw, float arithmetic."""
        r = _F32(self._bits.random_raw()) / _F32(4294967296.0)
        return float(r if r < 1 else np.nextafter(_F32(1), _F32(0)))

    def discrete(self, weights: np.ndarray) -> int:
        """discrete_distribution<int>(weights)(rng): normalised cumulative sums, lower_bound.

        Fewer than two weights draw nothing and return 0, as in libstdc++.
        """
        if weights.size < 2:
            return 0
        w = weights.astype(np.float64)
        cp = np.cumsum(w / np.cumsum(w)[-1])
        cp[-1] = 1.0
        return int(np.searchsorted(cp, self.uniform_double(), side="left"))


# --- parameter checks ----------------------------------------------------------------------
# Every value llama.cpp's samplers take is accepted, with llama.cpp's meaning (e.g. top_k <= 0,
# top_p >= 1, min_p <= 0: off; min_p > 1 or top_p <= 0: only the top token). Floats are held
# as float32, as llama.cpp holds them. Refused: NaN (no sampler gives it a meaning), a type
# that is not a number, and the few values on which llama.cpp crashes or divides by zero.


def _number(name: str, value) -> float:
    """A float parameter: any value but NaN, rounded to float32 (1e40 becomes inf, as in C)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    with np.errstate(over="ignore"):
        v = float(_F32(value))
    if np.isnan(v):
        raise ValueError(f"{name} must not be NaN")
    return v


def _int(name: str, value) -> int:
    """An int32_t parameter (any integer; what it means when negative is the sampler's)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _count(name: str, value, *, minimum: int = 0) -> int:
    """A size_t parameter (min_keep) or a size that must be at least `minimum`."""
    v = _int(name, value)
    if v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


# --- samplers ------------------------------------------------------------------------------


class Sampler(abc.ABC):
    """llama_sampler: apply to candidates, accept chosen tokens, reset, clone."""

    name: str

    @abc.abstractmethod
    def apply(self, cur: TokenDataArray) -> None:
        """Transform `cur` in place (reorder, drop, rewrite logits/p, or set `selected`)."""

    def accept(self, token: int) -> None:
        """Record a chosen token (only samplers with a history do anything)."""

    def reset(self) -> None:
        """Forget history and reseed, as at construction."""

    def rngs(self) -> list:
        """The random generators this sampler owns (saved and restored with the context state)."""
        return []

    def clone(self) -> Sampler:
        """An independent copy with the same parameters and state (RNG, history)."""
        return copy.deepcopy(self)

    def sample(self, ctx: LogitsSource, idx: int = -1) -> int:
        """llama_sampler_sample: read logits row `idx` of `ctx`, apply, accept, return the token."""
        cur = TokenDataArray.view_logits(ctx.get_logits_ith(idx))
        self.apply(cur)
        if not 0 <= cur.selected < cur.size:
            raise ValueError(f"{self.name}: no token selected; end the chain with greedy, dist, "
                             "mirostat or mirostat_v2")
        token = int(cur.ids[cur.selected])
        self.accept(token)
        return token


class Greedy(Sampler):
    """Select the candidate with the highest logit (the first one on ties)."""

    name = "greedy"

    def apply(self, cur: TokenDataArray) -> None:
        cur.selected = int(np.argmax(cur.logits))


class Dist(Sampler):
    """Sample from softmax(logits) with a seeded std::mt19937 (llama_sampler_init_dist)."""

    name = "dist"

    def __init__(self, seed: int = LLAMA_DEFAULT_SEED) -> None:
        self.seed = _check_seed("dist", seed)
        self.seed_cur = _rng_seed(self.seed)
        self.rng = _Mt19937(self.seed_cur)

    def apply(self, cur: TokenDataArray) -> None:
        if cur.size == 0:
            cur.selected = -1
            return
        # one draw per call even for a single candidate, so the stream does not depend on size
        rnd = self.rng.uniform_double()
        if cur.size == 1:
            cur.p = np.ones(1, dtype=_F32)
            cur.selected = 0
            return
        max_l = cur.logits[0] if cur.sorted else cur.logits.max()
        e = cur.logits - max_l
        np.exp(e, out=e)
        buf = e.astype(np.float64)
        np.cumsum(buf, out=buf)                 # sequential double sums, as llama.cpp's loop
        total = buf[-1]
        cur.selected = min(int(np.searchsorted(buf, total * rnd, side="left")), cur.size - 1)
        np.divide(e, total, out=buf)            # float p / double sum, rounded back to float
        cur.p = buf.astype(_F32)

    def rngs(self) -> list:
        return [self.rng]

    def reset(self) -> None:
        self.seed_cur = _rng_seed(self.seed)
        self.rng.seed(self.seed_cur)


class TopK(Sampler):
    """Keep the k highest logits, sorted (a partial sort). k <= 0 keeps everything."""

    name = "top-k"

    def __init__(self, k: int) -> None:
        self.k = _int("top_k: k", k)

    def apply(self, cur: TokenDataArray) -> None:
        if self.k <= 0:
            return
        cur.keep_top(min(self.k, cur.size))


class TopP(Sampler):
    """Nucleus: the smallest best-first prefix whose probability reaches p (at least min_keep).
    p >= 1 keeps everything; p <= 0 keeps the top token (or min_keep)."""

    name = "top-p"

    def __init__(self, p: float, min_keep: int = 1) -> None:
        self.p = _number("top_p: p", p)
        self.min_keep = _count("top_p: min_keep", min_keep)

    def apply(self, cur: TokenDataArray) -> None:
        if self.p >= 1.0:
            return
        _softmax(cur, do_sort=False)
        if cur.sorted:
            order = None
            last = self._cut(cur.p)
        else:
            # like llama.cpp: try the best 256 first, sort everything only if they fall short
            k = _TOP_P_TRY if cur.size > _TOP_P_SORT_ALL else cur.size
            order = _top_k_order(cur.logits, k)
            last = self._cut(cur.p[order])
            if last is None and k < cur.size:
                order = _sort_desc(cur.logits)
                last = self._cut(cur.p[order])
        if last is None:
            last = cur.size
        cur.keep(slice(0, last) if order is None else order[:last], sorted=True)

    def _cut(self, p_sorted: np.ndarray) -> int | None:
        cum = np.cumsum(p_sorted, dtype=_F32)
        first = max(self.min_keep - 1, 0)
        hits = np.flatnonzero(cum[first:] >= _F32(self.p))
        return first + int(hits[0]) + 1 if hits.size else None


class MinP(Sampler):
    """Keep candidates with p >= p_min * p_max, i.e. logit >= max logit + log(p_min).
    p_min <= 0 keeps everything; p_min > 1 keeps the top token (or min_keep)."""

    name = "min-p"

    def __init__(self, p: float, min_keep: int = 1) -> None:
        self.p = _number("min_p: p", p)
        self.min_keep = _count("min_p: min_keep", min_keep)

    def apply(self, cur: TokenDataArray) -> None:
        if self.p <= 0.0 or cur.size == 0:
            return
        log_p = np.log(_F32(self.p))
        if not cur.sorted:
            keep = cur.logits >= cur.logits.max() + log_p
            n = int(np.count_nonzero(keep))
            if n > 0 and n >= self.min_keep:
                cur.keep(np.flatnonzero(keep), sorted=False)
                return
            cur.keep(_sort_desc(cur.logits), sorted=True)
        start = max(1, self.min_keep)
        below = np.flatnonzero(cur.logits[start:] < cur.logits[0] + log_p)
        cur.keep(slice(0, start + int(below[0]) if below.size else cur.size), sorted=True)


class Typical(Sampler):
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy.
    p >= 1 keeps everything; p <= 0 keeps the most typical token (or min_keep)."""

    name = "typical"

    def __init__(self, p: float, min_keep: int = 1) -> None:
        self.p = _number("typical: p", p)
        self.min_keep = _count("typical: min_keep", min_keep)

    def apply(self, cur: TokenDataArray) -> None:
        if self.p >= 1.0:
            return
        _softmax(cur, do_sort=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_p = np.log(cur.p)
            entropy = -np.where(cur.p > 0, cur.p * log_p, _F32(0)).sum(dtype=_F32)
            shifted = np.abs(-log_p - entropy)
        order = np.argsort(shifted, kind="stable")
        cum = np.cumsum(cur.p[order], dtype=_F32)
        first = max(self.min_keep - 1, 0)
        hits = np.flatnonzero(cum[first:] > _F32(self.p))
        last = first + int(hits[0]) + 1 if hits.size else cur.size
        cur.keep(order[:last], sorted=False)


class Temp(Sampler):
    """Divide logits by t; t <= 0 keeps only the highest logit (the rest become -inf)."""

    name = "temp"

    def __init__(self, t: float) -> None:
        self.t = _number("temp: t", t)

    def apply(self, cur: TokenDataArray) -> None:
        _temp_impl(cur, self.t)


class TempExt(Sampler):
    """Dynamic temperature: t +- delta, chosen from the normalised entropy ** exponent;
    delta <= 0 is plain temp(t)."""

    name = "temp-ext"

    def __init__(self, t: float, delta: float, exponent: float) -> None:
        self.t = _number("temp_ext: t", t)
        self.delta = _number("temp_ext: delta", delta)
        self.exponent = _number("temp_ext: exponent", exponent)

    def apply(self, cur: TokenDataArray) -> None:
        if self.delta <= 0:
            _temp_impl(cur, self.t)
            return
        if cur.size <= 1:
            return
        t, delta = _F32(self.t), _F32(self.delta)
        min_temp = max(_F32(0), t - delta)
        max_temp = t + delta
        max_entropy = -np.log(_F32(1) / _F32(cur.size))
        _softmax(cur, do_sort=True)
        nz = cur.p[cur.p > 0]
        entropy = -(nz * np.log(nz)).sum(dtype=_F32)
        dyn_temp = min_temp + (max_temp - min_temp) * (entropy / max_entropy) ** _F32(self.exponent)
        _temp_impl(cur, dyn_temp)
        e = np.exp(cur.logits.astype(np.float64) - np.float64(cur.logits[0]))
        cur.p = (e / e.sum()).astype(_F32)


class Xtc(Sampler):
    """Exclude Top Choices: with chance `p`, drop every token with p >= t except the least likely.
    p <= 0 or t > 0.5 is off; p >= 1 always applies; t <= 0 leaves only the least likely token."""

    name = "xtc"

    def __init__(self, p: float, t: float, min_keep: int = 1, seed: int = LLAMA_DEFAULT_SEED) -> None:
        self.probability = _number("xtc: p", p)
        self.threshold = _number("xtc: t", t)
        self.min_keep = _count("xtc: min_keep", min_keep)
        self.seed = _check_seed("xtc", seed)
        self.seed_cur = _rng_seed(self.seed)
        self.rng = _Mt19937(self.seed_cur)

    def apply(self, cur: TokenDataArray) -> None:
        # a threshold above 0.5 can never cover two tokens: XTC is off
        if self.probability <= 0.0 or self.threshold > 0.5 or cur.size < 2:
            return
        if self.rng.uniform_float() > self.probability:
            return
        _softmax(cur, do_sort=True)
        below = np.flatnonzero(cur.p < _F32(self.threshold))
        n_above = int(below[0]) if below.size else cur.size
        pos_last = max(n_above - 1, 0)
        if cur.size - pos_last >= self.min_keep and pos_last > 0:
            cur.keep(slice(pos_last, None), sorted=True)

    def rngs(self) -> list:
        return [self.rng]

    def reset(self) -> None:
        self.seed_cur = _rng_seed(self.seed)
        self.rng.seed(self.seed_cur)


class TopNSigma(Sampler):
    """Keep logits within n standard deviations of the max (others -inf); n <= 0 is off."""

    name = "top-n-sigma"

    def __init__(self, n: float) -> None:
        self.n = _number("top_n_sigma: n", n)

    def apply(self, cur: TokenDataArray) -> None:
        if self.n <= 0.0 or cur.size <= 1:
            return
        valid = cur.logits[cur.logits != -np.inf]
        if valid.size:
            mean = valid.sum(dtype=_F32) / _F32(valid.size)
            std = np.sqrt(((valid - mean) ** 2).sum(dtype=_F32) / _F32(valid.size))
            with np.errstate(invalid="ignore"):     # n = inf with std 0: no cut, as in C
                cut = cur.logits.max() - _F32(self.n) * std
            cur.logits = np.where(cur.logits < cut, _F32(-np.inf), cur.logits)
        _softmax(cur, do_sort=False)


class _MirostatBase(Sampler):
    """What both mirostat versions share: seeded draws and the mu update toward tau."""

    def __init__(self, label: str, seed: int, tau: float, eta: float) -> None:
        self.seed = _check_seed(label, seed)
        self.tau = _number(f"{label}: tau", tau)
        self.eta = _number(f"{label}: eta", eta)
        self.seed_cur = _rng_seed(self.seed)
        self.rng = _Mt19937(self.seed_cur)
        self.mu = _F32(2.0) * _F32(self.tau)

    def _select(self, cur: TokenDataArray) -> None:
        """Draw from the (sorted, normalised) candidates and move mu by eta * (surprise - tau)."""
        idx = self.rng.discrete(cur.p)
        cur.selected = idx
        surprise = -np.log2(cur.p[idx])
        self.mu = _F32(self.mu - _F32(self.eta) * (surprise - _F32(self.tau)))

    def rngs(self) -> list:
        return [self.rng]

    def reset(self) -> None:
        self.mu = _F32(2.0) * _F32(self.tau)
        self.seed_cur = _rng_seed(self.seed)
        self.rng.seed(self.seed_cur)


class Mirostat(_MirostatBase):
    """Mirostat 1.0: estimate Zipf's s from the top m tokens, pick top-k for target surprise tau.
    m <= 0 estimates from all candidates; m == 1 estimates nothing, so keeps the top token."""

    name = "mirostat"

    def __init__(self, n_vocab: int, seed: int, tau: float, eta: float, m: int = 100) -> None:
        super().__init__("mirostat", seed, tau, eta)
        self.n_vocab = _count("mirostat: n_vocab", n_vocab, minimum=1)
        self.m = _int("mirostat: m", m)

    def apply(self, cur: TokenDataArray) -> None:
        _softmax(cur, do_sort=False)
        m = cur.size if self.m <= 0 else min(self.m, cur.size)    # C: size_t(m - 1) wraps for m <= 0
        head = cur.p[_top_k_order(cur.logits, m)]
        i = np.arange(head.size - 1, dtype=_F32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            t_i = np.log((i + _F32(2)) / (i + _F32(1)))
            b_i = np.log(head[:-1] / head[1:])
            s_hat = (t_i * b_i).sum(dtype=_F32) / (t_i * t_i).sum(dtype=_F32)
            eps = s_hat - _F32(1)
            k = ((eps * _F32(2) ** self.mu) / (_F32(1) - _F32(self.n_vocab) ** -eps)) ** (_F32(1) / s_hat)
        # llama.cpp converts with int(k); on x86 a NaN/inf/huge k becomes INT_MIN, then max(.., 1)
        k_int = int(k) if np.isfinite(k) and k < 2 ** 31 else 1
        k_int = min(max(k_int, 1), cur.size)
        cur.keep(_top_k_order(cur.logits, k_int), sorted=True)
        _softmax(cur, do_sort=True)
        self._select(cur)


class MirostatV2(_MirostatBase):
    """Mirostat 2.0: keep tokens with surprise -log2(p) <= mu, sample, move mu toward tau."""

    name = "mirostat-v2"

    def __init__(self, seed: int, tau: float, eta: float) -> None:
        super().__init__("mirostat_v2", seed, tau, eta)

    def apply(self, cur: TokenDataArray) -> None:
        _softmax(cur, do_sort=False)
        with np.errstate(divide="ignore"):
            n_keep = int(np.count_nonzero(-np.log2(cur.p) <= self.mu))
        cur.keep(_top_k_order(cur.logits, max(n_keep, 1)), sorted=True)
        _softmax(cur, do_sort=True)
        self._select(cur)


class Penalties(Sampler):
    """Repeat / frequency / presence penalties over the last `last_n` accepted tokens.

    repeat divides a positive logit (multiplies a negative one); freq subtracts
    count * freq; presence subtracts presence once. Only tokens in the history are touched.
    last_n <= 0 is off (llama_sampler_init_penalties clamps it to 0; -1 = context size is
    resolved by SamplerChain.from_params, as llama.cpp's common layer does).
    """

    name = "penalties"

    def __init__(self, last_n: int, repeat: float, freq: float, presence: float) -> None:
        self.last_n = max(_int("penalties: last_n", last_n), 0)
        self.repeat = _number("penalties: repeat", repeat)
        if self.repeat == 0:
            raise ValueError("penalties: repeat must not be 0 (it divides positive logits; 1 = off)")
        self.freq = _number("penalties: freq", freq)
        self.presence = _number("penalties: presence", presence)
        self.prev: collections.deque[int] = collections.deque(maxlen=max(self.last_n, 1))
        self.token_count: dict[int, int] = {}

    def accept(self, token: int) -> None:
        if self.last_n == 0:
            return
        token = int(token)
        self.token_count[token] = self.token_count.get(token, 0) + 1
        if len(self.prev) >= self.last_n:
            old = self.prev[0]
            self.token_count[old] -= 1
            if self.token_count[old] == 0:
                del self.token_count[old]
        self.prev.append(token)

    def apply(self, cur: TokenDataArray) -> None:
        if self.last_n == 0 or (self.repeat == 1.0 and self.freq == 0.0 and self.presence == 0.0):
            return
        tokens = np.fromiter(self.token_count.keys(), dtype=np.int64, count=len(self.token_count))
        counts = np.fromiter(self.token_count.values(), dtype=_F32, count=len(self.token_count))
        pos = _positions(cur, tokens)
        found = pos >= 0
        pos, counts = pos[found], counts[found]
        logit = cur.logits[pos]
        repeat = _F32(self.repeat)
        logit = np.where(logit <= 0, logit * repeat, logit / repeat)
        logit = logit - (counts * _F32(self.freq) + _F32(self.presence))
        cur.logits[pos] = logit
        cur.sorted = False

    def reset(self) -> None:
        self.prev.clear()
        self.token_count.clear()


class Dry(Sampler):
    """DRY ("Don't Repeat Yourself"): penalise tokens that would extend a repeated sequence.

    `breakers` are token sequences (head token then tail) that end a repetition, the form
    llama.cpp keeps after processing its string breakers; `dry(...)` builds them from
    strings. A token extending a repeat of length L >= allowed_length gets
    logit -= multiplier * base ** (L - allowed_length). Off when multiplier == 0, base < 1 or
    penalty_last_n == 0; penalty_last_n == -1 means n_ctx_train.
    """

    name = "dry"

    def __init__(self, multiplier: float, base: float, allowed_length: int, penalty_last_n: int,
                 breakers: Sequence[Sequence[int]] = (), *, n_ctx_train: int) -> None:
        self.multiplier = _number("dry: multiplier", multiplier)
        self.base = _number("dry: base", base)
        self.allowed_length = _int("dry: allowed_length", allowed_length)
        self.penalty_last_n = _int("dry: penalty_last_n", penalty_last_n)
        self.n_ctx_train = _int("dry: n_ctx_train", n_ctx_train)
        self.enabled = self.multiplier != 0.0 and self.base >= 1.0 and self.penalty_last_n != 0
        effective = self.n_ctx_train if self.penalty_last_n == -1 else max(self.penalty_last_n, 0)
        if self.enabled and effective < 1:
            # llama.cpp gives DRY a history of 0 tokens here and throws on the first accept
            raise ValueError(f"dry: penalty_last_n = {penalty_last_n} with n_ctx_train = {n_ctx_train} leaves "
                             "no history; use -1 (n_ctx_train, which must be >= 1) or a count >= 1")
        self.breakers: dict[int, list[tuple[int, ...]]] = {}
        for i, seq in enumerate(breakers):
            seq = tuple(int(t) for t in seq)
            if not seq:
                logger.warning("dry: skipping empty sequence breaker %d", i)
                continue
            tails = self.breakers.setdefault(seq[0], [])
            if seq[1:] not in tails:
                tails.append(seq[1:])
        self.last_tokens: collections.deque[int] = collections.deque(maxlen=max(effective, 1))

    def accept(self, token: int) -> None:
        if self.enabled:
            self.last_tokens.append(int(token))

    def reset(self) -> None:
        self.last_tokens.clear()

    def apply(self, cur: TokenDataArray) -> None:
        if not self.enabled:
            return
        effective = self.n_ctx_train if self.penalty_last_n == -1 else self.penalty_last_n
        n = min(len(self.last_tokens), effective, self.n_ctx_train)
        if n <= self.allowed_length or n <= 0:
            return
        recent = list(self.last_tokens)[-n:][::-1]      # recent[i]: i tokens back from the end
        rep_limit = self._repeat_limit(recent)
        if rep_limit < self.allowed_length:
            return
        repeat_count = self._repeat_counts(recent, rep_limit)
        max_repeat: dict[int, int] = {}
        for i in range(n - 1):
            length = repeat_count[i]
            if length >= self.allowed_length:
                # the token right after this repeated span would continue the repeat
                token = recent[n - 2 - i]
                if max_repeat.get(token, -1) < length:
                    max_repeat[token] = length
        self._penalise(cur, max_repeat)
        cur.sorted = False

    def _repeat_limit(self, recent: list[int]) -> int:
        """Step 1: the nearest restart (breaker) sequence caps how far back a repeat can reach."""
        for i, token in enumerate(recent):
            longest = -1
            for tail in self.breakers.get(token, ()):
                if longest < len(tail) <= i and all(tail[o] == recent[i - o - 1] for o in range(len(tail))):
                    longest = len(tail)
            if longest >= 0:
                return i - longest
        return len(recent)

    @staticmethod
    def _repeat_counts(recent: list[int], rep_limit: int) -> list[int]:
        """Step 2: reverse Z-algorithm; count[n-1-k] = length of the suffix repeated k back."""
        n = len(recent)
        last = n - 1
        count = [0] * n
        lt = rt = 0
        for k in range(1, n):
            if k > rt:
                m = 0
                while m + k < n and recent[m] == recent[m + k]:
                    m += 1
                count[last - k] = min(m, rep_limit)
                if m > 0:
                    lt, rt = k, k + m - 1
            else:
                p = k - lt
                if count[last - p] < rt - k + 1:
                    count[last - k] = min(count[last - p], rep_limit)
                else:
                    i = rt + 1
                    while i < n and recent[i] == recent[i - k]:
                        i += 1
                    count[last - k] = min(i - k, rep_limit)
                    lt, rt = k, i - 1
        return count

    def _penalise(self, cur: TokenDataArray, max_repeat: dict[int, int]) -> None:
        """Step 4: exponential penalty, except for single-token breakers."""
        tokens = [t for t in max_repeat if () not in self.breakers.get(t, ())]
        if not tokens:
            return
        pos = _positions(cur, np.array(tokens, dtype=np.int64))
        max_exponent = 0
        if self.base > 1.000001:
            max_exponent = int(_FLOAT_MAX_LOG / np.log(_F32(self.base)))
        for token, at in zip(tokens, pos, strict=False):
            if at < 0:
                continue
            exponent = max_repeat[token] - self.allowed_length
            if max_exponent > 0:
                exponent = min(exponent, max_exponent)
            penalty = _F32(float(_F32(self.multiplier)) * float(_F32(self.base)) ** exponent)
            cur.logits[at] = cur.logits[at] - penalty


class LogitBias(Sampler):
    """Add a fixed bias to the logits of chosen tokens (-inf bans a token)."""

    name = "logit-bias"

    def __init__(self, n_vocab: int, biases: Mapping[int, float]) -> None:
        self.n_vocab = _count("logit_bias: n_vocab", n_vocab, minimum=1)
        for token, bias in biases.items():
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < self.n_vocab:
                raise ValueError(f"logit_bias: token {token!r} is outside the vocabulary [0, {self.n_vocab})")
            if np.isnan(bias) or bias == np.inf:
                raise ValueError(f"logit_bias: bias for token {token} must be a number or -inf, got {bias!r}")
        self.tokens = np.array(list(biases.keys()), dtype=np.int64)
        self.biases = np.array(list(biases.values()), dtype=_F32)

    def apply(self, cur: TokenDataArray) -> None:
        if self.tokens.size == 0:
            return
        pos = _positions(cur, self.tokens)
        found = pos >= 0
        cur.logits[pos[found]] += self.biases[found]


# --- llama_sampler_init_*: the constructors under llama.cpp's names and keyword names ------


def greedy() -> Greedy:
    """llama_sampler_init_greedy: always the highest-logit candidate."""
    return Greedy()


def dist(seed: int = LLAMA_DEFAULT_SEED) -> Dist:
    """llama_sampler_init_dist: a draw from the softmax of the candidates."""
    return Dist(seed)


def top_k(k: int) -> TopK:
    """llama_sampler_init_top_k."""
    return TopK(k)


def top_p(p: float, min_keep: int = 1) -> TopP:
    """llama_sampler_init_top_p."""
    return TopP(p, min_keep)


def min_p(p: float, min_keep: int = 1) -> MinP:
    """llama_sampler_init_min_p."""
    return MinP(p, min_keep)


def typical(p: float, min_keep: int = 1) -> Typical:
    """llama_sampler_init_typical."""
    return Typical(p, min_keep)


def temp(t: float) -> Temp:
    """llama_sampler_init_temp."""
    return Temp(t)


def temp_ext(t: float, delta: float, exponent: float) -> TempExt:
    """llama_sampler_init_temp_ext: dynamic temperature in [t - delta, t + delta]."""
    return TempExt(t, delta, exponent)


def xtc(p: float, t: float, min_keep: int = 1, seed: int = LLAMA_DEFAULT_SEED) -> Xtc:
    """llama_sampler_init_xtc."""
    return Xtc(p, t, min_keep, seed)


def top_n_sigma(n: float) -> TopNSigma:
    """llama_sampler_init_top_n_sigma."""
    return TopNSigma(n)


def mirostat(n_vocab: int, seed: int, tau: float, eta: float, m: int = 100) -> Mirostat:
    """llama_sampler_init_mirostat."""
    return Mirostat(n_vocab, seed, tau, eta, m)


def mirostat_v2(seed: int, tau: float, eta: float) -> MirostatV2:
    """llama_sampler_init_mirostat_v2."""
    return MirostatV2(seed, tau, eta)


def penalties(penalty_last_n: int, penalty_repeat: float, penalty_freq: float, penalty_present: float) -> Penalties:
    """llama_sampler_init_penalties."""
    return Penalties(penalty_last_n, penalty_repeat, penalty_freq, penalty_present)


def logit_bias(n_vocab: int, logit_bias: Mapping[int, float] | Sequence[tuple[int, float]]) -> LogitBias:
    """llama_sampler_init_logit_bias: a {token: bias} mapping or (token, bias) pairs, as
    llama_logit_bias entries; a token listed twice adds its biases, as llama.cpp applies each entry."""
    if isinstance(logit_bias, Mapping):
        return LogitBias(n_vocab, logit_bias)
    summed: dict[int, float] = {}
    for token, bias in logit_bias:
        summed[token] = summed.get(token, 0.0) + bias
    return LogitBias(n_vocab, summed)


def dry(multiplier: float = 0.0, base: float = 1.75, allowed_length: int = 2, penalty_last_n: int = 64,
        seq_breakers: Sequence[str] = ("\n", ":", "\"", "*"), *, n_ctx_train: int,
        token_pieces: Sequence[bytes] | None = None,
        tokenize: Callable[[str], list[int]] | None = None) -> Dry:
    """llama_sampler_init_dry(vocab, n_ctx_train, ...): a Dry sampler with string breakers.

    Breakers are matched against the vocabulary like llama.cpp: every token whose text
    contains a breaker is a single-token breaker; a token whose text ends with the start of
    a breaker becomes a head, with the rest of the breaker tokenized as its tail.
    `token_pieces[id]` is the text of token id (e.g. `vocab.token_to_piece(id, special=True)`);
    `tokenize(text)` is needed only for breakers longer than one byte
    (e.g. `lambda s: vocab.tokenize(s, add_special=False, parse_special=False)`).
    Breakers are processed only when DRY is enabled, as in llama.cpp.
    """
    enabled = multiplier != 0.0 and base >= 1.0 and penalty_last_n != 0
    breakers: list[tuple[int, ...]] = []
    if enabled and seq_breakers:
        if token_pieces is None:
            raise ValueError("dry: token_pieces is required to process seq_breakers")
        for i, text in enumerate(seq_breakers):
            pattern = text.encode("utf-8")[:_DRY_MAX_CHAR_LEN]
            if not pattern:
                logger.warning("dry: skipping empty sequence breaker %d", i)
                continue
            if len(pattern) > 1 and tokenize is None:
                raise ValueError(f"dry: seq_breakers[{i}] {text!r} is longer than one byte; pass tokenize")
            breakers.extend(_overlapping_token_sequences(token_pieces, pattern, tokenize))
    return Dry(multiplier, base, allowed_length, penalty_last_n, breakers, n_ctx_train=n_ctx_train)


def _overlapping_token_sequences(token_pieces: Sequence[bytes], pattern: bytes,
                                 tokenize: Callable[[str], list[int]] | None) -> list[tuple[int, ...]]:
    """get_overlapping_token_sequences: (head, *tail) for every token that can start `pattern`.

    Vectorised over the whole vocabulary: the pieces are joined into one byte array and
    matched there, since a Python loop over 262144 pieces per breaker takes a second.
    """
    lengths = np.fromiter(map(len, token_pieces), dtype=np.int64, count=len(token_pieces))
    ends = np.cumsum(lengths)
    text = np.frombuffer(b"".join(token_pieces), dtype=np.uint8)
    want = np.frombuffer(pattern, dtype=np.uint8)
    # tokens whose piece contains the whole pattern are single-token breakers
    n_at = text.size - want.size + 1
    match = np.ones(max(n_at, 0), dtype=bool)
    for m, byte in enumerate(want):
        match &= text[m:m + n_at] == byte
    at = np.flatnonzero(match)
    owner = np.searchsorted(ends, at, side="right")
    contains = np.unique(owner[at + want.size <= ends[owner]])
    out: list[tuple[int, ...]] = [(int(t),) for t in contains]
    # a piece that ends with pattern[:j] starts the pattern; the rest follows as tokens
    partial = np.ones(lengths.size, dtype=bool)
    partial[contains] = False
    for j in range(want.size - 1, 0, -1):
        heads = np.flatnonzero(partial & (lengths >= j))
        for m in range(j):
            heads = heads[text[ends[heads] - j + m] == want[m]]
        if heads.size:
            assert tokenize is not None   # dry() requires it for multi-byte breakers
            tail = tuple(tokenize(pattern[j:].decode("utf-8", errors="replace"))[:_DRY_MAX_SEQ_LEN])
            out.extend((int(t), *tail) for t in heads)
    return out


# --- chain ---------------------------------------------------------------------------------


SAMPLER_TYPES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


def _sampler_names(text: str) -> tuple[str, ...]:
    """--samplers: names separated by ';' (llama.cpp's common_sampler_types_from_names)."""
    return tuple(n for n in text.split(";") if n)


def _breaker(text: str) -> tuple[str, ...]:
    """--dry-sequence-breaker: one breaker; "none" clears them."""
    return () if text == "none" else (text,)


def _bias(text: str) -> dict[int, float]:
    """--logit-bias TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-1."""
    for i in range(1, len(text)):
        if text[i] in "+-" and text[:i].isdigit():
            try:
                bias = float(text[i + 1:])
            except ValueError:
                break
            return {int(text[:i]): bias if text[i] == "+" else -bias}
    raise ValueError(f"--logit-bias {text!r}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1")


@dataclass
class SamplingParams:
    """common_params_sampling: what the default chain is built from, with llama.cpp's defaults.

    Each field is declared once with its llama.cpp flag and llama-server request name (see
    llm/params.py): the CLI, `LLM.generate`'s keyword arguments and the server's request fields
    come from here. Bounds are declared only where llama.cpp refuses a value (it takes top_p 2 or
    top_k -1 as "off"). A seed of -1 or LLAMA_DEFAULT_SEED draws a random one."""

    seed: int = param(-1, flags=("-s", "--seed"), lo=-1, hi=0xFFFFFFFF,
                      help="RNG seed (-1: random)")
    min_keep: int = param(0, flags=("--min-keep",), help="tokens each sampler keeps at least (0 = off)")
    top_k: int = param(40, flags=("--top-k",), help="top-k sampling (<= 0 = off)")
    top_p: float = param(0.95, flags=("--top-p",), help="top-p sampling (1.0 = off)")
    min_p: float = param(0.05, flags=("--min-p",), help="min-p sampling (0.0 = off)")
    xtc_probability: float = param(0.0, flags=("--xtc-probability",),
                                   help="xtc probability (0.0 = off)")
    xtc_threshold: float = param(0.10, flags=("--xtc-threshold",),
                                 help="xtc threshold (> 0.5 = off)")
    typ_p: float = param(1.0, flags=("--typical", "--typical-p"), name="typical_p",
                         help="locally typical sampling, parameter p (1.0 = off)")
    temp: float = param(0.80, flags=("--temp", "--temperature"), name="temperature",
                        help="temperature (0 = greedy)")
    dynatemp_range: float = param(0.0, flags=("--dynatemp-range",),
                                  help="dynamic temperature range (0.0 = off)")
    dynatemp_exponent: float = param(1.0, flags=("--dynatemp-exp",), name="dynatemp_exponent",
                                     help="dynamic temperature exponent")
    penalty_last_n: int = param(64, flags=("--repeat-last-n",), name="repeat_last_n", lo=-1,
                                help="last n tokens to consider for the penalties (0 = off, -1 = context size)")
    penalty_repeat: float = param(1.0, flags=("--repeat-penalty",), name="repeat_penalty",
                                  help="penalize repeated tokens (1.0 = off)")
    penalty_freq: float = param(0.0, flags=("--frequency-penalty",), name="frequency_penalty",
                                help="repeat alpha frequency penalty (0.0 = off)")
    penalty_present: float = param(0.0, flags=("--presence-penalty",), name="presence_penalty",
                                   help="repeat alpha presence penalty (0.0 = off)")
    dry_multiplier: float = param(0.0, flags=("--dry-multiplier",), help="DRY sampling multiplier (0.0 = off)")
    dry_base: float = param(1.75, flags=("--dry-base",), help="DRY sampling base value (below 1 = off)")
    dry_allowed_length: int = param(2, flags=("--dry-allowed-length",), help="allowed length for DRY sampling")
    dry_penalty_last_n: int = param(64, flags=("--dry-penalty-last-n",), lo=-1,
                                    help="DRY penalty for the last n tokens (0 = off, -1 = context size)")
    mirostat: int = param(0, flags=("--mirostat",), lo=0, hi=2,
                          help="Mirostat sampling (0 = off, 1 = Mirostat, 2 = Mirostat 2.0); replaces the chain")
    top_n_sigma: float = param(-1.0, flags=("--top-nsigma", "--top-n-sigma"), help="top-n-sigma sampling (-1.0 = off)")
    mirostat_tau: float = param(5.0, flags=("--mirostat-ent",), help="Mirostat target entropy, parameter tau")
    mirostat_eta: float = param(0.1, flags=("--mirostat-lr",), help="Mirostat learning rate, parameter eta")
    dry_sequence_breakers: tuple[str, ...] = param(
        ("\n", ":", "\"", "*"), flags=("--dry-sequence-breaker",), parse=_breaker, append=True, metavar="STRING",
        help="a sequence breaker for DRY sampling (repeatable; replaces the defaults; \"none\" = no breakers)")
    samplers: tuple[str, ...] = param(SAMPLER_TYPES, flags=("--samplers",), parse=_sampler_names, choices=SAMPLER_TYPES,
                                      metavar="SAMPLERS", help="samplers in order, separated by ';'")
    logit_bias: dict[int, float] = param(default_factory=dict, flags=("-l", "--logit-bias"), parse=_bias,
                                         append=True, metavar="TOKEN_ID(+/-)BIAS",
                                         help="change the likelihood of a token (repeatable)")

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = LLAMA_DEFAULT_SEED


class SamplerChain(Sampler):
    """llama_sampler_chain: samplers applied in order; accept goes to each of them."""

    name = "chain"

    def __init__(self, samplers: Sequence[Sampler] = ()) -> None:
        self.samplers: list[Sampler] = list(samplers)
        self.t_sample_us = 0.0
        self.n_sample = 0

    def add(self, smpl: Sampler) -> SamplerChain:
        """llama_sampler_chain_add; returns the chain so adds can be chained."""
        self.samplers.append(smpl)
        return self

    def remove(self, i: int) -> Sampler:
        """llama_sampler_chain_remove: take sampler i out of the chain and return it."""
        if not 0 <= i < len(self.samplers):
            raise IndexError(f"chain: no sampler at index {i} (chain has {len(self.samplers)})")
        return self.samplers.pop(i)

    def apply(self, cur: TokenDataArray) -> None:
        t0 = time.perf_counter()
        for smpl in self.samplers:
            smpl.apply(cur)
        self.t_sample_us += (time.perf_counter() - t0) * 1e6

    def accept(self, token: int) -> None:
        t0 = time.perf_counter()
        for smpl in self.samplers:
            smpl.accept(token)
        self.n_sample += 1
        self.t_sample_us += (time.perf_counter() - t0) * 1e6

    def reset(self) -> None:
        for smpl in self.samplers:
            smpl.reset()

    def rngs(self) -> list:
        return [rng for smpl in self.samplers for rng in smpl.rngs()]

    def clone(self) -> SamplerChain:
        return SamplerChain([smpl.clone() for smpl in self.samplers])

    def get_seed(self) -> int:
        """llama_sampler_get_seed: the seed in use by the last seeded sampler, else the default."""
        for smpl in reversed(self.samplers):
            if isinstance(smpl, (Dist, _MirostatBase)):
                return smpl.seed_cur
        return LLAMA_DEFAULT_SEED

    def perf(self) -> dict:
        """llama_perf_sampler: time spent in apply/accept and the number of accepted tokens."""
        return {"t_sample_ms": self.t_sample_us / 1e3, "n_sample": self.n_sample}

    def perf_reset(self) -> None:
        self.t_sample_us = 0.0
        self.n_sample = 0

    @classmethod
    def from_params(cls, params: SamplingParams, *, n_vocab: int, n_ctx: int = 0, n_ctx_train: int = 0,
                    token_pieces: Sequence[bytes] | None = None,
                    tokenize: Callable[[str], list[int]] | None = None) -> SamplerChain:
        """common_sampler_init: logit-bias, then params.samplers in order and dist (or mirostat).

        As llama.cpp's common layer, penalty_last_n / dry_penalty_last_n = -1 mean the context
        size n_ctx (needed only then) and values below -1 are refused. n_ctx_train,
        token_pieces and tokenize are only needed when DRY is enabled.
        """
        with _blame(params, "penalty_last_n"):
            last_n = _last_n("penalty_last_n", params.penalty_last_n, n_ctx)
        with _blame(params, "dry_penalty_last_n"):
            dry_last_n = _last_n("dry_penalty_last_n", params.dry_penalty_last_n, n_ctx)
        params = dataclasses.replace(params, penalty_last_n=last_n, dry_penalty_last_n=dry_last_n)
        chain = cls()
        if params.logit_bias:
            with _blame(params, "logit_bias"):
                chain.add(LogitBias(n_vocab, params.logit_bias))
        if params.mirostat == 0:
            for kind in params.samplers:
                with _blame(params, *_SAMPLER_FIELDS.get(kind, ("samplers",))):
                    chain.add(_from_params(kind, params, n_ctx_train, token_pieces, tokenize))
            chain.add(Dist(params.seed))
        elif params.mirostat in (1, 2):
            with _blame(params, "temp"):
                chain.add(Temp(params.temp))
            with _blame(params, "mirostat_tau", "mirostat_eta"):
                if params.mirostat == 1:
                    chain.add(Mirostat(n_vocab, params.seed, params.mirostat_tau, params.mirostat_eta, 100))
                else:
                    chain.add(MirostatV2(params.seed, params.mirostat_tau, params.mirostat_eta))
        else:
            raise params_mod.ParamError("mirostat", f"mirostat must be 0, 1 or 2, got {params.mirostat!r}")
        return chain

    @classmethod
    def default(cls, *, seed: int = LLAMA_DEFAULT_SEED, n_vocab: int) -> SamplerChain:
        """llama.cpp's default chain: penalties, dry, top-n-sigma, top-k 40, typical, top-p 0.95,
        min-p 0.05, xtc, temp 0.8, dist (the disabled ones are no-ops, as in llama.cpp)."""
        return cls.from_params(SamplingParams(seed=seed), n_vocab=n_vocab)


# the SamplingParams fields each sampler of the chain is built from, for naming the one a
# sampler refuses (a ParamError carries the request / keyword name: "repeat_penalty", ...)
_SAMPLER_FIELDS = {
    "penalties": ("penalty_repeat", "penalty_freq", "penalty_present", "penalty_last_n"),
    "dry": ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers"),
    "top_n_sigma": ("top_n_sigma",),
    "top_k": ("top_k",),
    "typ_p": ("typ_p", "min_keep"),
    "top_p": ("top_p", "min_keep"),
    "min_p": ("min_p", "min_keep"),
    "xtc": ("xtc_probability", "xtc_threshold", "min_keep"),
    "temperature": ("temp", "dynatemp_range", "dynatemp_exponent"),
}


@contextlib.contextmanager
def _blame(params: SamplingParams, *fields: str) -> Iterator[None]:
    """Re-raise a sampler's ValueError as a ParamError naming the field it came from: the first of
    `fields` set away from its default (the first of them when none is)."""
    try:
        yield
    except params_mod.ParamError:
        raise
    except ValueError as e:
        declared = {f.name: (f, arg) for f, arg in params_mod.fields_of(SamplingParams)}
        changed = [n for n in fields if getattr(params, n) != params_mod.default_of(declared[n][0])]
        f, arg = declared[(changed or list(fields))[0]]
        raise params_mod.ParamError(params_mod.name_of(f, arg), str(e)) from None


def _last_n(name: str, value: int, n_ctx: int) -> int:
    """common's rule for a history length: -1 is the context size, below -1 is an error."""
    if value < -1:
        raise ValueError(f"{name} must be >= -1 (-1 = context size), got {value!r}")
    if value == -1:
        if n_ctx < 1:
            raise ValueError(f"{name} = -1 means the context size: pass n_ctx")
        return n_ctx
    return value


def _from_params(kind: str, params: SamplingParams, n_ctx_train: int, token_pieces, tokenize) -> Sampler:
    if kind == "penalties":
        return Penalties(params.penalty_last_n, params.penalty_repeat, params.penalty_freq, params.penalty_present)
    if kind == "dry":
        return dry(params.dry_multiplier, params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n,
                   params.dry_sequence_breakers, n_ctx_train=n_ctx_train, token_pieces=token_pieces,
                   tokenize=tokenize)
    if kind == "top_n_sigma":
        return TopNSigma(params.top_n_sigma)
    if kind == "top_k":
        return TopK(params.top_k)
    if kind == "typ_p":
        return Typical(params.typ_p, params.min_keep)
    if kind == "top_p":
        return TopP(params.top_p, params.min_keep)
    if kind == "min_p":
        return MinP(params.min_p, params.min_keep)
    if kind == "xtc":
        return Xtc(params.xtc_probability, params.xtc_threshold, params.min_keep, params.seed)
    if kind == "temperature":
        return TempExt(params.temp, params.dynatemp_range, params.dynatemp_exponent)
    raise ValueError(f"samplers: unknown sampler type {kind!r}; expected one of {SAMPLER_TYPES}")
