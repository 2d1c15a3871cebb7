"""Cold vs warm start: fresh processes in a row share one empty cache folder; each loads the
model and generates its first token. The first compiles; the later (warm) ones load their
executables from the executable cache (cache_root()/exe), with no tracing or lowering; the
median of the warm runs is printed (issue 15 target: first token within 1 s of model load).

    .venv/bin/python benchmarks/bench_warm_start.py [-m MODEL] [-p PROMPT] [-r WARM_RUNS]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import llm
m = llm.LLM(sys.argv[1], n_ctx=512)
t1 = time.perf_counter()
r = m.generate(sys.argv[2], max_tokens=1, temperature=0.0)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "first_token_s": t2 - t1, "compile_s": r.timings["compile_s"],
                  "n_compiles": r.timings["n_compiles"], "disk_hits": m.ctx.sched.cache.stats.disk_hits}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-p", "--prompt", default="The capital of France is")
    ap.add_argument("-r", "--reps", type=int, default=3, help="warm processes (the median is reported)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, GGMLX_CACHE_DIR=cache)
        env.pop("GGMLX_NO_PERSISTENT_CACHE", None)
        runs = []
        for label in ["cold"] + [f"warm {i + 1}" for i in range(a.reps)]:
            out = subprocess.run([sys.executable, "-c", CHILD, a.model, a.prompt], env=env,
                                 capture_output=True, text=True, check=True)
            runs.append((label, json.loads(out.stdout.strip().splitlines()[-1])))
    print(f"model {a.model}")
    print("| process | load s | load -> first token s | compile s | graphs | from the executable cache |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in runs:
        print(f"| {label} | {r['load_s']:.2f} | {r['first_token_s']:.2f} | {r['compile_s']:.2f} | "
              f"{r['n_compiles']} | {r['disk_hits']} |")
    warm = statistics.median(r["first_token_s"] for _, r in runs[1:])
    load = statistics.median(r["load_s"] for _, r in runs[1:])
    print(f"warm median: load {load:.2f} s, load -> first token {warm:.2f} s "
          f"(warm/cold first-token ratio {warm / runs[0][1]['first_token_s']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
