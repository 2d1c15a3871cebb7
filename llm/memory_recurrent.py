"""The recurrent memory (llama.cpp's llama_memory_recurrent): one cell per sequence holding the
fixed-size state of every recurrent layer - the conv state r (the last d_conv - 1 inputs of
each conv channel) and the SSM state s - plus the position of the last token it has seen.

Buffers are ggmlx STATE leaves [n_embd_r or n_embd_s, n_seq_max + 1] on their layer's device;
a compiled graph reads the ubatch's sequences' columns (get_rows by `inp_s_copy`) and writes
the new states back with set_rows, donated like the KV cache. The last column is a scratch
cell that padded sequences of a ubatch read and write, so graphs are compiled for a power of
two of sequences without touching a real one.

Sequence s lives in cell s. A state holds no history, so removing only the tail of a
sequence is refused (`seq_rm` returns False, as llama.cpp does without rollback snapshots);
`seq_cp` copies the source's state columns, and a sequence removed whole gets zero states.
`seq_checkpoint` / `seq_restore` keep and put back one sequence's states, which is how
speculative decoding drops rejected drafts here (then decodes the kept ones again).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx.tensor import Tensor, new_state, np_dtype
from ggmlx.types import GGMLType
from llm.batch import MAX_SEQ, UBatch
from llm.kv_cache import locked

if TYPE_CHECKING:
    from llm.model import Model

_POS_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class RecurrentCheckpoint:
    """One sequence's recurrent states (every layer's row of its cell) at position `pos`."""
    seq_id: int
    pos: int
    rows: dict[Tensor, jax.Array]


class MemoryRecurrent:
    """Per-sequence recurrent states of the recurrent layers of a model (all of Mamba's, the
    SSM layers of a hybrid)."""

    mem_attn = None      # no attention layers here (llm.memory_hybrid pairs one with a KV cache)

    def __init__(self, model: Model, n_seq_max: int):
        if not 1 <= n_seq_max <= MAX_SEQ:
            raise ValueError(f"n_seq_max = {n_seq_max} is outside [1, {MAX_SEQ}]")
        hp = model.hparams
        self.hparams = hp
        self.size = n_seq_max                  # cells; one more column is the scratch cell
        self.n_seq_max = n_seq_max
        self.lock = threading.RLock()
        self.pos = np.full(self.size, -1, np.int64)
        self._place = model.place
        self._device: dict[Tensor, jax.Device] = {}
        self.r_l: list[Tensor | None] = []
        self.s_l: list[Tensor | None] = []
        for il in range(hp.n_layer):
            if not hp.is_recurrent(il):
                self.r_l.append(None)
                self.s_l.append(None)
                continue
            r = new_state(GGMLType.F32, (hp.n_embd_r(), self.size + 1), f"cache_r_l{il}")
            s = new_state(GGMLType.F32, (hp.n_embd_s(), self.size + 1), f"cache_s_l{il}")
            for buf in (r, s):
                self._device[buf] = self._place.dev_layer[il]
                buf.data = self._zeros(buf)
            self.r_l.append(r)
            self.s_l.append(s)
        self._undo: list[tuple[np.ndarray, np.ndarray]] = []

    @property
    def mem_recr(self) -> MemoryRecurrent:
        return self

    def _buffers(self) -> list[Tensor]:
        return [t for t in self.r_l + self.s_l if t is not None]

    def _zeros(self, t: Tensor) -> jax.Array:
        pl = self._place
        if pl.mesh is not None:     # replicated over the mesh: the states are small
            sharding = jax.sharding.NamedSharding(pl.mesh, jax.sharding.PartitionSpec())
            return jax.make_array_from_callback(t.shape, sharding,
                                                lambda idx: np.zeros(t.shape, np_dtype(t.type)))
        return jax.device_put(jnp.zeros(t.shape, np_dtype(t.type)), self._device[t])

    # ---- buffers ---------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(t.data.size * t.data.dtype.itemsize for t in self._buffers())

    def bytes_per_sequence(self) -> int:
        """Bytes of one sequence's states over all recurrent layers (a cell)."""
        return sum(t.ne[0] * 4 for t in self._buffers())

    def state(self) -> dict[Tensor, jax.Array]:
        return {t: t.data for t in self._buffers()}

    def update(self, new_state: dict[Tensor, jax.Array]) -> None:
        for t, v in new_state.items():
            t.data = v

    def lost(self) -> bool:
        return any(t.data.is_deleted() for t in self._buffers())

    @locked
    def rebuild(self) -> list[int]:
        seqs = [int(s) for s in np.flatnonzero(self.pos >= 0)]
        self.clear()
        return seqs

    def _zero_cells(self, cells: list[int]) -> None:
        if cells:
            idx = jnp.asarray(cells, jnp.int32)
            for t in self._buffers():
                t.data = t.data.at[..., idx, :].set(0.0)      # numpy order [..., cells, state]

    @locked
    def clear(self) -> None:
        for t in self._buffers():
            t.data = self._zeros(t)
        self.pos[:] = -1

    # ---- slots -----------------------------------------------------------------------

    def prepare(self, ubatches: list[UBatch]) -> list[np.ndarray] | None:
        """Each ubatch's cells, one per sequence in ubatch order (the sequence ids: cell s is
        sequence s). None when a ubatch's sequences are not equal splits of one sequence each."""
        slots = []
        for ub in ubatches:
            if not ub.equal_seqs or any(len(ids) != 1 for ids in ub.seq_id):
                return None
            n = ub.n_seq_tokens
            slots.append(np.array([ub.seq_id[i * n][0] for i in range(ub.n_seqs)], np.int32))
        return slots

    def apply(self, slot: np.ndarray, ub: UBatch) -> None:
        """The ubatch's sequences now end at its last positions (kept to undo a failed ubatch)."""
        last = ub.pos.reshape(ub.n_seqs, ub.n_seq_tokens)[:, -1]
        self._undo = [(slot.copy(), self.pos[slot].copy())]
        self.pos[slot] = last

    def undo(self, ub: UBatch) -> None:
        """Forget the last applied ubatch (its states were not written)."""
        for cells, pos in self._undo:
            self.pos[cells] = pos
        self._undo = []

    @staticmethod
    def split_slot(slot: np.ndarray) -> tuple:
        """(no KV cache slot, the recurrent cells) of a ubatch."""
        return None, slot

    def copy_indices(self, slot: np.ndarray, n_seqs_pad: int) -> np.ndarray:
        """int32 [n_seqs_pad]: the cell each of the graph's sequences reads and writes; padded
        sequences get the scratch cell."""
        out = np.full(n_seqs_pad, self.size, np.int32)
        out[:len(slot)] = slot
        return out

    # ---- sequence ops (llama_memory_seq_*) ---------------------------------------------

    def _check_seq(self, name: str, seq_id: int) -> None:
        if not 0 <= seq_id < self.size:
            raise ValueError(f"{name} = {seq_id} is out of range [0, n_seq_max = {self.size})")

    def seq_pos_min(self, seq_id: int) -> int:
        """The position of the last token the state has seen (a state keeps no earlier ones)."""
        self._check_seq("seq_id", seq_id)
        return int(self.pos[seq_id])

    def seq_pos_max(self, seq_id: int) -> int:
        self._check_seq("seq_id", seq_id)
        return int(self.pos[seq_id])

    @staticmethod
    def _range(p0: int, p1: int) -> tuple[int, int]:
        return max(p0, 0), (_POS_MAX if p1 < 0 else p1)

    def can_seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Whether seq_rm(seq_id, p0, p1) would succeed (it changes nothing when it fails)."""
        p0, p1 = self._range(p0, p1)
        if seq_id >= self.size:
            return False
        if seq_id < 0:
            return p0 == p1 or (p0 == 0 and p1 == _POS_MAX)
        pos = self.pos[seq_id]
        return not (pos >= 0 and 0 < p0 <= pos < p1)

    @locked
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of seq_id (-1: every sequence). False, changing nothing,
        for a part of a sequence that does not include its start: the state cannot forget
        only its last tokens. A sequence removed whole is reset to zero states."""
        if not self.can_seq_rm(seq_id, p0, p1):
            return False
        p0, p1 = self._range(p0, p1)
        cells = range(self.size) if seq_id < 0 else [seq_id]
        freed = [c for c in cells if self.pos[c] >= 0 and p0 <= self.pos[c] < p1]
        self.pos[freed] = -1
        self._zero_cells(freed)
        return True

    @locked
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make seq_id_dst continue from seq_id_src's state (copied; the range is ignored, as
        a state has no positions to select)."""
        self._check_seq("seq_id_src", seq_id_src)
        self._check_seq("seq_id_dst", seq_id_dst)
        if seq_id_src == seq_id_dst:
            return
        for t in self._buffers():
            t.data = t.data.at[..., seq_id_dst, :].set(t.data[..., seq_id_src, :])
        self.pos[seq_id_dst] = self.pos[seq_id_src]

    @locked
    def seq_checkpoint(self, seq_id: int) -> RecurrentCheckpoint:
        """A copy of seq_id's states and position, to go back to (speculative decoding's
        rejected drafts: a state cannot forget its last tokens)."""
        self._check_seq("seq_id", seq_id)
        rows = {t: t.data[..., seq_id, :] for t in self._buffers()}
        return RecurrentCheckpoint(seq_id, int(self.pos[seq_id]), rows)

    @locked
    def seq_restore(self, cp: RecurrentCheckpoint) -> None:
        """Put a sequence back in the state seq_checkpoint saw."""
        for t, row in cp.rows.items():
            t.data = t.data.at[..., cp.seq_id, :].set(row)
        self.pos[cp.seq_id] = cp.pos

    @locked
    def seq_keep(self, seq_id: int) -> None:
        self._check_seq("seq_id", seq_id)
        others = [c for c in range(self.size) if c != seq_id and self.pos[c] >= 0]
        self.pos[others] = -1
        self._zero_cells(others)

    @locked
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Shift the sequence's position when it lies in [p0, p1) (nothing to re-rotate)."""
        self._check_seq("seq_id", seq_id)
        p0, p1 = self._range(p0, p1)
        if shift and p0 <= self.pos[seq_id] < p1:
            self.pos[seq_id] += shift

    @locked
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self._check_seq("seq_id", seq_id)
        if d < 1:
            raise ValueError(f"seq_div: d = {d} must be at least 1")
        p0, p1 = self._range(p0, p1)
        if d != 1 and p0 <= self.pos[seq_id] < p1:
            self.pos[seq_id] //= d

    def can_keep(self, seq_id: int, n_keep: int) -> bool:
        """Whether seq_id can go on from position n_keep: only from its start or its end."""
        return n_keep == 0 or n_keep == self.pos[seq_id] + 1

    has_shift = False
    cells_swa = None

    def n_kv(self) -> int:
        """No KV cells: graphs of a recurrent memory have no KV length."""
        return 0

    def n_kv_swa(self) -> int:
        return 0

    def get_used(self) -> int:
        return int(np.count_nonzero(self.pos >= 0))
