"""llama.cpp's quantized bytes, as hashes, for tests/test_quantize.py.

    python tests/data/quantize/make_reference.py        (needs llama-cpp-python: pip install -e '.[compare]')

Rebuilds the test inputs from their seeds (tests/test_quantize.py: quantizer_rows, build), runs
llama.cpp on them in a child process (llm.research.quantize_llamacpp: ggml_quantize_chunk per
row, without and with an importance matrix; llama_model_quantize per model and file type, and
with a seeded importance matrix and llama-quantize's provenance keys) and writes reference.json:
per row its sha256; per case the sha256 of each output file and each tensor's type and hash, or
llama.cpp's error when it refuses the case.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


def _case(t, q, inp: Path, out: Path, ftype_name: str, keep_split: bool) -> dict:
    """One llama.cpp run: the files it wrote described, or its error."""
    from llm import quantize
    params = t.case_params(ftype_name, keep_split)
    flags = {"only_copy": params.only_copy, "keep_split": keep_split}
    try:
        q.quantize_file(inp, out, int(params.ftype), nthread=2, **flags)
    except RuntimeError as e:
        return {"error": str(e)}
    n_split = len(list(out.parent.glob(f"{out.name}-*-of-*.gguf"))) if keep_split else 1
    return t.describe(quantize.output_paths(out, n_split, keep_split))


def _imatrix_case(t, q, inp: Path, out: Path, model: str, ftype_name: str) -> dict:
    params = t.imatrix_params(model, ftype_name)
    kinds = {bool: "bool", int: "int", float: "float", str: "str"}
    kv = [(k, kinds[type(v)], v) for k, v in params.kv_overrides]
    try:
        q.quantize_file(inp, out, int(params.ftype), nthread=2, imatrix=params.imatrix, kv_overrides=kv)
    except RuntimeError as e:       # a tensor that needs the matrix has none in it
        return {"error": str(e)}
    return t.describe([str(out)])


def main() -> None:
    import llama_cpp

    from ggmlx import quants
    from ggmlx.types import GGMLType
    from llm.research import quantize_llamacpp as q
    t = _module("test_quantize", ROOT / "tests" / "test_quantize.py")
    rows = t.quantizer_rows()
    ref: dict = {"llama_cpp_python": llama_cpp.__version__, "rows": {}, "models": {}}
    for name in t.ROW_TYPES:
        ref["rows"][name] = [t.sha(r) for r in q.quantize_rows(int(GGMLType[name]), rows)]
    ref["rows_imatrix"] = {im_name: {ty.name: [t.sha(r) for r in q.quantize_rows(int(ty), rows, im)]
                                     for ty in quants.IMATRIX_TYPES}
                           for im_name, im in t.row_imatrices().items()}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for model in t.MODELS:
            inp = t.build(model, d)
            ref["models"][model] = {f: _case(t, q, inp, d / f"{model}-{f}.gguf", f, False) for f in t.FTYPES}
            print(model, sum("error" in c for c in ref["models"][model].values()), "refused", flush=True)
        ref["models_imatrix"] = {}
        for model, f in t.IMATRIX_CASES:
            ref["models_imatrix"].setdefault(model, {})[f] = _imatrix_case(
                t, q, d / f"{model}.gguf", d / f"{model}-{f}-imatrix.gguf", model, f)
        inp = t.build("gemma3-split", d)
        ref["models"]["gemma3-split"] = {case: _case(t, q, inp, d / f"split-{f}", f, keep)
                                         for case, f, keep in t.SPLIT_CASES}
    (HERE / "reference.json").write_text(json.dumps(ref, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
