"""Copy the synthetic llama.cpp reference models the parity tests use (the smallest file of
each architecture), with a compact subset of their logits.

Usage: python tests/data/synthetic/make_subset.py [REFERENCE_DIR/synthetic]
(REFERENCE_DIR: $GGMLX_REFERENCE or ../shared/reference by default)

Models: synth-llama-Q4_0.gguf (legacy quant blocks), synth-gemma3-Q4_K_M.gguf (K-quants,
gemma3 with 2 sliding-window layers), qwen2 (q/k/v biases), qwen3 (q/k norms, head 128, Q2_K/
Q3_K), phi3 (fused qkv and gate-up) and gemma2 (soft-caps, alternating sliding window, IQ4_XS);
the first also supplies the 512-token SPM vocabulary
of the tiny models that tests/tiny_model.py writes. For each, `<stem>.npz` holds:

- tokens [24]: the input ids;
- logits_dequant_f32 [24, 512]: llama.cpp on the model's dequantized-F32 twin (flash
  attention off, F32 KV cache), i.e. (nearly) exact math on the same weights;
- top1_main [24]: the argmax of llama.cpp's own logits (quantized activations);
- gen_ids [16], gen_margins [16]: llama.cpp's greedy continuation and the top-1 / top-2
  margin of the logits that chose each step.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
STEMS = ["synth-llama-Q4_0", "synth-gemma3-Q4_K_M", "synth-qwen2-Q4_0", "synth-qwen3-Q2_K",
         "synth-phi3-Q4_K_M", "synth-gemma2-IQ4_XS"]


def main(src: Path) -> None:
    for stem in STEMS:
        shutil.copyfile(src / "models" / f"{stem}.gguf", HERE / f"{stem}.gguf")
        z = np.load(src / "logits" / f"{stem}.npz")
        top2 = -np.sort(-z["gen_logits"], axis=1)[:, :2]
        np.savez_compressed(HERE / f"{stem}.npz", tokens=z["tokens"],
                            logits_dequant_f32=z["logits_dequant_f32"],
                            top1_main=z["logits"].argmax(1).astype(np.int32),
                            gen_ids=z["gen_ids"], gen_margins=(top2[:, 0] - top2[:, 1]).astype(np.float32))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from reference import reference_dir
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else reference_dir() / "synthetic")
