"""PPL and KLD of every quantization type, measured by this engine and by llama.cpp on the same files.

    .venv/bin/python benchmarks/bench_quant_types.py [--model smollm2-135m] [--types Q8_0,Q4_K_M,...]
        [--imatrix-chunks 8] [-t 2]

The model's F32 twin (its published weights dequantized) is the base. `llm quantize` makes each
type from it; the types llama-quantize refuses without an importance matrix (IMATRIX_TYPES) take
one from `llm imatrix` on tests/data/text/coriolanus.txt (chunks of 512). Every file is then
scored on tests/data/text/declaration.txt (chunks of 512, the second half of each scored) as
`llama-perplexity --kl-divergence` scores it, twice:

- ours: `llm perplexity`'s code on this engine's logits, against the base's distributions as
  this engine computes them;
- llama.cpp: llama-cpp-python's logits with llama-perplexity's defaults (weights as stored, so
  its CPU matmuls round activations to the weight type's vec_dot_type; F16 KV cache), against
  the base's distributions as llama.cpp computes them. It runs in a child process, all files
  in one; the chunks are the same tokens on both sides, BOS first where the model adds one.

Both sides store the base's log-probabilities in llama-perplexity's 16-bit format and score
with the same code (llm.research.perplexity.KLStats), so the columns differ only by the
engines' logits. Prints one markdown table per model (file size, PPL, mean KLD, same top-1).
Needs llama-cpp-python (pip install -e '.[compare]').
"""
from __future__ import annotations

import argparse
import io
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_imatrix_gradient import CALIBRATION, EVALUATION, N_CTX, summarize  # noqa: E402
from bench_imatrix_gradient import scores as ours  # noqa: E402

TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0",
         "IQ4_XS", "IQ4_NL", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "Q2_K",
         "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
# llama-quantize refuses these without an importance matrix (tensor_requires_imatrix)
IMATRIX_TYPES = frozenset({"Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"})


def _llamacpp_scores(base_path: str, paths: list[str], chunks: np.ndarray, bos: int | None,
                     threads: int) -> tuple[float, list[dict]]:
    """In the child: llama.cpp's base PPL, then each file's scores against llama.cpp's base."""
    import llama_cpp

    from llm.research import perplexity as ppl
    first = N_CTX // 2

    def logits_of(path: str):
        m = llama_cpp.Llama(model_path=path, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, logits_all=True,
                            verbose=False, n_threads=threads)
        for c in chunks:
            toks = c.copy()
            if bos is not None:
                toks[0] = bos
            m.reset()
            m.eval(toks.tolist())
            yield np.array(m.scores[first:N_CTX - 1], np.float32)
        m.close()

    base_rows, nll = [], []
    for c, logits in zip(chunks, logits_of(base_path), strict=True):
        base_rows.append(np.concatenate([ppl.quantize_log_probs(logits[r:r + 32])
                                         for r in range(0, len(logits), 32)]))
        nll.append(ppl.log_softmax_nll(logits, c[first + 1:]))
    base_ppl = math.exp(float(np.concatenate(nll).astype(np.float64).mean()))
    out = []
    for path in paths:
        st = ppl.KLStats()
        for c, rows, logits in zip(chunks, base_rows, logits_of(path), strict=True):
            st.add(logits, rows, c[first + 1:])
        out.append(summarize(st))
    return base_ppl, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a known model name (its F32 twin is the base)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--imatrix-chunks", type=int, default=8, help="calibration chunks of 512 tokens")
    ap.add_argument("-t", "--threads", type=int, default=2, help="llama.cpp's threads")
    a = ap.parse_args()
    import logging
    logging.getLogger("llm.quantize").setLevel(logging.ERROR)      # the per-model fallback warnings
    from llm import hub
    from llm.context import ContextParams
    from llm.imatrix import ImatrixParams, compute_imatrix
    from llm.model import load_model
    from llm.quantize import QuantizeParams, model_quantize, parse_ftype
    from llm.research import llamacpp_child
    from llm.research import perplexity as ppl
    from llm.research.diff_llamacpp import f32_twin_path
    llamacpp_child.require_llama_cpp()
    types = [t.strip().upper() for t in a.types.split(",")]
    twin = f32_twin_path(hub.pull(a.model))
    imatrix = None
    if IMATRIX_TYPES.intersection(types):
        t0 = time.perf_counter()
        model = load_model(twin)
        tokens = model.vocab.tokenize(CALIBRATION.read_text(), True, False)
        im = compute_imatrix(model, tokens, ImatrixParams(n_chunks=a.imatrix_chunks), ContextParams(n_ctx=N_CTX),
                             dataset=CALIBRATION.name)
        imatrix = im.values()
        del model
        log(f"imatrix: {im.chunk_count} chunks of {N_CTX}, {time.perf_counter() - t0:.0f} s")
    base, s = ours(twin, None)
    _, _, chunks = ppl.read_base_header(io.BytesIO(base))
    vocab = load_model(twin, vocab_only=True).vocab
    bos = vocab.bos if vocab.add_bos else None
    log(f"base (F32 twin): our PPL {s['ppl']:.4f}, {len(chunks)} chunks")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for t in types:
            out = Path(tmp) / f"{t}.gguf"
            t0 = time.perf_counter()
            model_quantize(twin, out, QuantizeParams(ftype=parse_ftype(t)[0],
                                                     imatrix=imatrix if t in IMATRIX_TYPES else None))
            t1 = time.perf_counter()
            _, r = ours(out, base)
            rows[t] = {"ours": r, "mib": out.stat().st_size / 2 ** 20}
            files.append(str(out))
            log(f"{t}: quantized in {t1 - t0:.1f} s, scored in {time.perf_counter() - t1:.1f} s: PPL {r['ppl']:.4f} "
                f"KLD {r['kld']:.5f}")
        t0 = time.perf_counter()
        base_ppl_lc, theirs = llamacpp_child.call(_llamacpp_scores, str(twin), files, chunks, bos, a.threads,
                                                  model_path=twin)
        log(f"llama.cpp scored {len(files) + 1} files in {time.perf_counter() - t0:.0f} s")
    print(f"\n{a.model}: F32 twin, {len(chunks)} chunks of {N_CTX} from {EVALUATION.name}\n")
    print("| type | imatrix | MiB | PPL ours | PPL llama.cpp | KLD ours | KLD llama.cpp | same top ours | "
          "same top llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    mib = twin.stat().st_size / 2 ** 20
    print(f"| F32 (base) | - | {mib:.0f} | {s['ppl']:.4f} | {base_ppl_lc:.4f} | - | - | - | - |")
    for t, lc in zip(types, theirs, strict=True):
        r, mib = rows[t]["ours"], rows[t]["mib"]
        print(f"| {t} | {'yes' if t in IMATRIX_TYPES else '-'} | {mib:.0f} | {r['ppl']:.4f} | {lc['ppl']:.4f} | "
              f"{r['kld']:.5f} ± {r['kld_unc']:.5f} | {lc['kld']:.5f} ± {lc['kld_unc']:.5f} | "
              f"{100 * r['same_top']:.2f} % | {100 * lc['same_top']:.2f} % |")
    return 0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
