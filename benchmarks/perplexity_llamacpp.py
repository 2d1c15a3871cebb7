"""Perplexity here and in llama.cpp on the same file and chunks, side by side.

Usage: python benchmarks/perplexity_llamacpp.py [-m smollm2-135m] [-f tests/data/text/declaration.txt]
                                                [-c 512] [--write-reference]

llama.cpp's logits come through llama-cpp-python (each chunk evaluated from an empty cache,
first token replaced by BOS, logits of every position) and are scored by llama-perplexity's
rule (llm.perplexity.log_softmax_nll on the second half of each chunk), the same rule our
`python -m llm perplexity` applies to our logits. --write-reference stores llama.cpp's
per-chunk numbers in tests/data/perplexity/ for the suite (which then needs no llama.cpp).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from llm import hub
from llm import perplexity as ppl
from llm.context import Context
from llm.model import load_model

ROOT = Path(__file__).resolve().parents[1]


def llamacpp_nll(path: str, text: str, n_ctx: int, n_chunks: int) -> tuple[list[int], np.ndarray]:
    import llama_cpp
    m = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                        verbose=False, n_threads=2)
    tokens = m.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    chunks = ppl.chunk_tokens(tokens, n_ctx, n_chunks)
    add_bos = load_model(path, vocab_only=True).vocab.add_bos     # the same file: the same flag
    first = n_ctx // 2
    out = []
    for c in chunks:
        toks = c.copy()
        if add_bos:
            toks[0] = m.token_bos()
        m.reset()
        m.eval(toks.tolist())
        logits = np.asarray(m.scores[:n_ctx], np.float32)
        out.append(ppl.log_softmax_nll(logits[first:n_ctx - 1], c[first + 1:]))
    return tokens, np.stack(out)


def ours_nll(path: str, text: str, n_ctx: int, n_chunks: int, n_batch: int) -> tuple[list[int], np.ndarray]:
    model = load_model(path)
    n_seq = max(1, n_batch // n_ctx)
    ctx = Context(model, n_ctx=n_seq * n_ctx, n_batch=n_seq * n_ctx, n_ubatch=min(512, n_seq * n_ctx),
                  n_seq_max=n_seq, kv_bucket=n_seq * n_ctx)
    tokens = model.vocab.tokenize(text, True, False)
    chunks = ppl.chunk_tokens(tokens, n_ctx, n_chunks)
    bos = model.vocab.bos if model.vocab.add_bos else None
    res = ppl.perplexity(ctx, chunks, bos, n_seq * n_ctx)
    return tokens, res.nll.reshape(len(chunks), -1)


def running_ppl(nll: np.ndarray) -> list[float]:
    flat_counts = np.cumsum([len(r) for r in nll])
    sums = np.cumsum([r.sum() for r in nll])
    return [math.exp(s / n) for s, n in zip(sums, flat_counts, strict=True)]


def final(nll: np.ndarray) -> tuple[float, float]:
    x = nll.reshape(-1).astype(np.float64)
    mean = x.mean()
    var = (x * x).mean() - mean * mean
    p = math.exp(mean)
    return p, math.sqrt(var / (len(x) - 1)) * p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-f", "--file", default=str(ROOT / "tests" / "data" / "text" / "declaration.txt"))
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-b", "--batch-size", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=-1)
    ap.add_argument("--write-reference", action="store_true")
    a = ap.parse_args()
    path = str(hub.resolve(a.model))
    text = Path(a.file).read_text(encoding="utf-8")
    t0 = time.perf_counter()
    ref_tokens, ref = llamacpp_nll(path, text, a.ctx_size, a.chunks)
    t1 = time.perf_counter()
    our_tokens, ours = ours_nll(path, text, a.ctx_size, a.chunks, a.batch_size)
    t2 = time.perf_counter()
    print(f"model {Path(path).name}, file {Path(a.file).name}, -c {a.ctx_size}: {len(ours)} chunks "
          f"(llama.cpp {t1 - t0:.0f} s, ours {t2 - t1:.0f} s)")
    print(f"tokens identical: {ref_tokens == our_tokens} ({len(our_tokens)} here, {len(ref_tokens)} in llama.cpp)")
    print("chunk   llama.cpp      ours")
    for i, (r, o) in enumerate(zip(running_ppl(ref), running_ppl(ours), strict=True)):
        print(f"[{i + 1}]  {r:10.4f}  {o:10.4f}")
    (pr, ur), (po, uo) = final(ref), final(ours)
    print(f"llama.cpp: Final estimate: PPL = {pr:.4f} +/- {ur:.5f}")
    print(f"ours:      Final estimate: PPL = {po:.4f} +/- {uo:.5f}")
    print(f"relative difference {abs(po / pr - 1) * 100:.3f}% (llama.cpp's uncertainty {ur / pr * 100:.2f}%); "
          f"per-token |dNLL| max {np.abs(ours - ref).max():.4f}, mean {np.abs(ours - ref).mean():.5f}")
    if a.write_reference:
        out = ROOT / "tests" / "data" / "perplexity" / f"{Path(path).stem.lower()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "model": Path(path).name, "file": Path(a.file).name, "n_ctx": a.ctx_size, "n_chunks": len(ref),
            "source": "llama.cpp logits via llama-cpp-python, scored by llama-perplexity's rule "
                      "(benchmarks/perplexity_llamacpp.py --write-reference)",
            "chunk_ppl": [round(x, 6) for x in running_ppl(ref)], "ppl": round(pr, 6), "uncertainty": round(ur, 6),
        }, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
