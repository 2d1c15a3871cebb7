"""Print the logits-parity table of llm.Context against the full llama.cpp reference.

Usage: python benchmarks/parity_report.py [--reference DIR]   (default: $GGMLX_REFERENCE or ../shared/reference)
                                          [--weight-format auto] [--only real|synthetic]

Real models (reference/logits, every case): prompt_ids then the twin's greedy ids are fed in
decode calls of 17-32 tokens (as tests/test_decode_parity.py does), and compared with
- the dequantized-F32 twin (llama.cpp's exact-math run): max |diff| of the last-position
  logits over the whole vocabulary, of the top-20 values at every prompt position, top-1
  agreement over prompt positions, teacher-forced greedy steps equal to the twin's;
- llama.cpp itself: top-1 agreement over prompt positions and max |diff| at the last one.
Synthetic models (reference/synthetic, every model of an architecture we load): all 24
positions against the twin (`logits_dequant_f32`, or `logits_f32kv_noflash` for F32 models)
and against llama.cpp's main logits.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import llm
from ggmlx import flags
from llm import hub
from llm.models import registered_archs

CHUNK = 32
TIE = 1e-2
MODEL_NAMES = {"smollm2-135m-instruct-q4_1.gguf": "smollm2-135m", "gemma-3-270m-q4_k_m.gguf": "gemma3-270m"}


def decode_chunked(ctx: llm.Context, tokens: np.ndarray) -> np.ndarray:
    """Logits of every token, fed as decode calls of 17..32 tokens (one graph shape)."""
    rows = []
    for part in np.array_split(np.asarray(tokens, np.int32), -(-len(tokens) // CHUNK)):
        ret = ctx.decode(llm.Batch(part, logits=np.ones(len(part), bool)))
        if ret != 0:
            raise RuntimeError(f"decode returned {ret}: {ctx.last_error}")
        rows.append(ctx.get_logits().copy())
    return np.concatenate(rows)


def real_cases(ref_dir: Path, weight_format: str) -> None:
    index = json.loads((ref_dir / "logits" / "index.json").read_text())
    print(f"{'case':44} {'T':>4} {'last/twin':>10} {'top20/twin':>10} {'top1=twin':>9} "
          f"{'greedy':>7} {'top1=cpp':>8} {'last/cpp':>8}")
    by_model: dict[str, list] = {}
    for case in index["cases"]:
        by_model.setdefault(case["model_file"], []).append(case)
    for model_file, cases in by_model.items():
        t0 = time.perf_counter()
        model = llm.load_model(hub.pull(MODEL_NAMES[model_file]), weight_format=weight_format)
        ctx = llm.Context(model, n_ctx=256, n_batch=CHUNK, n_ubatch=CHUNK, kv_bucket=256)
        hits = total = 0
        for case in cases:
            z = np.load(ref_dir / "logits" / Path(case["file"]).name)
            prompt, gen = z["prompt_ids"], z["gen_ids_dequant_f32"]
            n = len(prompt)
            ctx.memory_clear()
            logits = decode_chunked(ctx, np.concatenate([prompt, gen[:-1]]))
            top1 = logits.argmax(1)
            twin_vals = z["top20_vals_dequant_f32"]
            at_twin = np.take_along_axis(logits[:n], z["top20_ids_dequant_f32"], axis=1)
            gen_margin = z["gen_top5_vals_dequant_f32"][:, 0] - z["gen_top5_vals_dequant_f32"][:, 1]
            decided = gen_margin >= TIE
            greedy_ok = int(np.sum((top1[n - 1:] == gen) & decided))
            cpp = top1[:n] == z["top20_ids"][:, 0]
            hits += int(cpp.sum())
            total += n
            print(f"{case['case_id']:44} {n:4d} "
                  f"{np.abs(logits[n - 1] - z['last_logits_dequant_f32']).max():10.2e} "
                  f"{np.abs(at_twin - twin_vals).max():10.2e} "
                  f"{np.mean(top1[:n] == z['top20_ids_dequant_f32'][:, 0]):9.3f} "
                  f"{greedy_ok:3d}/{int(decided.sum()):<3d} {cpp.mean():8.3f} "
                  f"{np.abs(logits[n - 1] - z['last_logits']).max():8.3f}")
        print(f"{model_file}: top-1 agreement with llama.cpp over all {total} prompt positions "
              f"{hits / total:.3f} (weights {model.weight_format}, {time.perf_counter() - t0:.1f} s)")


def synthetic_models(ref_dir: Path, weight_format: str) -> None:
    index = json.loads((ref_dir / "synthetic" / "index.json").read_text())
    tokens = np.asarray(index["tokens"], np.int32)
    archs = set(registered_archs())
    print(f"\n{'model':30} {'exact':>13} {'max|diff|':>10} {'top1=exact':>10} {'vs cpp':>8} {'top1=cpp':>8}")
    for m in index["models"]:
        if m["arch"] not in archs:
            continue
        z = np.load(ref_dir / "synthetic" / m["logits_file"])
        exact_name = "logits_dequant_f32" if "logits_dequant_f32" in z.files else "logits_f32kv_noflash"
        model = llm.load_model(ref_dir / "synthetic" / m["model_file"], weight_format=weight_format)
        ctx = llm.Context(model, n_ctx=64, n_ubatch=CHUNK, kv_bucket=64)
        if ctx.decode(llm.Batch(tokens, logits=np.ones(len(tokens), bool))) != 0:
            raise RuntimeError(f"{m['model_file']}: {ctx.last_error}")
        logits = ctx.get_logits()
        exact, main = z[exact_name], z["logits"]
        print(f"{Path(m['model_file']).stem:30} {exact_name.removeprefix('logits_'):>13} "
              f"{np.abs(logits - exact).max():10.2e} {np.mean(logits.argmax(1) == exact.argmax(1)):10.3f} "
              f"{np.abs(logits - main).max():8.3f} {np.mean(logits.argmax(1) == main.argmax(1)):8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_ref = flags.REFERENCE.get() or Path(__file__).resolve().parents[2] / "shared" / "reference"
    ap.add_argument("--reference", type=Path, default=Path(default_ref),
                    help="llama.cpp reference data (default: $GGMLX_REFERENCE or ../shared/reference)")
    ap.add_argument("--weight-format", default="auto", choices=["auto", "native", "int8", "int4", "f32"])
    ap.add_argument("--only", choices=["real", "synthetic"])
    args = ap.parse_args()
    if args.only != "synthetic":
        real_cases(args.reference, args.weight_format)
    if args.only != "real":
        synthetic_models(args.reference, args.weight_format)


if __name__ == "__main__":
    main()
