"""Backends: one per JAX device, like ggml_backend_load_all + the device list.

A backend's buffers are device arrays placed with `jax.device_put`. Every op lowers to
portable JAX, so every backend runs every op. Accelerators come first in the registry (the
order llama.cpp offloads to), the CPU last.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Backend:
    name: str            # e.g. "CPU0", "CUDA0"
    kind: str            # "cpu", "gpu" or "tpu"
    device: jax.Device

    def __str__(self) -> str:
        return self.name


_PREFIX = {"cpu": "CPU", "gpu": "CUDA", "cuda": "CUDA", "rocm": "ROCM", "tpu": "TPU"}


def _backend(d: jax.Device) -> Backend:
    kind = "cpu" if d.platform == "cpu" else ("tpu" if d.platform == "tpu" else "gpu")
    return Backend(f"{_PREFIX.get(d.platform, d.platform.upper())}{d.id}", kind, d)


def backends() -> list[Backend]:
    """All backends: accelerators first, then the CPU devices."""
    out = []
    try:
        accel = [d for d in jax.devices() if d.platform != "cpu"]
    except RuntimeError:
        accel = []
    out += [_backend(d) for d in accel]
    out += [_backend(d) for d in jax.devices("cpu")]
    return out


def cpu_backend() -> Backend:
    return _backend(jax.devices("cpu")[0])


def backend_of(device: jax.Device) -> Backend:
    return _backend(device)
