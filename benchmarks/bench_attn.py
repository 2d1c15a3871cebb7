"""The native decode attention (ggmlx.native.attn_decode) per layer, on SmolLM2's head shapes by
default, over a chain of layers whose K/V caches are distinct buffers (enough layers and the
rows come from memory, as in a decode step, not from the caches).

    python benchmarks/bench_attn.py [--cells 128,1024,4096] [--rows 1] [--stride 1] [--layers 30]
        [--cache f16|f32|q8_0] [--heads 9 --kv-heads 3 --head-dim 64] [--lib NAME=PATH.so ...]

--rows R query rows (a batched step's sequences), row r attending to cells r, r + stride, ...
below --cells (stride R: R sequences decoded together interleave in the cache). --lib compares
builds of the library in one process, alternating (each registered under its own FFI target),
the installed one first: an A/B of a kernel change without the noise of separate runs. Prints
the minimum and median microseconds per layer of each.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import jax
import jax.numpy as jnp
import numpy as np

from ggmlx import native, quants
from ggmlx.types import GGMLType

CACHES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0}


def _targets(libs: list[str]) -> list[tuple[str, str]]:
    """(name, FFI target) of the installed library and of each --lib build."""
    if native.load_error() is not None:
        raise SystemExit(f"the native library is not loaded: {native.load_error()}")
    out = [("installed", native.TARGET_ATTN)]
    for spec in libs:
        name, _, path = spec.partition("=")
        lib = ctypes.cdll.LoadLibrary(path)
        target = f"ggmlx_attn_decode_{name}"
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.GgmlxAttnDecode), platform="cpu")
        out.append((name, target))
    return out


def _caches(a, n_kv: int, rng) -> tuple[list, list, int]:
    """Per layer K and V caches [n_kv, kv_heads * row bytes] of --cache, and a head's row bytes."""
    t = CACHES[a.cache]

    def one():
        x = rng.standard_normal((n_kv, a.kv_heads * a.head_dim)).astype(np.float32)
        if t == GGMLType.Q8_0:
            return jnp.asarray(quants.quantize(x, t))
        return jnp.asarray(x.astype(np.float16 if t == GGMLType.F16 else np.float32))

    ks = [one() for _ in range(a.layers)]
    vs = [one() for _ in range(a.layers)]
    return ks, vs, ks[0].shape[1] * ks[0].dtype.itemsize // a.kv_heads


def measure(a, cells: int, targets: list[tuple[str, str]]) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    ks, vs, head = _caches(a, cells, rng)
    q = jnp.asarray(rng.standard_normal((a.rows, a.heads, a.head_dim)).astype(np.float32))
    mask = np.full((a.rows, cells), -np.inf, np.float32)
    for r in range(a.rows):
        mask[r, r:cells:a.stride] = 0.0
    mask = jnp.asarray(mask)
    cell = head * a.kv_heads

    def chain_of(target: str):
        def one(q, k, v):
            out = jax.ShapeDtypeStruct((a.rows, a.heads, a.head_dim), jnp.float32)
            i64 = np.int64
            return jax.ffi.ffi_call(target, out)(
                q, k, v, mask, kv_type=i64(CACHES[a.cache]), n_kv=i64(cells), n_head_kv=i64(a.kv_heads),
                k_off=i64(0), k_cell=i64(cell), k_head=i64(head), v_off=i64(0), v_cell=i64(cell), v_head=i64(head),
                scale=np.float32(a.head_dim ** -0.5), softcap=np.float32(0.0))

        @jax.jit
        def chain(q, ks, vs):
            for k, v in zip(ks, vs, strict=True):
                q = q + 1e-3 * one(q, k, v)
            return q
        return chain

    chains = {name: chain_of(target) for name, target in targets}
    first = None
    for name, c in chains.items():   # compile, and every build gives the same result
        out = np.asarray(c(q, ks, vs))
        first = out if first is None else first
        if not np.allclose(out, first, atol=1e-4):
            raise SystemExit(f"{name} differs from the installed build by {np.abs(out - first).max()}")
    times: dict[str, list[float]] = {name: [] for name in chains}
    for _ in range(a.reps):
        for name, c in chains.items():
            t0 = time.perf_counter()
            c(q, ks, vs).block_until_ready()
            times[name].append((time.perf_counter() - t0) / a.layers * 1e6)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="128,1024,4096")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--stride", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--cache", choices=tuple(CACHES), default="f16")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--lib", action="append", default=[], metavar="NAME=PATH.so")
    a = ap.parse_args()
    targets = _targets(a.lib)
    print(f"{a.rows} row(s), stride {a.stride}, {a.heads} heads / {a.kv_heads} KV heads of {a.head_dim}, "
          f"{a.cache} cache, {a.layers} layers; us per layer")
    print("| cells | build | min | median |\n|---:|---|---:|---:|")
    for cells in (int(c) for c in a.cells.split(",")):
        for name, ts in measure(a, cells, targets).items():
            print(f"| {cells} | {name} | {min(ts):.1f} | {float(np.median(ts)):.1f} |")


if __name__ == "__main__":
    main()
