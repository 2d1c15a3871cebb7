"""A random LoRA adapter on a real model, ours against llama.cpp (issue 31's "done means").

Usage:
  python benchmarks/lora_parity.py [-m smollm2-135m] [--rank 8] [--scales 0.5,1,2]

Writes a seeded random adapter (rank --rank, on every layer's attention and FFN projections)
for the model, then for the model's F32 twin (every tensor dequantized) and for the quantized
file itself decodes one prompt with the adapter at each scale, in llama.cpp (llama-cpp-python:
llama_adapter_lora_init + llama_set_adapters_lora, in a child process) and here. Prints, per
scale, max |ours - llama.cpp| / max |llama.cpp| on the twin (target <= 1e-3) and, on the
quantized file, ours vs llama.cpp beside llama.cpp's own quantized-vs-twin distance (its noise).
The token embedding is left out: SmolLM2 ties its output to it, and llama.cpp would then apply
the embedding's flipped pair to the output product too.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The river ran past old mills and quiet farms, where people told stories of winter storms."
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def make_fixture():
    spec = importlib.util.spec_from_file_location("make_fixture", ROOT / "benchmarks" / "reference" / "make_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_fixture", mod)
    spec.loader.exec_module(mod)
    return mod


def write_adapter(path: Path, model_path: Path, rank: int, seed: int) -> None:
    from ggmlx import gguf
    from llm.adapter import write_lora
    rng = np.random.default_rng(seed)
    pairs = {}
    with gguf.GGUFReader(model_path) as f:
        arch = f.kv["general.architecture"]
        for name, ti in f.tensors.items():
            parts = name.split(".")
            if parts[0] == "blk" and parts[2] in TARGETS and parts[-1] == "weight":
                n_in, n_out = ti.ne[0], ti.ne[1]
                pairs[name] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in),
                               rng.standard_normal((n_out, rank)) * 0.05)
    write_lora(path, arch, pairs, alpha=float(2 * rank))


def llamacpp_logits(model: str, tokens: list[int], loras: list[tuple[str, float]]) -> np.ndarray:
    mf = make_fixture()
    lc = mf.LlamaCpp(Path(model))
    try:
        return lc.run(np.asarray(tokens), loras=tuple((Path(p), s) for p, s in loras))[0]
    finally:
        lc.close()


def our_logits(model_path: Path, tokens: list[int], adapter: Path, scale: float) -> np.ndarray:
    import llm
    from llm.batch import Batch
    model = llm.load_model(model_path)
    ctx = llm.Context(model, n_ctx=256, n_batch=256, n_ubatch=256, flash_attn=False)
    ctx.set_adapters_lora([llm.adapter_lora_init(model, adapter)], [scale])
    assert ctx.decode(Batch(np.asarray(tokens, np.int32), logits=np.ones(len(tokens), bool))) == 0
    return ctx.get_logits().copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--scales", default="0.5,1,2")
    ap.add_argument("--seed", type=int, default=31)
    a = ap.parse_args()
    import llm
    from llm import hub
    from llm.research import llamacpp_child
    qpath = hub.model_file(a.model)
    scales = [float(s) for s in a.scales.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        twin, adapter = Path(tmp) / "twin-F32.gguf", Path(tmp) / "lora.gguf"
        make_fixture().dequantized_twin(qpath, twin)
        write_adapter(adapter, qpath, a.rank, a.seed)
        tokens = llm.load_model(qpath, vocab_only=True).vocab.tokenize(PROMPT, True, True)
        print(f"{qpath.name}: rank-{a.rank} adapter on {', '.join(TARGETS)} of every layer; {len(tokens)} tokens")
        for s in scales:
            lora = [(str(adapter), s)]
            ref_twin = llamacpp_child.call(llamacpp_logits, str(twin), tokens, lora, model_path=twin)
            ref_q = llamacpp_child.call(llamacpp_logits, str(qpath), tokens, lora, model_path=qpath)
            got_twin, got_q = our_logits(twin, tokens, adapter, s), our_logits(qpath, tokens, adapter, s)
            base = llamacpp_child.call(llamacpp_logits, str(twin), tokens, [], model_path=twin)
            rel = np.abs(got_twin - ref_twin).max() / np.abs(ref_twin).max()
            moved = np.abs(ref_twin - base).max()
            top1 = (got_q.argmax(-1) == ref_q.argmax(-1)).mean()
            top1_own = (ref_twin.argmax(-1) == ref_q.argmax(-1)).mean()
            print(f"scale {s:g}: F32 twin max|diff|/max|logit| {rel:.2e} (the adapter moves logits by {moved:.2f}); "
                  f"quantized: ours vs llama.cpp {np.abs(got_q - ref_q).max():.3f} (top-1 {top1:.3f}), llama.cpp "
                  f"quantized vs its twin {np.abs(ref_q - ref_twin).max():.3f} (top-1 {top1_own:.3f}), ours "
                  f"quantized vs llama.cpp's twin {np.abs(got_q - ref_twin).max():.3f}")


if __name__ == "__main__":
    main()
