"""Perplexity here and in llama.cpp on the same file and chunks, side by side.

Usage: python benchmarks/perplexity_llamacpp.py [-m smollm2-135m] [-f tests/data/text/declaration.txt]
                                                [-c 512] [--chunks N] [--no-f32] [--write-reference]

llama.cpp's logits come through llama-cpp-python (each chunk evaluated from an empty cache,
first token replaced by BOS when the model adds one, logits of every position) and are scored
by llama-perplexity's rule (llm.perplexity.log_softmax_nll on the second half of each chunk),
the same rule our `python -m llm perplexity` applies to our logits.

Two llama.cpp columns:
- `llama.cpp`: its defaults, as llama-perplexity runs them (weights as stored, so the CPU
  matmuls round the activations to Q8 blocks; F16 KV cache; flash attention).
- `llama.cpp f32`: the same weights dequantized to F32 by llama.cpp itself
  (llama_model_quantize to ALL_F32), F32 KV cache, no flash attention: exact arithmetic on
  the same model, which is what we compute. The gap between the two llama.cpp columns is
  llama.cpp's own rounding noise on this model.

--write-reference stores both llama.cpp columns in tests/data/perplexity/ for the suite (which
then needs no llama.cpp).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from llm import hub
from llm.context import Context
from llm.model import load_model
from llm.research import perplexity as ppl

ROOT = Path(__file__).resolve().parents[1]


def dequantize_to_f32(src: str, dst: str, threads: int) -> None:
    """llama.cpp's own F32 copy of a GGUF (every tensor, the token embedding included)."""
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    p.allow_requantize = True
    p.pure = True
    p.quantize_output_tensor = True
    p.nthread = threads
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama_model_quantize could not write an F32 copy of {src}")


def llamacpp_nll(path: str, text: str, n_ctx: int, n_chunks: int, threads: int,
                 exact: bool = False) -> tuple[list[int], np.ndarray]:
    """Per-chunk NLL of the scored positions; exact: F32 KV cache and no flash attention."""
    import llama_cpp
    kw: dict = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False) if exact else {}
    m = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                        verbose=False, n_threads=threads, **kw)
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
        logits = np.array(m.scores[first:n_ctx - 1], np.float32)
        out.append(ppl.log_softmax_nll(logits, c[first + 1:]))
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


def summary(nll: np.ndarray, settings: str) -> dict:
    p, u = final(nll)
    return {"settings": settings, "chunk_ppl": [round(x, 6) for x in running_ppl(nll)], "ppl": round(p, 6),
            "uncertainty": round(u, 6)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-f", "--file", default=str(ROOT / "tests" / "data" / "text" / "declaration.txt"))
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-b", "--batch-size", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=-1)
    ap.add_argument("--no-f32", action="store_true", help="skip llama.cpp's exact F32 evaluation")
    ap.add_argument("--write-reference", action="store_true")
    a = ap.parse_args()
    path = str(hub.resolve(a.model))
    text = Path(a.file).read_text(encoding="utf-8")
    t0 = time.perf_counter()
    ref_tokens, ref = llamacpp_nll(path, text, a.ctx_size, a.chunks, a.threads)
    t1 = time.perf_counter()
    cols = {"llama.cpp": ref}
    if not a.no_f32:
        with tempfile.TemporaryDirectory() as tmp:
            f32 = str(Path(tmp) / "f32.gguf")
            dequantize_to_f32(path, f32, a.threads)
            cols["llama.cpp f32"] = llamacpp_nll(f32, text, a.ctx_size, a.chunks, a.threads, exact=True)[1]
    t2 = time.perf_counter()
    our_tokens, ours = ours_nll(path, text, a.ctx_size, a.chunks, a.batch_size)
    t3 = time.perf_counter()
    cols["ours"] = ours
    print(f"model {Path(path).name}, file {Path(a.file).name}, -c {a.ctx_size}, -b {a.batch_size}: {len(ours)} chunks "
          f"(llama.cpp {t1 - t0:.0f} s, llama.cpp f32 {t2 - t1:.0f} s, ours {t3 - t2:.0f} s)")
    print(f"tokens identical: {ref_tokens == our_tokens} ({len(our_tokens)} here, {len(ref_tokens)} in llama.cpp)")
    print("chunk " + "".join(f"{k:>15}" for k in cols))
    running = [running_ppl(v) for v in cols.values()]
    for i, row in enumerate(zip(*running, strict=True)):
        print(f"[{i + 1}]   " + "".join(f"{v:15.4f}" for v in row))
    for k, v in cols.items():
        p, u = final(v)
        print(f"{k + ':':15}Final estimate: PPL = {p:.4f} +/- {u:.5f}")
    pr = final(ref)[0]
    for k, v in cols.items():
        if k != "llama.cpp":
            print(f"{k} vs llama.cpp: PPL {(final(v)[0] / pr - 1) * 100:+.3f}%, per-token |dNLL| max "
                  f"{np.abs(v - ref).max():.4f}, mean {np.abs(v - ref).mean():.5f}")
    if "llama.cpp f32" in cols:
        x = cols["llama.cpp f32"]
        print(f"ours vs llama.cpp f32: PPL {(final(ours)[0] / final(x)[0] - 1) * 100:+.5f}%, per-token |dNLL| max "
              f"{np.abs(ours - x).max():.6f}, mean {np.abs(ours - x).mean():.7f}")
    if a.write_reference:
        if "llama.cpp f32" not in cols:
            raise SystemExit("--write-reference needs llama.cpp's F32 column (drop --no-f32)")
        out = ROOT / "tests" / "data" / "perplexity" / f"{Path(path).stem.lower()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "model": Path(path).name, "file": Path(a.file).name, "n_ctx": a.ctx_size, "n_chunks": len(ref),
            "n_tokens": len(ref_tokens),
            "source": "llama.cpp logits via llama-cpp-python, scored by llama-perplexity's rule "
                      "(benchmarks/perplexity_llamacpp.py --write-reference)",
            "llamacpp": summary(ref, "llama.cpp defaults: weights as stored (Q8 activations in the CPU matmuls), "
                                     "F16 KV cache, flash attention"),
            "llamacpp_f32": summary(cols["llama.cpp f32"], "the same weights dequantized to F32 by llama.cpp "
                                                           "(llama_model_quantize ALL_F32), F32 KV cache, "
                                                           "no flash attention"),
        }, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
