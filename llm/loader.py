"""The model loader (llama_model_loader): a validated GGUF file, its weights map, shape-checked
tensor creation with per-layer placement, and load_all_data with a cancellable progress
callback. Tensor bytes go from the mmap straight to device buffers."""
from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass

import jax

import ggmlx
from ggmlx import gguf, weights
from ggmlx.tensor import Tensor, new_weight
from ggmlx.types import GGMLType
from llm.errors import LoadCancelled, ModelLoadError


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


class ModelLoader:
    """Opens a GGUF file (all shards) and hands out weight tensors by name."""

    def __init__(self, path: str | os.PathLike):
        ggmlx.init()
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise ModelLoadError(f"{self.path}: no such model file")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except gguf.GGUFError as e:
            raise ModelLoadError(f"failed to read model file: {e}") from e
        self.kv = self.reader.kv
        self.weights_map = {name: WeightEntry(info) for name, info in self.reader.tensors.items()}
        self.created: list[tuple[Tensor, WeightEntry, jax.Device]] = []
        self._used: set[str] = set()
        self.weight_format = ""

    @property
    def arch_name(self) -> str:
        arch = self.kv.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: missing or non-string key 'general.architecture'")
        return arch

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
        t = new_weight(entry.info.type, want, name)
        self.created.append((t, entry, device))
        if not flags & TensorFlag.DUPLICATED:
            self._used.add(name)
        return t

    def check_all_used(self) -> None:
        """Every tensor in the file must have been claimed (llama.cpp's done_getting_tensors)."""
        unused = [n for n in self.weights_map if n not in self._used]
        if unused:
            raise ModelLoadError(f"{self.path}: {len(unused)} tensor(s) not used by the "
                                 f"'{self.arch_name}' graph, e.g. '{unused[0]}'")

    def load_all_data(self, progress_callback: Callable[[float], bool] | None = None,
                      weight_format: str = "auto") -> int:
        """Copy every created tensor's bytes to its device, held in `weight_format` (see
        ggmlx.weights.resolve_format). The callback gets the fraction
        done and returns False to cancel: then every buffer made so far is freed and
        LoadCancelled is raised. Returns the bytes read from the file; the concrete format
        used ("auto" resolved) is left in self.weight_format."""
        weights.check_format(weight_format)
        if weight_format == "auto":
            weight_format = weights.AUTO_FORMAT
        self.weight_format = weight_format
        total = sum(e.info.nbytes for _, e, _ in self.created) or 1
        done = 0
        placed: list[Tensor] = []
        try:
            for t, entry, device in self.created:
                if progress_callback is not None and progress_callback(done / total) is False:
                    raise LoadCancelled(f"{self.path}: loading cancelled by the progress callback "
                                        f"at {100 * done / total:.0f}%")
                t.data = weights.to_device(entry.info.data, GGMLType(entry.info.type), t.ne, device,
                                           weight_format)
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
