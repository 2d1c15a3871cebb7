"""Batches of tokens and their split into ubatches, mirroring llama.cpp's llama-batch.cpp.

`Batch` is what a caller hands to `decode` (llama_batch): token ids or embeddings, and
optionally positions, sequence ids and output flags. `BatchAllocator` (llama_batch_allocr)
validates it against the model and the memory, fills what was left out and splits it into
`UBatch`es of at most n_ubatch tokens. Sequence sets are uint64 bitmasks (bit s = sequence
s), so at most `MAX_SEQ` = 64 sequences.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import numpy as np

MAX_SEQ = 64
# The largest position a token may take: the position after it must fit int32 (llama_pos) too,
# so a sequence at POS_MAX is full and the next batch is rejected instead of overflowing.
POS_MAX = int(np.iinfo(np.int32).max) - 1
N_POS_SECTIONS = 4          # M-RoPE positions per token (llama_hparams::n_pos_per_embd)


class BatchError(ValueError):
    """An invalid batch; the message names the field and the token index at fault."""


class SeqPosMemory(Protocol):
    """What the allocator needs from the memory (the KV cache): each sequence's position range."""

    def seq_pos_min(self, seq_id: int) -> int: ...

    def seq_pos_max(self, seq_id: int) -> int: ...


_INT32 = np.iinfo(np.int32)


def _int_array(name: str, values, n: int | None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
        raise BatchError(f"{name} must be a 1-D sequence of integers, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    if n is not None and arr.shape[0] != n:
        raise BatchError(f"{name} has {arr.shape[0]} entries, the batch has {n} tokens")
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise BatchError(f"{name} has values outside int32")
    return arr.astype(np.int32)


def _seq_ids(values, n: int) -> tuple[tuple[int, ...], ...]:
    if isinstance(values, np.ndarray) and values.ndim == 2:
        values = values.tolist()
    if len(values) != n:
        raise BatchError(f"seq_id has {len(values)} entries, the batch has {n} tokens")
    out = []
    for i, ids in enumerate(values):
        ids = (ids,) if isinstance(ids, (int, np.integer)) else tuple(ids)
        if not ids:
            raise BatchError(f"seq_id[{i}] is empty: every token needs at least one sequence")
        for j, s in enumerate(ids):
            if not isinstance(s, (int, np.integer)) or isinstance(s, (bool, np.bool_)):
                raise BatchError(f"seq_id[{i}][{j}] = {s!r} is not an integer")
        if len(set(ids)) != len(ids):
            raise BatchError(f"seq_id[{i}] = {list(ids)} lists a sequence twice")
        out.append(tuple(int(s) for s in ids))
    return tuple(out)


class Batch:
    """Input of one decode call (llama_batch): `tokens` [n] ids or `embd` [n, n_embd] floats.

    pos [n]: positions (default: continue each sequence in the cache); for an M-RoPE model's
    embeddings also [4, n], each token's t, y, x and e positions (llama_batch's section-major
    positions: an image's grid, from llm.mtmd); seq_id: per token an int or a list of ints,
    or a 2-D int array (default: sequence 0); logits [n]: which tokens produce output
    (default: the last one).
    """

    def __init__(self, tokens=None, embd=None, pos=None, seq_id=None, logits=None):
        if (tokens is None) == (embd is None):
            raise BatchError("a batch needs exactly one of tokens or embd")
        self.token: np.ndarray | None = None
        self.embd: np.ndarray | None = None
        if tokens is not None:
            self.token = _int_array("tokens", tokens, None)
            n = self.token.shape[0]
        else:
            self.embd = np.asarray(embd, dtype=np.float32)
            if self.embd.ndim != 2:
                raise BatchError(f"embd must be 2-D [n_tokens, n_embd], got shape {self.embd.shape}")
            n = self.embd.shape[0]
        self.pos: np.ndarray | None = None
        self.pos_sections: np.ndarray | None = None     # int32 [4, n] with 2-D positions
        if pos is not None and np.ndim(pos) == 2:
            if self.embd is None:
                raise BatchError("2-D positions (M-RoPE sections) go with embd, not with tokens")
            if len(pos) != N_POS_SECTIONS:
                raise BatchError(f"pos has {len(pos)} rows; M-RoPE positions are {N_POS_SECTIONS} (t, y, x, e)")
            self.pos_sections = np.stack([_int_array(f"pos[{j}]", pos[j], n) for j in range(N_POS_SECTIONS)])
            self.pos = self.pos_sections[0]
        elif pos is not None:
            self.pos = _int_array("pos", pos, n)
        self.seq_id = None if seq_id is None else _seq_ids(seq_id, n)
        self.logits = None if logits is None else _int_array("logits", logits, n).astype(bool)

    @property
    def n_tokens(self) -> int:
        data = self.token if self.token is not None else self.embd
        assert data is not None   # the constructor requires one of them
        return data.shape[0]

    @classmethod
    def get_one(cls, tokens) -> Batch:
        """llama_batch_get_one: tokens of sequence 0 that continue it, output on the last."""
        return cls(tokens=tokens)


@dataclasses.dataclass(frozen=True)
class UBatch:
    """One micro-batch (llama_ubatch): the unit a graph processes, tokens in graph order.

    For equal splits the tokens are n_seqs groups of n_seq_tokens (one group per sequence
    set); a simple split has n_seqs = n_tokens virtual groups of one. `idxs` are the tokens'
    indices in the original batch, so outputs map back.
    """

    equal_seqs: bool
    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    token: np.ndarray | None      # int32 [n_tokens]
    embd: np.ndarray | None       # float32 [n_tokens, n_embd]
    pos: np.ndarray               # int32 [n_tokens]
    n_seq_id: np.ndarray          # int32 [n_tokens]
    seq_id: tuple[tuple[int, ...], ...]
    seq_set: np.ndarray           # uint64 [n_tokens], bit s set = token belongs to sequence s
    seq_id_unq: np.ndarray        # int32, the distinct sequence ids, ascending
    output: np.ndarray            # bool [n_tokens]
    idxs: np.ndarray              # int32 [n_tokens], index of each token in the batch
    pos_sections: np.ndarray | None = None   # int32 [4, n_tokens]: t (= pos), y, x, e of 2-D positions

    @functools.cached_property
    def n_outputs(self) -> int:
        return int(self.output.sum())

    @property
    def n_seqs_unq(self) -> int:
        return len(self.seq_id_unq)


def _seq_bits(ids: tuple[int, ...]) -> int:
    bits = 0
    for s in ids:
        bits |= 1 << s
    return bits


def ubatch_reserve(n_seq_tokens: int, n_seqs: int) -> UBatch:
    """A placeholder ubatch of the given shape (llama_batch_allocr::ubatch_reserve), used to
    build graphs ahead of time: token 0 at position 0, group s in sequence s, no outputs."""
    n_tokens = n_seq_tokens * n_seqs
    seq_id = tuple((i // n_seq_tokens,) for i in range(n_tokens))
    return UBatch(
        equal_seqs=True, n_tokens=n_tokens, n_seq_tokens=n_seq_tokens, n_seqs=n_seqs,
        token=np.zeros(n_tokens, np.int32), embd=None, pos=np.zeros(n_tokens, np.int32),
        n_seq_id=np.ones(n_tokens, np.int32), seq_id=seq_id,
        seq_set=np.array([_seq_bits(ids) for ids in seq_id], dtype=np.uint64),
        seq_id_unq=np.arange(n_seqs, dtype=np.int32), output=np.zeros(n_tokens, bool),
        idxs=np.arange(n_tokens, dtype=np.int32))


class BatchAllocator:
    """llama_batch_allocr: `init` validates and completes a batch, `split_*` cut it into ubatches.

    After `init`: token / embd / pos / seq_id / seq_set / output describe the completed
    batch; n_outputs counts its outputs and output_ids[i] is the row of token i in the
    batch-ordered output buffer (-1: no output), which is what get_logits_ith(i) reads.
    After a split: out_ids lists the batch indices of the outputs in ubatch order.
    """

    def __init__(self) -> None:
        self.n_tokens = 0
        self.n_embd = 0
        self.n_seq_max = 0
        self.token: np.ndarray | None = None
        self.embd: np.ndarray | None = None
        self.pos = np.zeros(0, np.int32)
        self.pos_sections: np.ndarray | None = None
        self.seq_id: tuple[tuple[int, ...], ...] = ()
        self.n_seq_id = np.zeros(0, np.int32)
        self.seq_set = np.zeros(0, np.uint64)
        self.seq_id_unq = np.zeros(0, np.int32)
        self.output = np.zeros(0, bool)
        self.n_outputs = 0
        self.output_ids = np.zeros(0, np.int32)
        self.out_ids = np.zeros(0, np.int32)
        self.n_used = 0
        self._seq_pos: dict[int, np.ndarray] = {}
        self._used = np.zeros(0, bool)

    def init(self, batch: Batch, *, n_vocab: int, n_embd: int, n_seq_max: int,
             memory: SeqPosMemory | None = None, output_all: bool = False, mrope: bool = False) -> None:
        """Validate `batch` and fill its missing fields (llama_batch_allocr::init).

        memory gives each sequence's cached positions: missing positions continue from
        seq_pos_max + 1 and given ones must, but for an M-RoPE model (mrope) they may jump
        forward (an image takes max(nx, ny) positions) and embeddings may start at the last
        one (an image's tokens share their first position). output_all (embeddings) makes
        every token an output. Raises BatchError naming the token and field; on error nothing
        is kept.
        """
        if not 1 <= n_seq_max <= MAX_SEQ:
            raise ValueError(f"n_seq_max = {n_seq_max} is outside [1, {MAX_SEQ}]")
        n = batch.n_tokens
        if n == 0:
            raise BatchError("the batch is empty (n_tokens = 0)")

        if batch.token is not None:
            bad = np.flatnonzero((batch.token < 0) | (batch.token >= n_vocab))
            if bad.size:
                i = int(bad[0])
                raise BatchError(f"token[{i}] = {int(batch.token[i])} is out of range "
                                 f"[0, n_vocab = {n_vocab})")
        elif batch.embd is not None and batch.embd.shape[1] != n_embd:
            raise BatchError(f"embd has {batch.embd.shape[1]} values per token, "
                             f"the model's n_embd is {n_embd}")

        seq_id = batch.seq_id if batch.seq_id is not None else ((0,),) * n
        rows: dict[int, list[int]] = {}     # each sequence's tokens
        for i, ids in enumerate(seq_id):
            for j, s in enumerate(ids):
                if not 0 <= s < n_seq_max:
                    raise BatchError(f"seq_id[{i}][{j}] = {s} is out of range "
                                     f"[0, n_seq_max = {n_seq_max})")
                rows.setdefault(int(s), []).append(i)
        seq_set = np.array([_seq_bits(ids) for ids in seq_id], dtype=np.uint64)
        seq_id_unq = np.array(sorted(rows), dtype=np.int32)

        if batch.pos_sections is not None and not mrope:
            raise BatchError("pos has M-RoPE sections, but the model takes one position per token")
        pos = batch.pos if batch.pos is not None else self._fill_pos(seq_id, seq_id_unq, memory)
        bad = np.flatnonzero((pos < 0) | (pos > POS_MAX))
        if bad.size:
            i = int(bad[0])
            if pos[i] < 0:
                raise BatchError(f"pos[{i}] = {int(pos[i])} is negative")
            given = "" if batch.pos is not None else f" (continuing sequence {seq_id[i][0]})"
            raise BatchError(f"pos[{i}] = {int(pos[i])}{given} is past POS_MAX = {POS_MAX}: "
                             f"the position after it must fit int32")
        pos = pos.astype(np.int32)

        if batch.logits is None:
            output = np.ones(n, bool) if output_all else np.arange(n) == n - 1
        elif output_all:
            output = np.ones(n, bool)
        else:
            output = batch.logits

        seq_pos = {s: pos[r] for s, r in sorted(rows.items())}
        self._check_positions(seq_pos, memory, mrope=mrope, embd=batch.embd is not None)
        self._check_coupled(seq_id, memory)

        self.n_tokens = n
        self.n_embd = n_embd
        self.n_seq_max = n_seq_max
        self.token = batch.token
        self.embd = batch.embd
        self.pos = pos
        self.pos_sections = batch.pos_sections
        self.seq_id = seq_id
        self.n_seq_id = np.array([len(ids) for ids in seq_id], dtype=np.int32)
        self.seq_set = seq_set
        self.seq_id_unq = seq_id_unq
        self.output = output
        self.n_outputs = int(output.sum())
        self.output_ids = np.where(output, np.cumsum(output) - 1, -1).astype(np.int32)
        self._seq_pos = seq_pos
        self._split_reset()

    @staticmethod
    def _fill_pos(seq_id, seq_id_unq: np.ndarray, memory: SeqPosMemory | None) -> np.ndarray:
        """Each token continues its first sequence; it advances all the sequences it is in.
        int64, so a sequence that reached POS_MAX gives a position the caller rejects."""
        p0 = {int(s): 0 if memory is None else memory.seq_pos_max(int(s)) + 1 for s in seq_id_unq}
        pos = np.empty(len(seq_id), np.int64)
        for i, ids in enumerate(seq_id):
            pos[i] = p0[ids[0]]
            for s in ids:
                p0[s] = int(pos[i]) + 1
        return pos

    @staticmethod
    def _check_positions(seq_pos: dict[int, np.ndarray], memory: SeqPosMemory | None, mrope: bool = False,
                         embd: bool = False) -> None:
        """Each sequence's positions continue its cache, without gaps, never decreasing; with M-RoPE
        (mrope) they may jump forward and embeddings may start at the cache's last position (an
        image's tokens share their first position)."""
        for s, p in seq_pos.items():
            single = p.size == 1       # a decoding sequence's one token: nothing to compare within the batch
            p_min, p_max = (int(p[0]), int(p[0])) if single else (int(p.min()), int(p.max()))
            p0 = memory.seq_pos_max(s) if memory is not None else -1
            if mrope and p0 >= 0 and (p_min < p0 if embd else p_min <= p0):
                first = p0 if embd else p0 + 1
                raise BatchError(f"sequence {s}: the cache holds positions up to {p0}, so the batch's "
                                 f"{'embeddings' if embd else 'tokens'} must start at {first} or later "
                                 f"(M-RoPE), but start at {p_min}")
            if not mrope and p0 >= 0 and p_min != p0 + 1:
                raise BatchError(f"sequence {s}: the cache holds positions up to {p0}, so the "
                                 f"batch must continue at {p0 + 1}, but it starts at {p_min}")
            if single:
                continue
            if not mrope and p_max - p_min + 1 > len(np.unique(p)):
                raise BatchError(f"sequence {s}: positions are not continuous "
                                 f"({len(np.unique(p))} distinct values in [{p_min}, {p_max}])")
            down = np.flatnonzero(np.diff(p) < 0)
            if down.size:
                raise BatchError(f"sequence {s}: positions decrease ({int(p[down[0]])} then "
                                 f"{int(p[down[0] + 1])})")

    @staticmethod
    def _check_coupled(seq_id, memory: SeqPosMemory | None) -> None:
        """Sequences that share a token must hold the same positions in the memory."""
        if memory is None:
            return
        pairs = {(ids[0], s) for ids in seq_id for s in ids[1:]}
        for s0, s1 in sorted(pairs):
            if (memory.seq_pos_min(s0) != memory.seq_pos_min(s1)
                    or memory.seq_pos_max(s0) != memory.seq_pos_max(s1)):
                raise BatchError(f"sequence {s1} is coupled to sequence {s0} in the batch, "
                                 f"but their cached positions have diverged")

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of sequence seq_id in the batch, -1 if absent."""
        p = self._seq_pos.get(seq_id)
        return -1 if p is None else int(p.min())

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of sequence seq_id in the batch, -1 if absent."""
        p = self._seq_pos.get(seq_id)
        return -1 if p is None else int(p.max())

    def output_rows(self, ubatch: UBatch) -> np.ndarray:
        """Rows of the batch-ordered output buffer that the ubatch's outputs go to, in order."""
        return self.output_ids[ubatch.idxs[ubatch.output]]

    def _split_reset(self) -> None:
        self.out_ids = np.zeros(0, np.int32)
        self.n_used = 0
        self._used = np.zeros(self.n_tokens, bool)

    def _check_n_ubatch(self, n_ubatch: int) -> None:
        if n_ubatch < 1:
            raise ValueError(f"n_ubatch = {n_ubatch} must be at least 1")
        if self.n_tokens == 0:
            raise ValueError("split before a successful init")

    def split_simple(self, n_ubatch: int) -> list[UBatch]:
        """Consecutive runs of at most n_ubatch tokens, in batch order (any sequences mixed)."""
        self._check_n_ubatch(n_ubatch)
        self._split_reset()
        return [self._ubatch_add(np.arange(start, min(start + n_ubatch, self.n_tokens)),
                                 n_seqs=min(n_ubatch, self.n_tokens - start), equal_seqs=False)
                for start in range(0, self.n_tokens, n_ubatch)]

    def split_equal(self, n_ubatch: int, pow2: bool = False) -> list[UBatch]:
        """Ubatches where each of several disjoint sequence sets contributes the same number of
        tokens (llama_batch_allocr::split_equal). At most n_ubatch sets per ubatch, so a ubatch
        never exceeds n_ubatch tokens (llama.cpp lets n_ubatch + 1 sets in). pow2: each set's
        run is cut to a power of two (a recurrent model's graphs then need no padded tokens,
        one shape per power of two)."""
        self._check_n_ubatch(n_ubatch)
        self._split_reset()
        set_tokens: dict[int, np.ndarray] = {}
        for bits in np.unique(self.seq_set):
            set_tokens[int(bits)] = np.flatnonzero(self.seq_set == bits)
        next_of = {bits: 0 for bits in set_tokens}  # first unused token of each set
        ubatches = []
        while self.n_used < self.n_tokens:
            cur_sets: list[int] = []
            for i in np.flatnonzero(~self._used):
                bits = int(self.seq_set[i])
                if all(bits & other == 0 for other in cur_sets):
                    cur_sets.append(bits)
                    if len(cur_sets) == n_ubatch:
                        break
            n_seqs = len(cur_sets)
            per_set: list[list[int]] = [[] for _ in cur_sets]
            while all(next_of[b] < len(set_tokens[b]) for b in cur_sets):
                for k, b in enumerate(cur_sets):
                    per_set[k].append(int(set_tokens[b][next_of[b]]))
                    next_of[b] += 1
                if (len(per_set[0]) + 1) * n_seqs > n_ubatch:
                    break
            if pow2:
                keep = 1 << (len(per_set[0]).bit_length() - 1)
                for k, b in enumerate(cur_sets):
                    next_of[b] -= len(per_set[k]) - keep
                    per_set[k] = per_set[k][:keep]
            idxs = np.array([i for lst in per_set for i in lst], dtype=np.int64)
            ubatches.append(self._ubatch_add(idxs, n_seqs=n_seqs, equal_seqs=True))
        return ubatches

    def split_seq(self, n_ubatch: int) -> list[UBatch]:
        """Ubatches of one sequence set each (llama_batch_allocr::split_seq): from the first
        unused token, take following tokens whose set is a subset of the current one."""
        self._check_n_ubatch(n_ubatch)
        self._split_reset()
        ubatches = []
        while self.n_used < self.n_tokens:
            cur = int(np.flatnonzero(~self._used)[0])
            cur_set = int(self.seq_set[cur])
            idxs = []
            while True:
                idxs.append(cur)
                if len(idxs) >= n_ubatch:
                    break
                cur += 1
                while cur < self.n_tokens and (
                        self._used[cur] or (cur_set & int(self.seq_set[cur])) != int(self.seq_set[cur])):
                    cur += 1
                if cur == self.n_tokens:
                    break
                cur_set = int(self.seq_set[cur])
            ubatches.append(self._ubatch_add(np.array(idxs, dtype=np.int64), n_seqs=1,
                                             equal_seqs=True))
        return ubatches

    def _ubatch_add(self, idxs: np.ndarray, n_seqs: int, equal_seqs: bool) -> UBatch:
        """The ubatch of batch tokens idxs (llama_batch_allocr::ubatch_add); records its outputs."""
        self._used[idxs] = True
        self.n_used += len(idxs)
        output = self.output[idxs]
        self.out_ids = np.concatenate([self.out_ids, idxs[output].astype(np.int32)])
        n_tokens = len(idxs)
        return UBatch(
            equal_seqs=equal_seqs,
            n_tokens=n_tokens,
            n_seq_tokens=n_tokens // n_seqs,
            n_seqs=n_seqs,
            token=None if self.token is None else self.token[idxs],
            embd=None if self.embd is None else self.embd[idxs],
            pos=self.pos[idxs],
            n_seq_id=self.n_seq_id[idxs],
            seq_id=tuple(self.seq_id[i] for i in idxs),
            seq_set=self.seq_set[idxs],
            seq_id_unq=np.array(sorted({s for i in idxs for s in self.seq_id[i]}), dtype=np.int32),
            output=output,
            idxs=idxs.astype(np.int32),
            pos_sections=None if self.pos_sections is None else self.pos_sections[:, idxs],
        )

