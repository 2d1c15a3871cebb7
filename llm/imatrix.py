"""llama-imatrix: the importance matrix of a model over a text, from this engine's own graph.

`compute_imatrix(model, tokens, ImatrixParams(n_ctx=512))` gathers what llama-imatrix's eval
callback (tools/imatrix/imatrix.cpp, IMatrixCollector::collect_imatrix) gathers: for every
`mul_mat` whose weight is named `blk.*` (and `output.weight` with `process_output`), the sum over
tokens of the square of each input column and the number of tokens; for every `mul_mat_id`
(MoE experts, any name) the same per expert, counting a token once for each expert it is routed
to. A 3-d weight (one matrix per head) keeps one row of sums per matrix. As in llama.cpp, a
`mul_mat` of a ubatch under 16 tokens is not counted.

The text is cut as llama-imatrix cuts it: tokenized once (with BOS when the model adds one),
at least 2 * n_ctx tokens, len // n_ctx chunks (at most n_chunks), each decoded from an empty
cache with its first token replaced by BOS (when the model adds one), every token counted.

How: an `ImatrixHook` (llm.graph.GraphHook) adds to each graph, per counted `mul_mat`, the
masked column sums of the squared input (`sum_rows(cont(transpose(sqr(x) * mask)))`, the mask
an input that is 1 on real tokens and 0 on padding) as an extra output, so a ubatch brings back
one vector per matrix; a `mul_mat_id`'s input and expert ids come back whole and are summed per
expert on the host (numpy, one `np.add.at` per node). One compiled graph per ubatch shape.

`ImatrixParams(gradient=True)` (`llm imatrix --gradient`) weighs each token's squared input by
the squared norm of the loss gradient at the matmul's output, |dL/dy_t|^2 with L the chunk's
next-token NLL: the row sums of the weight's diagonal Fisher (see _gradient_imatrix), in the
same units and file format, so llama-quantize reads it as any matrix. Each chunk runs as one
jitted value_and_grad of the same lowered graph with a zero delta input after every counted
matmul, the reductions inside it.

`Imatrix.write(path, "gguf")` writes llama-imatrix's GGUF (general.type = imatrix,
imatrix.datasets / chunk_count / chunk_size, `<name>.in_sum2` [n_mat, n_col] and
`<name>.counts` [n_mat, 1], sorted by name); `"dat"` its legacy format. Both are read by
llm.quantize.load_imatrix and by llama-quantize. The file goes to a temporary name renamed at
the end, so an error leaves no partial file.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import gguf, lower, ops
from ggmlx.compile import GraphCache, Program
from ggmlx.gguf import GGUFValueType
from ggmlx.tensor import Flag, Op, Tensor, new_input
from ggmlx.types import GGMLType
from llm.arch import LLMKV
from llm.batch import Batch
from llm.context import Context, ContextParams, DecodeStatus
from llm.graph import GraphBuilder, GraphInput, GraphParams
from llm.params import param

log = logging.getLogger(__name__)

MIN_UBATCH_TOKENS = 16      # collect_imatrix skips a mul_mat of fewer rows ("why are small batches ignored?")
OUTPUT_FORMATS = ("gguf", "dat")


class ImatrixError(ValueError):
    """Input an importance matrix cannot be computed from or written to (the message says which)."""


@dataclass
class ImatrixParams:
    """llama-imatrix's own knobs; the chunk size is the context's n_ctx (-c), the graph runs
    take the context's n_ubatch, cache types and attention path (llm.context.ContextParams)."""
    n_chunks: int = param(-1, flags=("--chunks",), lo=-1, help="at most this many chunks (-1: all)")
    process_output: bool = param(False, flags=("--process-output",), help="also collect output.weight")
    gradient: bool = param(False, flags=("--gradient",),
                           help="weigh each token's squared input by the squared gradient of the loss at the "
                                "matmul's output (the row sums of the diagonal Fisher; each chunk one graph run)")


@dataclass
class Imatrix:
    """Per matrix: in_sum2 [n_mat, n_col] (float32 sums of squared inputs) and counts [n_mat]
    (tokens), with llama-imatrix's provenance."""
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 512

    def values(self) -> dict[str, np.ndarray]:
        """Mean squared input per column, flattened over matrices (what llama-quantize reads;
        a matrix with no tokens gets 1, as llama.cpp's loader gives it)."""
        out = {}
        for name in sorted(self.sums):
            s, c = self.sums[name], self.counts[name].astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                out[name] = np.where(c[:, None] > 0, s / c[:, None], np.float32(1)).astype(np.float32).reshape(-1)
        return out

    def write(self, path: str | os.PathLike, output_format: str = "gguf") -> None:
        """Write llama-imatrix's GGUF or legacy .dat file, atomically."""
        if output_format not in OUTPUT_FORMATS:
            raise ImatrixError(f"output format must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}")
        path = Path(path)
        if path.is_dir():
            raise ImatrixError(f"{path}: is a directory")
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent or ".")
        except OSError as e:
            raise ImatrixError(f"cannot write {path}: {e.strerror}") from None
        os.close(fd)
        try:
            if output_format == "gguf":
                self._gguf().write(tmp)
            else:
                Path(tmp).write_bytes(self._dat())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _gguf(self) -> gguf.GGUFWriter:
        w = gguf.GGUFWriter()
        w.add_kv("general.type", "imatrix")
        w.add_kv(LLMKV.IMATRIX_DATASETS.key(), list(self.datasets), GGUFValueType.ARRAY, GGUFValueType.STRING)
        w.add_kv(LLMKV.IMATRIX_CHUNK_COUNT.key(), self.chunk_count, GGUFValueType.UINT32)
        w.add_kv(LLMKV.IMATRIX_CHUNK_SIZE.key(), self.chunk_size, GGUFValueType.UINT32)
        for name in sorted(self.sums):
            w.add_tensor(f"{name}.in_sum2", np.asarray(self.sums[name], np.float32))
            w.add_tensor(f"{name}.counts", self.counts[name].astype(np.float32).reshape(-1, 1))
        return w

    def _dat(self) -> bytes:
        """save_imatrix_legacy: per entry (sorted) the name, ncall = ceil(max count / chunk
        size), and sums / count * ncall (1 for a matrix without tokens); then the chunk count
        and the dataset. Entries no token reached are left out."""
        names = [n for n in sorted(self.sums) if self.counts[n].any()]
        parts = [np.int32(len(names)).tobytes()]
        for name in names:
            s, c = self.sums[name], self.counts[name]
            ncall = (int(c.max()) + self.chunk_size - 1) // self.chunk_size
            cf = c.astype(np.float32)[:, None]
            v = np.where(cf > 0, s / np.where(cf > 0, cf, 1), np.float32(1)) * np.float32(ncall)
            parts += [np.int32(len(name.encode())).tobytes(), name.encode(), np.int32(ncall).tobytes(),
                      np.int32(s.size).tobytes(), v.astype(np.float32).tobytes()]
        dataset = (self.datasets[-1] if self.datasets else "").encode()
        parts += [np.int32(self.chunk_count).tobytes(), np.int32(len(dataset)).tobytes(), dataset]
        return b"".join(parts)


class _InpTokenMask(GraphInput):
    """1 on the ubatch's real tokens, 0 on its padding: [1, n_tokens]."""

    def __init__(self, params: GraphParams):
        super().__init__(params)
        self.mask = new_input(GGMLType.F32, (1, params.n_tokens), "imatrix_token_mask")

    def set_input(self, ub, values: dict) -> None:
        m = np.zeros((self.params.n_tokens, 1), np.float32)
        m[:ub.n_tokens] = 1.0
        values[self.mask] = m


@dataclass
class _Dense:
    name: str
    node: Tensor        # [1, n_col, n_mat]: the ubatch's column sums


@dataclass
class _Routed:
    name: str
    x: Tensor           # [n_col, n_used or 1, n_tokens]
    ids: Tensor         # [n_used, n_tokens]
    n_as: int


class ImatrixHook:
    """The GraphHook that adds the statistic's outputs to each graph and sums them."""

    def __init__(self, process_output: bool = False):
        self.process_output = process_output
        self.sums: dict[str, np.ndarray] = {}       # float64 while summing
        self.counts: dict[str, np.ndarray] = {}
        self._taps: dict[int, tuple[list[_Dense], list[_Routed]]] = {}

    def _counted(self, w: Tensor) -> bool:
        return w.name.startswith("blk.") or (self.process_output and w.name == "output.weight")

    def apply(self, g: GraphBuilder) -> None:
        n_tok = g.params.n_tokens
        mask: _InpTokenMask | None = None
        dense: list[_Dense] = []
        routed: list[_Routed] = []
        for n in list(g.gf.nodes):
            if n.op not in (Op.MUL_MAT, Op.MUL_MAT_ID) or not n.src[0].flags & Flag.WEIGHT:
                continue
            w, x = n.src[0], n.src[1]
            if n.op is Op.MUL_MAT_ID:
                if x.ne[2] != n_tok or x.ne[3] != 1:
                    raise ImatrixError(f"{w.name}: mul_mat_id input {list(x.ne)} is not [cols, k, {n_tok} tokens]")
                x.set_output()
                n.src[2].set_output()
                routed.append(_Routed(w.name, x, n.src[2], w.ne[2]))
                continue
            if not self._counted(w):
                continue
            if x.ne[1] != n_tok or x.ne[2:] != w.ne[2:]:
                raise ImatrixError(f"{w.name}: input {list(x.ne)} is not [cols, {n_tok} tokens] per matrix "
                                   f"of the weight {list(w.ne)}")
            if mask is None:
                mask = _InpTokenMask(g.params)
                g.inputs.append(mask)
            sq = ops.mul(ops.sqr(x), mask.mask)
            col = ops.sum_rows(ops.cont(ops.transpose(sq))).set_name(f"{w.name} (imatrix)")
            col.set_output()
            dense.append(_Dense(w.name, col))
            g.gf.build_forward_expand(col)
        self._taps[id(g)] = (dense, routed)

    def collect(self, g: GraphBuilder, ub, outs: dict) -> None:
        dense, routed = self._taps.get(id(g), ([], []))
        n = ub.n_tokens
        if n >= MIN_UBATCH_TOKENS:
            for d in dense:
                v = np.asarray(outs[d.node], np.float64).reshape(-1, d.node.ne[1])   # [n_mat, n_col]
                self._add(d.name, v, np.full(v.shape[0], n, np.int64))
        for r in routed:
            x = np.asarray(outs[r.x], np.float32).reshape(r.x.ne[2], r.x.ne[1], r.x.ne[0])[:n]
            ids = np.asarray(outs[r.ids]).reshape(r.ids.ne[1], r.ids.ne[0])[:n]     # [tokens, n_used]
            if ids.min() < 0 or ids.max() >= r.n_as:
                raise ImatrixError(f"{r.name}: expert ids outside [0, {r.n_as})")
            k = ids.shape[1]
            sq = np.square(x[:, np.arange(k) % x.shape[1], :], dtype=np.float64)          # [tokens, k, cols]
            acc = np.zeros((r.n_as, x.shape[2]), np.float64)
            np.add.at(acc, ids.reshape(-1), sq.reshape(-1, x.shape[2]))
            self._add(r.name, acc, np.bincount(ids.reshape(-1), minlength=r.n_as).astype(np.int64))

    def _add(self, name: str, sums: np.ndarray, counts: np.ndarray) -> None:
        if not np.isfinite(sums).all():
            raise ImatrixError(f"non-finite values detected in {name}")
        if name not in self.sums:
            self.sums[name] = np.zeros_like(sums)
            self.counts[name] = np.zeros_like(counts)
        self.sums[name] += sums
        self.counts[name] += counts


def imatrix_chunks(tokens: list[int], n_ctx: int, n_chunks: int = -1) -> np.ndarray:
    """[n_chunk, n_ctx] token ids as llama-imatrix cuts them; ImatrixError for under 2 * n_ctx tokens."""
    if n_ctx < 1:
        raise ImatrixError(f"the context (-c) must be at least 1 token, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise ImatrixError(f"you need at least {2 * n_ctx} tokens for a context of {n_ctx} tokens; "
                           f"the text tokenizes to only {len(tokens)}")
    n = len(tokens) // n_ctx
    if n_chunks > 0:
        n = min(n, n_chunks)
    return np.asarray(tokens[:n * n_ctx], np.int32).reshape(n, n_ctx)


def compute_imatrix(model, tokens: list[int], params: ImatrixParams | None = None,
                    context: ContextParams | None = None, dataset: str = "",
                    on_chunk: Callable[[int, int], None] | None = None) -> Imatrix:
    """llama-imatrix's statistic of `model` (llm.model.Model) over `tokens` (the text tokenized
    with BOS as the model adds it), in chunks of context.n_ctx tokens (default 512); `dataset`
    is recorded as the file's dataset; on_chunk(done, total) after each chunk."""
    p = params or ImatrixParams()
    cp = context or ContextParams(n_ctx=512)
    c = cp.n_ctx
    chunks = imatrix_chunks(tokens, c, p.n_chunks)
    vocab = model.vocab
    bos = vocab.bos if vocab.add_bos else None
    if p.gradient:
        return _gradient_imatrix(model, chunks, bos, p, cp, dataset, on_chunk)
    ctx = Context(model, dataclasses.replace(cp, n_batch=c, n_ubatch=min(cp.n_ubatch, c), n_seq_max=1,
                                             kv_bucket=c))
    hook = ImatrixHook(p.process_output)
    ctx.edits = hook
    try:
        for i, chunk in enumerate(chunks):
            chunk = chunk.copy()
            if bos is not None:
                chunk[0] = bos
            ctx.memory_clear()
            status = ctx.decode(Batch(chunk, logits=np.ones(c, bool)))
            if status != DecodeStatus.OK:
                raise RuntimeError(f"imatrix: decode failed on chunk {i + 1}: {ctx.last_error}")
            if on_chunk is not None:
                on_chunk(i + 1, len(chunks))
    finally:
        ctx.edits = None
        ctx.memory_clear()
    sums = {n: s.astype(np.float32) for n, s in hook.sums.items()}
    counts = dict(hook.counts)
    chunk_count = max((int(v.max()) for v in counts.values()), default=0) // c
    return Imatrix(sums, counts, [dataset] if dataset else [], chunk_count, c)


# ---- the gradient-weighted matrix ------------------------------------------------------------

@dataclass
class _Tap:
    name: str
    x: Tensor                 # the matmul's input
    delta: Tensor             # a zero input added to its output: d loss / d delta = d loss / d output
    ids: Tensor | None        # mul_mat_id's expert ids
    n_mat: int                # matrices (experts, or a 3-d weight's heads)


def _insert_deltas(g: GraphBuilder, counted: Callable[[Tensor], bool]) -> list[_Tap]:
    """A zero delta input after every counted matmul's output (mul_mat of a counted weight,
    every mul_mat_id), consumers rewired to it, its input and ids made outputs."""
    inserted: dict[int, Tensor] = {}
    taps: list[_Tap] = []
    for n in g.gf.nodes:
        if n.op not in (Op.MUL_MAT, Op.MUL_MAT_ID) or not n.src[0].flags & Flag.WEIGHT:
            continue
        w, x = n.src[0], n.src[1]
        ids = n.src[2] if n.op is Op.MUL_MAT_ID else None
        if ids is None and not counted(w):
            continue
        if ids is None and (x.ne[1] != g.params.n_tokens or x.ne[2:] != w.ne[2:]):
            raise ImatrixError(f"{w.name}: input {list(x.ne)} is not [cols, {g.params.n_tokens} tokens] per matrix "
                               f"of the weight {list(w.ne)}")
        d = new_input(GGMLType.F32, n.ne, f"{w.name} (delta)")
        inserted[n.id] = ops.add(n, d)
        x.set_output()
        if ids is not None:
            ids.set_output()
        taps.append(_Tap(w.name, x, d, ids, w.ne[2] if ids is not None else w.ne[2] * w.ne[3]))
    g.splice(inserted)
    return taps


def _gradient_imatrix(model, chunks: np.ndarray, bos: int | None, p: ImatrixParams, cp: ContextParams,
                      dataset: str, on_chunk: Callable[[int, int], None] | None) -> Imatrix:
    """The Fisher-weighted matrix. For y = W x the diagonal Fisher of W_ij over the text is
    sum_t (dL/dy_ti)^2 x_tj^2 (L: the chunk's next-token NLL); llama.cpp's quantizers take one
    weight per column, so its row sum: sum_t |g_t|^2 x_tj^2, g_t = dL/dy_t. In llama-imatrix's
    units: in_sum2_j = N * sum_t w_t x_tj^2 / sum_t w_t with w_t = |g_t|^2 and N the token count
    (counts), i.e. a gradient-weighted mean square of the input, whose scale the quantizers do
    not depend on. mul_mat_id: w per token and expert slot, summed per expert."""
    n_chunk, c = chunks.shape
    ctx = Context(model, dataclasses.replace(cp, n_batch=c, n_ubatch=c, n_seq_max=1, kv_bucket=c))
    if ctx.recurrent:
        raise ImatrixError("--gradient is not implemented for recurrent models")
    n_vocab = model.n_vocab
    num: dict[str, np.ndarray] = {}      # sum_t w_t x_t^2, per matrix
    den: dict[str, np.ndarray] = {}      # sum_t w_t, per matrix
    counts: dict[str, np.ndarray] = {}
    programs: dict[str, Callable] = {}

    def counted(w: Tensor) -> bool:
        return w.name.startswith("blk.") or (p.process_output and w.name == "output.weight")

    for i, chunk in enumerate(chunks):
        chunk = chunk.copy()
        if bos is not None:
            chunk[0] = bos
        ctx.memory_clear()
        ctx.balloc.init(Batch(chunk, logits=np.ones(c, bool)), n_vocab=n_vocab, n_embd=model.hparams.n_embd,
                        n_seq_max=1, memory=ctx.memory)
        (ub,) = ctx.balloc.split_simple(c)
        memory: Any = ctx.memory            # a KV cache or a hybrid's (recurrent ones are refused above)
        prepared = memory.prepare([ub])
        assert prepared is not None         # an empty cache holds one ubatch of n_ctx tokens
        (slot,) = prepared
        memory.apply(slot, ub)
        params = ctx._params(ub)
        g = GraphBuilder(model, ctx.memory, params)
        model.builder.build_graph(g)
        taps = _insert_deltas(g, counted)
        assert g.res_logits is not None
        g.set_slot(slot)
        values: dict[Tensor, np.ndarray] = {}
        for inp in g.inputs:
            inp.set_input(ub, values)
        outputs = [g.res_logits] + [t.x for t in taps] + [t.ids for t in taps if t.ids is not None]
        prog = Program.from_nodes(g.gf.nodes, outputs, None)
        w_flat, treedef = jax.tree.flatten(tuple(t.data for t in prog.weights))
        state = ctx.memory.state()
        st_vals = [state[t] for t in prog.states]
        delta_ids = {t.delta.id for t in taps}
        in_vals = [np.zeros(t.shape, np.float32) if t.id in delta_ids
                   else np.asarray(values[t]).reshape(t.shape).astype(lower.jnp_dtype(t.type)) for t in prog.inputs]
        delta_pos = [next(j for j, t in enumerate(prog.inputs) if t.id == tap.delta.id) for tap in taps]
        key = GraphCache.key_of(prog.signature())
        if key not in programs:
            programs[key] = _gradient_program(prog.make_fn(treedef), taps, delta_pos, params.n_tokens, n_vocab)
        targets = np.zeros(params.n_tokens, np.int32)
        targets[:c - 1] = chunks[i, 1:]
        scored = (np.arange(params.n_tokens) < c - 1).astype(np.float32)
        real = (np.arange(params.n_tokens) < c).astype(np.float32)
        res = programs[key](tuple(in_vals[j] for j in delta_pos), tuple(w_flat), tuple(in_vals), tuple(st_vals),
                            targets, scored, real)
        ctx.memory_clear()
        for tap, r in zip(taps, res, strict=True):
            if tap.ids is None:
                _accumulate(num, den, counts, tap.name, np.asarray(r[0], np.float64), np.asarray(r[1], np.float64),
                            np.full(tap.n_mat, c, np.int64))
            else:
                x, ids, wt = (np.asarray(v) for v in r)
                x, ids, wt = x[:c], ids[:c], wt[:c].astype(np.float64)         # [T, k|1, K], [T, k], [T, k]
                k = ids.shape[1]
                sq = np.square(x[:, np.arange(k) % x.shape[1], :], dtype=np.float64) * wt[:, :, None]
                s_w = np.zeros((tap.n_mat, x.shape[2]), np.float64)
                np.add.at(s_w, ids.reshape(-1), sq.reshape(-1, x.shape[2]))
                w_sum = np.bincount(ids.reshape(-1), weights=wt.reshape(-1), minlength=tap.n_mat)
                _accumulate(num, den, counts, tap.name, s_w, w_sum,
                            np.bincount(ids.reshape(-1), minlength=tap.n_mat).astype(np.int64))
        if on_chunk is not None:
            on_chunk(i + 1, n_chunk)
    sums = {}
    for name in num:
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = np.where(den[name][:, None] > 0, num[name] / den[name][:, None], 0.0)
        sums[name] = (mean * counts[name][:, None]).astype(np.float32)
    chunk_count = max((int(v.max()) for v in counts.values()), default=0) // c
    return Imatrix(sums, counts, [dataset] if dataset else [], chunk_count, c)


def _accumulate(num, den, counts, name, s_w, w_sum, n) -> None:
    if not (np.isfinite(s_w).all() and np.isfinite(w_sum).all()):
        raise ImatrixError(f"non-finite values detected in {name}")
    if name not in num:
        num[name], den[name], counts[name] = np.zeros_like(s_w), np.zeros_like(w_sum), np.zeros_like(n)
    num[name] += s_w
    den[name] += w_sum
    counts[name] += n


def _gradient_program(fn, taps: list[_Tap], delta_pos: list[int], n_pad: int, n_vocab: int) -> Callable:
    """jit(chunk -> per tap: (sum_t w_t x_t^2 [n_mat, K], sum_t w_t [n_mat]), or for
    mul_mat_id its input, ids and w [T, k]): the forward pass, the NLL's gradient at every
    delta and the reductions in one compiled function."""
    def loss(ds, w, ins, st, targets, scored):
        ins = list(ins)
        for j, d in zip(delta_pos, ds, strict=True):
            ins[j] = d
        outs, _ = fn(w, ins, st)
        logits = outs[0].reshape(n_pad, n_vocab)
        lp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(lp, targets[:, None], axis=1)[:, 0]
        return jnp.sum(nll * scored), outs[1:]

    def step(ds, w, ins, st, targets, scored, real):
        (_, xs), grads = jax.value_and_grad(loss, has_aux=True)(ds, w, ins, st, targets, scored)
        res = []
        ids_out = iter(xs[len(taps):])
        for tap, x, gr in zip(taps, xs[:len(taps)], grads, strict=True):
            if tap.ids is None:
                xm = x.reshape(tap.n_mat, n_pad, -1)
                gm = gr.reshape(tap.n_mat, n_pad, -1)
                wt = jnp.sum(gm * gm, axis=2) * real                        # [n_mat, T]
                res.append((jnp.sum(wt[:, :, None] * xm * xm, axis=1), jnp.sum(wt, axis=1)))
            else:
                k = tap.ids.ne[0]
                wt = jnp.sum(gr.reshape(n_pad, k, -1) ** 2, axis=2)         # [T, k]
                res.append((x.reshape(n_pad, tap.x.ne[1], tap.x.ne[0]), next(ids_out).reshape(n_pad, k), wt))
        return res

    return jax.jit(step)
