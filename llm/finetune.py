"""LoRA fine-tuning on the GGUF file itself (issue 31, part 2).

The frozen model stays in the format it was loaded in (quantized weights stay quantized); the
adapter is a llama.cpp LoRA (llm.adapter) whose A and B are the only trained arrays, F32. The
gradient comes from the same lowered graph the engine decodes with (GraphBuilder, then
ggmlx's Program as one pure JAX function), flash attention and the KV-cache writes included:
`jax.value_and_grad` with respect to the adapter's leaves of the program's weights.

One step is one ubatch of `batch_size` sequences of L tokens, each its own sequence id at
positions 0..L-1, so the KV-cache mask keeps them apart. L is fixed for the whole run (the
longest example, at most max_seq_length, rounded up to 8): every step and every validation
batch has the same shape, and the step is compiled once, ahead of the loop. Padding and
(with mask_prompt) prompt tokens have zero weight in the loss, the mean token cross-entropy.

Data are mlx-lm's formats: a directory with train.jsonl, valid.jsonl (and test.jsonl), one
JSON object a line, either {"text"}, {"messages"} (rendered with the model's chat template;
the loss on the assistant turns) or {"prompt", "completion"} (plain text, BOS + prompt +
completion + EOS; the loss on the completion). The optimizer is optax's AdamW with linear
warm-up and cosine decay.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import lower, ops, weights
from ggmlx.compile import Program
from ggmlx.tensor import Tensor, new_input, new_weight
from ggmlx.types import GGMLType
from llm import params as params_mod
from llm.adapter import LoraAdapter, LoraScales, LoraWeight, adapter_lora_init, write_lora
from llm.batch import Batch, BatchAllocator
from llm.chat import templates as chat_mod
from llm.graph import GraphBuilder, GraphParams, InpEmbd
from llm.kv_cache import KVCache
from llm.model import Model
from llm.params import param

if TYPE_CHECKING:
    import optax

    from llm.api import LLM

log = logging.getLogger(__name__)

DEFAULT_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
SPLITS = ("train", "valid", "test")
SEQ_ROUND = 8       # L is a multiple of this


def _targets(text: str) -> tuple[str, ...]:
    return tuple(t for t in text.split(",") if t)


@dataclass
class LoraConfig:
    """What `train` does; each field is also a `python -m llm finetune` flag (mlx-lm's names)."""

    rank: int = param(8, flags=("--lora-rank",), lo=1, help="rank r of each adapter pair")
    alpha: float = param(16.0, flags=("--lora-alpha",), lo=0.0,
                         help="LoRA alpha: the update is alpha / r * B A (written as adapter.lora.alpha)")
    dropout: float = param(0.0, flags=("--lora-dropout",), lo=0.0, hi=0.95,
                           help="dropout on the adapters' inputs while training")
    num_layers: int = param(16, flags=("--num-layers",), lo=-1,
                            help="adapt the last N layers (-1: all of them)")
    targets: tuple[str, ...] = param(DEFAULT_TARGETS, flags=("--lora-targets",), append=True, parse=_targets,
                                     metavar="NAMES", help="weights to adapt in each layer, GGUF names "
                                     "(blk.N.<name>.weight), comma-separated; repeatable")
    learning_rate: float = param(1e-5, flags=("--learning-rate",), lo=0.0, help="peak learning rate of AdamW")
    warmup: int = param(0, flags=("--warmup",), lo=0, help="steps of linear warm-up before the cosine decay")
    weight_decay: float = param(0.01, flags=("--weight-decay",), lo=0.0, help="AdamW's decoupled weight decay")
    iters: int = param(1000, flags=("--iters",), lo=1, help="training steps")
    batch_size: int = param(4, flags=("--batch-size",), lo=1, hi=64, help="sequences per step")
    max_seq_length: int = param(2048, flags=("--max-seq-length",), lo=2,
                                help="examples are cut to this many tokens")
    steps_per_eval: int = param(200, flags=("--steps-per-eval",), lo=1, help="validate every N steps")
    val_batches: int = param(25, flags=("--val-batches",), lo=-1,
                             help="validation batches per evaluation (-1: the whole validation set)")
    save_every: int = param(100, flags=("--save-every",), lo=0,
                            help="write the adapter every N steps (with an adapter path; 0: only at the end)")
    grad_checkpoint: bool = param(False, flags=("--grad-checkpoint",),
                                  help="recompute each layer's activations in the backward pass (less memory)")
    seed: int = param(0, flags=("--seed",), lo=0, help="seed of the adapter init, the batch order and dropout")
    mask_prompt: bool = param(True, flags=("--mask-prompt",),
                              help="loss on completions and assistant turns only (--no-mask-prompt: every token)")


class DatasetError(ValueError):
    """A data file or row that cannot be trained on; the message names the file and the line."""


# ---- data ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One example as read, with where it came from ("train.jsonl:12")."""

    where: str
    data: dict


@dataclass(frozen=True)
class Example:
    """Token ids and, per token, whether predicting it counts in the loss."""

    tokens: np.ndarray      # int32 [n]
    weight: np.ndarray      # bool [n]; weight[0] is always False (nothing predicts it)
    where: str


# A JSONL path, or rows (dicts in mlx-lm's formats, or Rows as read_jsonl gives them)
Data = Sequence[dict | Row] | str | os.PathLike


def _check_row(where: str, row: Any) -> Row:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    keys: tuple[str, ...]
    if "text" in row:
        keys = ("text",)
    elif "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise DatasetError(f"{where}: 'messages' must be a non-empty list of objects")
        for j, m in enumerate(msgs):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DatasetError(f"{where}: messages[{j}] needs string 'role' and 'content'")
        return Row(where, row)
    elif "prompt" in row and "completion" in row:
        keys = ("prompt", "completion")
    else:
        raise DatasetError(f"{where}: a row needs 'text', 'messages', or 'prompt' and 'completion'; "
                           f"it has {sorted(row)}")
    for k in keys:
        if not isinstance(row[k], str):
            raise DatasetError(f"{where}: '{k}' must be a string, got {type(row[k]).__name__}")
    return Row(where, row)


def read_jsonl(path: str | os.PathLike) -> list[Row]:
    """The rows of one JSONL file (blank lines skipped); DatasetError naming the file and line
    for bad JSON or a row without the expected keys."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not JSON: {e.msg} (column {e.colno})") from None
            rows.append(_check_row(where, row))
    return rows


def load_data(directory: str | os.PathLike) -> dict[str, list[Row]]:
    """train.jsonl and valid.jsonl (required) and test.jsonl (if present) of a directory."""
    out = {}
    for split in SPLITS:
        path = os.path.join(directory, f"{split}.jsonl")
        if not os.path.exists(path):
            if split == "test":
                continue
            raise DatasetError(f"{path}: no such file (a data directory holds train.jsonl and valid.jsonl)")
        out[split] = read_jsonl(path)
    return out


def _chat_tokens(model: Model, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation through the model's chat template, as llm.LLM.chat_tokens renders it
    (BOS added unless the template writes it)."""
    v = model.vocab
    text = chat_mod.render(chat_mod.template_for(model.meta, model.arch), messages,
                           add_generation_prompt=add_generation_prompt,
                           bos_token=v.token_get_text(v.bos).decode("utf-8", "replace") if v.bos >= 0 else "",
                           eos_token=v.token_get_text(v.eos).decode("utf-8", "replace") if v.eos >= 0 else "")
    tokens = v.tokenize(text, add_special=False, parse_special=True)
    if v.add_bos and (not tokens or tokens[0] != v.bos):
        tokens = [v.bos] + tokens
    return tokens


def _chat_example(model: Model, row: Row, mask_prompt: bool) -> tuple[list[int], list[bool]]:
    """Tokens of a conversation; the loss weights cover each assistant turn (the tokens between
    the generation prompt before it and the end of the turn)."""
    msgs = row.data["messages"]
    try:
        tokens = _chat_tokens(model, msgs, add_generation_prompt=False)
        weight = [not mask_prompt] * len(tokens)
        if mask_prompt:
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                start = len(_chat_tokens(model, msgs[:i], add_generation_prompt=True))
                upto = _chat_tokens(model, msgs[:i + 1], add_generation_prompt=False)
                if tokens[:len(upto)] != upto or start > len(upto):
                    raise DatasetError(f"{row.where}: the chat template does not render the conversation up "
                                       f"to message {i} as a prefix of the whole; train it with "
                                       "mask_prompt off (--no-mask-prompt)")
                weight[start:len(upto)] = [True] * (len(upto) - start)
    except chat_mod.ChatTemplateError as e:
        raise DatasetError(f"{row.where}: {e}") from None
    return tokens, weight


def encode(model: Model, rows: Sequence[Row], *, mask_prompt: bool = True) -> list[Example]:
    """Rows as token ids and loss weights (see the module docstring for each format)."""
    v = model.vocab
    eos = [v.eos] if v.eos >= 0 else []
    out = []
    for row in rows:
        d = row.data
        if "text" in d:
            tokens = v.tokenize(d["text"], add_special=True, parse_special=True)
            if eos and tokens[-1:] != eos:
                tokens += eos
            weight = [True] * len(tokens)
        elif "messages" in d:
            tokens, weight = _chat_example(model, row, mask_prompt)
        else:
            prompt = v.tokenize(d["prompt"], add_special=True, parse_special=True)
            completion = v.tokenize(d["completion"], add_special=False, parse_special=True) + eos
            tokens = prompt + completion
            weight = [not mask_prompt] * len(prompt) + [True] * len(completion)
        if not tokens:
            raise DatasetError(f"{row.where}: the row has no tokens")
        w = np.asarray(weight, bool)
        w[0] = False
        out.append(Example(np.asarray(tokens, np.int32), w, row.where))
    return out


def _rows(data: Data, name: str) -> list[Row]:
    """A JSONL path's rows, or rows given as dicts (named `name[i]` in errors)."""
    if isinstance(data, (str, os.PathLike)):
        return read_jsonl(data)
    return [r if isinstance(r, Row) else _check_row(f"{name}[{i}]", r) for i, r in enumerate(data)]


def _examples(model: Model, data: Data, name: str, config: LoraConfig) -> list[Example]:
    ex = encode(model, _rows(data, name), mask_prompt=config.mask_prompt)
    if not ex:
        raise DatasetError(f"the {name} set is empty" + (f" ({data})" if isinstance(data, (str, os.PathLike)) else ""))
    cut = [e for e in ex if e.tokens.size > config.max_seq_length]
    if cut:
        log.warning("%d %s example(s) are longer than max_seq_length %d and are cut (first: %s, %d tokens)",
                    len(cut), name, config.max_seq_length, cut[0].where, cut[0].tokens.size)
        ex = [Example(e.tokens[:config.max_seq_length], e.weight[:config.max_seq_length], e.where) for e in ex]
    if not any(e.weight.any() for e in ex):
        raise DatasetError(f"the {name} set has no tokens to train on (every token is prompt or padding)")
    return ex


def _batches(examples: list[Example], batch_size: int, seed: int) -> Iterator[list[Example]]:
    """Training batches forever: each pass over the set in a new seeded order."""
    rng = np.random.default_rng(seed)
    stream: list[int] = []
    while True:
        while len(stream) < batch_size:
            stream += rng.permutation(len(examples)).tolist()
        yield [examples[i] for i in stream[:batch_size]]
        del stream[:batch_size]


@dataclass
class _Arrays:
    """One step's inputs: tokens [B*L], the next token of each [B*L] and its loss weight."""

    tokens: np.ndarray
    targets: np.ndarray
    weight: np.ndarray
    n_tokens: int           # real (not padding) tokens


def _pack(batch: list[Example], batch_size: int, seq_len: int, pad: int) -> _Arrays:
    """batch_size rows of seq_len tokens (a short batch padded with empty rows); position j's
    target is token j + 1 of its row, weighted by that token's loss weight."""
    tokens = np.full((batch_size, seq_len), pad, np.int32)
    weight = np.zeros((batch_size, seq_len), np.float32)
    n = 0
    for i, e in enumerate(batch):
        k = e.tokens.size
        tokens[i, :k] = e.tokens
        weight[i, :k - 1] = e.weight[1:]
        n += k
    targets = np.concatenate([tokens[:, 1:], np.full((batch_size, 1), pad, np.int32)], axis=1)
    return _Arrays(tokens.reshape(-1), targets.reshape(-1), weight.reshape(-1), n)


def seq_length(examples: Sequence[Example], max_seq_length: int) -> int:
    """The run's sequence length L: the longest example, at most max_seq_length, rounded up."""
    longest = min(max(e.tokens.size for e in examples), max_seq_length)
    return -(-longest // SEQ_ROUND) * SEQ_ROUND


# ---- the adapter -----------------------------------------------------------------------------

Pairs = dict[str, tuple[np.ndarray, np.ndarray]]     # weight name -> (A, B) in write_lora's numpy order


def adapted_weights(model: Model, config: LoraConfig) -> list[str]:
    """blk.N.<target>.weight for the last num_layers layers, those the model has."""
    n_layer = model.hparams.n_layer
    if config.num_layers == 0:
        raise ValueError("num_layers 0 adapts no layer (-1: all of them)")
    first = 0 if config.num_layers < 0 else max(0, n_layer - config.num_layers)
    have = {t.name: t for t in model.weight_tensors()}
    names = []
    for target in config.targets:
        found = [f"blk.{il}.{target}.weight" for il in range(first, n_layer) if f"blk.{il}.{target}.weight" in have]
        for name in found:
            if have[name].ne[2] != 1:
                raise ValueError(f"LoRA target {target!r}: {name} holds experts (3-d); training adapters of "
                                 "MoE expert weights is not supported")
        names += found
    if not names:
        raise ValueError(f"no weight of the model matches the LoRA targets {list(config.targets)} in layers "
                         f"{first}..{n_layer - 1} (names are GGUF's: blk.N.<target>.weight)")
    return sorted(names, key=lambda n: (int(n.split(".")[1]), n))


def init_pairs(model: Model, names: list[str], rank: int, seed: int) -> Pairs:
    """The standard LoRA start: A uniform in +-1/sqrt(n_in), B zero (the adapter does nothing yet)."""
    rng = np.random.default_rng(seed)
    have = {t.name: t for t in model.weight_tensors()}
    out = {}
    for name in names:
        n_in, n_out = have[name].ne[0], have[name].ne[1]
        bound = 1.0 / math.sqrt(n_in)
        out[name] = (rng.uniform(-bound, bound, (rank, n_in)).astype(np.float32), np.zeros((n_out, rank), np.float32))
    return out


def read_pairs(model: Model, path: str | os.PathLike) -> tuple[Pairs, float]:
    """An adapter file's pairs as F32 and its alpha (checked against the model by adapter_lora_init)."""
    adapter = adapter_lora_init(model, path)
    pairs = {}
    for name, lw in adapter.weights.items():
        a, b = (np.asarray(weights.materialize(t.data), np.float32).reshape(t.ne[1], t.ne[0]) for t in (lw.a, lw.b))
        pairs[name] = (a, b)
    return pairs, adapter.alpha


def _adapter(model: Model, pairs: Pairs, alpha: float) -> LoraAdapter:
    """The pairs as a LoraAdapter held F32 on their layers' devices (the trained leaves)."""
    out = {}
    for name, (a, b) in pairs.items():
        il = int(name.split(".")[1]) if name.startswith("blk.") else None
        dev = model.place.dev_layer[il] if il is not None else model.place.dev_output
        pair = []
        for suffix, x in ((".lora_a", a), (".lora_b", b)):
            t = new_weight(GGMLType.F32, tuple(reversed(x.shape)), name + suffix)
            t.data = weights.to_device(x, GGMLType.F32, t.ne, dev, "f32")
            pair.append(t)
        out[name] = LoraWeight(*pair)
    return LoraAdapter("<training>", model, alpha, out)


def write_adapter(path: str | os.PathLike, arch: str, pairs: Pairs, alpha: float, name: str = "") -> None:
    """The pairs as a llama.cpp LoRA GGUF, written to a temporary name first (never half a file)."""
    tmp = f"{path}.tmp"
    try:
        write_lora(tmp, arch, pairs, alpha=alpha, meta={"general.name": name} if name else None)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---- the training graph ----------------------------------------------------------------------

class _DropoutGraph(GraphBuilder):
    """The graph with LoRA dropout: an adapted product is W x + alpha/r * B (A (x * m)), m an
    input per product (0, or 1/(1-p)) drawn each step; the base product keeps x."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drops: list[Tensor] = []

    def lora_input(self, w: Tensor, cur: Tensor) -> Tensor:
        mask = new_input(GGMLType.F32, cur.ne, f"{w.name}.lora_drop")
        self.drops.append(mask)
        return ops.mul(cur, mask)


def _segments(prog: Program) -> list[tuple[list[Tensor], list[Tensor], list[Tensor]]]:
    """The program's nodes cut after each layer's output (l_out-N, as every architecture names
    it): per piece its nodes, the values it reads from before it and the values of it that
    later pieces or outputs read."""
    pieces: list[list[Tensor]] = [[]]
    for n in prog.nodes:
        pieces[-1].append(n)
        if n.name.startswith("l_out-"):
            pieces.append([])
    pieces = [p for p in pieces if p]
    owner = {n.id: k for k, p in enumerate(pieces) for n in p}
    reads: list[dict[int, Tensor]] = [{} for _ in pieces]
    writes: list[dict[int, Tensor]] = [{} for _ in pieces]
    for k, p in enumerate(pieces):
        for n in p:
            for s in n.src:
                if owner.get(s.id, -1) != k:
                    reads[k].setdefault(s.id, s)
                    if s.id in owner:
                        writes[owner[s.id]].setdefault(s.id, s)
    for o in prog.outputs:
        writes[owner[o.id]].setdefault(o.id, o)
    return [(p, list(r.values()), list(w.values())) for p, r, w in zip(pieces, reads, writes, strict=True)]


def _remat_fn(prog: Program, treedef) -> Callable:
    """fn(weights, inputs, states) -> outputs with each piece of _segments under
    jax.checkpoint: the backward pass keeps only the values between layers and recomputes
    the rest of a layer (per-layer rematerialisation)."""
    pieces = _segments(prog)

    def run_piece(vals, nodes, reads, writes):
        env = dict(zip(reads, vals, strict=True))
        lower.run_nodes(nodes, env)
        return [env[t] for t in writes]

    def fn(w_flat, in_vals, st_vals):
        env: dict = {}
        env.update(zip(prog.weights, jax.tree.unflatten(treedef, w_flat), strict=True))
        env.update(zip(prog.inputs, in_vals, strict=True))
        env.update(zip(prog.states, st_vals, strict=True))
        for nodes, reads, writes in pieces:
            piece = jax.checkpoint(lambda vals, nodes=nodes, reads=reads, writes=writes:
                                   run_piece(vals, nodes, reads, writes))
            env.update(zip(writes, piece([env[t] for t in reads]), strict=True))
        return tuple(env[o] for o in prog.outputs), ()

    return fn


class _TrainGraph:
    """The graph of one step, batch_size sequences of seq_len tokens in one ubatch, as a pure
    function of the adapter's arrays and the step's tokens. Every other input (positions,
    sequence ids, the mask, the cells written) is the same at every step, set once here."""

    def __init__(self, model: Model, adapter: LoraAdapter, batch_size: int, seq_len: int, *, dropout: float,
                 remat: bool):
        n = batch_size * seq_len
        self.n_tokens = n
        kv = KVCache(model, n, batch_size, kv_bucket=n, n_ubatch=n)
        balloc = BatchAllocator()
        batch = Batch(np.zeros(n, np.int32), pos=np.tile(np.arange(seq_len), batch_size),
                      seq_id=np.repeat(np.arange(batch_size), seq_len).tolist(), logits=np.ones(n, bool))
        balloc.init(batch, n_vocab=model.n_vocab, n_embd=model.hparams.n_embd, n_seq_max=batch_size, memory=kv)
        (ub,) = balloc.split_simple(n)
        slots = kv.prepare([ub])
        assert slots is not None        # an empty cache of exactly n cells
        kv.apply(slots[0], ub)
        gp = GraphParams(n_tokens=n, n_outputs=n, n_kv=kv.n_kv(), embd_input=False, loras=(adapter,),
                         n_kv_swa=kv.n_kv_swa() if kv.cells_swa is not None else 0)
        g = (_DropoutGraph if dropout > 0 else GraphBuilder)(model, kv, gp, lora=LoraScales((adapter,), (1.0,)))
        model.builder.build_graph(g)
        assert g.inp_attn is not None and g.res_logits is not None     # every decoder builds both
        g.inp_attn.slot, g.inp_attn.slot_swa = slots[0]
        values: dict[Tensor, Any] = {}
        for inp in g.inputs:
            inp.set_input(ub, values)
        prog = Program.from_nodes(g.gf.nodes, [g.res_logits])
        devices = {d for t in prog.weights for a in jax.tree.leaves(t.data) for d in a.devices()}
        if len(devices) > 1:
            raise ValueError(f"fine-tuning runs on one device; this model's weights are on {len(devices)} "
                             "(load it with devices=[] or n_gpu_layers for one device)")
        self.device = devices.pop()
        w_flat, treedef = jax.tree.flatten(tuple(t.data for t in prog.weights))
        trained = {id(t) for lw in adapter.weights.values() for t in (lw.a, lw.b)}
        self.index: dict[str, int] = {}         # adapter tensor name -> its leaf in w_flat
        k = 0
        for t in prog.weights:
            if id(t) in trained:
                self.index[t.name] = k
            k += len(jax.tree.leaves(t.data))
        self.frozen = jax.device_put(tuple(w_flat), self.device)
        drops = g.drops if isinstance(g, _DropoutGraph) else []
        self.drop_pos = [prog.inputs.index(t) for t in drops]
        self.dropout = dropout
        tokens = next(i.tokens for i in g.inputs if isinstance(i, InpEmbd))
        assert tokens is not None       # built from token ids
        self.tok_pos = prog.inputs.index(tokens)
        self.inputs = tuple(jax.device_put(np.asarray(values[t]).reshape(t.shape).astype(lower.jnp_dtype(t.type))
                                           if t in values else np.ones(t.shape, np.float32), self.device)
                            for t in prog.inputs)
        self.states = tuple(t.data for t in prog.states)   # the cache's zero buffers, read, never written back
        self.shapes = [t.shape for t in prog.inputs]
        self.fn = _remat_fn(prog, treedef) if remat else prog.make_fn(treedef)

    def params(self) -> dict[str, jax.Array]:
        """The adapter's arrays as they start (F32, the held shape [1, 1, ne1, ne0])."""
        return {name: self.frozen[j] for name, j in self.index.items()}

    def logits(self, params: dict, frozen: tuple, inputs: tuple, states: tuple, tokens: jax.Array,
               key: jax.Array | None) -> jax.Array:
        """[n_tokens, n_vocab]; key: dropout's (None: no dropout)."""
        w = list(frozen)
        for name, j in self.index.items():
            w[j] = params[name]
        ins = list(inputs)
        ins[self.tok_pos] = tokens
        if key is not None:
            keep = 1.0 - self.dropout
            for k, j in enumerate(self.drop_pos):
                bits = jax.random.bernoulli(jax.random.fold_in(key, k), keep, self.shapes[j])
                ins[j] = bits.astype(jnp.float32) / keep
        outs, _ = self.fn(w, ins, states)
        return outs[0].reshape(self.n_tokens, -1)


def _cross_entropy(logits: jax.Array, targets: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of the weighted token cross-entropies, sum of the weights)."""
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return jnp.sum(ce * weight), jnp.sum(weight)


def _schedule(config: LoraConfig) -> optax.Schedule:
    """The learning rate by update count (step - 1): a linear warm-up to the peak at step
    `warmup` (peak * step / warmup), then a cosine decay to 0 at step `iters`. A warm-up of
    at most one step is the decay alone: optax logs an empty warm-up through absl, whose first
    message configures the process's root logger."""
    # optax is imported here, not at the top: `python -m llm` imports this module for LoraConfig's
    # flags, and optax takes 50 ms that only training needs
    import optax
    lr, w = config.learning_rate, config.warmup
    if w <= 1:
        return optax.cosine_decay_schedule(lr, config.iters)
    return optax.warmup_cosine_decay_schedule(lr / w, lr, w - 1, max(config.iters, w))


class _Trainer:
    """The compiled step and evaluation of one run, and the adapter's current arrays."""

    def __init__(self, model: Model, config: LoraConfig, pairs: Pairs, alpha: float, seq_len: int):
        self.model, self.config, self.alpha, self.seq_len = model, config, alpha, seq_len
        self.shapes = {name: (a.shape, b.shape) for name, (a, b) in pairs.items()}
        self.graph = g = _TrainGraph(model, _adapter(model, pairs, alpha), config.batch_size, seq_len,
                                     dropout=config.dropout, remat=config.grad_checkpoint)
        import optax
        self.schedule = _schedule(config)
        self.opt = optax.adamw(self.schedule, weight_decay=config.weight_decay)
        self.params = g.params()
        self.opt_state = self.opt.init(self.params)
        self.pad = max(model.vocab.eos, 0)
        seed = config.seed

        def loss_fn(p, frozen, inputs, states, tokens, targets, weight, k):
            key = jax.random.fold_in(jax.random.key(seed), k) if config.dropout > 0 else None
            s, n = _cross_entropy(g.logits(p, frozen, inputs, states, tokens, key), targets, weight)
            return s / jnp.maximum(n, 1.0)

        def step(p, opt_state, frozen, inputs, states, tokens, targets, weight, k):
            loss, grads = jax.value_and_grad(loss_fn)(p, frozen, inputs, states, tokens, targets, weight, k)
            updates, opt_state = self.opt.update(grads, opt_state, p)
            new = optax.apply_updates(p, updates)
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(new)]))
            return new, opt_state, loss, finite, self.schedule(k - 1)

        def evaluate(p, frozen, inputs, states, tokens, targets, weight):
            return _cross_entropy(g.logits(p, frozen, inputs, states, tokens, None), targets, weight)

        arrays = self._device(_pack([], config.batch_size, seq_len, self.pad))
        t0 = time.perf_counter()
        consts = (g.frozen, g.inputs, g.states)
        self._step = jax.jit(step).lower(self.params, self.opt_state, *consts, *arrays, np.int32(1)).compile()
        self._eval = jax.jit(evaluate).lower(self.params, *consts, *arrays).compile()
        self.compile_s = time.perf_counter() - t0
        self.n_compiles = 2
        log.info("fine-tuning graph: %d sequences of %d tokens per step, %d adapted weights, compiled in %.1f s",
                 config.batch_size, seq_len, len(pairs), self.compile_s)

    def _device(self, a: _Arrays) -> tuple[jax.Array, jax.Array, jax.Array]:
        return jax.device_put((a.tokens, a.targets, a.weight), self.graph.device)

    def step(self, a: _Arrays, k: int) -> tuple[float, float, bool]:
        """Update k (1-based): (its loss, its learning rate, whether the loss and the new arrays
        are finite; only then are they kept)."""
        g = self.graph
        new, opt_state, loss, finite, lr = self._step(self.params, self.opt_state, g.frozen, g.inputs, g.states,
                                                      *self._device(a), np.int32(k))
        loss_v = float(loss)
        ok = math.isfinite(loss_v) and bool(finite)
        if ok:
            self.params, self.opt_state = new, opt_state
        return loss_v, float(lr), ok

    def evaluate(self, examples: list[Example], n_batches: int) -> float:
        """Mean token loss over the first n_batches batches of examples (-1: all of them)."""
        b = self.config.batch_size
        n_all = -(-len(examples) // b)
        total, count = 0.0, 0.0
        g = self.graph
        for i in range(n_all if n_batches < 0 else min(n_batches, n_all)):
            a = _pack(examples[i * b:(i + 1) * b], b, self.seq_len, self.pad)
            s, n = self._eval(self.params, g.frozen, g.inputs, g.states, *self._device(a))
            total, count = total + float(s), count + float(n)
        return total / max(count, 1.0)

    def pairs(self, params: dict | None = None) -> Pairs:
        """The adapter's arrays (the current ones, or `params`) in write_lora's numpy order."""
        p = self.params if params is None else params
        return {name: (np.asarray(p[name + ".lora_a"]).reshape(sa), np.asarray(p[name + ".lora_b"]).reshape(sb))
                for name, (sa, sb) in self.shapes.items()}


# ---- results and the loop --------------------------------------------------------------------

@dataclass(frozen=True)
class StepInfo:
    """What the callback sees after each step; val_loss is set on the steps that validate."""

    step: int
    iters: int
    loss: float
    learning_rate: float
    tokens: int             # real (not padding) tokens of this step
    tokens_per_s: float     # of the steps so far
    elapsed_s: float
    eta_s: float
    val_loss: float | None = None


@dataclass
class TrainResult:
    """A run's losses and speed, and the adapter it trained (`save` writes it)."""

    val_loss_start: float
    val_loss_end: float
    train_loss: list[float]
    val_loss: list[tuple[int, float]]         # (step, loss), step 0 first
    tokens_per_s: float
    peak_rss_mb: float
    steps: int
    seq_len: int
    n_tokens: int
    train_s: float
    compile_s: float
    n_compiles: int
    arch: str
    alpha: float
    adapter: Pairs = field(repr=False)
    name: str = ""
    test_loss: float | None = None            # on the whole test set after training, when given

    def save(self, path: str | os.PathLike) -> None:
        """The adapter as a llama.cpp LoRA GGUF (llm.adapter_lora_init and llama.cpp load it)."""
        write_adapter(path, self.arch, self.adapter, self.alpha, self.name)

    def report(self) -> dict:
        """The numbers as JSON-ready values (no adapter arrays)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "adapter"}
        out["val_loss"] = [list(v) for v in self.val_loss]
        return out


class TrainingError(RuntimeError):
    """Training stopped on a non-finite loss or adapter; `result` holds the last adapter whose
    loss was finite (written to the adapter path when one was given) and `step` the failed step."""

    def __init__(self, message: str, step: int, result: TrainResult):
        super().__init__(message)
        self.step = step
        self.result = result


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class _Progress:
    """The loop's running totals."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: list[tuple[int, float]] = field(default_factory=list)
    n_tokens: int = 0
    train_s: float = 0.0


def _result(tr: _Trainer, pr: _Progress, params: dict | None = None) -> TrainResult:
    return TrainResult(val_loss_start=pr.val_loss[0][1] if pr.val_loss else math.nan,
                       val_loss_end=pr.val_loss[-1][1] if pr.val_loss else math.nan,
                       train_loss=list(pr.train_loss), val_loss=list(pr.val_loss),
                       tokens_per_s=pr.n_tokens / pr.train_s if pr.train_s else 0.0, peak_rss_mb=_peak_rss_mb(),
                       steps=len(pr.train_loss), seq_len=tr.seq_len, n_tokens=pr.n_tokens, train_s=pr.train_s,
                       compile_s=tr.compile_s, n_compiles=tr.n_compiles, arch=tr.model.arch, alpha=tr.alpha,
                       adapter=tr.pairs(params), name=f"LoRA of {os.path.basename(tr.model.path)}")


def _stop(tr: _Trainer, pr: _Progress, step: int, what: str, good: dict, good_step: int,
          adapter_path: str | os.PathLike | None) -> TrainingError:
    """The error of a non-finite step, with the last good adapter (written if there is a path)."""
    result = _result(tr, pr, good)
    kept = "the starting adapter" if good_step == 0 else f"the adapter after step {good_step}"
    if adapter_path is not None:
        result.save(adapter_path)
        kept += f", written to {adapter_path}"
    hint = "" if step == 0 else " (a lower --learning-rate may help)"
    return TrainingError(f"step {step}: {what}; training stopped, {kept}{hint}", step, result)


def _validate(tr: _Trainer, pr: _Progress, valid: list[Example], step: int) -> float:
    loss = tr.evaluate(valid, tr.config.val_batches)
    pr.val_loss.append((step, loss))
    log.debug("step %d: validation loss %.4f", step, loss)
    return loss


def _loop(tr: _Trainer, train_ex: list[Example], valid_ex: list[Example], test_ex: list[Example],
          callback: Callable[[StepInfo], bool | None] | None, adapter_path: str | os.PathLike | None) -> TrainResult:
    c = tr.config
    pr = _Progress()
    if not math.isfinite(_validate(tr, pr, valid_ex, 0)):
        raise _stop(tr, pr, 0, f"the validation loss is {pr.val_loss[0][1]}", tr.params, 0, None)
    good, good_step = tr.params, 0      # the last arrays whose loss was finite, and after which step
    t_start = time.perf_counter()
    batches = _batches(train_ex, c.batch_size, c.seed)
    for k in range(1, c.iters + 1):
        a = _pack(next(batches), c.batch_size, tr.seq_len, tr.pad)
        before = tr.params
        t0 = time.perf_counter()
        loss, lr, ok = tr.step(a, k)
        pr.train_s += time.perf_counter() - t0
        if math.isfinite(loss):
            good, good_step = before, k - 1
        if not ok:
            what = f"the training loss is {loss}" if not math.isfinite(loss) else "the adapter is no longer finite"
            raise _stop(tr, pr, k, what, good, good_step, adapter_path)
        pr.train_loss.append(loss)
        pr.n_tokens += a.n_tokens
        val = None
        if k % c.steps_per_eval == 0 or k == c.iters:
            val = _validate(tr, pr, valid_ex, k)
            if not math.isfinite(val):
                raise _stop(tr, pr, k, f"the validation loss is {val}", before, k - 1, adapter_path)
        if adapter_path is not None and c.save_every and k % c.save_every == 0 and k < c.iters:
            write_adapter(adapter_path, tr.model.arch, tr.pairs(), tr.alpha)
        elapsed = time.perf_counter() - t_start
        info = StepInfo(step=k, iters=c.iters, loss=loss, learning_rate=lr, tokens=a.n_tokens,
                        tokens_per_s=pr.n_tokens / pr.train_s, elapsed_s=elapsed,
                        eta_s=elapsed / k * (c.iters - k), val_loss=val)
        if callback is not None and callback(info) is False:
            log.info("training stopped by the callback after step %d", k)
            break
    if pr.val_loss[-1][0] != len(pr.train_loss):
        _validate(tr, pr, valid_ex, len(pr.train_loss))
    result = _result(tr, pr)
    if test_ex:
        result.test_loss = tr.evaluate(test_ex, -1)
    if adapter_path is not None:
        result.save(adapter_path)
    return result


def train(model: Model | LLM, train_data: Data, valid_data: Data, config: LoraConfig | None = None, *,
          callback: Callable[[StepInfo], bool | None] | None = None,
          resume_adapter_file: str | os.PathLike | None = None,
          adapter_path: str | os.PathLike | None = None, test_data: Data | None = None) -> TrainResult:
    """Train a LoRA adapter of `model` (an llm.Model or llm.LLM, its weights frozen in their
    held format) on train_data, validated on valid_data (each a JSONL path or rows as dicts,
    mlx-lm's formats). `callback` sees a StepInfo after every step and stops the run by
    returning False; resume_adapter_file continues from an adapter GGUF (its weights, rank and
    alpha); adapter_path is written every save_every steps, at the end, and with the last good
    adapter when a step's loss is not finite (TrainingError). With test_data, the result's
    test_loss is the trained adapter's loss on all of it."""
    config = dataclasses.replace(config) if config is not None else LoraConfig()
    params_mod.check(config)
    m = model if isinstance(model, Model) else model.model
    if m.output is None:
        raise ValueError(f"{m.path} ({m.arch}) has no output layer: there are no logits to train on")
    train_ex = _examples(m, train_data, "train", config)
    valid_ex = _examples(m, valid_data, "valid", config)
    test_ex = _examples(m, test_data, "test", config) if test_data is not None else []
    seq_len = seq_length(train_ex + valid_ex + test_ex, config.max_seq_length)
    if resume_adapter_file is not None:
        pairs, alpha = read_pairs(m, resume_adapter_file)
        log.info("resuming from %s: %d adapted weights, alpha %g", resume_adapter_file, len(pairs), alpha)
    else:
        pairs, alpha = init_pairs(m, adapted_weights(m, config), config.rank, config.seed), config.alpha
    return _loop(_Trainer(m, config, pairs, alpha, seq_len), train_ex, valid_ex, test_ex, callback, adapter_path)
