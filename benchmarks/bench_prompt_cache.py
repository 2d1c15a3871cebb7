"""Time to first token for a long shared prefix: cold, warm in-process, warm from disk in a new process.

A ~1,500-token document is the shared prefix; each request appends a different question.
  cold            a fresh LLM without a prompt cache evaluates the whole prompt (run twice: the
                  first run includes compiling the prefill graphs, the second does not)
  warm in-process the same LLM after reset() (KV cleared) with prompt_cache=DIR: the prefix
                  comes back from the in-memory copy, only the question is evaluated (the
                  second such question is timed: the first compiles its ubatch shape)
  warm from disk  a new Python process with prompt_cache=DIR: the prefix is read from disk
                  (two processes one after the other: the first may compile shapes that the
                  persistent compilation cache then has for the second)
TTFT is measured from the call to the first token (model loading excluded).

    python benchmarks/bench_prompt_cache.py [--model smollm2-135m] [--prefix-tokens 1500]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llm  # noqa: E402
from llm import hub  # noqa: E402

DOC = ("The river town kept its records in a stone archive by the old bridge. Every spring the clerks "
       "copied the ledgers of grain, salt and timber, and every autumn they counted the boats that "
       "passed under the arches. ")


def prompt_for(m: llm.LLM, n_prefix: int, question: str) -> list[int]:
    doc = m.tokenize(DOC * (n_prefix // 30 + 2), add_special=True)[:n_prefix]
    return doc + m.tokenize(f"\nQuestion: {question}\nAnswer:", add_special=False)


def ttft(m: llm.LLM, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    for _ in m.stream(tokens, max_tokens=1, temperature=0.0):
        pass
    return time.perf_counter() - t0


def child(model: str, cache: str, n_prefix: int) -> None:
    m = llm.LLM(model, n_ctx=2048, prompt_cache=cache)
    tokens = prompt_for(m, n_prefix, "Who copied the ledgers?")
    t = ttft(m, tokens)
    print(json.dumps({"ttft": t, "hits": m.prompt_cache.hits, "n_prompt": len(tokens),
                      "n_p_eval": m.ctx.perf()["n_p_eval"], "n_compiles": m.ctx.perf()["n_compiles"]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.prefix_tokens)
        return
    model = str(hub.resolve(args.model))
    cache = tempfile.mkdtemp(prefix="prompt-cache-")
    rows = []

    cold = llm.LLM(model, n_ctx=2048)
    p1 = prompt_for(cold, args.prefix_tokens, "What did the clerks count?")
    rows.append(("cold, first run", ttft(cold, p1), len(p1), cold.ctx.perf()["n_p_eval"],
                 cold.ctx.perf()["n_compiles"]))
    cold.reset()
    n0, c0 = cold.ctx.perf()["n_p_eval"], cold.ctx.perf()["n_compiles"]
    rows.append(("cold, graphs compiled", ttft(cold, p1), len(p1), cold.ctx.perf()["n_p_eval"] - n0,
                 cold.ctx.perf()["n_compiles"] - c0))

    warm = llm.LLM(model, n_ctx=2048, prompt_cache=cache)
    ttft(warm, p1)                                   # fills the cache (memory and disk)
    for question in ("Where was the archive?", "Who kept the records?"):
        warm.reset()                                 # KV cleared: the prefix must come from the cache
        p2 = prompt_for(warm, args.prefix_tokens, question)
        n0 = warm.ctx.perf()["n_p_eval"]
        t = ttft(warm, p2)                           # the first question also compiles its ubatch shape
    rows.append(("warm in-process (memory)", t, len(p2), warm.ctx.perf()["n_p_eval"] - n0, 0))

    for run in ("first", "second"):                  # the first new process may still compile
        out = subprocess.run([sys.executable, __file__, "--child", model, cache, "--prefix-tokens",
                              str(args.prefix_tokens)], check=True, capture_output=True, text=True).stdout
        res = json.loads(out.strip().splitlines()[-1])
        assert res["hits"] == 1, res
        rows.append((f"warm from disk, {run} new process", res["ttft"], res["n_prompt"], res["n_p_eval"],
                     res["n_compiles"]))
    size = sum(p.stat().st_size for p in Path(cache).rglob("*.state"))

    print(f"model {Path(model).name}, prefix {args.prefix_tokens} tokens, cache entry {size / 2**20:.1f} MiB")
    print(f"{'case':34} {'TTFT s':>8} {'prompt':>7} {'evaluated':>10} {'compiles':>9}")
    for name, t, n, n_eval, n_comp in rows:
        print(f"{name:34} {t:8.3f} {n:7} {n_eval:10} {n_comp:9}")


if __name__ == "__main__":
    main()
