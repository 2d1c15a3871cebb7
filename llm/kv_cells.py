"""KV cache bookkeeping on the host, without device buffers: llama.cpp's `llama_kv_cells`
plus the slot logic of `llama_kv_cache` (find_slot, apply_ubatch, prepare, sequence ops,
the attention mask and the K-shift input).

Per cell: its position (-1 = empty), the set of sequences it belongs to (a uint64 bitmask,
bit s = sequence s), the position shift accumulated since the last K-shift and its 2-D
position (llama_kv_cell_ext: an M-RoPE image token's y, x; else the position twice). Everything
is numpy over all cells at once, so a decode step costs a few array passes, not a Python
loop over n_ctx cells. One stream (a unified cache for all sequences).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from llm.batch import MAX_SEQ, POS_MAX, UBatch
from llm.hparams import SWAType, is_masked_swa

_POS_MAX = np.iinfo(np.int32).max
_ONE = np.uint64(1)


def _bit(seq_id: int) -> np.uint64:
    return _ONE << np.uint64(seq_id)


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """Where a ubatch goes (llama_kv_cache::slot_info, one stream): idxs[i] is the cell of token i."""

    idxs: np.ndarray  # int32 [n_tokens]

    @property
    def size(self) -> int:
        return len(self.idxs)


class KVCells:
    """Cell metadata of a KV cache of n_ctx cells shared by up to n_seq_max sequences.

    swa_type / n_swa describe a sliding-window cache: a cell whose position fell out of the
    window of its (single) sequence may be reused, and masks hide such cells by default.
    """

    def __init__(self, n_ctx: int, n_seq_max: int, *, swa_type: SWAType = SWAType.NONE,
                 n_swa: int = 0):
        if n_ctx < 1:
            raise ValueError(f"n_ctx = {n_ctx} must be at least 1")
        if not 1 <= n_seq_max <= MAX_SEQ:
            raise ValueError(f"n_seq_max = {n_seq_max} is outside [1, {MAX_SEQ}]")
        if swa_type != SWAType.NONE and n_swa <= 0:
            raise ValueError(f"swa_type {swa_type.name} needs n_swa > 0, got {n_swa}")
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.swa_type = swa_type
        self.n_swa = n_swa
        self.pos = np.full(n_ctx, -1, np.int32)
        self.seq = np.zeros(n_ctx, np.uint64)
        self.shift = np.zeros(n_ctx, np.int32)
        self.ext_y = np.zeros(n_ctx, np.int32)
        self.ext_x = np.zeros(n_ctx, np.int32)
        self.has_shift = False
        self.head = 0  # where the next slot search starts

    # --- queries ---

    def get_used(self) -> int:
        """Number of non-empty cells."""
        return int(np.count_nonzero(self.pos >= 0))

    def used_max_p1(self) -> int:
        """Index of the last non-empty cell + 1 (0 when the cache is empty)."""
        used = np.flatnonzero(self.pos >= 0)
        return int(used[-1]) + 1 if used.size else 0

    def n_kv(self, bucket: int = 256) -> int:
        """KV length a graph must read: used_max_p1 rounded up to a multiple of bucket, at least
        one bucket, never more than n_ctx (llama_kv_cache::get_n_kv pads to 256 so graphs repeat)."""
        return self.n_kv_of(self.used_max_p1(), bucket)

    def n_kv_of(self, used_max_p1: int, bucket: int = 256) -> int:
        """n_kv once the cells up to used_max_p1 are filled (to reserve graphs ahead)."""
        if bucket < 1:
            raise ValueError(f"bucket = {bucket} must be at least 1")
        padded = -(-used_max_p1 // bucket) * bucket
        return min(self.n_ctx, max(bucket, padded))

    def _check_seq(self, name: str, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"{name} = {seq_id} is out of range [0, n_seq_max = {self.n_seq_max})")

    def _has(self, seq_id: int) -> np.ndarray:
        return (self.seq & _bit(seq_id)) != 0

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of sequence seq_id in the cache, -1 if it has none."""
        self._check_seq("seq_id", seq_id)
        p = self.pos[self._has(seq_id)]
        return int(p.min()) if p.size else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of sequence seq_id in the cache, -1 if it has none."""
        self._check_seq("seq_id", seq_id)
        p = self.pos[self._has(seq_id)]
        return int(p.max()) if p.size else -1

    # --- slots ---

    def _usable(self) -> np.ndarray:
        """Cells a new token may take: empty ones, and in a SWA cache the single-sequence cells
        that its sequence's next token can no longer see."""
        usable = self.pos < 0
        if self.swa_type == SWAType.NONE:
            return usable
        seq = self.seq
        single = (seq != 0) & ((seq & (seq - _ONE)) == 0)
        cand = np.flatnonzero(single & ~usable)
        # a single-bit mask 2**s -> s (exact in float64 for every s < 64)
        cand_seq = np.log2(seq[cand]).astype(np.int64)
        p_next = np.zeros(self.n_seq_max, np.int64)
        for s in np.flatnonzero(np.bincount(cand_seq, minlength=self.n_seq_max)):
            p_next[s] = self.seq_pos_max(int(s)) + 1
        usable[cand] = is_masked_swa(self.n_swa, self.swa_type, self.pos[cand], p_next[cand_seq])
        return usable

    def find_slot(self, ubatch: UBatch, cont: bool = False) -> SlotInfo | None:
        """Cells for the ubatch's tokens, searching from `head` and wrapping around (llama.cpp's
        find_slot). cont=True asks for one contiguous run of cells. None when nothing fits;
        the cells are not modified."""
        n_tokens = ubatch.n_tokens
        if n_tokens > self.n_ctx:
            return None
        head = self.head
        # plenty of free cells before head: search from the start to fill the cache densely
        if head > self.get_used() + 2 * n_tokens:
            head = 0
        usable = self._usable()
        if cont:
            runs = np.concatenate([[0], np.cumsum(usable)])
            starts = np.flatnonzero(runs[n_tokens:] - runs[:-n_tokens] == n_tokens)
            if not starts.size:
                return None
            after = starts[starts >= head]
            start = int(after[0] if after.size else starts[0])
            return SlotInfo(np.arange(start, start + n_tokens, dtype=np.int32))
        order = np.concatenate([np.arange(head, self.n_ctx), np.arange(0, head)])
        cells = order[usable[order]]
        if len(cells) < n_tokens:
            return None
        return SlotInfo(cells[:n_tokens].astype(np.int32))

    def apply(self, slot: SlotInfo, ubatch: UBatch) -> None:
        """Commit the ubatch to its slot (llama_kv_cache::apply_ubatch).

        A reused SWA cell drops its old token; then every older position of that sequence is
        purged too, so each sequence keeps a contiguous [pos_min, pos_max] range.
        """
        if slot.size != ubatch.n_tokens:
            raise ValueError(f"slot of {slot.size} cells for a ubatch of {ubatch.n_tokens} tokens")
        idxs = slot.idxs
        occupied = idxs[self.pos[idxs] >= 0]
        shared = occupied[(self.seq[occupied] & (self.seq[occupied] - _ONE)) != 0]
        if shared.size:
            raise ValueError(f"slot cell {int(shared[0])} is shared by several sequences and "
                             f"cannot be overwritten")
        pos_max_rm: dict[int, int] = {}
        for bits in np.unique(self.seq[occupied]):
            s = int(bits).bit_length() - 1
            pos_max_rm[s] = int(self.pos[occupied[self.seq[occupied] == bits]].max())
        self.pos[occupied] = -1
        self.seq[occupied] = 0
        self.shift[occupied] = 0

        self.pos[idxs] = ubatch.pos
        self.seq[idxs] = ubatch.seq_set
        sections = ubatch.pos_sections
        self.ext_y[idxs] = ubatch.pos if sections is None else sections[1]
        self.ext_x[idxs] = ubatch.pos if sections is None else sections[2]
        for s, p_max in pos_max_rm.items():
            p_min = self.seq_pos_min(s)
            if 0 <= p_min <= p_max:
                self.seq_rm(s, p_min, p_max + 1)
        self.head = int(idxs[-1]) + 1

    def prepare(self, ubatches: list[UBatch], cont: bool = False) -> list[SlotInfo] | None:
        """Slots for ALL ubatches of a batch, each placed as if the earlier ones were applied
        (llama_kv_cache::prepare). The cells are left unchanged either way; None if any fails."""
        slots: list[SlotInfo] = []
        saved = None    # the cells before the first apply: only a later ubatch needs one
        try:
            for i, ubatch in enumerate(ubatches):
                slot = self.find_slot(ubatch, cont=cont)
                if slot is None:
                    return None
                slots.append(slot)
                if i + 1 < len(ubatches):
                    if saved is None:
                        saved = (self.pos.copy(), self.seq.copy(), self.shift.copy(), self.ext_y.copy(),
                                 self.ext_x.copy(), self.head, self.has_shift)
                    self.apply(slot, ubatch)
        finally:
            if saved is not None:
                self.pos, self.seq, self.shift, self.ext_y, self.ext_x, self.head, self.has_shift = saved
        return slots

    # --- sequence operations (llama_memory_seq_*) ---

    @staticmethod
    def _range(p0: int, p1: int) -> tuple[int, int]:
        """llama.cpp's convention: p0 < 0 means 0, p1 < 0 means infinity."""
        return max(p0, 0), (_POS_MAX if p1 < 0 else p1)

    def _clear_cells(self, cells: np.ndarray | slice) -> None:
        self.pos[cells] = -1
        self.seq[cells] = 0
        self.shift[cells] = 0

    def _lower_head(self, freed: np.ndarray) -> None:
        first = np.flatnonzero(freed)
        if first.size and first[0] < self.head:
            self.head = int(first[0])

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of seq_id (seq_id -1: of every sequence). Always True for
        a KV cache (llama_memory_seq_rm returns False only for memories that cannot)."""
        if seq_id != -1:
            self._check_seq("seq_id", seq_id)
        p0, p1 = self._range(p0, p1)
        in_range = (self.pos >= p0) & (self.pos < p1)
        if seq_id == -1:
            freed = in_range
        else:
            sel = in_range & self._has(seq_id)
            self.seq[sel] &= ~_bit(seq_id)
            freed = sel & (self.seq == 0)
        self._clear_cells(freed)
        self._lower_head(freed)
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make positions [p0, p1) of seq_id_src also belong to seq_id_dst (no data is copied)."""
        self._check_seq("seq_id_src", seq_id_src)
        self._check_seq("seq_id_dst", seq_id_dst)
        if seq_id_src == seq_id_dst:
            return
        p0, p1 = self._range(p0, p1)
        sel = (self.pos >= p0) & (self.pos < p1) & self._has(seq_id_src)
        self.seq[sel] |= _bit(seq_id_dst)

    def seq_keep(self, seq_id: int) -> None:
        """Drop every sequence but seq_id; cells without seq_id become empty."""
        self._check_seq("seq_id", seq_id)
        has = self._has(seq_id)
        freed = ~has & (self.pos >= 0)
        self.seq[has] = _bit(seq_id)
        self._clear_cells(freed)
        self._lower_head(freed)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Shift positions [p0, p1) of seq_id by `shift` (llama_memory_seq_add).

        The cells' K must be re-roped by the same amount: `has_shift` turns on and
        `k_shift()` gives the per-cell delta. Cells pushed below position 0 become empty.
        """
        self._check_seq("seq_id", seq_id)
        if not isinstance(shift, (int, np.integer)) or isinstance(shift, (bool, np.bool_)):
            raise TypeError(f"seq_add: shift must be an integer, got {shift!r}")
        if shift == 0:
            return
        p0, p1 = self._range(p0, p1)
        if p0 == p1:
            return
        sel = (self.pos >= p0) & (self.pos < p1) & self._has(seq_id)
        new_pos = self.pos[sel].astype(np.int64) + int(shift)
        if new_pos.size and new_pos.max() > POS_MAX:
            raise ValueError(f"seq_add: shift = {shift} moves position {int(new_pos.max()) - int(shift)} of "
                             f"sequence {seq_id} past POS_MAX = {POS_MAX} (the cache is unchanged)")
        if sel.any():
            # cells pushed below 0 are freed below, so their delta needs no int32 room
            self.shift[sel] = np.where(new_pos < 0, 0, self.shift[sel] + (new_pos - self.pos[sel]))
            self.pos[sel] = np.maximum(new_pos, -1)
            self.has_shift = True
        freed = sel & (self.pos < 0)
        self._clear_cells(freed)
        first = np.flatnonzero(freed)
        self.head = int(first[0]) if first.size else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide positions [p0, p1) of seq_id by d (llama_memory_seq_div); K is re-roped by
        the change, as for seq_add."""
        self._check_seq("seq_id", seq_id)
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 1:
            raise ValueError(f"seq_div: d must be an integer >= 1, got {d!r}")
        if d == 1:
            return
        p0, p1 = self._range(p0, p1)
        sel = (self.pos >= p0) & (self.pos < p1) & self._has(seq_id)
        if sel.any():
            new_pos = self.pos[sel] // d
            self.shift[sel] += new_pos - self.pos[sel]
            self.pos[sel] = new_pos
            self.has_shift = True

    def clear(self) -> None:
        """Empty every cell (llama_memory_clear)."""
        self._clear_cells(slice(None))
        self.has_shift = False
        self.head = 0

    # --- graph inputs ---

    def k_shift(self) -> np.ndarray:
        """int32 [n_ctx]: the position delta each cell's K must be rotated by (0 for empty cells)."""
        return np.where(self.pos >= 0, self.shift, 0).astype(np.int32)

    def reset_shift(self) -> None:
        """Forget the pending shifts, once the K-shift graph has applied them."""
        self.shift[:] = 0
        self.has_shift = False

    def write_indices(self, slot: SlotInfo, n_tokens_pad: int) -> np.ndarray:
        """int32 [n_tokens_pad]: the cell each token's K/V row is written to.

        Padded tokens (beyond the slot) get index n_ctx, one past the last cell, so a scatter
        that drops out-of-bounds rows (JAX `.at[idx].set(v, mode="drop")`) never writes them.
        """
        if n_tokens_pad < slot.size:
            raise ValueError(f"n_tokens_pad = {n_tokens_pad} is smaller than the slot ({slot.size})")
        out = np.full(n_tokens_pad, self.n_ctx, np.int32)
        out[:slot.size] = slot.idxs
        return out

    def build_mask(self, ubatch: UBatch, n_kv: int, *, n_tokens_pad: int | None = None,
                   causal: bool = True, swa_type: SWAType | None = None,
                   n_swa: int | None = None) -> np.ndarray:
        """float32 [n_tokens_pad, n_kv] attention mask: 0 where token i may see cell j, -inf elsewhere.

        Call it after `apply` (the ubatch's own cells must be in the cache). A token sees a
        cell of its first sequence (llama.cpp assumes a token's sequences are equivalent)
        whose position is not after its own (when causal) and not outside the sliding window.
        A ubatch with 2-D positions (an M-RoPE image, whose tokens share one position) sees
        the cells at its own position up to its place in the grid (llama.cpp's M-RoPE causal
        mask: row by row, then by column).
        swa_type / n_swa default to the cache's own; pass them to mask a window on a cache
        shared by global and sliding-window layers.

        Padded rows (i >= n_tokens) see exactly cell 0: a row of only -inf would make softmax
        produce NaN, which could spread; cell 0 holds finite values, and padded rows are
        neither written to the cache nor output.
        """
        n_tokens = ubatch.n_tokens
        n_tokens_pad = n_tokens if n_tokens_pad is None else n_tokens_pad
        if n_tokens_pad < n_tokens:
            raise ValueError(f"n_tokens_pad = {n_tokens_pad} is smaller than the ubatch ({n_tokens})")
        if not 1 <= n_kv <= self.n_ctx:
            raise ValueError(f"n_kv = {n_kv} is outside [1, n_ctx = {self.n_ctx}]")
        swa_type = self.swa_type if swa_type is None else swa_type
        n_swa = self.n_swa if n_swa is None else n_swa

        cell_pos = self.pos[None, :n_kv]
        tok_pos = ubatch.pos[:, None]
        # one membership row per distinct sequence (usually one), broadcast to its tokens
        first_seq = np.array([ids[0] for ids in ubatch.seq_id])
        visible = np.empty((n_tokens, n_kv), bool)
        for s in np.unique(first_seq):
            visible[first_seq == s] = (self.seq[:n_kv] & _bit(int(s))) != 0
        if causal:
            visible &= cell_pos <= tok_pos
            if ubatch.pos_sections is not None:
                cy, cx = self.ext_y[None, :n_kv], self.ext_x[None, :n_kv]
                ty, tx = ubatch.pos_sections[1][:, None], ubatch.pos_sections[2][:, None]
                visible &= ~((cell_pos == tok_pos) & ((cy > ty) | ((cy == ty) & (cx > tx))))
        if swa_type != SWAType.NONE:
            visible &= ~is_masked_swa(n_swa, swa_type, cell_pos, tok_pos)

        mask = np.full((n_tokens_pad, n_kv), -np.inf, np.float32)
        np.copyto(mask[:n_tokens], np.float32(0.0), where=visible)
        mask[n_tokens:, 0] = 0.0
        return mask
