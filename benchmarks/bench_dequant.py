"""Dequantization throughput per ggml type: ggmlx numpy vs gguf-py vs ggmlx JAX under jit.

    python benchmarks/bench_dequant.py [--mb 4] [--repeats 5] [--types Q4_0,Q4_K]

Each type gets random blocks (finite f16 scales) of about --mb megabytes; the best of
--repeats runs is reported as million output elements per second, with the ratios
ours / gguf-py and jax / ours. JAX runs on the default device with the packed blocks
already there (as weights are), so it measures the dequantization alone.
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np

import ggmlx
from ggmlx import quants, weights
from ggmlx.types import GGMLType, block_size, type_size

try:
    import gguf
    from gguf import quants as gguf_quants
except ImportError:  # gguf-py is a test extra; without it that column stays empty
    gguf = None


def random_data(t: GGMLType, n_bytes: int, rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, int]]:
    """(bytes, ne) of a random tensor of rows of 4096 elements and about n_bytes bytes."""
    ne0 = 4096
    row_bytes = ne0 // block_size(t) * type_size(t)
    ne = (ne0, max(1, n_bytes // row_bytes))
    n_elements = ne[0] * ne[1]
    if t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        return quants.quantize(rng.standard_normal(n_elements).astype(np.float32), t).reshape(-1), ne
    blocks = rng.integers(0, 256, (n_elements // block_size(t), type_size(t)), dtype=np.uint8)
    scales = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    # Overwrite every f16 field that may hold a scale: harmless for the quant fields it hits.
    for off in range(0, type_size(t) - 1, 2):
        blocks[:, off:off + 2] = scales
    if t == GGMLType.MXFP4:
        blocks[:, 0] = rng.integers(110, 130, blocks.shape[0])
    return blocks.reshape(-1), ne


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ggmlx.init()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=4.0, help="bytes of packed data per type, in MB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--types", default="", help="comma-separated type names (default: all supported)")
    args = ap.parse_args()
    names = [n for n in args.types.split(",") if n]
    types = [GGMLType[n] for n in names] if names else list(quants.SUPPORTED_TYPES)
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0]}; {args.mb} MB per type; best of {args.repeats}")
    print(f"{'type':8} {'Melem':>7} {'numpy Me/s':>11} {'gguf-py Me/s':>13} {'jax Me/s':>10} "
          f"{'numpy GB/s':>11} {'ours/gguf':>10} {'jax/ours':>9}")
    for t in types:
        data, ne = random_data(t, int(args.mb * 1e6), rng)
        n = ne[0] * ne[1]
        ours = best_seconds(functools.partial(quants.dequantize, data, t, ne), args.repeats)
        ref = float("nan")
        if gguf is not None:
            rows = data.reshape(ne[1], -1)
            gtype = gguf.GGMLQuantizationType(int(t))
            ref = best_seconds(functools.partial(gguf_quants.dequantize, rows, gtype), args.repeats)
        blocks = weights.to_device(data, t, ne, weight_format="native").array   # as the engine holds it
        fn = jax.jit(functools.partial(quants.dequantize_jax, type=t, ne=ne))
        fn(blocks).block_until_ready()
        on_device = best_seconds(lambda fn=fn, blocks=blocks: fn(blocks).block_until_ready(), args.repeats)
        print(f"{t.name:8} {n / 1e6:7.2f} {n / ours / 1e6:11.0f} {n / ref / 1e6:13.0f} {n / on_device / 1e6:10.0f} "
              f"{data.size / ours / 1e9:11.2f} {ref / ours:10.2f} {ours / on_device:9.2f}")


if __name__ == "__main__":
    main()
