"""The model loader (llama_model_loader): typed reads of the GGUF metadata (`get_key`,
`get_arr`, `get_key_or_arr`), a validated GGUF file, its weights map, shape-checked tensor
creation with per-layer placement, and load_all_data with a cancellable progress callback.
Tensor bytes go from the mmap straight to device buffers."""
from __future__ import annotations

import enum
import functools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import jax
import numpy as np

import ggmlx
from ggmlx import gguf, weights
from ggmlx.tensor import Tensor, new_weight
from ggmlx.types import GGMLType
from llm.arch import LLMKV, LLMTensor
from llm.errors import LoadCancelled, MetadataError, ModelLoadError

_V = TypeVar("_V", int, float, bool, str)

# What each kind of value may be stored as, and its name in errors. bool is no integer here.
_KIND_NAMES = {int: "an integer", float: "a number", bool: "a bool", str: "a string"}
_ARRAY_NAMES = {int: "an array of integers", float: "an array of numbers", bool: "an array of bools",
                str: "an array of strings"}
_DTYPE_KINDS = {int: "iu", float: "iuf", bool: "b"}
# the Python types whose values are elements of each kind as they are
_PLAIN_TYPES: dict[type, set[type]] = {int: {int}, float: {int, float}, bool: {bool}, str: {str}}


def _is_kind(value: object, kind: type) -> bool:
    is_bool = isinstance(value, (bool, np.bool_))
    if kind is bool:
        return is_bool
    if kind is int:
        return isinstance(value, (int, np.integer)) and not is_bool
    if kind is float:
        return isinstance(value, (int, float, np.integer, np.floating)) and not is_bool
    return isinstance(value, str)


# The matrices held in the lanes format under numerics "ggml" (weights.lanes_ok): the projections
# of attention and the FFN and the output head, which only mul_mat reads, and the token embedding,
# which the output head often is too (get_rows gathers its rows from the lane groups).
_LANE_WEIGHTS = re.compile("(?:" + "|".join(re.escape(tt.value).replace("%d", r"\d+") for tt in (
    LLMTensor.ATTN_Q, LLMTensor.ATTN_K, LLMTensor.ATTN_V, LLMTensor.ATTN_QKV, LLMTensor.ATTN_OUT,
    LLMTensor.FFN_GATE, LLMTensor.FFN_UP, LLMTensor.FFN_DOWN, LLMTensor.OUTPUT, LLMTensor.TOKEN_EMBD)) + r")\.weight")


class TensorFlag(enum.IntFlag):
    """llama_model_loader's TENSOR_NOT_REQUIRED and TENSOR_DUPLICATED."""
    NONE = 0
    NOT_REQUIRED = 1
    DUPLICATED = 2


@dataclass
class WeightEntry:
    """One entry of the weights map: where a tensor's bytes are (llama_tensor_weight)."""
    info: gguf.TensorInfo

    @property
    def path(self) -> str:
        return self.info.path


class GGUFMeta:
    """Typed reads of GGUF metadata, named like llama_model_loader's getters. `path` names the
    file in errors; `%s` in a key stands for `general.architecture`. A missing key without a
    default, or a value of the wrong type, raises MetadataError naming the file and the key."""

    def __init__(self, kv: Mapping[str, object], path: str = "<gguf kv>"):
        self.kv = kv
        self.path = path

    def error(self, message: str) -> ModelLoadError:
        """A load error about this file (for checks beyond a key's type)."""
        return ModelLoadError(f"{self.path}: {message}")

    @property
    def arch_name(self) -> str:
        """`general.architecture`, the value `%s` stands for in the other keys."""
        return self.get_key(LLMKV.GENERAL_ARCHITECTURE, str)

    def key_name(self, key: LLMKV) -> str:
        return key.key(self.arch_name) if "%s" in key.value else key.value

    def has_key(self, key: LLMKV) -> bool:
        return self.key_name(key) in self.kv

    def _wrong_type(self, name: str, value: object, expected: str) -> MetadataError:
        return MetadataError(self.path, name, f"key '{name}' has a value of type {type(value).__name__} "
                                              f"({value!r:.60}), expected {expected}")

    def _missing(self, name: str) -> MetadataError:
        return MetadataError(self.path, name, f"missing required key '{name}'")

    def get_key(self, key: LLMKV, kind: type[_V], default: _V | None = None) -> _V:
        """The scalar value of `key` as `kind` (int, float, bool or str); `default` when the key
        is absent, which is an error when no default is given."""
        name = self.key_name(key)
        if name not in self.kv:
            if default is None:
                raise self._missing(name)
            return default
        value = self.kv[name]
        if not _is_kind(value, kind):
            raise self._wrong_type(name, value, _KIND_NAMES[kind])
        return _convert(value, kind)

    def get_arr(self, key: LLMKV, kind: type[_V], default: list[_V] | None = None) -> list[_V]:
        """The array value of `key` with elements of `kind`, as a list; `default` when absent."""
        name = self.key_name(key)
        if name not in self.kv:
            if default is None:
                raise self._missing(name)
            return list(default)
        value = self.kv[name]
        arr = _as_list(value, kind)
        if arr is None:
            raise self._wrong_type(name, value, _ARRAY_NAMES[kind])
        return arr

    def get_arr_len(self, key: LLMKV, kind: type[_V]) -> int:
        """len(get_arr(key, kind)), without decoding a string array read lazily (Gemma3's 262144
        tokens: ~190 MB of strings at the load's peak, when its vocabulary comes from the cache)."""
        value = self.kv.get(self.key_name(key))
        if kind is str and isinstance(value, gguf.StringArray):
            return len(value)
        return len(self.get_arr(key, kind))

    def get_key_or_arr(self, key: LLMKV, kind: type[_V], n: int, default: list[_V] | None = None) -> list[_V]:
        """n values: a scalar repeated n times, or an array of exactly n (one per layer)."""
        name = self.key_name(key)
        if name not in self.kv:
            if default is None:
                raise self._missing(name)
            return list(default)
        value = self.kv[name]
        if _is_kind(value, kind):
            return [_convert(value, kind)] * n
        arr = _as_list(value, kind)
        if arr is None:
            raise self._wrong_type(name, value, f"{_KIND_NAMES[kind]} or {_ARRAY_NAMES[kind]}")
        if len(arr) != n:
            raise MetadataError(self.path, name, f"key '{name}' has an array of {len(arr)} values, "
                                                 f"expected one per layer ({n})")
        return arr


def _convert(value: Any, kind: type[_V]) -> _V:
    """A checked value as the plain Python type (numpy scalars and ints read as floats too)."""
    return kind(value)


def _as_list(value: object, kind: type[_V]) -> list[_V] | None:
    """value's elements as `kind`, or None when it is no array of that kind."""
    if isinstance(value, np.ndarray):
        if kind is str or value.ndim != 1 or (value.size and value.dtype.kind not in _DTYPE_KINDS[kind]):
            return None
        if kind is int:     # Python ints, exact for uint64 too (astype(int64) would wrap them)
            return value.tolist()
        # widen first, so the values are the ones float64 holds (a float32 score stays exact)
        wide = np.bool_ if kind is bool else np.float64
        return value.astype(wide).tolist()
    if isinstance(value, gguf.StringArray):
        return cast(list[_V], list(value.tolist())) if kind is str else None
    if not isinstance(value, (list, tuple)):
        return None
    # the element types once, in C (a vocabulary's 262144 strings: a per-element check took 0.2 s)
    if set(map(type, value)) <= _PLAIN_TYPES[kind]:
        return list(value) if kind is not float else [_convert(v, kind) for v in value]
    if all(_is_kind(v, kind) for v in value):
        return [_convert(v, kind) for v in value]
    return None


class ModelLoader(GGUFMeta):
    """Opens a GGUF file (all shards): its metadata (GGUFMeta) and weight tensors by name."""

    def __init__(self, path: str | os.PathLike):
        ggmlx.init()
        if not os.path.isfile(str(path)):
            raise ModelLoadError(f"{path}: no such model file")
        try:
            self.reader = gguf.GGUFReader(str(path), lazy_strings=True)
        except gguf.GGUFError as e:
            raise ModelLoadError(f"failed to read model file: {e}") from e
        super().__init__(self.reader.kv, str(path))
        self.weights_map = {name: WeightEntry(info) for name, info in self.reader.tensors.items()}
        self.created: list[tuple[Tensor, WeightEntry, jax.Device, weights.WeightSplit | None]] = []
        self._used: set[str] = set()
        self.weight_format = ""
        # split_mode "row": every tensor goes on this mesh, divided as split_of(name) says
        self.mesh: jax.sharding.Mesh | None = None
        self.split_of: Callable[[str], weights.WeightSplit | None] = lambda name: None

    def close(self) -> None:
        self.reader.close()

    def create_tensor(self, name: str, ne: tuple[int, ...], device: jax.Device,
                      flags: TensorFlag = TensorFlag.NONE) -> Tensor | None:
        """A weight leaf for `name`, checked against the expected shape `ne` (ggml order).
        Missing and NOT_REQUIRED -> None; missing otherwise -> ModelLoadError."""
        entry = self.weights_map.get(name)
        if entry is None:
            if flags & TensorFlag.NOT_REQUIRED:
                return None
            raise ModelLoadError(f"{self.path}: missing tensor '{name}'")
        got = tuple(entry.info.ne) + (1,) * (4 - len(entry.info.ne))
        want = tuple(ne) + (1,) * (4 - len(ne))
        if got != want:
            raise ModelLoadError(f"{self.path}: tensor '{name}' has wrong shape; expected "
                                 f"{list(want)}, got {list(got)}")
        split = None
        held = want
        if self.mesh is not None:
            try:
                split = self.split_of(name)
                weights.check_split(name, entry.info.type, want, self.mesh.devices.size, split)
            except ValueError as e:
                raise ModelLoadError(f"{self.path}: split_mode 'row' over {self.mesh.devices.size} devices: "
                                     f"{e}") from None
            if split is not None:
                held = split.padded_ne(want)    # attention padded to whole heads per device
        t = new_weight(entry.info.type, held, name)
        self.created.append((t, entry, device, split))
        if not flags & TensorFlag.DUPLICATED:
            self._used.add(name)
        return t

    def skip_tensors(self, prefix: str) -> int:
        """Claim every tensor whose name starts with `prefix` without loading it (llama.cpp's
        TENSOR_SKIP: an MTP / NextN block the graph does not run); returns how many."""
        names = [n for n in self.weights_map if n.startswith(prefix)]
        self._used.update(names)
        return len(names)

    def check_all_used(self) -> None:
        """Every tensor in the file must have been claimed (llama.cpp's done_getting_tensors)."""
        unused = [n for n in self.weights_map if n not in self._used]
        if unused:
            raise ModelLoadError(f"{self.path}: {len(unused)} tensor(s) not used by the "
                                 f"'{self.arch_name}' graph, e.g. '{unused[0]}'")

    @staticmethod
    def lane_weight(name: str) -> bool:
        """Whether the tensor of this name may be held in the lanes format under numerics "ggml"
        (weights.lanes_ok): a matrix of mul_mat (and the token embedding's get_rows)."""
        return _LANE_WEIGHTS.fullmatch(name) is not None

    def load_all_data(self, progress_callback: Callable[[float], bool] | None = None,
                      weight_format: str = "auto", numerics: str = "exact") -> int:
        """Copy every created tensor's bytes to its device, held in `weight_format` (see
        ggmlx.weights.resolve_format; under numerics "ggml" as ggmlx.weights.to_device says).
        The callback gets the fraction
        done and returns False to cancel: then every buffer made so far is freed and
        LoadCancelled is raised. Returns the bytes read from the file; the concrete format
        used ("auto" resolved) is left in self.weight_format."""
        weights.check_format(weight_format, numerics)
        if weight_format == "auto":
            weight_format = weights.auto_format(list(self.mesh.devices.flat) if self.mesh is not None
                                                else [d for _, _, d, _ in self.created])
        self.weight_format = weight_format
        total = sum(e.info.nbytes for _, e, _, _ in self.created) or 1
        done = 0
        placed: list[Tensor] = []
        try:
            for t, entry, device, split in self.created:
                if progress_callback is not None and progress_callback(done / total) is False:
                    raise LoadCancelled(f"{self.path}: loading cancelled by the progress callback "
                                        f"at {100 * done / total:.0f}%")
                if self.mesh is not None:
                    t.data = weights.to_mesh(entry.info.data, GGMLType(entry.info.type), tuple(entry.info.ne),
                                             self.mesh, split, weight_format, t.name)
                else:
                    t.data = weights.to_device(entry.info.data, GGMLType(entry.info.type), t.ne, device,
                                               weight_format, numerics, lanes=self.lane_weight(t.name),
                                               release=functools.partial(self.reader.release, entry.info))
                if weights.converted(t.data):      # its file pages are read: out of the RSS
                    self.reader.release(entry.info)
                elif not weights.aliases(t.data, entry.info.data):   # copied, once the copy is done
                    t.data.array.block_until_ready()
                    self.reader.release(entry.info)
                placed.append(t)
                done += entry.info.nbytes
            if progress_callback is not None and progress_callback(1.0) is False:
                raise LoadCancelled(f"{self.path}: loading cancelled by the progress callback at 100%")
        except BaseException:
            for t in placed:
                t.data.delete()
                t.data = None
            raise
        return done
