"""Decode (tg) and prefill (pp) tok/s of each weight format on the real models, in one
process so the ratios are comparable on a noisy machine.

    .venv/bin/python benchmarks/bench_formats.py [-p 512] [-n 128] [-r 3] [MODEL ...]
"""
from __future__ import annotations

import argparse
import sys

from llm.cli.bench import bench_model

DEFAULT_MODELS = ["/tmp/models/smollm2-135m-instruct-q4_1.gguf", "/tmp/models/gemma-3-270m-q4_k_m.gguf"]
FORMATS = ("native", "int8", "int4", "f32")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    a = ap.parse_args(argv)
    print("| model | format | pp t/s | tg t/s | pp vs f32 | tg vs f32 | peak RSS MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for path in a.models:
        rows = {}
        for fmt in FORMATS:
            res = {r.test[:2]: r for r in bench_model(path, n_prompt=a.n_prompt, n_gen=a.n_gen, reps=a.reps,
                                                      weight_format=fmt)}
            rows[fmt] = res
        for fmt, res in rows.items():
            pp, tg = res["pp"].tok_s_median, res["tg"].tok_s_median
            print(f"| {path.rsplit('/', 1)[-1]} | {fmt} | {pp:.1f} | {tg:.1f} | "
                  f"{pp / rows['f32']['pp'].tok_s_median:.2f} | {tg / rows['f32']['tg'].tok_s_median:.2f} | "
                  f"{res['tg'].peak_rss_mib:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
