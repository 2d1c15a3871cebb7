"""LoRA adapters (llama.cpp's src/llama-adapter.cpp): llama.cpp's LoRA GGUF read, checked
against the model, and held on the devices of the weights they adapt.

A LoRA GGUF has `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and
per adapted weight `<weight>.lora_a` [n_in, r] and `<weight>.lora_b` [r, n_out] (ggml order);
the token embedding's pair is flipped, a [r, n_vocab] and b [r, n_embd], so the graph can
look rows of a up by token (llama.cpp's build_inp_embd). Any float or quantized type.

The graph (llm.graph: build_lora_mm, build_lora_mm_id, build_inp_embd) adds
`scale * alpha / r * B (A x)` to every product with an adapted weight, with `scale` a graph
input per adapter and token (LoraScales): changing scales reuses the compiled graph, and
sequences of one batch can carry different scales (per-request adapters in a server).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ggmlx import gguf, weights
from ggmlx.tensor import Tensor, new_weight
from ggmlx.types import GGMLType
from llm.arch import LLMKV
from llm.errors import ModelLoadError

if TYPE_CHECKING:
    import jax

    from llm.model import Model

log = logging.getLogger(__name__)

SUFFIX_A, SUFFIX_B = ".lora_a", ".lora_b"
TOKEN_EMBD = "token_embd.weight"


@dataclass(eq=False)
class LoraWeight:
    """The pair adapting one model weight (llama_adapter_lora_weight)."""

    a: Tensor
    b: Tensor

    @property
    def rank(self) -> int:
        return self.b.ne[0]

    def alpha_scale(self, alpha: float) -> float:
        """alpha / r, or 1 for an adapter without alpha (llama_adapter_lora_weight::get_scale)."""
        return alpha / self.rank if alpha else 1.0


@dataclass(eq=False)
class LoraAdapter:
    """A loaded LoRA adapter (llama_adapter_lora). Compared by identity: a graph built with
    one adapter set is reused only with that same set."""

    path: str
    model: Model                              # the model it was loaded for
    alpha: float
    weights: dict[str, LoraWeight]            # adapted model weight name -> its pair
    meta: dict[str, str] = field(default_factory=dict)
    alora_invocation_tokens: tuple[int, ...] = ()

    def get_weight(self, name: str) -> LoraWeight | None:
        return self.weights.get(name)

    def meta_val_str(self, key: str) -> str | None:
        """llama_adapter_meta_val_str: a metadata value as text (None when absent)."""
        return self.meta.get(key)

    @property
    def n_bytes(self) -> int:
        return sum(t.data.nbytes for w in self.weights.values() for t in (w.a, w.b) if t.data is not None)


def _device_of(model: Model, name: str) -> jax.Device:
    """The device of the model weight `name` (its layer's, the input's or the output's)."""
    place = model.place
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
        return place.dev_layer[int(parts[1])]
    return place.dev_input if name == TOKEN_EMBD else place.dev_output


def _check_shape(path: str, name: str, base: Tensor, a: gguf.TensorInfo, b: gguf.TensorInfo) -> None:
    """llama.cpp's checks, with the tensor and both shapes named."""
    a_ne, b_ne = tuple(a.ne) + (1,) * 4, tuple(b.ne) + (1,) * 4
    shapes = f"{name}: {list(base.ne[:3])}, lora_a {list(a.ne)}, lora_b {list(b.ne)}"
    if name == TOKEN_EMBD:      # flipped pair: a [r, n_vocab], b [r, n_embd]
        if base.ne[0] != b_ne[1] or base.ne[1] != a_ne[1] or a_ne[0] != b_ne[0]:
            raise ModelLoadError(f"{path}: LoRA tensor '{name}' has the wrong shape for this model ({shapes})")
        return
    if base.ne[0] != a_ne[0] or base.ne[1] != b_ne[1] or base.ne[2] != a_ne[2] or base.ne[2] != b_ne[2]:
        raise ModelLoadError(f"{path}: LoRA tensor '{name}' has the wrong shape for this model ({shapes})")
    if a_ne[1] != b_ne[0]:
        raise ModelLoadError(f"{path}: LoRA tensor '{name}': the rank of lora_a ({a_ne[1]}) differs from "
                             f"lora_b's ({b_ne[0]}); lora_a must be stored transposed, [n_in, r] ({shapes})")


def _pairs(path: str, f: gguf.GGUFReader) -> dict[str, tuple[gguf.TensorInfo, gguf.TensorInfo]]:
    """Bundle `.lora_a` / `.lora_b` tensors by the weight they adapt; norm vectors are skipped
    as llama.cpp skips them, any other tensor is an error."""
    a: dict[str, gguf.TensorInfo] = {}
    b: dict[str, gguf.TensorInfo] = {}
    for name, info in f.tensors.items():
        if name.endswith(SUFFIX_A):
            a[name.removesuffix(SUFFIX_A)] = info
        elif name.endswith(SUFFIX_B):
            b[name.removesuffix(SUFFIX_B)] = info
        elif name.endswith("_norm.weight"):
            log.warning("%s: LoRA norm tensor '%s' is ignored (as llama.cpp does)", path, name)
        else:
            raise ModelLoadError(f"{path}: LoRA tensor '{name}' has an unexpected suffix "
                                 f"(expected {SUFFIX_A} or {SUFFIX_B})")
    for name in sorted(a.keys() ^ b.keys()):
        missing = SUFFIX_B if name in a else SUFFIX_A
        raise ModelLoadError(f"{path}: LoRA tensor pair for '{name}' is missing '{name}{missing}'")
    return {name: (a[name], b[name]) for name in sorted(a)}


def _alpha(path: str, kv: dict) -> float:
    alpha = kv.get(LLMKV.ADAPTER_LORA_ALPHA.value, 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not np.isfinite(alpha):
        raise ModelLoadError(f"{path}: '{LLMKV.ADAPTER_LORA_ALPHA.value}' must be a number, got {alpha!r}")
    return float(alpha)


def _check_meta(path: str, f: gguf.GGUFReader, model: Model) -> tuple[float, tuple[int, ...]]:
    kv = f.kv
    if kv.get(LLMKV.GENERAL_TYPE.value) != "adapter":
        raise ModelLoadError(f"{path}: '{LLMKV.GENERAL_TYPE.value}' must be 'adapter', got "
                             f"{kv.get(LLMKV.GENERAL_TYPE.value)!r}")
    arch = kv.get(LLMKV.GENERAL_ARCHITECTURE.value)
    if arch != model.arch:
        raise ModelLoadError(f"{path}: the adapter is for architecture {arch!r}, the model {model.path} is "
                             f"{model.arch!r}")
    if kv.get(LLMKV.ADAPTER_TYPE.value) != "lora":
        raise ModelLoadError(f"{path}: '{LLMKV.ADAPTER_TYPE.value}' must be 'lora', got "
                             f"{kv.get(LLMKV.ADAPTER_TYPE.value)!r}")
    alpha = _alpha(path, kv)
    tokens = kv.get(LLMKV.ADAPTER_ALORA_INVOCATION_TOKENS.value, ())
    if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, int) for t in tokens):
        raise ModelLoadError(f"{path}: '{LLMKV.ADAPTER_ALORA_INVOCATION_TOKENS.value}' must be an array of "
                             "token ids")
    return float(alpha), tuple(int(t) for t in tokens)


def adapter_lora_init(model: Model, path: str | os.PathLike) -> LoraAdapter:
    """llama_adapter_lora_init: read a LoRA GGUF for `model`; ModelLoadError naming the file and
    the tensor for an adapter of another architecture or shape, a rank mismatch, a pair with a
    half missing, a truncated file."""
    path = str(path)
    if model.place.mesh is not None:
        raise ModelLoadError(f"{path}: LoRA adapters on a model split by rows (split_mode 'row') are not "
                             "supported; load the model with split_mode 'layer'")
    try:
        f = gguf.GGUFReader(path)
    except (OSError, gguf.GGUFError) as e:
        raise ModelLoadError(f"{path}: cannot read the LoRA adapter: {e}") from None
    with f:
        alpha, invocation = _check_meta(path, f, model)
        base = {t.name: t for t in model.weight_tensors()}
        fmt = model.weight_format
        out: dict[str, LoraWeight] = {}
        for name, (a, b) in _pairs(path, f).items():
            if name not in base:
                raise ModelLoadError(f"{path}: LoRA tensor '{name}' does not exist in the model {model.path} "
                                     "(an adapter for another model?)")
            _check_shape(path, name, base[name], a, b)
            dev = _device_of(model, name)
            pair = []
            for info in (a, b):
                t = new_weight(GGMLType(info.type), tuple(info.ne), info.name)
                try:
                    t.data = weights.to_device(info.data, GGMLType(info.type), t.ne, dev, fmt)
                except ValueError as e:
                    raise ModelLoadError(f"{path}: LoRA tensor '{info.name}': {e}") from None
                pair.append(t)
            out[name] = LoraWeight(*pair)
        if not out:
            raise ModelLoadError(f"{path}: the adapter has no lora_a / lora_b tensors")
        meta = {k: str(v) for k, v in f.kv.items() if not isinstance(v, (list, tuple))}
    adapter = LoraAdapter(path, model, alpha, out, meta, invocation)
    log.info("%s: LoRA adapter of %d weights (alpha %g), %.2f MiB", path, len(out), alpha, adapter.n_bytes / 2**20)
    return adapter


@dataclass
class LoraScales:
    """The adapters a context applies (llama_set_adapters_lora) and their scales: one list for
    every token, or a sequence's own list (`seq`) for its tokens. The graph reads them per token
    from an input, so only the adapter set, not a scale, selects the compiled graph."""

    adapters: tuple[LoraAdapter, ...] = ()
    scales: tuple[float, ...] = ()
    seq: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def per_token(self, seq_ids: tuple[tuple[int, ...], ...], n_tokens: int) -> np.ndarray:
        """[n_adapters, n_tokens] float32: each token's scales (its first sequence's; padding 0)."""
        out = np.zeros((len(self.adapters), n_tokens), np.float32)
        first = np.fromiter((ids[0] if ids else -1 for ids in seq_ids), np.int64, len(seq_ids))
        out[:, :len(first)] = np.asarray(self.scales, np.float32)[:, None]
        for seq_id, own in self.seq.items():        # per sequence, not per token
            out[:, :len(first)][:, first == seq_id] = np.asarray(own, np.float32)[:, None]
        return out


def write_lora(path: str | os.PathLike, arch: str, pairs: dict[str, tuple[np.ndarray, np.ndarray]], *,
               alpha: float = 0.0, type: GGMLType = GGMLType.F32, meta: dict | None = None) -> None:
    """A LoRA GGUF in llama.cpp's layout. `pairs` maps a model weight name to (A, B) in numpy
    order: A [r, n_in] and B [n_out, r] (the product is B @ A); for token_embd.weight A is
    [n_vocab, r] and B [n_embd, r], as llama.cpp stores that pair flipped. Typed F32/F16 only."""
    w = gguf.GGUFWriter()
    w.add_kv(LLMKV.GENERAL_ARCHITECTURE.value, arch)
    w.add_kv(LLMKV.GENERAL_TYPE.value, "adapter")
    w.add_kv(LLMKV.ADAPTER_TYPE.value, "lora")
    w.add_kv(LLMKV.ADAPTER_LORA_ALPHA.value, float(alpha), gguf.GGUFValueType.FLOAT32)
    for k, v in (meta or {}).items():
        w.add_kv(k, v)
    dtype = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}[GGMLType(type)]
    for name, (a, b) in pairs.items():
        w.add_tensor(name + SUFFIX_A, np.ascontiguousarray(a, dtype))
        w.add_tensor(name + SUFFIX_B, np.ascontiguousarray(b, dtype))
    w.write(path)


def _dequantized(info: gguf.TensorInfo) -> np.ndarray:
    """A tensor's values as float32 in numpy order."""
    from ggmlx.quants import numpy_ref
    return numpy_ref.dequantize(np.asarray(info.data), GGMLType(info.type), tuple(info.ne)).astype(np.float32)


def lora_delta(info_a: gguf.TensorInfo, info_b: gguf.TensorInfo, name: str, scale: float) -> np.ndarray:
    """scale * alpha / r * B A of one pair, in the model weight's numpy order (alpha folded in
    `scale` by the caller)."""
    a, b = _dequantized(info_a), _dequantized(info_b)
    if name == TOKEN_EMBD:                  # A [n_vocab, r], B [n_embd, r]: rows by token
        return np.float32(scale) * (a @ b.T)
    return np.float32(scale) * np.matmul(b, a)      # per expert for 3-d pairs: [n_exp, n_out, n_in]


def fuse(model_path: str | os.PathLike, out_path: str | os.PathLike,
         adapters: list[tuple[str | os.PathLike, float]], *, type: GGMLType = GGMLType.F32) -> int:
    """Merge LoRA adapters into a model's weights: W + scale * alpha / r * B A for each adapted
    weight, written as `type` (F32 or F16); every other tensor and key is copied as it is.
    Returns the number of weights changed. The file is written to a temporary name first."""
    type = GGMLType(type)
    if type not in (GGMLType.F32, GGMLType.F16):
        raise ValueError(f"fuse: adapted weights are written as F32 or F16, not {type.name}")
    deltas: dict[str, np.ndarray] = {}
    with gguf.GGUFReader(model_path) as base:
        arch = base.kv.get(LLMKV.GENERAL_ARCHITECTURE.value)
        for path, scale in adapters:
            with gguf.GGUFReader(path) as f:
                if f.kv.get(LLMKV.GENERAL_TYPE.value) != "adapter" or f.kv.get(LLMKV.ADAPTER_TYPE.value) != "lora":
                    raise ModelLoadError(f"{path}: not a LoRA adapter (general.type / adapter.type)")
                if f.kv.get(LLMKV.GENERAL_ARCHITECTURE.value) != arch:
                    raise ModelLoadError(f"{path}: the adapter is for architecture "
                                         f"{f.kv.get(LLMKV.GENERAL_ARCHITECTURE.value)!r}, {model_path} is {arch!r}")
                alpha = _alpha(str(path), f.kv)
                for name, (a, b) in _pairs(str(path), f).items():
                    if name not in base.tensors:
                        raise ModelLoadError(f"{path}: LoRA tensor '{name}' does not exist in {model_path}")
                    rank = b.ne[0]
                    d = lora_delta(a, b, name, scale * (alpha / rank if alpha else 1.0))
                    want = numpy_order(base.tensors[name].ne)
                    if d.shape != want:
                        raise ModelLoadError(f"{path}: LoRA tensor '{name}' makes a {list(d.shape)} update for a "
                                             f"{list(want)} weight")
                    deltas[name] = deltas.get(name, 0) + d
        w = gguf.GGUFWriter()
        for k, v in base.kv.items():
            w.add_kv(k, v, base.kv_types[k], base.kv_array_types.get(k))
        for name, info in base.tensors.items():
            if name in deltas:
                merged = _dequantized(info) + deltas[name]
                w.add_tensor(name, merged.astype(np.float16 if type == GGMLType.F16 else np.float32))
            else:
                w.add_tensor(name, np.array(info.data), info.type, info.ne)
        tmp = f"{out_path}.tmp"
        try:
            w.write(tmp)
            os.replace(tmp, out_path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return len(deltas)


def numpy_order(ne) -> tuple[int, ...]:
    """A ggml shape (ne0 innermost) as a numpy shape, trailing 1s dropped."""
    dims = list(ne)
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(reversed(dims))
