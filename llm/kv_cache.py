"""The KV cache (llama_kv_cache): per-layer K and V device buffers plus the cell bookkeeping
of `llm.kv_cells`. Buffers are ggmlx STATE leaves [n_embd_{k,v}_gqa, n_ctx] on their
layer's device; a compiled graph takes them in and returns them updated (donated, so the
set_rows write happens in place).

Sliding-window layers get a cache of their own, as llama.cpp's `llama_kv_cache_iswa`: n_swa
(per sequence) plus one ubatch of cells, padded to the KV bucket, with their own `KVCells`
that reuse a cell once its position has left the window of its sequence; full-attention
layers keep n_ctx cells. It is opt-in here (`Context(swa_full=False)`; llama.cpp's cparam
defaults to it): state save/load does not handle two sets of cells yet. With swa_full=True,
or when the window cache would not be smaller, the SWA layers share the full cells and only
get their mask.
The two sets of cells see the same ubatches and sequence operations, so they agree on every
position the window still holds."""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import types
from ggmlx.backend import MESH_AXIS
from ggmlx.tensor import Tensor, buffer_layout, new_state
from ggmlx.types import GGMLType, block_size, row_size
from llm.batch import UBatch
from llm.errors import SizeError
from llm.hparams import HParams, SWAType
from llm.kv_cells import KVCells, SlotInfo

if TYPE_CHECKING:
    from llm.model import Model

# llama.cpp's cache types (common/arg.cpp's kv_cache_types). A block type holds each cell's row
# as ggml's blocks, written by set_rows' quantize_row_*_ref; attention dequantizes the cells it reads.
KV_TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16, "q8_0": GGMLType.Q8_0,
            "q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1, "iq4_nl": GGMLType.IQ4_NL, "q5_0": GGMLType.Q5_0,
            "q5_1": GGMLType.Q5_1}

_F = TypeVar("_F", bound=Callable[..., Any])


def locked(method: _F) -> _F:
    """Run the method under its object's `lock`: calls from several threads take turns
    instead of handing the same donated buffers to two computations."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


def available_bytes(device: jax.Device) -> int | None:
    """Memory that a new buffer on `device` may still take: the allocator's free bytes on an
    accelerator, the host's available memory for the CPU; None when unknown."""
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_bytes_per_device(model, n_ctx: int, type_k: GGMLType, type_v: GGMLType) -> dict[jax.Device, int]:
    """Bytes the K and V buffers of n_ctx cells take on each device: a layer's on its device
    (split_mode "layer"); over a mesh (split_mode "row") every device holds 1/n of each layer
    when the cache is divided by KV heads, the whole of it when replicated."""
    hp = model.hparams
    pl = model.placement
    mesh_devices = list(pl.mesh.devices.flat) if pl.mesh is not None else []
    share = len(mesh_devices) if pl.kv_split else 1
    need: dict[jax.Device, int] = {}
    for il in filter(hp.has_kv, range(hp.n_layer)):
        n_v = 0 if hp.is_mla else hp.n_embd_v_gqa(il)       # MLA: V is a view of the latent in K
        n = n_ctx * (row_size(type_k, hp.n_embd_k_gqa(il)) + row_size(type_v, n_v))
        for dev in mesh_devices or [pl.dev_layer[il]]:
            need[dev] = need.get(dev, 0) + n // share
    return need


def check_fits(model, n_ctx: int, type_k: GGMLType, type_v: GGMLType) -> None:
    """SizeError, with the estimate, when the K and V buffers of n_ctx cells do not fit in
    the memory of their devices (asking XLA for 77 GB fails late, with a long traceback)."""
    for dev, n in kv_bytes_per_device(model, n_ctx, type_k, type_v).items():
        free = available_bytes(dev)
        if free is not None and n > free:
            raise SizeError(f"n_ctx = {n_ctx}: the KV cache needs {n / 2**30:.2f} GiB on {dev}, "
                            f"more than the {free / 2**30:.2f} GiB available "
                            f"(the model was trained with a context of {model.hparams.n_ctx_train})")


def _zeros_on_mesh(t: Tensor, pl) -> jax.Array:
    """A zero cache buffer over the mesh: divided by KV heads (its ggml dim 0, the heads'
    features) when they divide, else replicated; every process makes only its shards."""
    P = jax.sharding.PartitionSpec
    spec = P(None, None, None, MESH_AXIS) if pl.kv_split else P()
    sharding = jax.sharding.NamedSharding(pl.mesh, spec)
    shape, dt = buffer_layout(t)
    return jax.make_array_from_callback(shape, sharding, lambda idx: np.zeros(sharding.shard_shape(shape), dt))


def swa_cache_size(hp: HParams, n_ctx: int, n_seq_max: int = 1, n_ubatch: int = 512, kv_bucket: int = 256,
                   swa_full: bool = False) -> int | None:
    """Cells of the sliding-window layers' own cache: n_swa per sequence plus one ubatch,
    padded to the KV bucket (llama_kv_cache_iswa's size_swa); None when they keep the full
    cache (no SWA layers, swa_full, or a window cache that would not be smaller)."""
    if not any(hp.swa_layers) or hp.swa_type == SWAType.NONE or swa_full:
        return None
    size = -(-(hp.n_swa * n_seq_max + n_ubatch) // kv_bucket) * kv_bucket
    return size if size < n_ctx else None


def estimate_bytes(hp: HParams, n_ctx: int, type_k: str = "f32", type_v: str = "f32", **swa) -> int:
    """Bytes of the K and V buffers a KVCache(n_ctx, ...) allocates (llama.cpp's: a row of
    n_embd_{k,v}_gqa values per cell and layer in the type's bytes, ggml_row_size); swa: the
    keyword arguments of swa_cache_size (n_seq_max, n_ubatch, kv_bucket, swa_full)."""
    n_swa_cells = swa_cache_size(hp, n_ctx, **swa) or n_ctx
    tk, tv = (kv_type(name, t) for name, t in (("type_k", type_k), ("type_v", type_v)))
    n_v = [0 if hp.is_mla else hp.n_embd_v_gqa(il) for il in range(hp.n_layer)]
    return sum((n_swa_cells if hp.is_swa(il) else n_ctx) * (row_size(tk, hp.n_embd_k_gqa(il)) + row_size(tv, n_v[il]))
               for il in filter(hp.has_kv, range(hp.n_layer)))


def mla_per_head_bytes(hp: HParams, n_ctx: int, type_k: str = "f32", type_v: str = "f32") -> int:
    """Bytes an MLA model's cache would need with per-head K and V (n_head heads of the
    decompressed k_mla / v_mla sizes, as an unabsorbed cache holds them): what its latent saves."""
    tk, tv = (kv_type(name, t) for name, t in (("type_k", type_k), ("type_v", type_v)))
    k, v = hp.n_embd_head_k_mla, hp.n_embd_head_v_mla
    return sum(n_ctx * (row_size(tk, hp.n_head(il) * k) + row_size(tv, hp.n_head(il) * v))
               for il in filter(hp.has_kv, range(hp.n_layer)))


def kv_type(name: str, t: str) -> GGMLType:
    """The GGML type of cache type t (llama.cpp's name); ValueError naming the argument."""
    if t not in KV_TYPES:
        raise ValueError(f"{name} must be one of {', '.join(KV_TYPES)}, got {t!r}")
    return KV_TYPES[t]


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of order n (a power of two) as llama.cpp's
    ggml_gen_hadamard builds it, float32 [n, n]; it is its own inverse."""
    h = np.zeros((n, n), np.float32)
    h[0, 0] = 1.0 / np.sqrt(np.float32(n))
    s = 1
    while s < n:
        h[s:2 * s, :s], h[:s, s:2 * s], h[s:2 * s, s:2 * s] = h[:s, :s], h[:s, :s], -h[:s, :s]
        s *= 2
    return h


def rotation_sizes(hp: HParams, tk: GGMLType, tv: GGMLType) -> tuple[int, int]:
    """Orders of the Hadamard rotations llama.cpp applies to Q and K, and to V (0: none): with
    a quantized cache and one head size in every layer that is a multiple of 64, K and Q turn
    by the largest power of two >= 64 dividing it, V by 64 (and the attention output back), so
    the quantized rows spread an outlier over the block (llama_kv_cache's attn_rot_k/v)."""
    layers = [il for il in range(hp.n_layer) if hp.has_kv(il) and hp.n_head_kv(il) > 0]
    heads_k = {hp.n_embd_k_gqa(il) // hp.n_head_kv(il) for il in layers}
    heads_v = {hp.n_embd_v_gqa(il) // hp.n_head_kv(il) for il in layers}
    n_k = n_v = 0
    if types.traits(tk).is_quantized and len(heads_k) == 1 and (d_k := heads_k.pop()) % 64 == 0 and d_k > 0:
        n_k = 64
        while d_k % (2 * n_k) == 0:
            n_k *= 2
    if types.traits(tv).is_quantized and len(heads_v) == 1 and (d_v := heads_v.pop()) % 64 == 0 and d_v > 0:
        n_v = 64
    return n_k, n_v


class KVCache:
    """The attention memory (llama_kv_cache); `mem_attn` is itself, it has no recurrent part.
    n_rot_k / n_rot_v: the orders of the Hadamard rotations of a quantized cache (rotation_sizes)."""

    mem_recr = None

    def __init__(self, model: Model, n_ctx: int, n_seq_max: int, type_k: str = "f32", type_v: str = "f32",
                 kv_bucket: int = 256, *, n_ubatch: int = 512, swa_full: bool = True):
        hp = model.hparams
        tk, tv = kv_type("type_k", type_k), kv_type("type_v", type_v)
        if kv_bucket < 1:
            raise ValueError(f"kv_bucket must be >= 1, got {kv_bucket}")
        for name, t, n in (("type_k", tk, hp.n_embd_head_k), ("type_v", tv, hp.n_embd_head_v)):
            if n % block_size(t):
                raise ValueError(f"{name} = {t.name.lower()}: the head size {n} is not a multiple of "
                                 f"its block size {block_size(t)}")
            if hp.is_mla and types.traits(t).is_quantized:
                raise ValueError(f"{name} = {t.name.lower()}: a quantized cache of multi-head latent "
                                 f"attention is not supported")
        self.n_rot_k, self.n_rot_v = rotation_sizes(hp, tk, tv)
        check_fits(model, n_ctx, tk, tv)
        self.hparams = hp
        self.n_ctx = n_ctx
        self.kv_bucket = kv_bucket
        # llama.cpp's cparams.causal_attn: the model's, switched off around an image's tokens by
        # llama_set_causal_attn (Context.set_causal_attn) for models that attend over it whole
        self.causal_attn = hp.causal_attn
        self.lock = threading.RLock()     # one decode or sequence operation at a time
        self.cells = KVCells(n_ctx, n_seq_max)
        self.cells_swa: KVCells | None = None     # the sliding-window layers' own cells, if any
        self.n_ctx_swa = swa_cache_size(hp, n_ctx, n_seq_max, n_ubatch, kv_bucket, swa_full) or n_ctx
        if self.n_ctx_swa < n_ctx:
            self.cells_swa = KVCells(self.n_ctx_swa, n_seq_max, swa_type=hp.swa_type, n_swa=hp.n_swa)
        self.k_l: list[Tensor] = []
        self.v_l: list[Tensor] = []
        self._device: dict[Tensor, jax.Device] = {}
        self._place = model.place
        for il in range(hp.n_layer):
            if not hp.has_kv(il):       # KV sharing: the same buffers as the layer it reads
                self.k_l.append(self.k_l[hp.kv_layer(il)])
                self.v_l.append(self.v_l[hp.kv_layer(il)])
                continue
            size = self.n_ctx_of(il)
            k = new_state(tk, (hp.n_embd_k_gqa(il), size), f"cache_k_l{il}")
            v = new_state(tv, (0 if hp.is_mla else hp.n_embd_v_gqa(il), size), f"cache_v_l{il}")   # MLA: V is in K
            for buf in (k, v):
                self._device[buf] = self._place.dev_layer[il]
                buf.data = self._zeros(buf)
            self.k_l.append(k)
            self.v_l.append(v)

    @property
    def mem_attn(self) -> KVCache:
        return self

    def get_used(self) -> int:
        return self.cells.get_used()

    def _zeros(self, t: Tensor) -> jax.Array:
        if self._place.mesh is not None:
            return _zeros_on_mesh(t, self._place)
        shape, dt = buffer_layout(t)
        dev = self._device[t]
        if dev.platform == "cpu":
            # host zeros copied in: jnp.zeros would compile a broadcast first (SmolLM2's 60 buffers:
            # 65 ms instead of 104 ms of a process's start)
            return jax.device_put(np.zeros(shape, dt), dev)
        return jnp.zeros(shape, dt, device=dev)

    def lost(self) -> bool:
        """Were buffers donated to a computation that failed before handing them back?"""
        return any(t.data.is_deleted() for t in self.k_l + self.v_l)

    @locked
    def rebuild(self) -> list[int]:
        """New zero buffers for the lost ones and every cell cleared: the K/V of every cached
        token are gone. Returns the sequences that held cells (now cleared)."""
        seqs = [s for s in range(self.cells.n_seq_max) if self.cells.seq_pos_max(s) >= 0]
        self.clear()
        return seqs

    @property
    def nbytes(self) -> int:
        return sum(t.data.size * t.data.dtype.itemsize for t in self.state())

    def state(self) -> dict[Tensor, jax.Array]:
        return {t: t.data for t in self.k_l + self.v_l}

    def update(self, new_state: dict[Tensor, jax.Array]) -> None:
        for t, v in new_state.items():
            t.data = v

    def is_swa(self, il: int) -> bool:
        """Whether layer il has the sliding-window cache (not the full one)."""
        return self.cells_swa is not None and self.hparams.is_swa(il)

    def n_ctx_of(self, il: int) -> int:
        """Cells of layer il's buffers."""
        return self.n_ctx_swa if self.is_swa(il) else self.n_ctx

    def all_cells(self) -> list[KVCells]:
        return [self.cells] if self.cells_swa is None else [self.cells, self.cells_swa]

    # ---- slots -----------------------------------------------------------------------

    def prepare(self, ubatches: list[UBatch]) -> list[tuple[SlotInfo, SlotInfo | None]] | None:
        """Slots for all ubatches in the full cells and, if any, in the window cells (None
        when either has no room; nothing changes either way)."""
        slots = self.cells.prepare(ubatches)
        if slots is None:
            return None
        if self.cells_swa is None:
            return [(s, None) for s in slots]
        slots_swa = self.cells_swa.prepare(ubatches)
        if slots_swa is None:
            return None
        return list(zip(slots, slots_swa, strict=True))

    def apply(self, slot: tuple[SlotInfo, SlotInfo | None], ub: UBatch) -> None:
        self.cells.apply(slot[0], ub)
        if self.cells_swa is not None and slot[1] is not None:
            self.cells_swa.apply(slot[1], ub)

    def undo(self, ub: UBatch) -> None:
        """Remove a failed or aborted ubatch's positions, as llama_decode does, so no cell
        claims K/V that were never written."""
        for s in ub.seq_id_unq:
            in_seq = np.array([int(s) in ids for ids in ub.seq_id])
            for c in self.all_cells():
                c.seq_rm(int(s), int(ub.pos[in_seq].min()), -1)

    @staticmethod
    def split_slot(slot: tuple[SlotInfo, SlotInfo | None]) -> tuple:
        """(the KV cache's slot, no recurrent cells) of a ubatch."""
        return slot, None

    def can_keep(self, seq_id: int, n_keep: int) -> bool:
        """Whether decoding seq_id on from position n_keep (after seq_rm(seq_id, n_keep, -1))
        sees everything it should: the window cells must still hold the positions the next
        token's window needs (llama.cpp's server forces a full re-processing otherwise)."""
        if n_keep == 0 or self.cells_swa is None:
            return True
        p_min = self.cells_swa.seq_pos_min(seq_id)
        return 0 <= p_min <= max(0, n_keep - self.hparams.n_swa)

    # ---- graph inputs ----------------------------------------------------------------

    def n_kv(self) -> int:
        return self.cells.n_kv(self.kv_bucket)

    def n_kv_at(self, used_max_p1: int) -> int:
        """n_kv once the cells up to used_max_p1 are filled."""
        return self.cells.n_kv_of(used_max_p1, self.kv_bucket)

    def n_kv_swa(self) -> int:
        """KV length the sliding-window layers read (n_kv() when they share the full cells)."""
        if self.cells_swa is None:
            return self.n_kv()
        return self.cells_swa.n_kv(min(self.kv_bucket, self.n_ctx_swa))

    def write_indices(self, slot: SlotInfo, n_tokens_pad: int, swa: bool = False) -> np.ndarray:
        cells = self.cells_swa if swa and self.cells_swa is not None else self.cells
        return cells.write_indices(slot, n_tokens_pad)

    def mask(self, ub: UBatch, n_tokens_pad: int, n_kv: int, swa: bool) -> np.ndarray:
        hp = self.hparams
        if swa and self.cells_swa is not None:
            return self.cells_swa.build_mask(ub, n_kv, n_tokens_pad=n_tokens_pad, causal=self.causal_attn)
        if swa:
            return self.cells.build_mask(ub, n_kv, n_tokens_pad=n_tokens_pad, causal=self.causal_attn,
                                         swa_type=hp.swa_type, n_swa=hp.n_swa)
        return self.cells.build_mask(ub, n_kv, n_tokens_pad=n_tokens_pad, causal=self.causal_attn,
                                     swa_type=SWAType.NONE)

    # ---- sequence ops (llama_memory_seq_*) ---------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        """The smallest position every layer still holds (the window cache's, when there is one)."""
        return (self.cells_swa or self.cells).seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.cells.seq_pos_max(seq_id)

    @locked
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        for c in self.all_cells():
            c.seq_rm(seq_id, p0, p1)
        return True

    @locked
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        for c in self.all_cells():
            c.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    @locked
    def seq_keep(self, seq_id: int) -> None:
        for c in self.all_cells():
            c.seq_keep(seq_id)

    @locked
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Shift positions; the cached K rows are re-rotated before the next decode."""
        for c in self.all_cells():
            c.seq_add(seq_id, p0, p1, shift)

    @locked
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide positions [p0, p1) by d; the cached K rows are re-rotated before the next decode."""
        for c in self.all_cells():
            c.seq_div(seq_id, p0, p1, d)

    @property
    def has_shift(self) -> bool:
        return any(c.has_shift for c in self.all_cells())

    @locked
    def clear(self) -> None:
        """Empty every cell; buffers lost in a failed computation get new (zero) ones."""
        for t in self.k_l + self.v_l:
            if t.data.is_deleted():
                t.data = self._zeros(t)
        for c in self.all_cells():
            c.clear()
