"""How close each numerics mode comes to llama.cpp's own run of the same quantized file.

    .venv/bin/python benchmarks/numerics_agreement.py [-m smollm2-135m | --shape 1b] [-f FILE] [-c 512]
        [--chunks 4] [-t 2]

llama.cpp (llama-cpp-python, its defaults: the weights as stored, activations rounded to each
type's vec_dot_type, F16 KV cache) evaluates chunks of the text as llama-perplexity does (first
token BOS where the model adds one, the second half of each chunk scored); this engine
evaluates the same chunks with `numerics="exact"` and with `numerics="ggml"` (load_model), the
KV cache in F16 as llama.cpp's. Per mode, over every scored position: top-1 agreement with
llama.cpp, mean and max KL(llama.cpp || ours) in nats, and the perplexity beside llama.cpp's.
llama.cpp runs in a child process (a crash of it cannot take this one down); its logits come
back through .npy files, a chunk at a time.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402  benchmarks/shapes.py, beside this script

from llm import hub  # noqa: E402
from llm.context import Context  # noqa: E402
from llm.model import load_model  # noqa: E402
from llm.research import perplexity as ppl  # noqa: E402


def _llamacpp_logits(path: str, chunks: np.ndarray, bos: int | None, threads: int, out_dir: str) -> None:
    """In the child: each chunk's scored logits as out_dir/<i>.npy."""
    import llama_cpp
    n_ctx = chunks.shape[1]
    first = n_ctx // 2
    m = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                        verbose=False, n_threads=threads)
    for i, c in enumerate(chunks):
        toks = c.copy()
        if bos is not None:
            toks[0] = bos
        m.reset()
        m.eval(toks.tolist())
        np.save(Path(out_dir) / f"{i}.npy", np.array(m.scores[first:n_ctx - 1], np.float32))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--shape", choices=sorted(shapes.SHAPES), default=None,
                    help="instead of -m: benchmarks/shapes.py's random-weight Q4_K_M llama of this shape")
    ap.add_argument("-f", "--file", default=str(ROOT / "tests" / "data" / "text" / "declaration.txt"))
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    path = str(shapes.build(a.shape, a.threads) if a.shape else hub.resolve(a.model))
    vocab = load_model(path, vocab_only=True).vocab
    chunks = ppl.chunk_tokens(vocab.tokenize(Path(a.file).read_text(encoding="utf-8"), True, False),
                              a.ctx_size, a.chunks)
    bos = vocab.bos if vocab.add_bos else None
    first = a.ctx_size // 2
    with tempfile.TemporaryDirectory() as tmp:
        child = multiprocessing.get_context("spawn").Process(
            target=_llamacpp_logits, args=(path, chunks, bos, a.threads, tmp))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"llama.cpp's child process failed (exit code {child.exitcode})")
        ref = [_log_softmax(np.load(Path(tmp) / f"{i}.npy")) for i in range(len(chunks))]
    ref_nll = np.concatenate([-lp[np.arange(len(lp)), c[first + 1:]] for lp, c in zip(ref, chunks, strict=True)])
    print(f"model {Path(path).name}, file {Path(a.file).name}, {len(chunks)} chunks of {a.ctx_size} "
          f"({len(ref_nll)} scored positions); llama.cpp PPL {math.exp(ref_nll.mean()):.4f}")
    print("| numerics | top-1 agreement | mean KL | max KL | PPL | PPL vs llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|")
    for numerics in ("exact", "ggml"):
        model = load_model(path, numerics=numerics)
        ctx = Context(model, n_ctx=a.ctx_size, n_batch=a.ctx_size, n_ubatch=a.ctx_size, type_k="f16", type_v="f16")
        agree, kls, nll = [], [], []

        def on_logits(i: int, logits: np.ndarray, agree=agree, kls=kls, nll=nll) -> None:
            lp = _log_softmax(logits)
            agree.append(lp.argmax(-1) == ref[i].argmax(-1))
            kls.append((np.exp(ref[i]) * (ref[i] - lp)).sum(-1))
            nll.append(-lp[np.arange(len(lp)), chunks[i][first + 1:]])

        ppl.chunk_logits(ctx, chunks, bos, a.ctx_size, on_logits)
        kl = np.concatenate(kls)
        p = math.exp(np.concatenate(nll).mean())
        print(f"| {numerics} | {np.concatenate(agree).mean():.4f} | {kl.mean():.3g} | {kl.max():.3g} | {p:.4f} "
              f"| {100 * (p / math.exp(ref_nll.mean()) - 1):+.2f}% |")
        del ctx, model
    return 0


if __name__ == "__main__":
    sys.exit(main())
