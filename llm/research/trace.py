"""Research surface over the compiled graph: traces, interventions, gradients, logit lens.

Everything works on llama.cpp's node names (`cb(cur, "l_out", il)` -> `l_out-3`). A name that
several nodes carry (llama.cpp names both the projected and the roped query `Qcur-3`) is
`Qcur-3` for the first and `Qcur-3#1`, `Qcur-3#2`, ... for the later ones, in graph order.

A node's value is shown in numpy order over its own rank: a ggml `[n_embd, n_tokens]`
tensor is `[n_tokens, n_embd]`, `Qcur-3#1` (`[d_head, n_head, n_tokens]`) is
`[n_tokens, n_head, d_head]`, `kq_soft_max-3` (`[n_kv, n_tokens, n_head]`) is
`[n_head, n_tokens, n_kv]`. The rank and which axes follow the token count and the KV
length are found once per model by building (not running) the graph at two sizes.

- Captures are extra outputs of the compiled graph (the nodes are flagged as outputs), read
  once per ubatch; they are not copied back per op.
- An intervention `fn(x) -> x'` (or `fn(x, il)`) becomes a MAP_CUSTOM1 node right after the
  node it edits, and every consumer reads x'. Inside a graph x has the graph's padded token
  count (a bucket), so write fns that work row-wise or by position (`patch` below). The
  compiled-graph cache keys on the function object: the same object compiles once; values
  it closes over are compiled in as constants.
- Gradients run `jax.value_and_grad` through the same lowered program (quantized weights
  dequantized where they are read), with a zero "delta" input added after each `wrt` node.
- A prompt with images (LLM.trace(..., images=)) is evaluated chunk by chunk as
  mtmd_helper_eval_chunks does; `capture_encoder` patterns pick nodes of the vision (or
  audio) encoder's graph by clip.cpp's names (`layer_out-1`, `kq_soft_max-0`), extra outputs
  of that image shape's cached graph, so a capture runs the encoder even for an image whose
  embeddings are cached (and leaves that cache as it was). Each image chunk's trace is a
  MediaTrace in `Trace.media`; `Trace.image_attention` reads a text token's attention on an
  image's tokens as the image's grid.
"""
from __future__ import annotations

import difflib
import fnmatch
import inspect
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import lower, ops
from ggmlx.compile import GraphCache, Program, compute
from ggmlx.graph import Graph
from ggmlx.tensor import Tensor, new_input
from ggmlx.types import GGMLType
from llm.batch import Batch
from llm.context import bucket
from llm.generation.batcher import MEDIA_PLACEHOLDER
from llm.graph import GraphBuilder, GraphParams
from llm.mtmd.context import InputChunk, MtmdContext

Interventions = dict[str, Callable]

_LAYER = re.compile(r"-(\d+)(#\d+)?$")


def node_labels(nodes: Iterable[Tensor]) -> dict[int, str]:
    """tensor id -> unique label: its name, with `#k` for the k-th later node of that name.
    Unnamed nodes get no label."""
    seen: dict[str, int] = {}
    out = {}
    for n in nodes:
        if not n.name:
            continue
        k = seen.get(n.name, 0)
        seen[n.name] = k + 1
        out[n.id] = n.name if k == 0 else f"{n.name}#{k}"
    return out


def layer_of(label: str) -> int:
    """The layer index in a label (`l_out-3` -> 3, `Qcur-3#1` -> 3), -1 outside layers."""
    m = _LAYER.search(label)
    return int(m.group(1)) if m else -1


@dataclass(frozen=True)
class NodeInfo:
    """A named node's rank and the ggml dims that follow the token count / the KV length."""
    label: str
    ne: tuple[int, int, int, int]      # at the probe's size (3 tokens, 5 KV cells)
    rank: int
    token_dim: int | None
    kv_dim: int | None

    def view_shape(self, ne) -> tuple[int, ...]:
        """numpy-order shape of a value with this ggml ne, over the node's rank."""
        return tuple(reversed(tuple(ne)[:self.rank]))

    def axis(self, dim: int | None) -> int | None:
        return None if dim is None else self.rank - 1 - dim


def probe_nodes(model, kv, flash_attn: bool) -> dict[str, NodeInfo]:
    """Every named node of the model's graph (graph order), from three symbolic builds."""
    def build(n_tokens: int, n_kv: int) -> dict[str, Tensor]:
        g = GraphBuilder(model, kv, GraphParams(n_tokens=n_tokens, n_outputs=n_tokens, n_kv=n_kv,
                                                embd_input=False, flash_attn=flash_attn,
                                                n_seqs=1 if kv.mem_recr is not None else 0))
        model.builder.build_graph(g)
        labels = node_labels(g.gf.nodes)
        return {labels[n.id]: n for n in g.gf.nodes if n.id in labels}

    base, more_t, more_kv = build(2, 4), build(3, 4), build(3, 5)
    table = {}
    for label, t in more_kv.items():
        def changed(a, b):
            dims = [d for d in range(4) if a.ne[d] != b.ne[d]]
            return dims[-1] if dims else None
        tok = changed(base[label], more_t[label]) if label in base and label in more_t else None
        kvd = changed(more_t[label], t) if label in more_t else None
        rank = max(t.n_dims, (tok or 0) + 1, (kvd or 0) + 1)
        table[label] = NodeInfo(label, t.ne, rank, tok, kvd)
    return table


def _close(pattern: str, labels: list[str]) -> str:
    plain = [lb for lb in labels if "#" not in lb]
    near = difflib.get_close_matches(pattern, plain, n=5, cutoff=0.5)
    if not near:
        stem = pattern.split("-")[0].rstrip("*")
        near = [lb for lb in plain if lb.startswith(stem[:3])][:5] if stem else []
    return ", ".join(near) if near else ", ".join(plain[:8]) + ", ..."


def resolve(patterns: Iterable[str], table: dict[str, NodeInfo]) -> list[str]:
    """Labels matched by fnmatch patterns, in graph order; ValueError for a pattern that
    matches nothing, listing close names."""
    labels = list(table)
    picked = set()
    for p in patterns:
        if not isinstance(p, str):
            raise ValueError(f"node pattern must be a str, got {p!r}")
        hit = [lb for lb in labels if fnmatch.fnmatchcase(lb, p)]
        if not hit:
            raise ValueError(f"no node matches {p!r}; close names: {_close(p, labels)}")
        picked.update(hit)
    return [lb for lb in labels if lb in picked]


class Intervention:
    """What a MAP_CUSTOM1 node runs: the user's fn on the node's value in its view shape.
    Its repr (part of the compiled-graph key) names the function object by identity; the
    cache keeps the key, and with it the function, alive."""

    def __init__(self, fn: Callable, label: str, rank: int):
        self.fn = fn
        self.label = label
        self.rank = rank
        self.il = layer_of(label)
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        self.takes_il = len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)

    def __call__(self, x4):
        x = x4.reshape(x4.shape[4 - self.rank:])
        y = self.fn(x, self.il) if self.takes_il else self.fn(x)
        y = jnp.asarray(y)
        if y.shape != x.shape or y.dtype != x.dtype:
            raise ValueError(f"intervention on {self.label!r} returned {y.dtype}{list(y.shape)}, "
                             f"the node is {x.dtype}{list(x.shape)}")
        return y.reshape(x4.shape)

    def __repr__(self) -> str:
        fn = self.fn
        return f"Intervention({self.label}, {getattr(fn, '__qualname__', type(fn).__name__)}@{id(fn):#x})"


@dataclass
class Captured:
    """Rows of one captured node, one entry per ubatch: (value in view shape, real tokens)."""
    info: NodeInfo
    parts: list[tuple[np.ndarray, int]] = field(default_factory=list)


class GraphEdits:
    """Interventions and captures for the graphs a Context builds while `ctx.edits` is set.
    Patterns are resolved and fns shape-checked here, before any graph runs, so bad input
    leaves no half-built graph and no KV cache change."""

    def __init__(self, table: dict[str, NodeInfo], interventions: Interventions | None = None,
                 capture: Iterable[str] = (), deltas: Iterable[str] = ()):
        self.table = table
        self.fns: dict[str, Intervention] = {}
        for pattern, fn in (interventions or {}).items():
            if not callable(fn):
                raise ValueError(f"intervention for {pattern!r} must be callable, got {type(fn).__name__}")
            for label in resolve([pattern], table):
                if label in self.fns:
                    raise ValueError(f"node {label!r} is matched by two intervention patterns")
                self.fns[label] = Intervention(fn, label, table[label].rank)
        self.capture = resolve(list(capture), table) if capture else []
        self.deltas = resolve(list(deltas), table) if deltas else []
        self.captured = {label: Captured(table[label]) for label in self.capture}
        self._nodes: dict[int, dict[str, Tensor | None]] = {}     # id(builder) -> label -> captured tensor
        self.delta_inputs: dict[str, Tensor] = {}    # label -> the zero input added after it
        self.delta_taps: dict[str, Tensor] = {}      # label -> the value the delta is added to

    def check(self, n_tokens: Iterable[int]) -> None:
        """Run every fn abstractly on its node's shape in graphs of these (padded) token
        counts: a fn returning another shape or dtype, or failing, is a ValueError naming
        the node, raised before anything runs."""
        for label, iv in self.fns.items():
            info = self.table[label]
            for n in n_tokens:
                ne = list(info.ne)
                if info.token_dim is not None:
                    ne[info.token_dim] = n
                try:
                    jax.eval_shape(iv, jax.ShapeDtypeStruct(tuple(reversed(ne)), jnp.float32))
                except ValueError:
                    raise
                except Exception as e:
                    raise ValueError(f"intervention on {label!r} fails on a value of shape "
                                     f"{list(info.view_shape(ne))}: {type(e).__name__}: {e}") from e

    def apply(self, g: GraphBuilder) -> None:
        """Insert the intervention (and gradient delta) nodes after their nodes, rewire every
        consumer to them, flag captured nodes as outputs and rebuild g.gf in order."""
        labels = node_labels(g.gf.nodes)
        inserted: dict[int, Tensor] = {}
        by_label: dict[str, Tensor] = {}
        for n in g.gf.nodes:
            label = labels.get(n.id)
            if label is None:
                continue
            by_label[label] = n
            cur = n
            if label in self.fns:
                cur = ops.map_custom1(cur, self.fns[label]).set_name(f"{n.name} (intervention)")
            if label in self.deltas:
                d = new_input(GGMLType.F32, n.ne, f"{label} (delta)")
                self.delta_inputs[label] = d
                self.delta_taps[label] = cur
                cur = ops.add(cur, d).set_name(f"{n.name} (delta)")
            if cur is not n:
                inserted[n.id] = cur
        g.splice(inserted)
        nodes: dict[str, Tensor | None] = {}
        for label in self.capture:
            t = by_label.get(label)
            if t is None:       # inp_embd of an embeddings batch is its input leaf: collect reads the rows
                if label != "inp_embd" or not g.params.embd_input:
                    raise ValueError(f"node {label!r} is not in this graph")
                nodes[label] = None
                continue
            t = inserted.get(t.id, t)
            t.set_output()
            nodes[label] = t
        self._nodes[id(g)] = nodes

    def collect(self, g: GraphBuilder, ub, outs: dict) -> None:
        """Keep this ubatch's rows of every captured node."""
        for label, t in self._nodes.get(id(g), {}).items():
            info = self.table[label]
            if t is None:       # an embeddings batch's inp_embd: the model's own columns of its rows
                v = np.asarray(ub.embd, np.float32)[:, :info.ne[0]]
            else:
                v = np.asarray(outs[t]).reshape(info.view_shape(t.ne))
            self.captured[label].parts.append((v, ub.n_tokens))


def assemble(cap: Captured, n_total: int) -> np.ndarray:
    """One array over all ubatches: padded token rows dropped, the KV axis cut (or padded
    with zeros) to the trace's tokens, parts joined along the token axis."""
    info = cap.info
    t_ax, kv_ax = info.axis(info.token_dim), info.axis(info.kv_dim)
    parts = []
    for v, n in cap.parts:
        if t_ax is not None:
            v = np.take(v, np.arange(n), axis=t_ax)
        if kv_ax is not None:
            if v.shape[kv_ax] >= n_total:
                v = np.take(v, np.arange(n_total), axis=kv_ax)
            else:
                pad = [(0, 0)] * v.ndim
                pad[kv_ax] = (0, n_total - v.shape[kv_ax])
                v = np.pad(v, pad)
        parts.append(v)
    if t_ax is None:
        return parts[-1]
    return np.concatenate(parts, axis=t_ax)


# ---- the Trace -------------------------------------------------------------------------

def _summary(a: np.ndarray) -> str:
    return (f"{a.dtype}{list(a.shape)} mean={a.mean():.3g} std={a.std():.3g} "
            f"min={a.min():.3g} max={a.max():.3g}") if a.size else f"{a.dtype}{list(a.shape)}"


@dataclass
class LogitLens:
    """Top tokens of every captured l_out-* read through result_norm and the output matrix."""
    layers: list[int]            # layer index of each row
    top_ids: np.ndarray          # [n_layers, n_tokens, top_k]
    top_probs: np.ndarray        # [n_layers, n_tokens, top_k]
    pieces: list[list[list[str]]]
    token: int | None = None     # the chosen token, when given
    token_rank: np.ndarray | None = None     # [n_layers, n_tokens]: 0 = top-1
    token_prob: np.ndarray | None = None     # [n_layers, n_tokens]
    positions: list[int] | None = None       # the trace positions of the columns, when chosen

    def __repr__(self) -> str:
        k = self.top_ids.shape[2]
        lines = [f"LogitLens: {len(self.layers)} layers x {self.top_ids.shape[1]} positions, top {k}"]
        rows = sorted({int(r) for r in np.linspace(0, len(self.layers) - 1, min(8, len(self.layers)))})
        for i in rows:
            il = self.layers[i]
            top = " ".join(f"{p!r}:{q:.2f}" for p, q in zip(self.pieces[i][-1], self.top_probs[i, -1], strict=True))
            lines.append(f"  layer {il:3d} last position: {top}")
        return "\n".join(lines)


@dataclass(eq=False)
class MediaTrace:
    """One image (or sound) chunk of a traced prompt: its tokens are the trace's positions
    [start, start + n_tokens); `embd` is what the encoder gave the text model [n_tokens,
    n_embd]; `values` the encoder nodes captured (clip.cpp's names, numpy order over each
    node's ggml rank: `kq_soft_max-0` is [n_head, n_patches, n_patches], `layer_out-1`
    [n_patches, n_embd])."""
    chunk: InputChunk
    start: int
    embd: np.ndarray = field(repr=False)
    values: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def n_tokens(self) -> int:
        return self.chunk.n_tokens

    @property
    def names(self) -> list[str]:
        return list(self.values)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.values:
            near = difflib.get_close_matches(name, self.names, n=5, cutoff=0.4)
            raise KeyError(f"encoder node {name!r} was not captured (capture_encoder=[...]); captured close "
                           f"names: {near or self.names[:8]}")
        return self.values[name]

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of the image's tokens, which come row by row: the ImageTokens' ny x nx
        where the text model reads 2-D positions; else (mtmd gives 1-d positions, nx = n_tokens,
        ny = 1) the grid of the preprocessed image's aspect that holds n_tokens (gemma3's 256
        tokens of a square image: 16 x 16)."""
        img = self.chunk.image
        assert img is not None      # a MediaTrace is made for media chunks only
        if self.chunk.type != "image":
            raise ValueError(f"a sound's chunk ({self.chunk.type}) has no image grid")
        if img.ny > 1:
            return img.ny, img.nx
        h, w = img.pixels.shape[1:]
        rows = max(1, round(math.sqrt(img.n_tokens * h / w)))
        if img.n_tokens % rows:
            raise ValueError(f"the image's {img.n_tokens} tokens form no grid of its {w} x {h} pixels")
        return rows, img.n_tokens // rows


class Trace:
    """Captured activations of one prompt (see the module docstring for shapes and names).
    `flash_attn` tells which attention path ran: only the unfused one has `kq_soft_max-*`.
    A prompt with images: `tokens` holds MEDIA_PLACEHOLDER at each image token, and
    `media` a MediaTrace per image (or sound) chunk, in prompt order."""

    def __init__(self, llm, tokens: list[int], values: dict[str, np.ndarray], logits: np.ndarray,
                 flash_attn: bool, media: Sequence[MediaTrace] = ()):
        self._llm = llm
        self.tokens = list(tokens)
        self.names = list(values)
        self._values = values
        self.logits = logits
        self.flash_attn = flash_attn
        self.media = list(media)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._values:
            near = difflib.get_close_matches(name, self.names, n=5, cutoff=0.4)
            raise KeyError(f"{name!r} was not captured; captured close names: {near or self.names[:8]}")
        return self._values[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __iter__(self):
        return iter(self.names)

    def items(self):
        return self._values.items()

    def __repr__(self) -> str:
        lines = [f"Trace: {len(self.tokens)} tokens, {len(self.names)} nodes "
                 f"({'flash attention' if self.flash_attn else 'unfused attention'})"]
        show = self.names if len(self.names) <= 12 else self.names[:6] + ["..."] + self.names[-5:]
        for name in show:
            lines.append("  ..." if name == "..." else f"  {name:24} {_summary(self._values[name])}")
        lines.append(f"  {'logits':24} {_summary(self.logits)}")
        for k, m in enumerate(self.media):
            lines.append(f"  media {k}: {m.chunk.type} tokens [{m.start}, {m.start + m.n_tokens}), "
                         f"{len(m.values)} encoder nodes")
        return "\n".join(lines)

    def layers(self, prefix: str = "l_out") -> list[int]:
        """Layer indices captured for names `prefix-<il>`, ascending."""
        return sorted(layer_of(n) for n in self.names if n.startswith(prefix + "-") and "#" not in n)

    def logit_lens(self, top_k: int = 5, token: int | str | None = None,
                   positions: Iterable[int] | None = None) -> LogitLens:
        """Apply result_norm + the output matrix (+ the final soft-cap) to every captured
        l_out-*: top tokens and probabilities per layer and position, and the rank of
        `token` (an id or a text that is one token) when given. `positions`: only these
        (e.g. an image's, `range(m.start, m.start + m.n_tokens)`), the columns in that order."""
        layers = self.layers("l_out")
        if not layers:
            raise ValueError("logit_lens needs captured l_out-* nodes: trace with capture=['l_out-*']")
        pos = None if positions is None else [int(p) for p in positions]
        if pos is not None:
            n = len(self.tokens)
            bad = [p for p in pos if not 0 <= p < n]
            if bad or not pos:
                raise ValueError(f"positions {bad[:5] or '(none)'} are outside the trace's {n} positions")
        vocab = self._llm.vocab
        tok: int | None = None
        if isinstance(token, str):
            ids = self._llm.tokenize(token, add_special=False)
            if len(ids) != 1:
                raise ValueError(f"token {token!r} is {len(ids)} tokens, not one")
            tok = ids[0]
        elif token is not None:
            tok = int(token)
            if not 0 <= tok < vocab.n_tokens:
                raise ValueError(f"token {tok} is outside the vocabulary [0, {vocab.n_tokens})")
        top_ids, top_probs, ranks, probs = [], [], [], []
        for il in layers:
            hidden = self[f"l_out-{il}"]
            logits = lens_logits(self._llm.model, hidden if pos is None else hidden[pos])
            p = jax.nn.softmax(jnp.asarray(logits), axis=-1)
            v, i = jax.lax.top_k(p, top_k)
            top_ids.append(np.asarray(i))
            top_probs.append(np.asarray(v))
            if tok is not None:
                pt = p[:, tok]
                ranks.append(np.asarray(jnp.sum(p > pt[:, None], axis=-1)))
                probs.append(np.asarray(pt))
        top_ids_a = np.stack(top_ids)
        pieces = [[[vocab.token_to_piece(int(t), 0, False).decode("utf-8", "replace") for t in row]
                   for row in layer] for layer in top_ids_a]
        return LogitLens(layers, top_ids_a, np.stack(top_probs), pieces, tok,
                         np.stack(ranks) if ranks else None, np.stack(probs) if probs else None, pos)

    def image_attention(self, token: int, *, layer: int | None = None, head: int | None = None,
                        image: int = 0) -> np.ndarray:
        """The attention probabilities the query at position `token` (negative: from the
        end) puts on the tokens of `media[image]`, as that image's grid [rows, columns]
        (MediaTrace.grid), ready to lay over its picture. `layer` / `head`: one, or the mean
        over the captured kq_soft_max-* layers / over heads when None. Needs a trace with
        images=[...] and capture=['kq_soft_max-*']."""
        n = len(self.tokens)
        if not isinstance(token, (int, np.integer)) or not -n <= token < n:
            raise ValueError(f"token {token!r} is outside the trace's {n} positions")
        if not self.media:
            raise ValueError("image: the trace holds no image; trace(prompt, images=[...], "
                             "capture=['kq_soft_max-*'])")
        if not 0 <= image < len(self.media):
            raise ValueError(f"image {image} is outside the trace's {len(self.media)} media chunks")
        m = self.media[image]
        if m.chunk.type != "image":
            raise ValueError(f"image {image} is a sound's chunk ({m.chunk.type}): it has no image grid")
        layers = self.layers("kq_soft_max")
        if not layers:
            raise ValueError("image_attention needs captured kq_soft_max-* nodes: trace with "
                             "capture=['kq_soft_max-*'] (the unfused attention path)")
        if layer is not None and layer not in layers:
            raise ValueError(f"layer {layer} was not captured; kq_soft_max layers: {layers}")
        rows = []
        for il in layers if layer is None else [layer]:
            p = self[f"kq_soft_max-{il}"]           # [n_head, n_tokens, n_kv]
            if head is not None and not 0 <= head < p.shape[0]:
                raise ValueError(f"head {head} is outside [0, {p.shape[0]}) for kq_soft_max-{il}")
            q = p[:, token % n, m.start:m.start + m.n_tokens]
            rows.append(q.mean(axis=0) if head is None else q[head])
        return np.mean(rows, axis=0).reshape(m.grid)


def lens_logits(model, x: np.ndarray) -> np.ndarray:
    """result_norm + output (+ final soft-cap) of hidden states x [n, n_embd], as a small
    graph through the compiled-graph cache; rows padded to a power of two."""
    n = x.shape[0]
    n_pad = 1 << max(n - 1, 0).bit_length()
    hp = model.hparams
    inp = new_input(GGMLType.F32, (hp.n_embd, n_pad), "lens_inp")
    cur = ops.mul(ops.rms_norm(inp, hp.f_norm_rms_eps), model.output_norm).set_name("result_norm")
    cur = ops.mul_mat(model.output, cur)
    cap = hp.f_final_logit_softcapping
    if cap > 0.0:
        cur = ops.scale(ops.tanh(ops.scale(cur, 1.0 / cap)), cap)
    cur.set_name("result_output")
    g = Graph().build_forward_expand(cur)
    xp = np.zeros((n_pad, hp.n_embd), np.float32)
    xp[:n] = x
    outs, _ = compute(g, {inp: xp}, device=model.place.dev_output)
    return np.asarray(outs[cur]).reshape(n_pad, -1)[:n]


# ---- running: trace and gradient -------------------------------------------------------

def _tokens(llm, prompt) -> list[int]:
    tokens = llm.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not tokens:
        raise ValueError("the prompt is empty (no tokens)")
    bad = [t for t in tokens if not 0 <= t < llm.model.n_vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {llm.model.n_vocab})")
    return tokens


def _ubatches(tokens: list[int], n_ubatch: int) -> list[list[int]]:
    return [tokens[i:i + n_ubatch] for i in range(0, len(tokens), n_ubatch)]


def pick_flash_attn(llm, patterns: Iterable[str], flash_attn: bool | None) -> bool:
    """The attention path of a trace: as asked, else unfused when a pattern matches a node
    only the unfused path has (kq-*, kq_soft_max-*, kqv-*), else the context's."""
    if flash_attn is not None:
        return bool(flash_attn)
    only = set(llm.node_table(False)) - set(llm.node_table(True))
    if any(fnmatch.fnmatchcase(lb, p) for p in patterns for lb in only):
        return False
    return llm.ctx.flash_attn


def run_trace(llm, prompt, capture: Iterable[str], interventions: Interventions | None,
              flash_attn: bool | None) -> Trace:
    tokens = _tokens(llm, prompt)
    capture = [capture] if isinstance(capture, str) else list(capture)
    fa = pick_flash_attn(llm, capture + list(interventions or {}), flash_attn)
    ctx = llm.trace_context(len(tokens))
    edits = GraphEdits(llm.node_table(fa), interventions, capture)
    edits.check(sorted({bucket(len(c), ctx.n_ubatch) for c in _ubatches(tokens, ctx.n_ubatch)}))
    ctx.flash_attn = fa
    ctx.memory_clear()
    ctx.edits = edits
    rows = []
    try:
        for start in range(0, len(tokens), ctx.n_batch):
            chunk = tokens[start:start + ctx.n_batch]
            ret = ctx.decode(Batch(chunk, logits=np.ones(len(chunk), bool)))
            if ret != 0:
                raise RuntimeError(f"trace: decode returned {ret}: {ctx.last_error}")
            rows.append(ctx.get_logits().copy())
    finally:
        ctx.edits = None
        ctx.memory_clear()
    values = {label: assemble(edits.captured[label], len(tokens)) for label in edits.capture}
    for cap in edits.captured.values():     # the context may keep this graph (and its edits) a while
        cap.parts.clear()
    return Trace(llm, tokens, values, np.concatenate(rows), fa)


def _encoder_nodes(mctx: MtmdContext, chunk: InputChunk, patterns: list[str]) -> dict[str, Tensor]:
    """The nodes of this chunk's encoder graph the patterns match (label -> tensor); a
    ValueError naming capture_encoder for a pattern that matches nothing."""
    assert chunk.image is not None
    ny, nx = chunk.image.pixels.shape[1:]
    g = mctx.graph(nx, ny, audio=chunk.type == "audio")
    labels = node_labels(g.gf.nodes)
    by_label = {labels[n.id]: n for n in g.gf.nodes if n.id in labels}
    table = {lb: NodeInfo(lb, t.ne, t.n_dims, None, None) for lb, t in by_label.items()}
    try:
        return {lb: by_label[lb] for lb in resolve(patterns, table)}
    except ValueError as e:
        raise ValueError(f"capture_encoder: {e}") from None


def _encode(mctx: MtmdContext, chunk: InputChunk, nodes: dict[str, Tensor], start: int) -> MediaTrace:
    """The chunk's embeddings, from the embedding cache when no node is captured; else one
    run of its cached graph with the nodes as extra outputs (an encoder run, counted as
    one; its embeddings are not cached, so the cache keeps what plain runs gave)."""
    if not nodes:
        return MediaTrace(chunk, start, mctx.encode_chunk(chunk))
    img = chunk.image
    assert img is not None
    t0 = time.perf_counter()
    ny, nx = img.pixels.shape[1:]
    g = mctx.graph(nx, ny, audio=chunk.type == "audio")
    assert g.out is not None
    outs, _ = compute(g.gf, {g.inp_raw: img.pixels, **g.inputs}, device=mctx.text_model.place.dev_output,
                      extra_outputs=list(nodes.values()))
    embd = np.asarray(outs[g.out], np.float32).reshape(-1, mctx.n_mmproj_embd)
    values = {lb: np.asarray(outs[t], np.float32).reshape(tuple(reversed(t.ne[:t.n_dims])))
              for lb, t in nodes.items()}
    mctx.n_encode += 1
    mctx.t_encode += time.perf_counter() - t0
    return MediaTrace(chunk, start, embd, values)


def run_media_trace(llm, prompt: str | list[int], images: Sequence, capture: Iterable[str],
                    capture_encoder: Iterable[str], interventions: Interventions | None,
                    flash_attn: bool | None) -> Trace:
    """A trace of a prompt whose media markers stand for `images`, evaluated chunk by chunk
    as mtmd_helper_eval_chunks does (non-causal attention over an image where the model
    wants it, M-RoPE positions), every position's logits kept."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str holding a media marker per image, got {type(prompt).__name__}")
    chunks = llm.media_prompt(prompt, images)       # ValueError without an mmproj, MediaError for bad media
    mctx: MtmdContext = llm.mtmd
    capture = [capture] if isinstance(capture, str) else list(capture)
    enc = [capture_encoder] if isinstance(capture_encoder, str) else list(capture_encoder)
    media = [c for c in chunks if c.image is not None]
    if enc and not media:
        raise ValueError("capture_encoder: the prompt holds no image (a media marker per image, images=[...])")
    enc_nodes = [_encoder_nodes(mctx, c, enc) if enc else {} for c in media]
    tokens: list[int] = []
    for c in chunks:
        tokens += c.tokens if c.image is None else [MEDIA_PLACEHOLDER] * c.n_tokens
    ctx = llm.trace_context(len(tokens))
    fa = pick_flash_attn(llm, capture + list(interventions or {}), flash_attn)
    edits = GraphEdits(llm.node_table(fa), interventions, capture)
    if media and "inp_embd" in edits.fns:
        raise ValueError("interventions: an image's tokens are an embeddings batch, whose graph has no inp_embd "
                         "node to edit; edit a later node (l_out-0, ...)")
    sizes: set[int] = set()       # the padded ubatch sizes the graphs will have
    for c in chunks:
        for s in range(0, c.n_tokens, ctx.n_batch):
            n = min(ctx.n_batch, c.n_tokens - s)
            sizes.update(bucket(min(ctx.n_ubatch, n - u), ctx.n_ubatch) for u in range(0, n, ctx.n_ubatch))
    edits.check(sorted(sizes))
    ctx.flash_attn = fa
    ctx.memory_clear()
    ctx.edits = edits
    rows: list[np.ndarray] = []
    traced: list[MediaTrace] = []
    n_past = 0
    at = 0          # the chunk's first token among the trace's tokens (n_past counts positions)

    def decode(batch: Batch, what: str) -> None:
        ret = ctx.decode(batch)
        if ret != 0:
            raise RuntimeError(f"trace: decoding {what} returned {ret}: {ctx.last_error}")
        rows.append(ctx.get_logits().copy())

    try:
        for c in chunks:
            if c.image is None:
                for s in range(0, len(c.tokens), ctx.n_batch):
                    part = c.tokens[s:s + ctx.n_batch]
                    decode(Batch(part, pos=np.arange(n_past, n_past + len(part)), logits=np.ones(len(part), bool)),
                           "text")
                    n_past += len(part)
                at += c.n_tokens
                continue
            mt = _encode(mctx, c, enc_nodes[len(traced)], at)
            traced.append(mt)
            pos = c.image.decoder_pos(n_past)
            non_causal = mctx.projector.non_causal and c.type == "image"      # mtmd_decode_use_non_causal
            if non_causal:
                ctx.set_causal_attn(False)
            try:
                for s in range(0, c.n_tokens, ctx.n_batch):
                    e = mt.embd[s:s + ctx.n_batch]
                    decode(Batch(embd=e, pos=pos[..., s:s + len(e)], logits=np.ones(len(e), bool)), c.type)
            finally:
                if non_causal:
                    ctx.set_causal_attn(True)
            n_past += c.n_pos
            at += c.n_tokens
    finally:
        ctx.edits = None
        ctx.memory_clear()
    values = {label: assemble(edits.captured[label], len(tokens)) for label in edits.capture}
    for cap in edits.captured.values():
        cap.parts.clear()
    return Trace(llm, tokens, values, np.concatenate(rows), fa, traced)


@dataclass
class _GradProgram:
    fn: Callable                 # jitted value_and_grad
    delta_pos: list[int]


def run_gradient(llm, prompt, target, wrt: Iterable[str], interventions: Interventions | None,
                 flash_attn: bool | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float]:
    """(d target / d node for each wrt label, the nodes' values, the target's value)."""
    tokens = _tokens(llm, prompt)
    n = len(tokens)
    wrt = [wrt] if isinstance(wrt, str) else list(wrt)
    fa = pick_flash_attn(llm, wrt + list(interventions or {}), flash_attn)
    ctx = llm.trace_context(n)
    if n > ctx.n_ubatch:
        raise ValueError(f"gradient: the prompt has {n} tokens; it must fit one ubatch (n_ubatch = {ctx.n_ubatch})")
    n_vocab = llm.model.n_vocab
    if callable(target):
        sel = np.zeros(2, np.int32)
        try:
            out = jax.eval_shape(target, jax.ShapeDtypeStruct((n, n_vocab), jnp.float32))
        except Exception as e:
            raise ValueError(f"gradient target fails on logits [{n}, {n_vocab}]: {type(e).__name__}: {e}") from e
        if out.shape != ():
            raise ValueError(f"gradient target must return a scalar, it returns shape {list(out.shape)} "
                             f"from logits [{n}, {n_vocab}]")
        target_fn = target
    else:
        try:
            pos, tok = (int(v) for v in target)
        except (TypeError, ValueError):
            raise ValueError(f"gradient target must be (position, token_id) or a function of the logits, "
                             f"got {target!r}") from None
        if not -n <= pos < n:
            raise ValueError(f"gradient target position {pos} is outside the prompt's {n} positions")
        if not 0 <= tok < n_vocab:
            raise ValueError(f"gradient target token {tok} is outside the vocabulary [0, {n_vocab})")
        sel = np.array([pos % n, tok], np.int32)
        target_fn = None
    edits = GraphEdits(llm.node_table(fa), interventions, deltas=wrt)
    edits.check([bucket(n, ctx.n_ubatch)])
    ctx.flash_attn = fa
    ctx.memory_clear()
    try:
        batch = Batch(tokens, logits=np.ones(n, bool))
        ctx.balloc.init(batch, n_vocab=n_vocab, n_embd=llm.model.hparams.n_embd, n_seq_max=ctx.n_seq_max,
                        memory=ctx.memory)
        # the whole prompt in one ubatch (a recurrent memory's: one sequence of n tokens)
        (ub,) = ctx.balloc.split_equal(ctx.n_ubatch) if ctx.recurrent else ctx.balloc.split_simple(ctx.n_ubatch)
        prepared = ctx.memory.prepare([ub])
        assert prepared is not None         # an empty memory holds any one ubatch that fits n_ctx
        (slot,) = prepared
        ctx.memory.apply(slot, ub)
        params = ctx._params(ub)
        g = GraphBuilder(llm.model, ctx.memory, params)
        llm.model.builder.build_graph(g)
        edits.apply(g)
        assert g.res_logits is not None   # every architecture builds its logits
        g.set_slot(slot)
        values: dict[Tensor, np.ndarray] = {}
        for inp in g.inputs:
            inp.set_input(ub, values)
        deltas = [edits.delta_inputs[label] for label in edits.deltas]
        taps = [edits.delta_taps[label] for label in edits.deltas]
        prog = Program.from_nodes(g.gf.nodes, [g.res_logits] + taps, None)
        devices = {next(iter(t.data.array.devices())) for t in prog.weights}
        if len(devices) > 1:
            raise ValueError(f"gradient runs on one device; this model's weights are on {len(devices)}")
        dev = devices.pop()
        w_vals = [t.data for t in prog.weights]
        w_flat, treedef = jax.tree.flatten(tuple(w_vals))
        state = ctx.memory.state()
        st_vals = [state[t] for t in prog.states]
        delta_ids = {d.id for d in deltas}
        in_vals = [np.zeros(t.shape, np.float32) if t.id in delta_ids
                   else np.asarray(values[t]).reshape(t.shape).astype(lower.jnp_dtype(t.type)) for t in prog.inputs]
        delta_pos = [next(j for j, t in enumerate(prog.inputs) if t.id == d.id) for d in deltas]
        key = (GraphCache.key_of(prog.signature()), n, id(target_fn) if target_fn else None)
        gp = llm.grad_programs.get(key)
        if gp is None:
            fn = prog.make_fn(treedef)
            n_pad = params.n_tokens

            def objective(ds, w, ins, st, sel):
                ins = list(ins)
                for j, d in zip(delta_pos, ds, strict=True):
                    ins[j] = d
                outs, _ = fn(w, ins, st)
                logits = outs[0].reshape(n_pad, n_vocab)[:n]
                val = logits[sel[0], sel[1]] if target_fn is None else target_fn(logits)
                return val, outs[1:]

            gp = _GradProgram(jax.jit(jax.value_and_grad(objective, has_aux=True)), delta_pos)
            llm.grad_programs[key] = gp
        put = lambda x: jax.device_put(x, dev)  # noqa: E731
        (val, taps_v), grads = gp.fn(tuple(put(in_vals[j]) for j in delta_pos), put(tuple(w_flat)),
                                     put(tuple(in_vals)), put(tuple(st_vals)), put(sel))
    finally:
        ctx.memory_clear()
    out_g, out_v = {}, {}
    for label, gr, v, d in zip(edits.deltas, grads, taps_v, deltas, strict=True):
        info = edits.table[label]
        cap = Captured(info, [(np.asarray(gr).reshape(info.view_shape(d.ne)), n)])
        out_g[label] = assemble(cap, n)
        out_v[label] = assemble(Captured(info, [(np.asarray(v).reshape(info.view_shape(d.ne)), n)]), n)
    return out_g, out_v, float(val)


def patch(source: np.ndarray, positions: Iterable[int] | None = None) -> Callable:
    """An intervention that writes rows of `source` (a traced value, tokens on axis 0) into
    the node at `positions` (all of source's rows when None): activation patching. Rows
    are positions within the ubatch, i.e. prompt positions when the prompt fits one."""
    src = np.asarray(source, np.float32)
    pos = np.arange(src.shape[0]) if positions is None else np.asarray(list(positions), np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= src.shape[0]):
        raise ValueError(f"patch positions {pos.tolist()} are outside the source's {src.shape[0]} rows")
    rows = jnp.asarray(src[pos])

    def fn(x):
        return x.at[pos].set(rows.astype(x.dtype))
    return fn
