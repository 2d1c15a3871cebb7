"""Time llama.cpp's default sampler chain on one vocabulary-sized logits row.

Usage: python benchmarks/bench_sampling.py [--n-vocab 262144] [--iters 200]

The chain is penalties -> dry -> top-n-sigma -> top-k 40 -> typical -> top-p 0.95 ->
min-p 0.05 -> xtc -> temp 0.8 -> dist (llama.cpp's common defaults; the disabled samplers are
no-ops). Reported: the whole `sample()` call (row copy, chain, accept) per token, the time
in each sampler of the chain, and single samplers on a full row (as in llama.cpp's
test-sampling perf section). Target: <= 3 ms per sample for 262,144 logits.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from llm.sampling import samplers as sampling


class _Row:
    """Stands in for llm.Context: returns the same logits row for every index."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def get_logits_ith(self, i: int) -> np.ndarray:
        return self.logits


def make_logits(n_vocab: int, seed: int) -> np.ndarray:
    """Model-like logits: a broad body and a few hundred tokens well above it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, n_vocab).astype(np.float32)
    logits[rng.choice(n_vocab, 300, replace=False)] += rng.uniform(4.0, 12.0, 300).astype(np.float32)
    return logits


def time_sample(chain: sampling.SamplerChain, ctx: _Row, iters: int) -> float:
    for _ in range(10):
        chain.sample(ctx, -1)
    t0 = time.perf_counter()
    for _ in range(iters):
        chain.sample(ctx, -1)
    return (time.perf_counter() - t0) / iters


def time_per_sampler(chain: sampling.SamplerChain, logits: np.ndarray, iters: int) -> dict[str, float]:
    totals = {"from_logits": 0.0} | {smpl.name: 0.0 for smpl in chain.samplers}
    for _ in range(iters):
        t0 = time.perf_counter()
        cur = sampling.TokenDataArray.from_logits(logits)
        totals["from_logits"] += time.perf_counter() - t0
        for smpl in chain.samplers:
            t0 = time.perf_counter()
            smpl.apply(cur)
            totals[smpl.name] += time.perf_counter() - t0
        chain.accept(int(cur.ids[cur.selected]))
    return {name: t / iters for name, t in totals.items()}


def time_single(smpl: sampling.Sampler, logits: np.ndarray, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        smpl.apply(sampling.TokenDataArray.from_logits(logits))
    return (time.perf_counter() - t0) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-vocab", type=int, default=262144)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()

    logits = make_logits(args.n_vocab, seed=0)
    ctx = _Row(logits)
    chain = sampling.SamplerChain.default(seed=1234, n_vocab=args.n_vocab)

    per_sample = time_sample(chain, ctx, args.iters)
    print(f"default chain, n_vocab {args.n_vocab}: {per_sample * 1e3:.3f} ms per sample() "
          f"({args.iters} samples; target <= 3 ms)")

    print("time per sampler in the default chain:")
    for name, t in time_per_sampler(chain.clone(), logits, args.iters).items():
        print(f"  {name:<12} {t * 1e6:9.1f} us")

    print("single samplers on the full row (each includes from_logits):")
    singles = [
        ("from_logits only", None),
        ("top_k(40)", sampling.TopK(40)),
        ("top_p(0.8, 1)", sampling.TopP(0.8, 1)),
        ("min_p(0.2, 1)", sampling.MinP(0.2, 1)),
        ("temp(0.8)", sampling.Temp(0.8)),
        ("dist(1234)", sampling.Dist(1234)),
        ("penalties(64, 1.1, 0.1, 0.1)", _penalties_with_history()),
    ]
    n_single = max(args.iters // 4, 10)
    for label, smpl in singles:
        if smpl is None:
            t0 = time.perf_counter()
            for _ in range(n_single):
                sampling.TokenDataArray.from_logits(logits)
            t = (time.perf_counter() - t0) / n_single
        else:
            t = time_single(smpl, logits, n_single)
        print(f"  {label:<30} {t * 1e3:8.3f} ms")


def _penalties_with_history() -> sampling.Penalties:
    smpl = sampling.Penalties(64, 1.1, 0.1, 0.1)
    for token in range(0, 64 * 97, 97):
        smpl.accept(token)
    return smpl


if __name__ == "__main__":
    main()
