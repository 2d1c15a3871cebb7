"""Tokenizer throughput on about 1 MB of mixed English prose and Python code, for both models.

    python benchmarks/bench_tokenize.py [--mb 1.0] [--models smollm2-135m,gemma3-270m] [--parse-special]

The text is half English (the Python documentation topics shipped with the standard
library, `pydoc_data.topics`) and half code (standard-library sources), interleaved in
chunks of a few KB so that both kinds run through the special-token partitioning and the
word caches together. "cold" is the first call on a freshly loaded vocabulary (empty word
caches), "warm" the best of --repeats further calls. llama.cpp is not installed here, so
only absolute rates are reported.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import time

from ggmlx.gguf import GGUFReader
from llm import hub
from llm.loader import GGUFMeta
from llm.vocab import load_vocab

_CODE_MODULES = ("argparse", "collections", "email.message", "json.decoder", "logging",
                 "pathlib", "textwrap", "typing")


def mixed_text(n_bytes: int) -> str:
    """About n_bytes of UTF-8: English documentation and Python source, interleaved."""
    from pydoc_data.topics import topics
    prose = "\n\n".join(topics[k] for k in sorted(topics))
    code = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in _CODE_MODULES)
    chunk = 4096
    parts, size, i = [], 0, 0
    while size < n_bytes:
        for source in (prose, code):
            start = (i * chunk) % max(1, len(source) - chunk)
            piece = source[start:start + chunk]
            parts.append(piece)
            size += len(piece.encode())
        i += 1
    return "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1.0, help="size of the text in MB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--parse-special", action="store_true", help="also match control tokens")
    args = ap.parse_args()
    text = mixed_text(int(args.mb * 1e6))
    n_bytes = len(text.encode())
    print(f"text: {n_bytes / 1e6:.2f} MB, {len(text)} characters (English prose + Python code)")
    print(f"{'model':14} {'vocab':5} {'load s':>7} {'tokens':>8} {'cold s':>7} {'cold tok/s':>11} "
          f"{'warm s':>7} {'warm tok/s':>11} {'warm MB/s':>9}")
    for name in args.models.split(","):
        path = hub.locate(name)
        t0 = time.perf_counter()
        vocab = load_vocab(GGUFMeta(GGUFReader(path).kv, str(path)))
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = vocab.tokenize(text, add_special=True, parse_special=args.parse_special)
        t_cold = time.perf_counter() - t0
        t_warm = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            again = vocab.tokenize(text, add_special=True, parse_special=args.parse_special)
            t_warm = min(t_warm, time.perf_counter() - t0)
        assert again == ids
        n = len(ids)
        print(f"{name:14} {vocab.type.name:5} {t_load:7.2f} {n:8d} {t_cold:7.2f} {n / t_cold:11,.0f} "
              f"{t_warm:7.2f} {n / t_warm:11,.0f} {n_bytes / 1e6 / t_warm:9.2f}")


if __name__ == "__main__":
    main()
