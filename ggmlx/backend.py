"""Backends: one per JAX device, like ggml_backend_load_all + the device list.

A backend's buffers are device arrays placed with `jax.device_put`. Every op lowers to
portable JAX, so every backend runs every op. Accelerators come first in the registry (the
order llama.cpp offloads to), the CPU last.

A mesh backend (`mesh_backend`) is several devices acting as one (split_mode "row", tensor
parallelism): its buffers are global arrays with a NamedSharding over a 1-d
`jax.sharding.Mesh`, and a split placed on it compiles to one SPMD program for all of them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np


@dataclass(frozen=True)
class Backend:
    name: str            # e.g. "CPU0", "CUDA0", "TP[CPU0,CPU1]"
    kind: str            # "cpu", "gpu" or "tpu"
    device: jax.Device   # a mesh backend: its first device
    mesh: jax.sharding.Mesh | None = None

    def __str__(self) -> str:
        return self.name

    @functools.cached_property
    def devices(self) -> frozenset[jax.Device]:
        """Made once: the scheduler compares every state's devices with it on each decode."""
        return frozenset(self.mesh.devices.flat) if self.mesh is not None else frozenset((self.device,))

    @property
    def target(self) -> jax.Device | jax.sharding.Sharding:
        """Where jax.device_put puts an input: the device, or replicated over the mesh."""
        if self.mesh is None:
            return self.device
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def put(self, x) -> jax.Array:
        """A host value (the same in every process) as an array on this backend."""
        if self.mesh is None:
            return jax.device_put(x, self.device)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, self.target, lambda idx: x[idx])


MESH_AXIS = "tp"   # the one axis of a mesh backend (tensor parallelism)

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


def make_mesh(devices: list[jax.Device], axis: str = MESH_AXIS) -> jax.sharding.Mesh:
    """A 1-d mesh of devices (in the order given) along one named axis."""
    return jax.sharding.Mesh(np.asarray(devices, dtype=object), (axis,))


def mesh_backend(mesh: jax.sharding.Mesh) -> Backend:
    """The backend that is all devices of mesh as one."""
    devs = list(mesh.devices.flat)
    first = _backend(devs[0])
    name = "TP[" + ",".join(_backend(d).name for d in devs) + "]"
    return Backend(name, first.kind, devs[0], mesh)


def backend_of_array(x: jax.Array) -> Backend:
    """The backend an array lives on: its device, or the mesh it is laid out over."""
    sh = x.sharding
    if isinstance(sh, jax.sharding.NamedSharding) and isinstance(sh.mesh, jax.sharding.Mesh) \
            and sh.mesh.devices.size > 1:
        return mesh_backend(sh.mesh)
    return _backend(next(iter(x.devices())))
