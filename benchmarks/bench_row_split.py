"""split_mode="row" over 1, 2 and 4 simulated CPU devices: prefill and decode tok/s side by
side in one run. The devices share this machine's cores, so this measures the overhead of
the SPMD program (collectives, per-device launches), not a speed-up. "layer/1" is the plain
one-device model for reference.

    .venv/bin/python benchmarks/bench_row_split.py [-m MODEL] [--pp 64] [--tg 32] [--devices 1,2,4]
"""
from __future__ import annotations

import argparse
import json
import time


def measure(model, n_pp: int, n_tg: int, reps: int = 3) -> dict:
    """Prefill of n_pp tokens and n_tg single-token steps, after one round that compiles.
    The machine is shared, so each figure is the median over reps rounds (prefill) and
    over every step (decode)."""
    import numpy as np

    import llm
    ctx = llm.Context(model, n_ctx=256, n_batch=n_pp, n_ubatch=n_pp)
    prompt = [1] + [100 + 37 * i for i in range(n_pp - 1)]
    t_pp, t_tg = [], []
    for rep in range(reps + 1):          # round 0 compiles
        ctx.memory_clear()
        t0 = time.perf_counter()
        assert ctx.decode(llm.Batch(prompt)) == 0, ctx.last_error
        np.asarray(ctx.get_logits_ith(-1))
        if rep:
            t_pp.append(time.perf_counter() - t0)
        for k in range(n_tg if rep else 2):
            t0 = time.perf_counter()
            assert ctx.decode(llm.Batch.get_one([5 + k])) == 0, ctx.last_error
            if rep:
                t_tg.append(time.perf_counter() - t0)
    return {"pp_tok_s": n_pp / float(np.median(t_pp)), "tg_tok_s": 1.0 / float(np.median(t_tg)),
            "n_compiles": ctx.perf()["n_compiles"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--devices", default="1,2,4")
    a = ap.parse_args()
    counts = [int(x) for x in a.devices.split(",")]
    import jax

    import ggmlx
    ggmlx.init()
    jax.config.update("jax_num_cpu_devices", max(counts))
    import llm
    from llm import hub
    path = hub.resolve(a.model)
    rows = [("layer/1", llm.load_model(path, devices=[]))]
    rows += [(f"row/{n}", llm.load_model(path, devices=jax.devices("cpu")[:n], split_mode="row")) for n in counts]
    print(f"{'config':10} {'pp tok/s':>10} {'tg tok/s':>10} {'compiles':>9}")
    results = {}
    for name, model in rows:
        r = measure(model, a.pp, a.tg)
        results[name] = r
        print(f"{name:10} {r['pp_tok_s']:10.1f} {r['tg_tok_s']:10.1f} {r['n_compiles']:9d}", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
