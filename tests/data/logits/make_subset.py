"""Cut the compact logits-parity subset in this folder from the full llama.cpp reference.

Usage: python tests/data/logits/make_subset.py [REFERENCE_DIR/logits]
(REFERENCE_DIR: $GGMLX_REFERENCE or ../shared/reference by default)

For every case `<model>__<prompt>.npz` of the reference it writes `<model>__<prompt>.npz`
here with (see the reference README for the meaning of the source arrays):

- prompt_ids, top20_ids (llama.cpp's own top-20 at every prompt position),
  top20_ids_dequant_f32 / top20_vals_dequant_f32 (the dequantized-F32 twin's top-20),
  gen_ids_dequant_f32 / gen_top5_ids_dequant_f32 / gen_top5_vals_dequant_f32 (the twin's
  greedy continuation and the top-5 that chose each step, for the margins);
- last_ids: the twin's 256 highest last-position ids, then 2048 other ids drawn with a fixed
  seed; last_twin / last_main: `last_logits_dequant_f32` and `last_logits` at those ids.

and `index.json` with the case list. The full vocabulary rows (up to 1 MB each) stay out.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
N_TOP = 256
N_RANDOM = 2048
KEEP = ["prompt_ids", "top20_ids", "top20_ids_dequant_f32", "top20_vals_dequant_f32",
        "gen_ids_dequant_f32", "gen_top5_ids_dequant_f32", "gen_top5_vals_dequant_f32"]


def last_ids(twin: np.ndarray, seed: int) -> np.ndarray:
    top = np.argsort(-twin, kind="stable")[:N_TOP]
    rest = np.setdiff1d(np.arange(twin.size), top)
    rng = np.random.default_rng(seed)
    return np.concatenate([top, np.sort(rng.choice(rest, N_RANDOM, replace=False))]).astype(np.int32)


def main(src: Path) -> None:
    index = json.loads((src / "index.json").read_text())
    cases = []
    for k, case in enumerate(index["cases"]):
        z = np.load(src / Path(case["file"]).name)
        out = {name: z[name] for name in KEEP}
        ids = last_ids(z["last_logits_dequant_f32"], seed=k)
        out["last_ids"] = ids
        out["last_twin"] = z["last_logits_dequant_f32"][ids]
        out["last_main"] = z["last_logits"][ids]
        np.savez_compressed(HERE / f"{case['case_id']}.npz", **out)
        cases.append({"case_id": case["case_id"], "model_file": case["model_file"],
                      "prompt_name": case["prompt_name"], "n_prompt_tokens": case["n_prompt_tokens"],
                      "n_vocab": case["n_vocab"]})
    (HERE / "index.json").write_text(json.dumps({
        "source": "llama.cpp reference logits (llama-cpp-python 0.3.36, CPU); cut by make_subset.py",
        "models": index["models"], "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from reference import reference_dir
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else reference_dir() / "logits")
