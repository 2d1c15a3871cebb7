"""Cold vs warm start: two fresh processes in a row share one empty XLA persistent cache;
each loads the model and generates its first token. The second traces the graphs again but
finds their executables on disk (issue target: first token within 2 s of model load).

    .venv/bin/python benchmarks/bench_warm_start.py [-m MODEL] [-p PROMPT]
"""
from __future__ import annotations

import argparse
import json
import os
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
                  "n_compiles": r.timings["n_compiles"]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-p", "--prompt", default="The capital of France is")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, GGMLX_CACHE_DIR=cache)
        env.pop("GGMLX_NO_PERSISTENT_CACHE", None)
        runs = []
        for label in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", CHILD, a.model, a.prompt], env=env,
                                 capture_output=True, text=True, check=True)
            runs.append((label, json.loads(out.stdout.strip().splitlines()[-1])))
    print(f"model {a.model}")
    print("| process | load s | load -> first token s | compile s | compiles |")
    print("|---|---:|---:|---:|---:|")
    for label, r in runs:
        print(f"| {label} | {r['load_s']:.2f} | {r['first_token_s']:.2f} | {r['compile_s']:.2f} | {r['n_compiles']} |")
    print(f"warm/cold first-token ratio: {runs[1][1]['first_token_s'] / runs[0][1]['first_token_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
