"""The hybrid memory (llama.cpp's llama_memory_hybrid): the attention layers' KV cache and the
recurrent layers' states side by side, seeing the same ubatches and sequence operations.
A sequence operation that the recurrent part refuses (removing a sequence's tail) changes
neither part."""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from ggmlx.tensor import Tensor
from llm.batch import UBatch
from llm.kv_cache import KVCache
from llm.memory_recurrent import MemoryRecurrent, RecurrentCheckpoint

if TYPE_CHECKING:
    from llm.model import Model


class MemoryHybrid:
    def __init__(self, model: Model, n_ctx: int, n_seq_max: int, type_k: str = "f32", type_v: str = "f32",
                 kv_bucket: int = 256, *, n_ubatch: int = 512, swa_full: bool = True):
        self.mem_attn = KVCache(model, n_ctx, n_seq_max, type_k, type_v, kv_bucket, n_ubatch=n_ubatch,
                                swa_full=swa_full)
        self.mem_recr = MemoryRecurrent(model, n_seq_max)
        self.mem_recr.lock = self.lock = self.mem_attn.lock       # one lock for both parts
        self.hparams = model.hparams

    # the attention part's view, for the callers that size or read the KV cells
    @property
    def cells(self):
        return self.mem_attn.cells

    @property
    def cells_swa(self):
        return self.mem_attn.cells_swa

    @property
    def n_ctx(self) -> int:
        return self.mem_attn.n_ctx

    @property
    def has_shift(self) -> bool:
        return self.mem_attn.has_shift

    def n_kv(self) -> int:
        return self.mem_attn.n_kv()

    def n_kv_at(self, used_max_p1: int) -> int:
        return self.mem_attn.n_kv_at(used_max_p1)

    def n_kv_swa(self) -> int:
        return self.mem_attn.n_kv_swa()

    def get_used(self) -> int:
        return self.mem_attn.get_used()

    # ---- buffers ---------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.mem_attn.nbytes + self.mem_recr.nbytes

    def state(self) -> dict[Tensor, jax.Array]:
        return self.mem_attn.state() | self.mem_recr.state()

    def update(self, new_state: dict[Tensor, jax.Array]) -> None:
        for t, v in new_state.items():
            t.data = v

    def lost(self) -> bool:
        return self.mem_attn.lost() or self.mem_recr.lost()

    def rebuild(self) -> list[int]:
        with self.lock:
            seqs = sorted(set(self.mem_attn.rebuild()) | set(self.mem_recr.rebuild()))
        return seqs

    def clear(self) -> None:
        with self.lock:
            self.mem_attn.clear()
            self.mem_recr.clear()

    # ---- slots -----------------------------------------------------------------------

    def prepare(self, ubatches: list[UBatch]) -> list[tuple] | None:
        attn = self.mem_attn.prepare(ubatches)
        recr = self.mem_recr.prepare(ubatches)
        if attn is None or recr is None:
            return None
        return list(zip(attn, recr, strict=True))

    def apply(self, slot: tuple, ub: UBatch) -> None:
        self.mem_attn.apply(slot[0], ub)
        self.mem_recr.apply(slot[1], ub)

    def undo(self, ub: UBatch) -> None:
        self.mem_attn.undo(ub)
        self.mem_recr.undo(ub)

    @staticmethod
    def split_slot(slot: tuple) -> tuple:
        """(the KV cache's slot, the recurrent cells) of a ubatch."""
        return slot

    # ---- sequence ops ------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        return max(self.mem_attn.seq_pos_min(seq_id), self.mem_recr.seq_pos_min(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return self.mem_attn.seq_pos_max(seq_id)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        with self.lock:
            if not self.mem_recr.can_seq_rm(seq_id, p0, p1):
                return False
            self.mem_attn.seq_rm(seq_id, p0, p1)
            return self.mem_recr.seq_rm(seq_id, p0, p1)

    def seq_checkpoint(self, seq_id: int) -> RecurrentCheckpoint:
        return self.mem_recr.seq_checkpoint(seq_id)

    def seq_restore(self, cp: RecurrentCheckpoint) -> None:
        """The recurrent states back to the checkpoint, the KV cells after it removed."""
        with self.lock:
            self.mem_recr.seq_restore(cp)
            self.mem_attn.seq_rm(cp.seq_id, cp.pos + 1, -1)

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        with self.lock:
            self.mem_attn.seq_cp(seq_id_src, seq_id_dst, p0, p1)
            self.mem_recr.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        with self.lock:
            self.mem_attn.seq_keep(seq_id)
            self.mem_recr.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        with self.lock:
            self.mem_attn.seq_add(seq_id, p0, p1, shift)
            self.mem_recr.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        with self.lock:
            self.mem_attn.seq_div(seq_id, p0, p1, d)
            self.mem_recr.seq_div(seq_id, p0, p1, d)

    def can_keep(self, seq_id: int, n_keep: int) -> bool:
        return self.mem_attn.can_keep(seq_id, n_keep) and self.mem_recr.can_keep(seq_id, n_keep)


def memory_kind(memory) -> str:
    """"kv", "recurrent" or "hybrid": which of llama.cpp's memories a context holds."""
    if isinstance(memory, MemoryHybrid):
        return "hybrid"
    return "recurrent" if isinstance(memory, MemoryRecurrent) else "kv"


