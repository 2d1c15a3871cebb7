"""Rebuild synthetic_kv.json and tensor_names.json (see README.md here).

Usage: python tests/data/hparams/regenerate.py [REFERENCE_DIR]
REFERENCE_DIR defaults to $GGMLX_REFERENCE or ../shared/reference; the real models come from
their PyPI packages through llm.hub.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ggmlx.gguf import GGUFReader

HERE = Path(__file__).parent
SYNTHETIC = ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "llama_moe"]   # tensor_names order
LEFT_OUT = {"tokenizer.ggml.scores", "tokenizer.ggml.token_type"}   # not read by hparams


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _model_file(reference: Path, name: str) -> Path:
    kind = "F16" if name == "llama_moe" else "F32"
    return reference / "synthetic" / "models" / f"synth-{name}-{kind}.gguf"


def main(reference: Path) -> None:
    from llm import hub
    kv, names = {}, {}
    for name in SYNTHETIC:
        r = GGUFReader(_model_file(reference, name))
        kv[name] = {k: _plain(v) for k, v in sorted(r.kv.items()) if k not in LEFT_OUT}
        names[name] = sorted(r.tensors)
        r.close()
    for name, model in (("smollm2", "smollm2-135m"), ("gemma3_270m", "gemma3-270m")):
        r = GGUFReader(hub.pull(model))
        names[name] = sorted(r.tensors)
        r.close()
    (HERE / "synthetic_kv.json").write_text(json.dumps(kv, indent=0, sort_keys=True))
    (HERE / "tensor_names.json").write_text(json.dumps(names, indent=0))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    from reference import reference_dir
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else reference_dir())
