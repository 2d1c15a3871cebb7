"""What the gradient-weighted importance matrix buys: PPL and KLD at low-bit types.

    .venv/bin/python benchmarks/bench_imatrix_gradient.py [--model smollm2-135m] [--chunks 8]
        [--types Q2_K,Q3_K_M,IQ3_S]

The model's F32 twin (SmolLM2-135M's Q4_1 weights, or Gemma3-270M's, dequantized) is the base.
Two matrices are computed on the calibration text tests/data/text/coriolanus.txt (chunks of
512): llm imatrix's activation matrix (llama-imatrix's statistic) and `--gradient`'s
Fisher-weighted one. The base is quantized with each (llm quantize, llama-quantize's bytes for
a given matrix) and scored on another text, tests/data/text/declaration.txt, by
`llm perplexity --kl-divergence` against the base's distributions (chunks of 512, the second
half of each scored). Prints a markdown table, with the gradient matrix's per-token KLD minus
the activation matrix's on the same tokens (paired).
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

CALIBRATION = ROOT / "tests" / "data" / "text" / "coriolanus.txt"
EVALUATION = ROOT / "tests" / "data" / "text" / "declaration.txt"
N_CTX = 512


def summarize(st) -> dict:
    """{ppl, kld, kld_tokens, kld_unc, same_top} of a KLStats."""
    nll, kld = np.concatenate(st.nll), np.concatenate(st.kld)
    return {"ppl": math.exp(nll.mean()), "kld": float(kld.mean()), "kld_tokens": kld,
            "kld_unc": float(kld.std() / math.sqrt(len(kld) - 1)), "same_top": st.same_top / st.count}


def scores(path: Path, base: bytes | None) -> tuple[bytes, dict]:
    """(the KL base file of path's model, {ppl, kld, same_top}) over the evaluation text, by this
    engine; base None computes the base file (and the PPL) instead of the KLD against it."""
    from llm.context import Context
    from llm.model import load_model
    from llm.research import perplexity as ppl
    model = load_model(path)
    ctx = Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, kv_bucket=N_CTX)
    bos = model.vocab.bos if model.vocab.add_bos else None
    if base is None:
        chunks = ppl.chunk_tokens(model.vocab.tokenize(EVALUATION.read_text(), True, False), N_CTX)
        out = io.BytesIO()
        res = ppl.perplexity(ctx, chunks, bos, N_CTX, base_out=out)
        return out.getvalue(), {"ppl": res.ppl}
    return base, summarize(ppl.kl_divergence(ctx, io.BytesIO(base), bos, N_CTX))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="calibration chunks of 512 tokens")
    ap.add_argument("--types", default="Q2_K,Q3_K_M,IQ3_S")
    ap.add_argument("--model", default="smollm2-135m", help="a known model name (its F32 twin is the base)")
    a = ap.parse_args()
    from llm import hub
    from llm.context import ContextParams
    from llm.imatrix import ImatrixParams, compute_imatrix
    from llm.model import load_model
    from llm.quantize import QuantizeParams, model_quantize, parse_ftype
    from llm.research.diff_llamacpp import f32_twin_path
    twin = f32_twin_path(hub.pull(a.model))
    model = load_model(twin)
    tokens = model.vocab.tokenize(CALIBRATION.read_text(), True, False)
    matrices = {}
    for kind, gradient in (("activation", False), ("gradient", True)):
        t0 = time.perf_counter()
        im = compute_imatrix(model, tokens, ImatrixParams(n_chunks=a.chunks, gradient=gradient),
                             ContextParams(n_ctx=N_CTX), dataset=CALIBRATION.name)
        matrices[kind] = im.values()
        print(f"{kind} matrix: {len(im.sums)} entries, {im.chunk_count} chunks, {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    del model
    base, s = scores(twin, None)
    rows = [f"| F32 (base) | - | {s['ppl']:.4f} | - | - | - |"]
    print(f"base PPL {s['ppl']:.4f}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for t in a.types.split(","):
            kld_act = None
            for kind, values in matrices.items():
                out = Path(tmp) / f"{t}-{kind}.gguf"
                model_quantize(twin, out, QuantizeParams(ftype=parse_ftype(t)[0], imatrix=values))
                _, r = scores(out, base)
                out.unlink()
                paired = "-"
                if kld_act is None:
                    kld_act = r["kld_tokens"]
                else:       # the same tokens: the per-token difference and its standard error
                    d = r["kld_tokens"] - kld_act
                    paired = f"{d.mean():+.5f} ± {d.std() / math.sqrt(len(d) - 1):.5f}"
                rows.append(f"| {t} | {kind} | {r['ppl']:.4f} | {r['kld']:.5f} ± {r['kld_unc']:.5f} | {paired} | "
                            f"{100 * r['same_top']:.2f} % |")
                print(rows[-1], file=sys.stderr, flush=True)
    print(f"{a.model}\n\n| type | imatrix | PPL | KLD | KLD - activation's (paired) | same top |\n"
          "|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
