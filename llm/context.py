"""The context (llama_context): KV cache, batch allocator, scheduler and the decode loop.

decode(batch) mirrors llama_decode: validate and split the batch, find KV cells for every
ubatch before any runs (all or nothing), then per ubatch: apply its cells, reuse the previous
graph when every input's can_reuse holds or build a new one, set the inputs, compute, and
copy the requested logits rows to the host output buffer."""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ggmlx import ops, types
from ggmlx.backend import backend_of, mesh_backend
from ggmlx.compile import get_default_cache
from ggmlx.graph import Graph
from ggmlx.sched import Plan, Scheduler
from ggmlx.tensor import Tensor, new_input
from ggmlx.types import GGMLType
from ggmlx.weights import materialize
from llm import params as params_mod
from llm import state
from llm.adapter import LoraAdapter, LoraScales
from llm.arch import llm_arch_is_hybrid, llm_arch_is_recurrent
from llm.batch import POS_MAX, Batch, BatchAllocator, BatchError, UBatch
from llm.errors import StateError
from llm.graph import GraphBuilder, GraphHook, GraphParams, mul_mat_hadamard, rope_params
from llm.hparams import PoolingType
from llm.kv_cache import KV_TYPES, KVCache, hadamard, locked
from llm.memory_hybrid import MemoryHybrid
from llm.memory_recurrent import MemoryRecurrent
from llm.model import Model
from llm.params import ParamError, param, with_parameters

logger = logging.getLogger(__name__)

GRAPHS_KEPT = 32    # built graphs a context keeps by shape (ubatch size, outputs, KV length)
# A loaded executable of a big ubatch holds XLA memory in proportion to its rows (SmolLM2 at 512
# rows: 82 MB, at 128: 16 MB), and a long prompt crosses a KV bucket with nearly every ubatch:
# of the graphs of at least LARGE_UBATCH tokens a context keeps only the LARGE_GRAPHS_KEPT used
# last, the others dropped once their executables are on disk (reading one back: ~0.1 s).
LARGE_UBATCH = 256
LARGE_GRAPHS_KEPT = 2


class DecodeStatus(IntEnum):
    """llama_decode's return codes; an IntEnum, so each compares equal to llama.cpp's number."""

    OK = 0              # the batch was decoded
    NO_KV_SLOT = 1      # no room in the KV cache for the batch (cache unchanged)
    ABORTED = 2         # the abort or eval callback stopped it (earlier ubatches kept)
    INVALID_BATCH = -1  # the batch is malformed (nothing changed)
    FATAL = -3          # the engine failed while computing (see Context.last_exception)


def bucket(n: int, cap: int | None = None) -> int:
    """The padded size of n: the next power of two, at most cap (and never below n)."""
    p = 1
    while p < n:
        p *= 2
    return p if cap is None else max(min(p, cap), n)


@dataclass
class Perf:
    t_start: float
    t_p_eval: float = 0.0
    t_eval: float = 0.0
    t_compile: float = 0.0
    t_wait: float = 0.0        # from dispatching a ubatch until its logits are on the host
    t_inputs: float = 0.0      # device_put of graph inputs (part of neither of the above)
    n_p_eval: int = 0
    n_eval: int = 0
    n_reused: int = 0
    n_graph_builds: int = 0
    n_compiles: int = 0


def _weight(t) -> np.ndarray:
    """A weight's values as float32 rows [ne1, ne0] (a vector: [ne0])."""
    x = np.asarray(materialize(t.data), np.float32)
    return x.reshape(-1) if t.ne[1] == 1 else x.reshape(-1, t.ne[0])


def rank_head(model, v: np.ndarray) -> np.ndarray:
    """The classification head of rank pooling: tanh(cls v + cls_b), then cls_out (+ cls_out_b)."""
    v = v.astype(np.float32)
    if model.cls is not None:
        v = _weight(model.cls) @ v
        if model.cls_b is not None:
            v = v + _weight(model.cls_b)
        v = np.tanh(v)
    if model.cls_out is not None:
        v = _weight(model.cls_out) @ v
        if model.cls_out_b is not None:
            v = v + _weight(model.cls_out_b)
    return v


# The KV cache type of a context that names none, by the model's numerics: llama.cpp's own (f16)
# under "ggml", whose runs follow llama.cpp's default ones; f32 under "exact" (research,
# gradients, the parity tests' F32 caches).
DEFAULT_KV_TYPE = {"exact": "f32", "ggml": "f16"}


@dataclass
class ContextParams:
    """llama_context_params (with common's flags): how a Context is sized and what it computes."""

    n_ctx: int = param(2048, flags=("-c", "--ctx-size"), lo=1, help="size of the prompt context (KV cells)")
    n_batch: int = param(512, flags=("-b", "--batch-size"), lo=1, help="logical maximum batch size")
    n_ubatch: int = param(512, flags=("-ub", "--ubatch-size"), lo=1, help="physical maximum batch size")
    n_seq_max: int = param(1, flags=("-np", "--parallel"), lo=1,
                           help="number of parallel sequences (server slots)")
    type_k: str | None = param(None, flags=("-ctk", "--cache-type-k"), choices=tuple(KV_TYPES),
                               help="KV cache data type for K; unset: f16 under numerics ggml (llama.cpp's "
                                    "default), f32 under exact")
    type_v: str | None = param(None, flags=("-ctv", "--cache-type-v"), choices=tuple(KV_TYPES),
                               help="KV cache data type for V (a quantized one needs flash_attn); unset: as for K")
    kv_bucket: int = param(256, lo=1, help="KV lengths are padded to a multiple of this (one graph per bucket)")
    swa_full: bool = param(True, flags=("--swa-full",),
                           help="full-size cache for sliding-window layers (needed to save/restore state)")
    embeddings: bool = param(False, flags=("--embeddings",), help="output embeddings (and pooled ones)")
    pooling_type: str | int | None = param(None, flags=("--pooling",), choices=("none", "mean", "cls", "last", "rank"),
                                           help="pooling type for embeddings; the model's if unset")
    flash_attn: bool = param(True, flags=("-fa", "--flash-attn"),
                             help="fused attention; off: the unfused path with kq / kq_soft_max nodes")
    n_outputs_min: int = param(1, lo=1, help="graphs output at least this many rows (one output size for a server)")
    reserve: tuple[int, ...] = param((), help="ubatch sizes to compile ahead when the context is made")


def kv_types(p: ContextParams, numerics: str) -> tuple[str, str]:
    """The K and V cache types of p, DEFAULT_KV_TYPE[numerics] where it names none."""
    default = DEFAULT_KV_TYPE[numerics]
    return p.type_k or default, p.type_v or default


def create_memory(model: Model, p: ContextParams, n_ubatch: int) -> KVCache | MemoryRecurrent | MemoryHybrid:
    """The memory the architecture needs (llama_model::create_memory): a recurrent memory for
    Mamba-style models, a hybrid one for models mixing attention and recurrent layers, else
    the KV cache. p's cache types are resolved (kv_types), as the Context's own params are."""
    arch = model.hparams.arch
    if llm_arch_is_recurrent(arch):
        return MemoryRecurrent(model, p.n_seq_max)
    assert p.type_k is not None and p.type_v is not None
    if llm_arch_is_hybrid(arch):
        return MemoryHybrid(model, p.n_ctx, p.n_seq_max, p.type_k, p.type_v, p.kv_bucket, n_ubatch=n_ubatch,
                            swa_full=p.swa_full)
    return KVCache(model, p.n_ctx, p.n_seq_max, p.type_k, p.type_v, p.kv_bucket, n_ubatch=n_ubatch,
                   swa_full=p.swa_full)


def _lora_scales(scales: tuple, n: int, where: str) -> tuple[float, ...]:
    if len(scales) != n:
        raise ValueError(f"{where}: {len(scales)} scales for {n} adapters")
    for i, v in enumerate(scales):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}: scales[{i}] = {v!r} is not a finite number")
    return tuple(float(v) for v in scales)


class Context:
    """A model plus its KV cache and runtime state; see docs/design.md for the contract."""

    @with_parameters(ContextParams)
    def __init__(self, model: Model, params: ContextParams | None = None, *, cb_eval: Callable | None = None,
                 abort_callback: Callable[[], bool] | None = None, **kwargs):
        """`params` (or its fields as keyword arguments, which override it): see ContextParams.
        `cb_eval` sees every node's value (ggml's eval callback); `abort_callback` returning
        True stops a decode between ubatches."""
        if model.placement is None:
            raise ValueError("the model was loaded with vocab_only=True: it has no weights to decode with")
        p = params_mod.from_kwargs(ContextParams, kwargs, where="Context", base=params or ContextParams())
        params_mod.check(p)
        type_k, type_v = kv_types(p, model.numerics)
        p = dataclasses.replace(p, type_k=type_k, type_v=type_v)
        self.params = p
        n_ctx, n_batch, n_ubatch, n_seq_max = p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max
        embeddings, pooling_type, flash_attn = p.embeddings, p.pooling_type, p.flash_attn
        if n_ctx > POS_MAX + 1:
            raise ValueError(f"n_ctx = {n_ctx} is more than the {POS_MAX + 1} cells a KV cache can index "
                             f"(int32 positions; the model was trained with {model.hparams.n_ctx_train})")
        hp = model.hparams
        if not flash_attn and types.traits(KV_TYPES[type_v]).is_quantized:
            raise ParamError("type_v", f"type_v = {type_v}: a quantized V cache needs flash_attn "
                                       f"(as llama.cpp: the unfused path multiplies by V transposed)")
        self.embeddings = bool(embeddings)
        self.pooling_type = hp.pooling_type if pooling_type is None else PoolingType.parse(pooling_type)
        if self.pooling_type == PoolingType.UNSPECIFIED:
            self.pooling_type = hp.pooling_type
        self.has_logits = model.output is not None
        if not self.has_logits and not self.embeddings:
            raise ValueError(f"model {model.path} ({model.arch}) has no output layer, it only gives "
                             f"embeddings: create the context with embeddings=True")
        if self.embeddings and self.pooling_type == PoolingType.RANK and model.cls_out is None \
                and model.cls is None:
            raise ValueError(f"pooling_type 'rank' needs a classifier head (cls.weight or cls.output.weight), "
                             f"which model {model.path} ({model.arch}) does not have")
        self.model = model
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_ubatch = min(n_ubatch, n_batch)
        self.n_seq_max = n_seq_max
        # graphs output at least this many rows (when the ubatch has that many tokens): a server
        # that samples up to n_seq_max rows per step then compiles one output size, not five
        self.n_outputs_min = p.n_outputs_min
        self.abort_callback = abort_callback
        self.flash_attn = flash_attn       # False: the unfused attention path (kq_soft_max nodes)
        # interventions / captures (a GraphHook: llm.research.trace.GraphEdits) for the next decodes
        self.edits: GraphHook | None = None
        # LoRA adapters applied to every decode and their scales (set_adapters_lora; one object
        # for the context's life, read by the graphs' InpLora)
        self.lora = LoraScales()
        self.memory = create_memory(model, p, self.n_ubatch)
        self.recurrent = self.memory.mem_recr is not None
        # one lock for the cache and the context: a decode and a sequence operation from
        # another thread take turns (each is short); outputs belong to the last decode
        self.lock = self.memory.lock
        self.balloc = BatchAllocator()
        pl = model.place
        if pl.mesh is not None:
            backend_list = [mesh_backend(pl.mesh)]
        else:
            devices = []
            for d in [pl.dev_input, *pl.dev_layer, pl.dev_output]:
                if d not in devices:
                    devices.append(d)
            backend_list = [backend_of(d) for d in devices]
        self.sched = Scheduler(backend_list, get_default_cache(), cb_eval)
        self.logits = np.zeros((0, model.n_vocab), np.float32)
        self.embd = np.zeros((0, hp.n_embd), np.float32)
        self.embd_seq: dict[int, np.ndarray] = {}
        self.output_ids = np.zeros(0, np.int32)
        self.last_error: str | None = None
        self.last_exception: BaseException | None = None    # behind the last DecodeStatus.FATAL
        self._prev: tuple[GraphBuilder, Plan] | None = None   # the last graph, for reuse
        # graphs built (and compiled) by shape, so a shape seen before costs no build or lookup
        self._graphs: OrderedDict[GraphParams, tuple[GraphBuilder, Plan]] = OrderedDict()
        self._fingerprint: bytes | None = None
        self._perf = Perf(time.perf_counter())
        if p.reserve:
            self.reserve(p.reserve)

    # ---- LoRA adapters -------------------------------------------------------------------

    @locked
    def set_adapters_lora(self, adapters: Sequence[LoraAdapter], scales: Sequence[float]) -> None:
        """llama_set_adapters_lora: apply these adapters (loaded for this model by
        llm.adapter_lora_init) with these scales to the following decodes; an empty list removes
        them. The same adapters with other scales reuse the compiled graphs (scales are inputs);
        sequences' own scales (set_adapter_scales_seq) are dropped when the set changes."""
        adapters, scales = tuple(adapters), tuple(scales)
        if len(adapters) != len(scales):
            raise ValueError(f"set_adapters_lora: {len(adapters)} adapters but {len(scales)} scales")
        for i, a in enumerate(adapters):
            if not isinstance(a, LoraAdapter):
                raise TypeError(f"set_adapters_lora: adapters[{i}] is {type(a).__name__}, not an llm.LoraAdapter")
            if a.model is not self.model:
                raise ValueError(f"set_adapters_lora: adapters[{i}] ({a.path}) was loaded for another model")
        if len(set(map(id, adapters))) != len(adapters):
            raise ValueError("set_adapters_lora: an adapter is listed twice")
        checked = _lora_scales(scales, len(adapters), "set_adapters_lora")
        if adapters != self.lora.adapters:
            self.lora.seq.clear()
        # changed in place: the graphs' InpLora read this object at each decode
        self.lora.adapters, self.lora.scales = adapters, checked

    @locked
    def set_adapter_scales_seq(self, seq_id: int, scales: Sequence[float] | None) -> None:
        """The scales of the applied adapters for sequence `seq_id`'s tokens alone (one per
        adapter, in set_adapters_lora's order; 0 leaves an adapter off), or None to use the
        context's again: sequences with different adapters decode in one batch."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"set_adapter_scales_seq: seq_id {seq_id!r} is not in [0, {self.n_seq_max})")
        if scales is None:
            self.lora.seq.pop(seq_id, None)
        else:
            self.lora.seq[seq_id] = _lora_scales(tuple(scales), len(self.lora.adapters), "set_adapter_scales_seq")

    @locked
    def reserve(self, n_tokens: tuple[int, ...] = (1,), n_kv: tuple[int, ...] | None = None) -> int:
        """Compile ahead of time the graphs of ubatches of these sizes that output the last
        token's logits, at each KV length of n_kv (default: the current one; graph
        reservation; 1 = the decode step). The executables land in the shared cache, so the
        first real ubatch of such a size compiles nothing. Returns the number of compilations."""
        kv_lengths = (self.memory.n_kv(),) if n_kv is None else tuple(n_kv)
        for n in n_tokens:
            if not 1 <= n <= self.n_ubatch:
                raise ValueError(f"reserve: ubatch size {n} is outside [1, n_ubatch = {self.n_ubatch}]")
        if self.memory.mem_attn is None:        # states only: no KV length
            return self._reserve([self._reserve_params(n, 0) for n in n_tokens])
        for kv in kv_lengths:
            if not 1 <= kv <= self.n_ctx:
                raise ValueError(f"reserve: KV length {kv} is outside [1, n_ctx = {self.n_ctx}]")
        return self._reserve([self._reserve_params(n, kv) for n in n_tokens for kv in kv_lengths])

    @locked
    def reserve_generation(self, n_prompt: int, n_predict: int, verify: tuple[int, ...] = ()) -> int:
        """Compile ahead every graph that decoding n_prompt tokens (in n_batch, then n_ubatch
        pieces) and then up to n_predict - 1 single tokens will use, starting from the cache as it
        is: the KV buckets a generation crosses compile before its first token, not in the
        middle of it, and outside the prompt's timing. `verify`: also the ubatches of these
        sizes with every token's logits (speculative decoding's verification steps). Logs a
        line per graph it compiles. Returns the number of compilations."""
        kv = self.memory.mem_attn
        if kv is None:
            return self._reserve_recurrent(n_prompt, verify)
        used = kv.cells.used_max_p1()
        shapes: set[GraphParams] = set()
        for start in range(0, n_prompt, self.n_batch):
            chunk = min(self.n_batch, n_prompt - start)
            for first in range(0, chunk, self.n_ubatch):
                n = min(self.n_ubatch, chunk - first)
                used = min(used + n, self.n_ctx)
                shapes.add(self._reserve_params(n, kv.n_kv_at(used)))
        last = min(used + max(n_predict - 1, 0), self.n_ctx)
        shapes.update(self._reserve_params(1, kv.n_kv_at(u)) for u in range(used + 1, last + 1))
        for n in verify:
            if not 1 <= n <= self.n_ubatch:
                raise ValueError(f"reserve_generation: verification size {n} is outside "
                                 f"[1, n_ubatch = {self.n_ubatch}]")
            shapes.update(dataclasses.replace(self._reserve_params(n, kv.n_kv_at(u)), n_outputs=n)
                          for u in range(used + n, min(last + n, self.n_ctx) + 1))
        todo = sorted((p for p in shapes if p not in self._graphs), key=lambda p: (p.n_kv, p.n_tokens))
        return self._reserve(todo)

    def _reserve_recurrent(self, n_prompt: int, verify: tuple[int, ...]) -> int:
        """reserve_generation for a recurrent memory: one graph per power of two a prompt's
        ubatches split into, and the decode step; states do not grow, so nothing else."""
        shapes = {self._reserve_params(1, 0)}
        for start in range(0, n_prompt, self.n_ubatch):
            n = min(self.n_ubatch, n_prompt - start)
            shapes.update(self._reserve_params(1 << b, 0) for b in range(n.bit_length()) if n >> b & 1)
        shapes.update(dataclasses.replace(self._reserve_params(n, 0), n_outputs=n) for n in verify)
        return self._reserve(sorted((p for p in shapes if p not in self._graphs), key=lambda p: p.n_tokens))

    def _reserve_params(self, n_tokens: int, n_kv: int) -> GraphParams:
        """The shape of a ubatch of n_tokens (of one sequence, for a recurrent memory) that
        outputs the last token's logits."""
        return GraphParams(n_tokens=bucket(n_tokens, self.n_ubatch), n_outputs=1, n_kv=n_kv, embd_input=False,
                           embeddings=self.embeddings, flash_attn=self.flash_attn, edits=self.edits,
                           loras=self.lora.adapters, n_kv_swa=self._n_kv_swa(),
                           n_seqs=1 if self.recurrent else 0)

    def _reserve(self, shapes: list[GraphParams]) -> int:
        stats = self.sched.cache.stats
        misses, t_comp = stats.misses, stats.compile_seconds
        todo = [params for params in shapes if params not in self._graphs]
        # the small graphs' executables read side by side; the large ones one at a time, each
        # build dropping an older one (_drop_large_graphs), so a long prompt's never all load
        plans = [(params, self._build(params)[1]) for params in todo if params.n_tokens < LARGE_UBATCH]
        self.sched.preload([plan for _, plan in plans], {}, self.memory.state())
        for params, plan in plans:
            self.sched.reserve(plan, {}, self.memory.state(), self._progress(params))
        for params in todo:
            if params.n_tokens >= LARGE_UBATCH:
                self.sched.reserve(self._build(params)[1], {}, self.memory.state(), self._progress(params))
        self._perf.n_compiles += stats.misses - misses
        self._perf.t_compile += stats.compile_seconds - t_comp
        return stats.misses - misses

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    # ---- decode ----------------------------------------------------------------------

    def _fail(self, code: DecodeStatus, msg: str) -> DecodeStatus:
        self.last_error = msg
        logger.warning("decode: %s", msg)
        return code

    @locked
    def decode(self, batch: Batch) -> DecodeStatus:
        """A DecodeStatus: OK (0); NO_KV_SLOT (1, cache unchanged); ABORTED (2, earlier ubatches
        kept, the aborted one removed); INVALID_BATCH (-1, nothing changed); FATAL (< -1, the
        exception is logged with its traceback and kept in `last_exception`; the failed
        ubatch's tokens are removed from the cache, or every sequence is cleared when the
        computation lost the cache's buffers: `last_error` says which)."""
        self.last_error = None
        self.last_exception = None
        if not isinstance(batch, Batch):
            return self._fail(DecodeStatus.INVALID_BATCH, f"expected an llm.Batch, got {type(batch).__name__}")
        if batch.n_tokens > self.n_batch:
            return self._fail(DecodeStatus.INVALID_BATCH, f"n_tokens = {batch.n_tokens} > n_batch = {self.n_batch}")
        hp = self.model.hparams
        if not hp.causal_attn:
            # an encoder keeps no memory between calls (llama.cpp gives it none)
            self.memory.clear()
        try:
            self.balloc.init(batch, n_vocab=hp.n_vocab, n_embd=hp.n_embd_inp(), n_seq_max=self.n_seq_max,
                             memory=self.memory, output_all=self.pooled, mrope=hp.n_pos_per_embd() > 1)
        except BatchError as e:
            return self._fail(DecodeStatus.INVALID_BATCH, str(e))
        if self.memory.has_shift:
            self._apply_k_shift()
        if not hp.causal_attn and batch.n_tokens > self.n_ubatch:
            return self._fail(DecodeStatus.INVALID_BATCH, f"a non-causal model needs the whole batch in one ubatch: "
                                              f"n_tokens = {batch.n_tokens} > n_ubatch = {self.n_ubatch}")
        # one unified cache for all sequences: llama.cpp splits simply (any sequences mixed in a
        # ubatch, each sequence's tokens kept in order, as pooling needs), so decoding tokens and
        # a prompt chunk of other sequences run as one graph
        if self.recurrent:
            # a recurrent state follows one sequence: ubatches of equal runs per sequence
            # (llama.cpp's split_equal), in powers of two so no token is padded into a state
            if any(len(ids) > 1 for ids in self.balloc.seq_id):
                return self._fail(DecodeStatus.INVALID_BATCH, "a recurrent model's tokens each belong to one "
                                  "sequence (copy a shared prompt with memory.seq_cp instead)")
            # (pooled embeddings: each sequence whole, as pooling reads a sequence in one ubatch)
            ubatches = self.balloc.split_equal(self.n_ubatch, pow2=not self.pooled)
        else:
            ubatches = self.balloc.split_simple(self.n_ubatch)
        slots = self.memory.prepare(ubatches)
        if slots is None:
            return self._fail(DecodeStatus.NO_KV_SLOT, f"no KV cache slot for {batch.n_tokens} tokens "
                                              f"(n_ctx = {self.n_ctx}, used = {self.memory.get_used()})")
        n_outputs = self.balloc.n_outputs
        self.logits = np.zeros((n_outputs if self.has_logits else 0, self.n_vocab), np.float32)
        if self.embeddings:
            self.embd = np.zeros((n_outputs, hp.n_embd), np.float32)
            self.embd_seq = {}
        self.output_ids = self.balloc.output_ids.copy()
        for ub, slot in zip(ubatches, slots, strict=False):
            if self.abort_callback is not None and self.abort_callback():
                return self._fail(DecodeStatus.ABORTED, "aborted by the abort callback")
            try:
                ok = self._process_ubatch(ub, slot)
            except Exception as e:  # a failure inside the engine, not in the input
                undone = self._undo_ubatch(ub)
                self.last_exception = e
                self.last_error = f"{type(e).__name__}: {e}{undone}"
                logger.exception("decode: fatal error in a ubatch of %d tokens%s", ub.n_tokens, undone)
                return DecodeStatus.FATAL
            if not ok:
                return self._fail(DecodeStatus.ABORTED, f"aborted by the eval callback{self._undo_ubatch(ub)}")
        return DecodeStatus.OK

    def _undo_ubatch(self, ub: UBatch) -> str:
        """After a ubatch failed or was aborted: remove its positions from the cache, as
        llama_decode does, so no cell claims K/V that were never written. When the failure
        came after the cache's buffers were donated to the computation, they are gone:
        rebuild them empty, clearing every sequence. Returns what happened, for the message."""
        self.memory.undo(ub)
        if not self.memory.lost():
            return f"; its {ub.n_tokens} tokens were removed from the KV cache"
        cleared = self.memory.rebuild()
        return (f"; the KV cache's buffers were lost in the failed computation: rebuilt empty, "
                f"sequences {cleared} cleared")

    def n_tokens_unpadded(self, n_tokens: int) -> int:
        """The most tokens, at most n_tokens, that a batch can hold without its last ubatch being
        padded (a graph's token count is a power of two up to n_ubatch): a caller mixing decodes
        with a prompt chunk fills the graph instead of paying for padding. Recurrent models
        pad by sequences, not tokens: n_tokens itself."""
        if self.recurrent or n_tokens <= 0:
            return n_tokens
        full, rest = divmod(n_tokens, self.n_ubatch)
        return full * self.n_ubatch + (bucket(rest + 1) // 2 if rest else 0)

    def _params(self, ub: UBatch) -> GraphParams:
        n_seqs = bucket(ub.n_seqs) if self.recurrent else 0      # padded with the scratch cell
        n_tokens = ub.n_seq_tokens * n_seqs if self.recurrent else bucket(ub.n_tokens, self.n_ubatch)
        n_out = ub.n_outputs
        n_min = min(self.n_outputs_min, n_tokens)
        n_outputs = n_tokens if n_out == ub.n_tokens else bucket(max(n_out, n_min, 1), n_tokens)
        return GraphParams(n_tokens=n_tokens, n_outputs=n_outputs, n_kv=self.memory.n_kv(),
                           embd_input=ub.embd is not None, embeddings=self.embeddings,
                           flash_attn=self.flash_attn, edits=self.edits, loras=self.lora.adapters,
                           n_kv_swa=self._n_kv_swa(), n_seqs=n_seqs)

    @staticmethod
    def _progress(params: GraphParams) -> Callable[[], None]:
        """Logs what is about to compile (a cold start's progress line; called only when no
        cache holds the executable)."""
        def say() -> None:
            n, n_out = params.n_tokens, params.n_outputs
            kind = "decode" if n == 1 else "prefill" if n_out < n else "multi-token"
            outs = f", {n_out} outputs" if 1 < n_out < n else ""
            logger.info("compiling %s graph (%d token%s%s, kv %d) ...", kind, n, "s" if n > 1 else "", outs,
                        params.n_kv)
        return say

    def _n_kv_swa(self) -> int:
        return self.memory.n_kv_swa() if self.memory.cells_swa is not None else 0

    def _build(self, params: GraphParams) -> tuple[GraphBuilder, Plan]:
        """Build and plan the graph of one shape, and keep it (the last GRAPHS_KEPT shapes)."""
        g = GraphBuilder(self.model, self.memory, params, lora=self.lora)
        self.model.builder.build_graph(g)
        if params.edits is not None:
            params.edits.apply(g)
        plan = self.sched.alloc_graph(g.gf)
        self._perf.n_graph_builds += 1
        self._graphs[params] = (g, plan)
        while len(self._graphs) > GRAPHS_KEPT:
            self._graphs.popitem(last=False)
        if params.n_tokens >= LARGE_UBATCH:
            self._drop_large_graphs(built=params)
        return g, plan

    def _drop_large_graphs(self, built: GraphParams) -> None:
        """Keep LARGE_GRAPHS_KEPT graphs of large ubatches (the one just built and the one in use
        first, counted kept or not): the oldest others whose executables are all on disk leave
        the context and the shared cache, unless a kept graph runs the same executable."""
        held = {built}
        if self._prev is not None and self._prev[0].params.n_tokens >= LARGE_UBATCH:
            held.add(self._prev[0].params)
        others = [p for p in self._graphs if p.n_tokens >= LARGE_UBATCH and p not in held]
        n_drop = len(others) + len(held) - LARGE_GRAPHS_KEPT
        dropped: list[tuple[GraphBuilder, Plan]] = []
        for p in others:                     # oldest first
            if len(dropped) >= n_drop:
                break
            if all(sp.compiled is None or sp.compiled.on_disk for sp in self._graphs[p][1].splits):
                dropped.append(self._graphs.pop(p))
        if not dropped:
            return
        kept = {sp.compiled.key for _, plan in self._graphs.values() for sp in plan.splits if sp.compiled is not None}
        for _, plan in dropped:
            for sp in plan.splits:
                if sp.compiled is not None and sp.compiled.key not in kept:
                    self.sched.cache.discard(sp.compiled.key)

    def _process_ubatch(self, ub: UBatch, slot) -> bool:
        t0 = time.perf_counter()
        self.memory.apply(slot, ub)
        params = self._params(ub)
        if self._prev is not None and all(i.can_reuse(params) for i in self._prev[0].inputs):
            g, plan = self._prev
            self._perf.n_reused += 1
        elif params in self._graphs:
            g, plan = self._prev = self._graphs[params]
            self._graphs.move_to_end(params)
            self._perf.n_reused += 1
        else:
            g, plan = self._prev = self._build(params)
        g.set_slot(slot)
        values: dict = {}
        for inp in g.inputs:
            inp.set_input(ub, values)
        stats = self.sched.cache.stats
        misses, t_comp = stats.misses, stats.compile_seconds
        t_in = self.sched.t_inputs
        t_dispatch = time.perf_counter()
        outs, new_state, ok = self.sched.compute(plan, values, self.memory.state(), self._progress(params))
        self.memory.update(new_state)
        self._perf.n_compiles += stats.misses - misses
        self._perf.t_compile += stats.compile_seconds - t_comp
        # the output rows: the graph's first ub.n_outputs, unless its outputs bucket is every
        # padded token (no inp_out_ids: 7 tokens wanting 5 outputs fill an 8-row graph), then
        # the rows of the wanted tokens
        out = (np.flatnonzero(ub.output) if params.n_outputs == params.n_tokens and ub.n_outputs < ub.n_tokens
               else slice(0, ub.n_outputs))
        if ub.n_outputs and self.has_logits:
            rows = np.asarray(outs[g.res_logits]).reshape(params.n_outputs, self.n_vocab)[out]
            self.logits[self.balloc.output_rows(ub)] = rows
        if params.edits is not None:
            params.edits.collect(g, ub, outs)
        if ub.n_outputs and self.embeddings:
            embd = np.asarray(outs[g.res_embd]).reshape(params.n_outputs, -1)[out]
            self.embd[self.balloc.output_rows(ub)] = embd
            if self.pooled:
                self._pool(ub, embd)
        t_in = self.sched.t_inputs - t_in
        self._perf.t_inputs += t_in
        self._perf.t_wait += time.perf_counter() - t_dispatch - t_in
        dt = time.perf_counter() - t0
        if ub.n_tokens > 1:
            self._perf.t_p_eval += dt
            self._perf.n_p_eval += ub.n_tokens
        else:
            self._perf.t_eval += dt
            self._perf.n_eval += 1
        return ok

    def _apply_k_shift(self) -> None:
        """Re-rotate every cached K row by its cell's pending position shift (llama.cpp's
        build_graph_shift), one small graph over all layers (each layer with its cells)."""
        hp = self.model.hparams
        kv = self.memory.mem_attn
        assert kv is not None       # only a KV cache has shifts
        gf = Graph()
        values: dict[Tensor, object] = {}
        inputs: dict[int, tuple[Tensor, Tensor]] = {}
        for cells in kv.all_cells():
            n = cells.n_ctx
            shift = new_input(GGMLType.I32, (n,), "k_shift" if cells is kv.cells else "k_shift_swa")
            idxs = new_input(GGMLType.I32, (n,), "k_shift_idxs" if cells is kv.cells else "k_shift_idxs_swa")
            inputs[id(cells)] = (shift, idxs)
            values[shift] = cells.k_shift()
            values[idxs] = np.arange(n, dtype=np.int32)
        k_rot = None
        if kv.n_rot_k:      # a quantized K is held turned: back, rope, turn again (llama.cpp's build_rope_shift)
            k_rot = new_input(GGMLType.F32, (kv.n_rot_k, kv.n_rot_k), "attn_inp_k_rot")
            values[k_rot] = hadamard(kv.n_rot_k)
        for il in range(hp.n_layer):
            if not hp.has_rope(il) or not hp.has_kv(il):    # a shared cache is shifted by its own layer
                continue
            k = kv.k_l[il]
            cells = kv.cells_swa if kv.is_swa(il) and kv.cells_swa is not None else kv.cells
            shift, idxs = inputs[id(cells)]
            cur = ops.reshape_3d(ops.cast(k, GGMLType.F32), hp.n_embd_head_k_l(il), hp.n_head_kv(il), cells.n_ctx)
            if k_rot is not None:
                cur = mul_mat_hadamard(cur, k_rot)
            cur = ops.rope_ext(cur, shift, self.model.layers[il].rope_freqs, **rope_params(hp, il))
            if k_rot is not None:
                cur = mul_mat_hadamard(cur, k_rot)
            cur = ops.set_rows(k, ops.reshape_2d(cur, hp.n_embd_k_gqa(il), cells.n_ctx), idxs)
            gf.build_forward_expand(cur.set_name(f"k_shifted-{il}"))
        plan = self.sched.alloc_graph(gf)
        _, new_state, _ = self.sched.compute(plan, values, kv.state())
        kv.update(new_state)
        for cells in kv.all_cells():
            cells.reset_shift()

    @property
    def pooled(self) -> bool:
        """Does this context pool embeddings per sequence (every token is then an output)?"""
        return self.embeddings and self.pooling_type != PoolingType.NONE

    def _pool(self, ub: UBatch, embd: np.ndarray) -> None:
        """Pool the ubatch's token embeddings per sequence (llama.cpp's build_pooling; a
        sequence is expected to lie in one ubatch). embd rows are the ubatch's tokens."""
        seqs = np.array([ids[0] for ids in ub.seq_id])
        for s in np.unique(seqs):
            rows = np.flatnonzero(seqs == s)
            pos = ub.pos[rows]
            if self.pooling_type == PoolingType.MEAN:
                v = embd[rows].mean(axis=0, dtype=np.float32)
            elif self.pooling_type == PoolingType.LAST or (self.pooling_type == PoolingType.RANK
                                                           and self.model.hparams.causal_attn):
                v = embd[rows[np.flatnonzero(pos == pos.max())[-1]]]
            else:  # CLS, RANK: the first token of the sequence
                v = embd[rows[np.argmin(pos)]]
            if self.pooling_type == PoolingType.RANK:
                v = rank_head(self.model, v)
            self.embd_seq[int(s)] = np.asarray(v, np.float32)

    @property
    def last_graph(self):
        """(GraphBuilder, Plan) of the last ubatch's graph, for dumps and inspection."""
        if self._prev is None:
            raise ValueError("no graph yet: decode a batch first")
        return self._prev

    # ---- outputs ---------------------------------------------------------------------

    def get_logits_ith(self, i: int) -> np.ndarray:
        """Logits of batch token i (negative i counts outputs from the end, as llama.cpp);
        ValueError for a token that produced no logits."""
        if not self.has_logits:
            raise ValueError(f"model {self.model.path} ({self.model.arch}) has no output layer: "
                             f"no logits, only embeddings (get_embeddings_ith / get_embeddings_seq)")
        n_outputs = self.logits.shape[0]
        if i < 0:
            j = n_outputs + i
            if j < 0:
                raise ValueError(f"get_logits_ith({i}): only {n_outputs} outputs in the last batch")
        else:
            if i >= len(self.output_ids):
                raise ValueError(f"get_logits_ith({i}): the last batch had {len(self.output_ids)} tokens")
            j = int(self.output_ids[i])
            if j < 0:
                raise ValueError(f"get_logits_ith({i}): token {i} did not request logits")
        return self.logits[j]

    def get_logits(self) -> np.ndarray:
        """All output rows of the last decode, in batch order [n_outputs, n_vocab]."""
        return self.logits

    def get_embeddings_ith(self, i: int) -> np.ndarray:
        """The final hidden state [n_embd] of batch token i (negative i counts outputs from
        the end); ValueError for a context without embeddings or a token without output."""
        if not self.embeddings:
            raise ValueError("get_embeddings_ith: the context was created without embeddings=True")
        n_outputs = self.embd.shape[0]
        if i < 0:
            j = n_outputs + i
            if j < 0:
                raise ValueError(f"get_embeddings_ith({i}): only {n_outputs} outputs in the last batch")
        else:
            if i >= len(self.output_ids):
                raise ValueError(f"get_embeddings_ith({i}): the last batch had {len(self.output_ids)} tokens")
            j = int(self.output_ids[i])
            if j < 0:
                raise ValueError(f"get_embeddings_ith({i}): token {i} was not an output")
        return self.embd[j]

    def get_embeddings_seq(self, seq_id: int) -> np.ndarray:
        """The pooled embedding of a sequence of the last batch ([n_embd]; [n_cls_out] for
        rank pooling); ValueError when the context does not pool or the sequence was absent."""
        if not self.embeddings:
            raise ValueError("get_embeddings_seq: the context was created without embeddings=True")
        if self.pooling_type == PoolingType.NONE:
            raise ValueError("get_embeddings_seq: pooling_type is 'none' (per-token embeddings only: "
                             "use get_embeddings_ith, or create the context with pooling_type "
                             "'mean', 'cls', 'last' or 'rank')")
        if seq_id not in self.embd_seq:
            raise ValueError(f"get_embeddings_seq({seq_id}): sequence {seq_id} was not in the last batch")
        return self.embd_seq[seq_id]

    def get_embeddings(self) -> np.ndarray:
        """All output tokens' final hidden states of the last decode [n_outputs, n_embd]."""
        if not self.embeddings:
            raise ValueError("get_embeddings: the context was created without embeddings=True")
        return self.embd

    # ---- memory and perf -------------------------------------------------------------

    @locked
    def memory_clear(self) -> None:
        self.memory.clear()

    @locked
    def set_causal_attn(self, causal: bool) -> None:
        """llama_set_causal_attn: whether the next decodes mask later positions. libmtmd turns it
        off while it decodes an image that the model attends over whole (Gemma 3) and back on
        after; the mask is a graph input, so no graph changes."""
        kv = self.memory.mem_attn if isinstance(self.memory, MemoryHybrid) else self.memory
        if not isinstance(kv, KVCache):
            raise ValueError(f"set_causal_attn: a {type(self.memory).__name__} has no attention mask")
        kv.causal_attn = bool(causal)

    def perf(self) -> dict:
        p = self._perf
        return {
            "t_start_ms": p.t_start * 1e3,
            "t_p_eval_ms": p.t_p_eval * 1e3, "n_p_eval": p.n_p_eval,
            "t_eval_ms": p.t_eval * 1e3, "n_eval": p.n_eval,
            "t_compile_ms": p.t_compile * 1e3,
            "t_wait_ms": p.t_wait * 1e3, "t_inputs_ms": p.t_inputs * 1e3,
            "n_reused": p.n_reused, "n_graph_builds": p.n_graph_builds, "n_compiles": p.n_compiles,
        }

    def perf_reset(self) -> None:
        self._perf = Perf(time.perf_counter())

    # ---- saved state (llama_state_*; format and checks in llm.state) ------------------

    @property
    def fingerprint(self) -> bytes:
        """The model's fingerprint in saved states (computed once, from the GGUF header)."""
        if self._fingerprint is None:
            self._fingerprint = state.model_fingerprint(self.model)
        return self._fingerprint

    def _state_bytes(self, tokens, seq_id, sampler) -> bytes:
        if self.memory.has_shift:
            self._apply_k_shift()      # saved K rows must already carry their positions
        return state.serialize(self, self.fingerprint, tokens, seq_id=seq_id, sampler=sampler)

    @locked
    def state_get_data(self, tokens=(), sampler=None) -> bytes:
        """The whole state (KV cells and rows, last logits, `sampler`'s RNG states, tokens) as bytes."""
        return self._state_bytes(tokens, None, sampler)

    @locked
    def state_set_data(self, data: bytes, sampler=None, *, where: str = "state data") -> list[int]:
        """Replace the state by `data` from state_get_data; returns its tokens. StateError
        (context unchanged) when the data does not fit this context."""
        saved = state.parse(self, self.fingerprint, bytes(data), where, kind=state.KIND_FULL, sampler=sampler)
        state.apply_full(self, saved, sampler)
        return saved.tokens

    def state_save_file(self, path, tokens, sampler=None) -> None:
        """llama_state_save_file: the whole state plus `tokens`, written atomically."""
        state.write_atomic(path, self.state_get_data(tokens, sampler))

    def state_load_file(self, path, sampler=None) -> list[int]:
        """llama_state_load_file: restore a state file; returns the tokens saved with it."""
        return self.state_set_data(self._read_state(path, seq=False), sampler, where=str(path))

    @locked
    def state_seq_get_data(self, seq_id: int, tokens=()) -> bytes:
        """One sequence's cells and K/V rows (no logits) as bytes."""
        return self._state_bytes(tokens, seq_id, None)

    @locked
    def state_seq_set_data(self, data: bytes, dest_seq_id: int, *, where: str = "state data") -> list[int]:
        """Put a sequence state into dest_seq_id, replacing what that sequence held; returns
        its tokens. StateError (context unchanged) when it does not fit."""
        if not isinstance(dest_seq_id, int) or not 0 <= dest_seq_id < self.n_seq_max:
            raise StateError(f"{where}: dest_seq_id {dest_seq_id!r} is out of range [0, n_seq_max = {self.n_seq_max})")
        saved = state.parse(self, self.fingerprint, bytes(data), where, kind=state.KIND_SEQ)
        kv = self.memory.mem_attn
        if kv is not None:
            own = kv.cells.seq == (np.uint64(1) << np.uint64(dest_seq_id))
            n_free = int(np.count_nonzero((kv.cells.pos < 0) | own))
            if n_free < saved.pos.size:
                raise StateError(f"{where}: {saved.pos.size} cells do not fit: the context has {n_free} free cells")
        self.memory.seq_rm(dest_seq_id, -1, -1)
        state.apply_seq(self, saved, dest_seq_id, state.free_cells_for(self, saved, where))
        return saved.tokens

    def state_seq_save_file(self, path, seq_id: int, tokens) -> None:
        """llama_state_seq_save_file: one sequence's state plus `tokens`, written atomically."""
        state.write_atomic(path, self.state_seq_get_data(seq_id, tokens))

    def state_seq_load_file(self, path, dest_seq_id: int) -> list[int]:
        """llama_state_seq_load_file: restore a sequence state into dest_seq_id; returns its tokens."""
        return self.state_seq_set_data(self._read_state(path, seq=True), dest_seq_id, where=str(path))

    def _read_state(self, path, *, seq: bool) -> bytes:
        """The file's bytes (a regular file, not a link), refused before reading when it is larger
        than any state of this context."""
        return state.read_file(path, state.max_state_bytes(self, seq=seq))
