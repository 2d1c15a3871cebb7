"""split_mode="row" over 1, 2 and 4 simulated CPU devices: prefill and decode tok/s side by
side in one run (rounds interleaved over the configs, medians), for each RowPlan choice,
with the collectives of the compiled prefill and decode programs (count and bytes per
step, read from the optimized HLO). The devices share this machine's cores, so the tok/s
measure the overhead of the SPMD program (collectives, per-device launches), not a
speed-up; the collective bytes are what a real interconnect would carry. "layer/1" is the
plain one-device model for reference.

    .venv/bin/python benchmarks/bench_row_split.py [-m MODEL] [--pp 64] [--tg 32] [--devices 1,2,4]
        [--plans gather/rows,pad/rows,gather/cols] [--rounds 5]

A plan is UNEVEN_HEADS/VOCAB (llm.RowPlan); a plan that the model cannot serve on a device
count (a column split that cuts a quant block) is reported and skipped.
"""
from __future__ import annotations

import argparse
import json
import re
import time

# the result type of an HLO collective: one shape or a tuple of them
_COLLECTIVE = re.compile(r"= (\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?) "
                         r"(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def collectives(hlo: str) -> dict:
    """Collectives of one optimized HLO module: count and result bytes by kind (an
    all-gather's result is the gathered array; an all-reduce's, the reduced one)."""
    out: dict[str, list[int]] = {}
    for m in _COLLECTIVE.finditer(hlo):
        nbytes = 0
        for dt, dims in _SHAPE.findall(m.group(1)):
            size = 1
            for d in filter(None, dims.split(",")):
                size *= int(d)
            nbytes += size * _BYTES.get(dt, 4)
        c = out.setdefault(m.group(2), [0, 0])
        c[0] += 1
        c[1] += nbytes
    return {k: {"n": v[0], "bytes": v[1]} for k, v in out.items()}


def _summary(c: dict) -> str:
    return " ".join(f"{k.replace('all-', 'a')}:{v['n']}/{v['bytes'] / 1024:.1f}K" for k, v in sorted(c.items())) or "-"


class Runner:
    """One model's context: `warm` compiles the prefill and decode programs (and reads their
    collectives), `round` times one prefill of n_pp tokens and n_tg single-token steps."""

    def __init__(self, model, n_pp: int, n_tg: int):
        import llm
        self.ctx = llm.Context(model, n_ctx=256, n_batch=n_pp, n_ubatch=n_pp)
        self.prompt = [1] + [100 + 37 * i for i in range(n_pp - 1)]
        self.n_tg = n_tg
        self.t_pp: list[float] = []
        self.t_tg: list[float] = []
        self.collectives: dict[str, dict] = {}
        self.n_warm_compiles = 0

    def warm(self) -> None:
        from ggmlx.compile import get_default_cache
        cache = get_default_cache()
        seen = {p.key for p in cache.programs()}
        self._prefill()
        self.collectives["pp"] = _collectives_of(cache, seen)
        seen = {p.key for p in cache.programs()}
        self._step(0)
        self.collectives["tg"] = _collectives_of(cache, seen)
        self._step(1)
        self.n_warm_compiles = self.ctx.perf()["n_compiles"]

    def _prefill(self) -> float:
        import numpy as np

        import llm
        self.ctx.memory_clear()
        t0 = time.perf_counter()
        assert self.ctx.decode(llm.Batch(self.prompt)) == 0, self.ctx.last_error
        np.asarray(self.ctx.get_logits_ith(-1))
        return time.perf_counter() - t0

    def _step(self, k: int) -> float:
        import llm
        t0 = time.perf_counter()
        assert self.ctx.decode(llm.Batch.get_one([5 + k])) == 0, self.ctx.last_error
        return time.perf_counter() - t0

    def round(self) -> None:
        self.t_pp.append(self._prefill())
        self.t_tg += [self._step(k) for k in range(self.n_tg)]

    def result(self) -> dict:
        import numpy as np
        return {"pp_tok_s": len(self.prompt) / float(np.median(self.t_pp)),
                "tg_tok_s": 1.0 / float(np.median(self.t_tg)),
                "n_compiles_after_warm": self.ctx.perf()["n_compiles"] - self.n_warm_compiles,
                "collectives": self.collectives}


def _collectives_of(cache, seen: set[str]) -> dict:
    """The collectives of the programs compiled since `seen` (summed)."""
    total: dict[str, dict] = {}
    for p in cache.programs():
        if p.key in seen:
            continue
        for k, v in collectives(p.executable.as_text()).items():
            t = total.setdefault(k, {"n": 0, "bytes": 0})
            t["n"] += v["n"]
            t["bytes"] += v["bytes"]
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--devices", default="1,2,4")
    ap.add_argument("--plans", default="gather/rows")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    counts = [int(x) for x in a.devices.split(",")]
    import jax

    import ggmlx
    ggmlx.init()
    jax.config.update("jax_num_cpu_devices", max(counts))
    import llm
    from llm import hub
    path = hub.resolve(a.model)
    plans = [tuple(p.split("/")) for p in a.plans.split(",")]
    rows = [("layer/1", lambda: llm.load_model(path, devices=[]))]
    for n in counts:
        for heads, vocab in plans:
            rows.append((f"row/{n} {heads}/{vocab}",
                         lambda n=n, heads=heads, vocab=vocab: llm.load_model(
                             path, devices=jax.devices("cpu")[:n], split_mode="row",
                             row_plan=llm.RowPlan(uneven_heads=heads, vocab=vocab))))
    runners: dict[str, Runner] = {}
    for name, load in rows:
        try:
            runners[name] = Runner(load(), a.pp, a.tg)
        except llm.ModelLoadError as e:
            print(f"{name:22} cannot: {str(e).split(': ', 2)[-1]}", flush=True)
            continue
        runners[name].warm()
    # rounds interleave the configs, so a change in the shared machine's load hits them all
    for _ in range(a.rounds):
        for r in runners.values():
            r.round()
    print(f"{'config':22} {'pp tok/s':>9} {'tg tok/s':>9} {'compiles':>8}  collectives per prefill  |  per decode step "
          "(kind:count/KiB)")
    results = {}
    for name, r in runners.items():
        res = results[name] = r.result()
        c = res["collectives"]
        print(f"{name:22} {res['pp_tok_s']:9.1f} {res['tg_tok_s']:9.1f} {res['n_compiles_after_warm']:8d}  "
              f"{_summary(c['pp'])}  |  {_summary(c['tg'])}", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
