"""Prompt-lookup speculative decoding, ours and llama-cpp-python's, side by side: greedy
tokens per second with and without it on a repetitive task (quoting a code block back) and
on free text, our acceptance rate, and whether our output is token-identical to plain
decoding. Each engine runs in its own subprocess per repetition, alternating.

    python benchmarks/bench_speculative.py [-m smollm2-135m] [-n 128] [-r 2] [-t 2]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

from llm import hub

CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
TASKS = {
    "repetitive": f"Here is a Python function:\n\n{CODE}\nRewrite it with the variable `out` renamed to "
                  f"`result`, keeping everything else the same:\n\n",
    "free text": "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n",
}


def _ours(model: str, n_gen: int, threads: int) -> dict:
    import llm
    m = llm.LLM(model, n_ctx=2048)
    res = {}
    for task, prompt in TASKS.items():
        for mode in ("plain", "lookup"):
            spec = "prompt-lookup" if mode == "lookup" else None
            m.generate(prompt, max_tokens=n_gen, temperature=0.0, speculative=spec)          # warm-up, compiles
            t0 = time.perf_counter()
            c = m.generate(prompt, max_tokens=n_gen, temperature=0.0, speculative=spec)
            dt = time.perf_counter() - t0
            res[f"{task}|{mode}"] = {"tok_s": len(c.tokens) / dt, "tokens": c.tokens,
                                     "drafted": c.timings.get("spec_drafted", 0),
                                     "accepted": c.timings.get("spec_accepted", 0)}
    return res


def _llama_cpp(model: str, n_gen: int, threads: int) -> dict:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    res = {}
    for mode in ("plain", "lookup"):
        draft = LlamaPromptLookupDecoding() if mode == "lookup" else None
        m = llama_cpp.Llama(model_path=model, n_ctx=2048, n_threads=threads, verbose=False, draft_model=draft)
        for task, prompt in TASKS.items():
            m.create_completion(prompt, max_tokens=n_gen, temperature=0.0)                # warm-up, caches prompt
            t0 = time.perf_counter()
            out = m.create_completion(prompt, max_tokens=n_gen, temperature=0.0)
            dt = time.perf_counter() - t0
            res[f"{task}|{mode}"] = {"tok_s": out["usage"]["completion_tokens"] / dt}
    return res


ENGINES = {"ggmlx": _ours, "llama.cpp": _llama_cpp}


def _run_child(engine: str, a) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    cmd = [sys.executable, __file__, "--child", engine, a.model, str(a.n_gen), str(a.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)
    a.model = str(hub.resolve(a.model))
    engines = ["ggmlx"] + (["llama.cpp"] if importlib.util.find_spec("llama_cpp") else [])
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(a.reps):
        for e in engines:
            runs[e].append(_run_child(e, a))
    print(f"model {a.model}  greedy, {a.n_gen} tokens, threads {a.threads}, reps {a.reps} (median tok/s)")
    print("| task | engine | plain tok/s | prompt-lookup tok/s | speed-up | acceptance | identical |")
    print("|---|---|---:|---:|---:|---:|---|")
    for task in TASKS:
        for e in engines:
            plain = statistics.median(r[f"{task}|plain"]["tok_s"] for r in runs[e])
            look = statistics.median(r[f"{task}|lookup"]["tok_s"] for r in runs[e])
            acc, same = "", ""
            if e == "ggmlx":
                r0 = runs[e][0]
                lk = r0[f"{task}|lookup"]
                acc = f"{lk['accepted']}/{lk['drafted']} = {lk['accepted'] / max(lk['drafted'], 1):.0%}"
                same = str(all(r[f"{task}|lookup"]["tokens"] == r[f"{task}|plain"]["tokens"] for r in runs[e]))
            print(f"| {task} | {e} | {plain:.1f} | {look:.1f} | {look / plain:.2f}x | {acc} | {same} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(ENGINES[sys.argv[2]](sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
    else:
        sys.exit(main())
