"""The native int8 and int4 matvecs (ggmlx/native) against the pure-XLA dequantize-then-dot
path, per number of activation rows N, on the weight shapes of SmolLM2 and Gemma3.

    python benchmarks/bench_native.py [--n 1,2,4,8,16] [--reps 20] [--formats int8,int4]

Both paths run in one process, alternating, each inside a jitted chain of products so
per-call dispatch is amortized; prints microseconds per product, the weight bytes read per
second, the ratio XLA / native (> 1: native faster) and the native time of the first format
over this one's (> 1: faster than it). All variants of one shape and N alternate in one loop.
int4 holds Q4_0/Q4_1/Q4_K; a Q8_0 weight is int8 under both, measured once. The chain multiplies distinct copies
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
    "smollm2 ffn_down 576x1536 Q4_1": (576, 1536, "Q4_1"),
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
    ap.add_argument("--formats", default="int8,int4")
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
    fmts = a.formats.split(",")
    print(f"{'weight':34s} {'fmt':4s} {'N':>3s} {'xla us':>9s} {'native us':>10s} {'xla GB/s':>9s} {'nat GB/s':>9s} "
          f"{'xla/native':>10s} {'vs ' + fmts[0]:>8s}")
    for name, (M, K, tname) in SHAPES.items():
        t = GGMLType[tname]
        rng = np.random.default_rng(0)
        raw = quantize(rng.standard_normal((M, K)).astype(np.float32), t)
        held = {}   # format -> distinct copies; a Q8_0 weight is int8 under int4 too: measured once
        for fmt in fmts:
            w = weights.to_device(raw, t, (K, M, 1, 1), weight_format=fmt)
            if w.spec.format == fmt:
                held[fmt] = [w] + [weights.to_device(raw, t, (K, M, 1, 1), weight_format=fmt)
                                   for _ in range(max(1, -(-CHAIN_BYTES // w.nbytes)) - 1)]
        if not held:    # e.g. a Q8_0 weight with --formats int4: held as int8, not asked for
            continue
        for n in ns:
            x = jnp.asarray(rng.standard_normal((n, K)).astype(np.float32))
            fns = {(fmt, ok): jax.jit(lambda ws, x, ok=ok: _chain(weights, ws, x, ok))
                   for fmt in held for ok in (False, True)}
            times: dict[tuple[str, bool], list[float]] = {k: [] for k in fns}
            for (fmt, _), f in fns.items():
                f(held[fmt], x).block_until_ready()
            for _ in range(a.reps):          # alternated: every variant sees the same load
                for (fmt, ok), f in fns.items():
                    t0 = time.perf_counter()
                    f(held[fmt], x).block_until_ready()
                    times[fmt, ok].append((time.perf_counter() - t0) / len(held[fmt]) * 1e6)
            base = statistics.median(times[next(iter(held)), True])
            for fmt, ws in held.items():
                xla, nat = statistics.median(times[fmt, False]), statistics.median(times[fmt, True])
                nb = ws[0].nbytes
                print(f"{name:34s} {fmt:4s} {n:3d} {xla:9.0f} {nat:10.0f} {nb / xla / 1e3:9.1f} {nb / nat / 1e3:9.1f} "
                      f"{xla / nat:10.2f} {base / nat:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
