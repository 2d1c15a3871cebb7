"""The native int8 matvec (ggmlx/native) against the pure-XLA dequantize-then-dot path, per
number of activation rows N, on the weight shapes of SmolLM2 and Gemma3.

    python benchmarks/bench_native.py [--n 1,2,4,8,16] [--reps 20]

Both paths run in one process, alternating, each inside a jitted chain of products so
per-call dispatch is amortized; prints microseconds per product, the weight bytes read per
second, and the ratio XLA / native (> 1: native faster). The chain multiplies distinct copies
of the weight, at least 64 MiB in all, so every product reads its weight from memory as a
decode step does (the same small weight again and again would sit in the caches). N = 1 is
plain decode; N > 1 is what batched serving (one row per running sequence) and speculative
verification (one row per drafted token) feed to every weight.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import ggmlx

SHAPES = {      # (M, K, ggml type) of one weight
    "smollm2 ffn_up 1536x576 Q4_1": (1536, 576, "Q4_1"),
    "smollm2 lm_head 49152x576 Q8_0": (49152, 576, "Q8_0"),
    "gemma3-sized ffn_up 2048x640 Q4_1": (2048, 640, "Q4_1"),
    "gemma3 lm_head 262144x640 Q8_0": (262144, 640, "Q8_0"),
}
CHAIN_BYTES = 64 << 20     # more than the last-level cache: each product reads from memory


def _chain(weights, ws, x, native_ok: bool):
    """The products of each copy in ws by slightly different x, summed (none is dead code)."""
    acc = weights.mul_mat(ws[0], x, native_ok=native_ok)
    for i, w in enumerate(ws[1:], 1):
        acc = acc + weights.mul_mat(w, x * (1.0 + i * 1e-3), native_ok=native_ok)
    return acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    ggmlx.init()
    import jax
    import jax.numpy as jnp

    from ggmlx import flags, native, weights
    from ggmlx.quants.quantizers import quantize
    from ggmlx.types import GGMLType
    if flags.NATIVE.get() != "1":
        import os
        os.environ[flags.NATIVE.name] = "1"
    if not native.available():
        raise SystemExit(f"the native kernel is not available: {native.load_error()}")
    ns = [int(x) for x in a.n.split(",")]
    print(f"{'weight':34s} {'N':>3s} {'xla us':>9s} {'native us':>10s} {'xla GB/s':>9s} {'nat GB/s':>9s} "
          f"{'xla/native':>10s}")
    for name, (M, K, tname) in SHAPES.items():
        t = GGMLType[tname]
        rng = np.random.default_rng(0)
        raw = quantize(rng.standard_normal((M, K)).astype(np.float32), t)
        w = weights.to_device(raw, t, (K, M, 1, 1), weight_format="int8")
        ws = [w] + [weights.to_device(raw, t, (K, M, 1, 1), weight_format="int8")
                    for _ in range(max(1, -(-CHAIN_BYTES // w.nbytes)) - 1)]
        for n in ns:
            x = jnp.asarray(rng.standard_normal((n, K)).astype(np.float32))

            fns = {ok: jax.jit(lambda ws, x, ok=ok: _chain(weights, ws, x, ok)) for ok in (False, True)}
            times: dict[bool, list[float]] = {False: [], True: []}
            for f in fns.values():
                f(ws, x).block_until_ready()
            for _ in range(a.reps):
                for ok, f in fns.items():
                    t0 = time.perf_counter()
                    f(ws, x).block_until_ready()
                    times[ok].append((time.perf_counter() - t0) / len(ws) * 1e6)
            xla, nat = statistics.median(times[False]), statistics.median(times[True])
            print(f"{name:34s} {n:3d} {xla:9.0f} {nat:10.0f} {w.nbytes / xla / 1e3:9.1f} {w.nbytes / nat / 1e3:9.1f} "
                  f"{xla / nat:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
