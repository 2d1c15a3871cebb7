"""The model: hparams, vocab and weight tensors placed on devices (llama_model), and
`load_model`, the entry point that runs steps 2-6 of the pipeline: open the file, pick the
architecture, load hparams and vocab, declare tensors, load their data."""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from ggmlx import gguf, types, weights
from ggmlx.backend import make_mesh
from ggmlx.tensor import Tensor
from ggmlx.types import GGMLType
from ggmlx.weights import WeightSplit
from llm.arch import ArchBuilder
from llm.errors import ModelLoadError
from llm.hparams import HParams, load_hparams
from llm.layer import Layer
from llm.loader import ModelLoader
from llm.models import get_arch
from llm.vocab import Vocab, load_vocab_cached

log = logging.getLogger(__name__)


@dataclass
class Placement:
    """Where each part of the model lives: the input layer on the CPU (as llama.cpp keeps
    it), each repeating layer and the output layer on the device chosen for it. With
    split_mode "row" every weight and the KV cache live on `mesh` instead (the dev_* fields
    name its first device), divided as `row_split_plan` says under `row_plan` (resolved: no
    "auto"); `kv_split` tells whether the KV cache is divided by KV heads (else replicated)."""
    dev_input: jax.Device
    dev_layer: list[jax.Device]
    dev_output: jax.Device
    mesh: jax.sharding.Mesh | None = None
    kv_split: bool = False
    row_plan: RowPlan | None = None


SPLIT_MODES = ("layer", "row")


@dataclass(frozen=True)
class RowPlan:
    """The choices of split_mode "row" that are made by measurement (docs/distributed.md):

    - `uneven_heads`, where the head counts do not divide by the device count: "gather"
      splits each attention projection by output rows and all-gathers the result
      (llama.cpp's row mode); "pad" rearranges the heads so each device holds whole heads
      (KV heads copied when there are fewer than devices, zero heads padded otherwise,
      head_layout), keeps the KV cache divided and all-reduces once after the output
      projection, as when they divide; "auto" (default): "pad" where the model allows it
      (pad_blocker), else "gather".
    - `vocab`, the embeddings and lm_head: "rows" (by vocabulary: the lookup masked and
      summed, the logits all-gathered) or "cols" (by embedding features: the lookup
      all-gathered, the logits all-reduced)."""
    uneven_heads: str = "auto"
    vocab: str = "rows"

    def __post_init__(self):
        if self.uneven_heads not in ("auto", "gather", "pad"):
            raise ValueError(f"RowPlan.uneven_heads must be 'auto', 'gather' or 'pad', got {self.uneven_heads!r}")
        if self.vocab not in ("rows", "cols"):
            raise ValueError(f"RowPlan.vocab must be 'rows' or 'cols', got {self.vocab!r}")


# split_mode "row": how each 2-d weight is divided (Megatron-style tensor parallelism).
_ROWS, _ROWS_GATHER, _COLS = WeightSplit(1), WeightSplit(1, gather=True), WeightSplit(0)
# attention by heads (every layer's head and KV-head counts divide by the device count):
# Q/K/V by output rows = whole heads, the output projection by input columns + all-reduce
_SPLIT_BY_HEADS = {"attn_q": _ROWS, "attn_k": _ROWS, "attn_v": _ROWS, "attn_output": _COLS}
# otherwise llama.cpp's row split: each projection by output rows, the result all-gathered
_SPLIT_GATHERED = {"attn_q": _ROWS_GATHER, "attn_k": _ROWS_GATHER, "attn_v": _ROWS_GATHER,
                   "attn_output": _ROWS_GATHER}
_SPLIT_COMMON = {
    "attn_qkv": _ROWS_GATHER,                            # fused [Q; K; V] rows: not head-aligned
    "ffn_gate": _ROWS, "ffn_up": _ROWS, "ffn_down": _COLS,  # FFN: gate/up by features, down + reduce
}
_SPLIT_VOCAB = {"rows": {"token_embd": _ROWS_GATHER, "output": _ROWS_GATHER},   # by vocabulary
                "cols": {"token_embd": _COLS, "output": _COLS}}                 # by features


def heads_divide(hp: HParams, n: int) -> bool:
    """Whether every layer's query and KV head counts divide by n (attention split by heads)."""
    return all(hp.n_head(il) % n == 0 and hp.n_head_kv(il) % n == 0 for il in range(hp.n_layer))


def head_layout(n_head: int, n_head_kv: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """RowPlan(uneven_heads="pad"): the held order of the KV heads and of the query heads
    (file head index, -1 for a zero head) such that each of n devices holds whole KV heads
    with their query groups. Fewer KV heads than devices, with n a multiple of them and each
    group dividing evenly: every KV head is copied to n / n_head_kv devices, which share its
    group (no padding). Otherwise the KV heads are padded with zero heads (and zero query
    groups) to a multiple of n."""
    g = n_head // n_head_kv
    if n_head_kv % n == 0:
        return tuple(range(n_head_kv)), tuple(range(n_head))
    if n % n_head_kv == 0 and g % (n // n_head_kv) == 0:
        r = n // n_head_kv
        gl = g // r
        return (tuple(j // r for j in range(n)),
                tuple((j // r) * g + (j % r) * gl + i for j in range(n) for i in range(gl)))
    n_kv = -(-n_head_kv // n) * n
    return (tuple(j if j < n_head_kv else -1 for j in range(n_kv)),
            tuple(j * g + i if j < n_head_kv else -1 for j in range(n_kv) for i in range(g)))


def pad_blocker(hp: HParams, ml: ModelLoader) -> str | None:
    """Why RowPlan(uneven_heads="pad") cannot hold this model (None: it can): it needs the
    same head counts in every layer, separate Q/K/V without biases, attn_output heads of
    whole quant blocks, Q/K norms per head (an all-heads norm would sum over the copied and
    zero heads), attn_q rows that are just the query heads, and no latent (MLA's one KV head
    is shared by every query head)."""
    if len(set(hp.n_head_arr)) != 1 or len(set(hp.n_head_kv_arr)) != 1:
        return "the head counts differ between layers"
    if hp.is_mla:
        return "multi-head latent attention: every query head reads the one latent KV head"
    for name, entry in ml.weights_map.items():
        parts = name.split(".")
        if parts[0] != "blk" or len(parts) != 4:
            continue
        if parts[2] == "attn_qkv" or (parts[2] in ("attn_q", "attn_k", "attn_v") and parts[3] == "bias"):
            return f"tensor {name!r} (fused Q/K/V or a Q/K/V bias)"
        if parts[2] in ("attn_q_norm", "attn_k_norm") and entry.info.ne[0] != hp.n_embd_head_k:
            return f"tensor {name!r}: Q/K normed over all heads at once"
        if parts[2] == "attn_q" and parts[3] == "weight" and entry.info.ne[1] != hp.n_head() * hp.n_embd_head_k:
            return f"tensor {name!r}: its rows are not {hp.n_head()} query heads (a gate beside each head)"
        bs = types.block_size(GGMLType(entry.info.type))
        if parts[2] == "attn_output" and parts[3] == "weight" and hp.n_embd_head_v % bs:
            return f"tensor {name!r}: heads of {hp.n_embd_head_v} features are not whole blocks of {bs}"
    return None


def _padded_attention(hp: HParams, n: int) -> dict[str, WeightSplit]:
    """The attention splits of RowPlan(uneven_heads="pad"): Q/K/V by rows, the output
    projection by columns, each rearranged by head_layout."""
    if len(set(hp.n_head_arr)) != 1 or len(set(hp.n_head_kv_arr)) != 1:
        raise ValueError("RowPlan(uneven_heads='pad') needs the same head counts in every layer")
    kv, q = head_layout(hp.n_head(), hp.n_head_kv(), n)
    dk, dv = hp.n_embd_head_k, hp.n_embd_head_v
    return {"attn_q": WeightSplit(1, heads=q, unit=dk), "attn_k": WeightSplit(1, heads=kv, unit=dk),
            "attn_v": WeightSplit(1, heads=kv, unit=dv), "attn_output": WeightSplit(0, heads=q, unit=dv)}


def padded_hparams(hp: HParams, n: int) -> HParams:
    """The head counts the graph and KV cache of RowPlan(uneven_heads="pad") run with."""
    kv, q = head_layout(hp.n_head(), hp.n_head_kv(), n)
    return dataclasses.replace(hp, n_head_arr=[len(q)] * hp.n_layer, n_head_kv_arr=[len(kv)] * hp.n_layer)


def uses_padded_heads(hp: HParams, n: int, plan: RowPlan) -> bool:
    return n > 1 and plan.uneven_heads == "pad" and not heads_divide(hp, n)


def row_split_plan(hp: HParams, n: int, plan: RowPlan | None = None) -> Callable[[str], WeightSplit | None]:
    """tensor name -> its split over n devices (None: replicated: norms, biases, rope
    factors, MoE experts). ValueError for a tensor the plan cannot serve."""
    plan = plan or RowPlan(uneven_heads="gather")
    pad = uses_padded_heads(hp, n, plan)
    attn = _padded_attention(hp, n) if pad else _SPLIT_BY_HEADS if heads_divide(hp, n) else _SPLIT_GATHERED
    table = {**attn, **_SPLIT_COMMON, **_SPLIT_VOCAB[plan.vocab]}

    def split_of(name: str) -> WeightSplit | None:
        parts = name.split(".")
        if n == 1 or len(parts) != (4 if parts[0] == "blk" else 2):
            return None
        base = parts[2] if parts[0] == "blk" else parts[0]
        if pad and (base == "attn_qkv" or (parts[-1] == "bias" and base in ("attn_q", "attn_k", "attn_v"))):
            raise ValueError(f"tensor {name!r}: RowPlan(uneven_heads='pad') pads separate Q/K/V weights "
                             "without biases; use uneven_heads='gather'")
        return table.get(base) if parts[-1] == "weight" else None

    return split_of


def place_row(devices: list[jax.Device] | None, n_gpu_layers: int, tensor_split: list[float] | None,
              hp: HParams, plan: RowPlan | None = None) -> Placement:
    """split_mode "row": every layer on a mesh of `devices` (default: the accelerators, else
    every CPU device). It cannot be mixed with a layer split in this version."""
    if tensor_split is not None:
        raise ValueError("tensor_split divides layers between devices (split_mode 'layer'); "
                         "split_mode 'row' divides every layer evenly: drop tensor_split")
    if 0 <= n_gpu_layers < hp.n_layer + 1:
        raise ValueError(f"n_gpu_layers={n_gpu_layers} keeps layers off the devices, a layer split; "
                         "split_mode 'row' cannot be mixed with a layer split: use n_gpu_layers=-1")
    if devices is None:
        devices = [d for d in jax.devices() if d.platform != "cpu"] or jax.devices("cpu")
    devices = list(devices)
    if not devices:
        raise ValueError("split_mode 'row' needs at least one device")
    if len(set(devices)) != len(devices):
        raise ValueError(f"split_mode 'row': devices must be distinct, got {devices}")
    plan = plan or RowPlan(uneven_heads="gather")
    return Placement(devices[0], [devices[0]] * hp.n_layer, devices[0], make_mesh(devices),
                     kv_split=len(devices) > 1 and (heads_divide(hp, len(devices))
                                                    or uses_padded_heads(hp, len(devices), plan)),
                     row_plan=plan)


def place_layers(n_layer: int, devices: list[jax.Device] | None, n_gpu_layers: int,
                 tensor_split: list[float] | None) -> Placement:
    """llama.cpp's layer assignment (llama_model::load_tensors). There are n_layer + 1 slots,
    the repeating layers then the output layer; the last `n_gpu_layers` of them (all when
    negative) are offloaded, slot il going to the first device whose cumulative
    `tensor_split` share exceeds (il - i_gpu_start) / act_gpu_layers. The input layer always
    stays on the CPU. Shares and fractions are float32, as in llama.cpp."""
    cpu = jax.devices("cpu")[0]
    if devices is None:
        devices = [d for d in jax.devices() if d.platform != "cpu"]
    devices = list(devices)
    if not devices:
        return Placement(cpu, [cpu] * n_layer, cpu)
    if tensor_split is None:
        tensor_split = [1.0] * len(devices)
    if len(tensor_split) != len(devices) or any(s < 0 for s in tensor_split) or sum(tensor_split) <= 0:
        raise ValueError(f"tensor_split {tensor_split} must give one non-negative share per device "
                         f"({len(devices)} devices) with a positive sum")
    if n_gpu_layers < 0:
        n_gpu_layers = n_layer + 1
    shares = np.cumsum(np.asarray(tensor_split, np.float32), dtype=np.float32)
    splits = shares / shares[-1]
    i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0)
    act_gpu_layers = min(n_gpu_layers, n_layer + 1)

    def device_of(il: int) -> jax.Device:
        if il < i_gpu_start or il - i_gpu_start >= act_gpu_layers:
            return cpu
        frac = np.float32(il - i_gpu_start) / np.float32(act_gpu_layers)
        return devices[int(np.searchsorted(splits, frac, side="right"))]

    return Placement(cpu, [device_of(il) for il in range(n_layer)], device_of(n_layer))


@dataclass
class Model:
    path: str
    arch: str
    hparams: HParams
    vocab: Vocab
    builder: ArchBuilder
    placement: Placement | None = None
    tok_embd: Tensor | None = None
    output_norm: Tensor | None = None
    output: Tensor | None = None
    output_norm_b: Tensor | None = None
    output_b: Tensor | None = None
    # encoders: token-type and position embeddings, the embedding norm
    type_embd: Tensor | None = None
    pos_embd: Tensor | None = None
    tok_norm: Tensor | None = None
    tok_norm_b: Tensor | None = None
    # classifier head of rank pooling (llama.cpp's cls, cls_b, cls_out, cls_out_b)
    cls: Tensor | None = None
    cls_b: Tensor | None = None
    cls_out: Tensor | None = None
    cls_out_b: Tensor | None = None
    # Gemma 3n: per-layer token embeddings and their projection from the residual, AltUp's
    # projections into and out of the extra streams
    per_layer_tok_embd: Tensor | None = None
    per_layer_model_proj: Tensor | None = None
    per_layer_proj_norm: Tensor | None = None
    altup_proj: Tensor | None = None
    altup_unembd_proj: Tensor | None = None
    layers: list[Layer] = field(default_factory=list)
    n_bytes: int = 0
    meta: dict = field(default_factory=dict)
    weight_format: str = "auto"
    numerics: str = "exact"

    @property
    def place(self) -> Placement:
        """Where the layers live; a vocab-only model has no weights to place."""
        if self.placement is None:
            raise ValueError(f"{self.path}: the model was loaded with vocab_only=True and has no weights")
        return self.placement

    @property
    def n_vocab(self) -> int:
        return self.hparams.n_vocab

    def weight_tensors(self) -> list[Tensor]:
        out = [t for t in (self.tok_embd, self.output_norm, self.output, self.output_norm_b, self.output_b,
                           self.type_embd, self.pos_embd, self.tok_norm, self.tok_norm_b,
                           self.cls, self.cls_b, self.cls_out, self.cls_out_b, self.per_layer_tok_embd,
                           self.per_layer_model_proj, self.per_layer_proj_norm, self.altup_proj,
                           self.altup_unembd_proj) if t is not None]
        for layer in self.layers:
            out += [t for t in vars(layer).values() if t is not None]
        return out


# Architectures whose graphs multiply wq/wk/wv, and ffn_gate/ffn_up, by one same input in
# every layer (what fusing them needs: the lowering shares one product per input; a member
# multiplied alone would cost the whole fused product).
FUSE_ARCHS = frozenset({"llama", "gemma3"})


def fuse_weights(model: Model, release: Callable[[Tensor], None] | None = None) -> int:
    """Hold wq/wk/wv, and ffn_gate/ffn_up, of each layer as members of one fused weight
    (weights.fuse_rows): the graph keeps llama.cpp's separate mul_mat nodes, and the lowering
    makes one weight pass for the group (a SmolLM2 decode step: 7 weight passes per layer
    become 4; tg128 107-125 -> 133-141 tok/s). Each output row is the same dot as before.
    Returns the number of fused groups; only architectures in FUSE_ARCHS, and only weights
    that can share one array (same type, format, ne0, device). `release(t)` is called for each
    member once its group's copy is made (the loader drops the member's file pages then, so a
    load never holds them and the fused copies whole at once: Gemma3's peak -40 MB)."""
    if model.arch not in FUSE_ARCHS:
        return 0
    n = 0
    for layer in model.layers:
        for group in ([layer.wq, layer.wk, layer.wv], [layer.ffn_gate, layer.ffn_up]):
            parts = [t for t in group if t is not None and t.data is not None and t.data.spec.rows is None]
            if len(parts) != len(group):
                continue
            members = weights.fuse_rows([t.data for t in parts], group=n)
            if members is None:
                continue
            members[0].array.block_until_ready()
            for t, m in zip(parts, members, strict=True):
                t.data.delete()
                t.data = m
                if release is not None:
                    release(t)
            n += 1
    return n


def _log_replicated_experts(model: Model) -> None:
    """split_mode "row" keeps MoE expert tensors whole on every device (see
    docs/distributed.md): say so, with the bytes that are not divided."""
    exps = [t for t in model.weight_tensors() if t.name.split(".")[-2].endswith("_exps")]
    if exps:
        nbytes = sum(types.nbytes(t.type, t.ne) for t in exps)
        log.warning("split_mode 'row': the %d MoE expert tensors (%.1f MiB) are replicated on every device, "
                    "not divided: they are 3-d [n_expert, n_ff, n_embd] and mul_mat_id reads the chosen "
                    "experts from the whole table; the attention, dense FFN and vocabulary are divided",
                    len(exps), nbytes / 2**20)


def load_model(path: str | os.PathLike, devices: list[jax.Device] | None = None, n_gpu_layers: int = -1,
               tensor_split: list[float] | None = None, vocab_only: bool = False,
               progress_callback: Callable[[float], bool] | None = None,
               weight_format: str = "auto", split_mode: str = "layer", fuse: bool = True,
               row_plan: RowPlan | None = None, numerics: str = "exact") -> Model:
    """Load a GGUF model (see docs/design.md). `devices` hold the repeating layers (default: the
    accelerators; pass CPU devices to split over simulated devices). split_mode "layer"
    (default) gives each device whole layers, "row" divides every layer over all of them
    (tensor parallelism on a jax.sharding.Mesh; see docs/distributed.md). `weight_format` is how
    quantized weights are held: "native" (GGUF blocks), "int8" (exact int8 + scales), "int4"
    (Q4_0/Q4_1/Q4_K as exact packed nibbles + scales, other types as int8), "f32" (dequantized
    at load) or "auto" (int4, the fastest measured on XLA:CPU with the native kernels; int8
    without them or on other devices);
    model.weight_format tells which was used. `fuse` (default on) holds wq/wk/wv, and
    ffn_gate/ffn_up, of a layer in one array each (fuse_weights; split_mode "layer" only): the
    graph and its node names are unchanged, a decode step reads each group in one pass.
    `row_plan` (split_mode "row"): the measured choices of RowPlan; with uneven_heads="pad"
    model.hparams holds the padded head counts the graph runs with. `numerics` (ggmlx.weights
    .NUMERICS): "exact" (default) multiplies by the weights' exact values; "ggml" computes the
    products as ggml-cpu does (activations quantized to each type's vec_dot_type, integer dots
    from the GGUF blocks: llama.cpp's own results and speed), see docs/design.md."""
    if split_mode not in SPLIT_MODES:
        raise ValueError(f"split_mode must be one of {', '.join(SPLIT_MODES)}, got {split_mode!r}")
    weights.check_format(weight_format, numerics)
    if numerics == "ggml" and split_mode == "row":
        raise ValueError("numerics 'ggml' works with split_mode 'layer' only (a split weight's shards "
                         "take the exact path)")
    ml = ModelLoader(path)
    try:
        arch = ml.arch_name
        try:
            builder = get_arch(arch)
        except ModelLoadError as e:
            raise ModelLoadError(f"{ml.path}: {e}") from None
        hp = load_hparams(ml, builder)
        vocab = load_vocab_cached(ml)
        weights.trim_heap()     # the vocabulary's build (Gemma3: 46 MB), before the weights come in
        meta = {k: v.tolist() if isinstance(v, gguf.StringArray) else v for k, v in ml.kv.items()
                if not k.startswith("tokenizer.ggml.")}
        model = Model(path=ml.path, arch=arch, hparams=hp, vocab=vocab, builder=builder, meta=meta,
                      weight_format=weight_format)
        if vocab_only:
            return model
        if split_mode == "row":
            row_plan = row_plan or RowPlan()
            if row_plan.uneven_heads == "auto":
                blocker = pad_blocker(hp, ml)
                if blocker:
                    log.info("split_mode 'row': heads that do not divide are gathered, not padded: %s", blocker)
                row_plan = dataclasses.replace(row_plan, uneven_heads="gather" if blocker else "pad")
            model.placement = place_row(devices, n_gpu_layers, tensor_split, hp, row_plan)
            mesh = model.placement.mesh
            assert mesh is not None   # place_row made it
            ml.mesh = mesh
            try:
                ml.split_of = row_split_plan(hp, mesh.devices.size, row_plan)
            except ValueError as e:
                raise ModelLoadError(f"{ml.path}: split_mode 'row' over {mesh.devices.size} devices: {e}") from None
        else:
            model.placement = place_layers(hp.n_layer, devices, n_gpu_layers, tensor_split)
        builder.load_tensors(model, ml)
        ml.check_all_used()
        if split_mode == "row":
            _log_replicated_experts(model)
        model.n_bytes = ml.load_all_data(progress_callback, weight_format, numerics)
        model.weight_format = ml.weight_format
        model.numerics = numerics
        n_mesh = 1 if model.place.mesh is None else model.place.mesh.devices.size
        if model.place.row_plan is not None and uses_padded_heads(hp, n_mesh, model.place.row_plan):
            model.hparams = padded_hparams(hp, n_mesh)
        if fuse and split_mode == "layer":      # row-split weights follow a per-name plan
            def release(t: Tensor) -> None:      # a member's own bytes, read for the fused copy
                if t.name in ml.weights_map:
                    ml.reader.release(ml.weights_map[t.name].info)
            fuse_weights(model, release=release)
        weights.trim_heap()
        return model
    finally:
        ml.close()
