"""Write llama.cpp's activations (through llama-cpp-python's eval callback, as
`python -m llm diff-llamacpp` reads them) for tests/test_diff_llamacpp.py, so CI checks the
per-node agreement without llama-cpp-python.

    python tests/data/activations/make_activations.py [--real]

- synthetic: every committed tests/data/synthetic/*.gguf model, every named F32 node, 4 tokens;
- --real: SmolLM2 Q4_1, its dequantized-F32 twin and Gemma3 Q4_K_M (llm.hub.pull), the
  attn_norm-*, ffn_out-*, l_out-* nodes, 4-5 tokens.
Values are stored as float16 scaled by each node's max |value| (`__scales`, in node order;
enough for cosines to ~1e-6 from 1), one .npz per model, with index.json listing tokens,
nodes and the llama-cpp-python version.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
SYNTH = HERE.parent / "synthetic"
SYNTH_TOKENS = [1, 45, 80, 120]
REAL_PROMPT = "The quick brown fox"
REAL_NODES = ["attn_norm-*", "ffn_out-*", "l_out-*"]


def record(name: str, path: str, tokens: list[int], patterns: list[str], index: dict) -> None:
    from llm.research import diff_llamacpp as D
    values, _ = D.run_llamacpp(path, tokens, patterns, flash_attn=False)
    values = {k: v for k, v in values.items() if " " not in k and not k.startswith("node_")}
    # attention scores span llama.cpp's padded KV length (n_kv, last axis): keep the prompt's cells
    scores = ("kq", "kq_scaled_1", "kq_tanh", "kq_scaled_2", "kq_soft_max")
    values = {k: v[..., :len(tokens)] if k.split("-")[0] in scores else v for k, v in values.items()}
    # float16 of value / max|value| per node (Gemma's residual stream exceeds float16's range)
    scales = {k: float(np.abs(v).max()) or 1.0 for k, v in values.items()}
    np.savez_compressed(HERE / f"{name}.npz", **{k: (v / scales[k]).astype(np.float16) for k, v in values.items()},
                        __scales=np.array([scales[k] for k in values], np.float32))
    index[name] = {"model": Path(path).name, "tokens": tokens, "patterns": patterns, "nodes": list(values)}
    print(f"{name}: {len(values)} nodes")


def main() -> None:
    import llama_cpp

    from llm import hub
    from llm.model import load_model
    from llm.research.diff_llamacpp import f32_twin_path
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", action="store_true")
    a = ap.parse_args()
    index_path = HERE / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    index["llama_cpp_python"] = llama_cpp.__version__
    for gguf in sorted(SYNTH.glob("*.gguf")):
        record(gguf.stem, str(gguf), SYNTH_TOKENS, ["*"], index)
    if a.real:
        for name, known, twin in (("smollm2-q4_1", "smollm2-135m", False), ("smollm2-f32-twin", "smollm2-135m", True),
                                  ("gemma3-q4_k_m", "gemma3-270m", False)):
            path = hub.pull(known)
            vocab = load_model(path, vocab_only=True).vocab
            tokens = vocab.tokenize(REAL_PROMPT, True, True)
            record(name, str(f32_twin_path(path) if twin else path), tokens, REAL_NODES, index)
            index[name]["known_model"] = known
            index[name]["f32_twin"] = twin
    index_path.write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
