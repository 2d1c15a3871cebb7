"""llama.cpp control vectors (`--control-vector`, `--control-vector-scaled`,
`--control-vector-layer-range`) as interventions.

A control-vector file is a GGUF file of F32 tensors `direction.N` [n_embd], N >= 1. Like
llama.cpp's loader, every file's directions are scaled by its strength and summed per
layer; like its `build_cvec`, layer il's direction is added to the layer output (`l_out-il`)
for 1 <= il < n_layer and layer_start <= il <= layer_end (a bound <= 0 means the first /
last layer). Layer 0 never gets one.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from ggmlx import gguf
from ggmlx.types import GGMLType

_DIRECTION = re.compile(r"direction\.(\d+)$")


class ControlVectorError(ValueError):
    """A control-vector file that cannot be applied to this model (the message names it)."""


@dataclass
class ControlVector:
    """Summed, scaled directions: data[il] is added to l_out-il (row 0 stays zero)."""
    data: np.ndarray             # [n_layer, n_embd] float32

    def interventions(self, layer_start: int = -1, layer_end: int = -1) -> dict:
        """{"l_out-il": fn} for the layers in [layer_start, layer_end] that have a direction;
        one function object for all, so generation compiles once per graph shape."""
        n_layer = self.data.shape[0]
        start = 1 if layer_start <= 0 else layer_start
        end = n_layer - 1 if layer_end <= 0 else min(layer_end, n_layer - 1)
        dirs = jnp.asarray(self.data)

        def add_direction(x, il):
            return x + dirs[il]
        return {f"l_out-{il}": add_direction for il in range(max(start, 1), end + 1)
                if np.any(self.data[il] != 0)}


def load(files: list[tuple[str | os.PathLike, float]], n_embd: int, n_layer: int) -> ControlVector:
    """Read (path, strength) pairs and sum strength * direction.N per layer."""
    data = np.zeros((n_layer, n_embd), np.float32)
    for path, strength in files:
        try:
            f = gguf.GGUFReader(path)
        except (OSError, gguf.GGUFError) as e:
            raise ControlVectorError(f"control vector {path}: {e}") from None
        with f:
            found = 0
            for name, t in f.tensors.items():
                m = _DIRECTION.match(name)
                if m is None:
                    continue
                il = int(m.group(1))
                if il < 1:
                    raise ControlVectorError(f"control vector {path}: tensor {name!r} has layer index {il} "
                                             "(must be >= 1)")
                if t.type != GGMLType.F32 or t.ne[0] != n_embd or any(d != 1 for d in t.ne[1:]):
                    raise ControlVectorError(f"control vector {path}: tensor {name!r} is {t.type.name} {list(t.ne)}, "
                                             f"the model needs F32 [{n_embd}]")
                found += 1
                if il < n_layer:
                    data[il] += np.frombuffer(t.data, np.float32, n_embd) * np.float32(strength)
            if not found:
                raise ControlVectorError(f"control vector {path}: no direction.N tensors")
    return ControlVector(data)


def write(path: str | os.PathLike, directions: dict[int, np.ndarray], arch: str = "") -> None:
    """A control-vector file in llama.cpp's layout (what its cvec-generator writes)."""
    w = gguf.GGUFWriter()
    w.add_kv("general.architecture", "controlvector")
    w.add_kv("controlvector.model_hint", arch)
    w.add_kv("controlvector.layer_count", len(directions))
    for il, v in sorted(directions.items()):
        w.add_tensor(f"direction.{il}", np.asarray(v, np.float32))
    w.write(path)
