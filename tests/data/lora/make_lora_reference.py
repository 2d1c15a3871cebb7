"""llama.cpp's logits with LoRA adapters on the tiny test model, for tests/test_lora_llamacpp.py.

    python tests/data/lora/make_lora_reference.py        (needs llama-cpp-python: pip install -e '.[compare]')

The base models (tiny llama, F32 and Q8_0) and the adapters are rebuilt from their seeds by
tests/test_lora_llamacpp.py's `build` (so only llama.cpp's outputs are committed); llama.cpp runs
in a child process (llm.research.llamacpp_child) through llama_adapter_lora_init +
llama_set_adapters_lora, flash attention off, F32 KV cache.
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)       # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def llamacpp_logits(model: str, tokens: list[int], loras: list[tuple[str, float]]) -> np.ndarray:
    """In the child: one decode with the adapters applied."""
    mf = _module("make_fixture", ROOT / "benchmarks" / "reference" / "make_fixture.py")
    lc = mf.LlamaCpp(Path(model))
    try:
        logits, _ = lc.run(np.asarray(tokens), loras=tuple((Path(p), s) for p, s in loras))
    finally:
        lc.close()
    return logits


def main() -> None:
    from llm.research import llamacpp_child
    t = _module("test_lora_llamacpp", ROOT / "tests" / "test_lora_llamacpp.py")
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = t.build(Path(tmp))
        for case in t.CASES:
            base, tokens, loras = t.case_inputs(files, case)
            out[case] = llamacpp_child.call(llamacpp_logits, str(base), tokens, loras, model_path=base)
            print(f"{case}: logits {out[case].shape}")
    np.savez_compressed(HERE / "llamacpp_logits.npz", **out)


if __name__ == "__main__":
    main()
