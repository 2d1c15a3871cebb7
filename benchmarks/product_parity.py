"""numerics="ggml" products against llama.cpp's, one weight type at a time, on llama.cpp's own input.

    .venv/bin/python benchmarks/product_parity.py [-m smollm2-135m] [-n 20] [-t 2]

The model's F32 twin is quantized (`llm quantize`, Q8_0) with each layer's ffn_down in another
of the types `native.block_matmul` reads (SmolLM2's 1536-wide ffn_down holds the 256-element
types too). llama.cpp (llama-cpp-python, in a child process) decodes n tokens with an eval
callback that keeps every layer's `ffn_swiglu` (ffn_down's input) and `ffn_out` (its product).
For each layer, `block_matmul` of llama.cpp's own input under every instruction set allowed
here (GGMLX_BLOCK_ISA), and from the weight in the lanes format (weights.pack_lanes, the held
format of numerics="ggml" on AVX-512; "-" for IQ4_XS and the K-quants without a lane layout),
is compared with llama.cpp's product: the relative error
||ours - theirs|| / ||theirs|| is the f32 rounding of the sums' order when the integer dots are
the same (a rounding of one activation differently, or another dot, would show as 1e-4 or more).
Whole-model agreement is `numerics_agreement.py`'s: a tiny difference upstream (an RMS norm's
last bit) moves some activations across a rounding boundary, and those flips grow layer by layer.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from ggmlx import gguf, native, weights
from ggmlx.types import GGMLType as T
from llm import hub
from llm.quantize import LlamaFType, QuantizeParams, model_quantize
from llm.research.diff_llamacpp import f32_twin_path, run_llamacpp

# ffn_down of layer i in TYPES[i] (the rest of the model Q8_0)
TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.MXFP4, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL,
         T.Q8_0)


def _rel_err(x: np.ndarray, w: np.ndarray, t: T, ref: np.ndarray, lanes: bool) -> float:
    """The larger relative error of all rows' products and of the first row's alone (the
    few-row and the tiled kernels)."""
    import jax.numpy as jnp
    y = np.asarray(native.block_matmul(jnp.asarray(x), jnp.asarray(w), int(t), lanes=lanes), np.float64)
    one = np.asarray(native.block_matmul(jnp.asarray(x[:1]), jnp.asarray(w), int(t), lanes=lanes), np.float64)
    return max(np.linalg.norm(y - ref) / np.linalg.norm(ref), np.linalg.norm(one - ref[:1]) / np.linalg.norm(ref[:1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m",
                    help="known model name or GGUF (its F32 twin is quantized)")
    ap.add_argument("-n", "--n-tokens", type=int, default=20, help="tokens decoded (more than 16: the tiled kernels)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    if native.load_error() is not None:
        print(f"the native kernels cannot be used: {native.load_error()}", file=sys.stderr)
        return 2
    twin = f32_twin_path(hub.resolve(a.model))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mixed.gguf"
        model_quantize(twin, path, QuantizeParams(
            ftype=LlamaFType.MOSTLY_Q8_0, nthread=a.threads,
            tensor_types=[(rf"blk\.{i}\.ffn_down", t) for i, t in enumerate(TYPES)]))
        tensors = gguf.GGUFReader(path).tensors
        layers = [i for i in range(len(TYPES)) if f"blk.{i}.ffn_down.weight" in tensors]
        tokens = [int(v) for v in np.random.default_rng(0).integers(100, 10000, a.n_tokens)]
        theirs, _ = run_llamacpp(path, tokens, [f"ffn_swiglu-{i}" for i in layers] + [f"ffn_out-{i}" for i in layers],
                                 False, a.threads)
        isas = native.BLOCK_ISAS[:native.BLOCK_ISAS.index(os.environ.get("GGMLX_BLOCK_ISA", "amx")) + 1]
        print(f"{Path(str(hub.resolve(a.model))).name}'s twin, {a.n_tokens} tokens; relative error of "
              f"block_matmul(llama.cpp's ffn_swiglu) against llama.cpp's ffn_out, rows 1..{a.n_tokens}")
        print("| layer | type | " + " | ".join(isas) + " | lanes |")
        print("|---:|---|" + "---:|" * (len(isas) + 1))
        worst = 0.0
        for i in layers:
            t = tensors[f"blk.{i}.ffn_down.weight"]
            K, M = t.ne[0], t.ne[1]
            x = theirs[f"ffn_swiglu-{i}"].reshape(len(tokens), K).astype(np.float32)
            ref = theirs[f"ffn_out-{i}"].reshape(len(tokens), M).astype(np.float64)
            blocks = np.asarray(t.data).view(np.uint8).reshape(M, -1)
            errs = []
            for isa in isas:
                os.environ["GGMLX_BLOCK_ISA"] = isa
                errs.append(_rel_err(x, blocks, t.type, ref, lanes=False))
            lanes = t.type in weights.LANE_FIELDS and M % weights.LANE_ROWS == 0
            if lanes:     # under the widest instruction set allowed (the last of isas)
                errs.append(_rel_err(x, weights.pack_lanes(blocks, t.type), t.type, ref, lanes=True))
            worst = max(worst, *errs)
            print(f"| {i} | {t.type.name} | " + " | ".join(f"{e:.2e}" for e in errs) + ("" if lanes else " | -") + " |")
        print(f"largest: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
