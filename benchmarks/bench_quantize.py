"""`llm quantize` against llama-quantize on a real model: the same bytes, and the time side by side.

    python benchmarks/bench_quantize.py [--model smollm2-135m] [--types Q4_K_M,Q8_0 | all] [--nthread 1]
                                        [--reps 3] [--imatrix]

The input is the model's F32 twin made by llama.cpp itself (llama_model_quantize to ALL_F32 with
allow_requantize, which dequantizes every tensor with ggml's dequantizers; ours must give the same
twin). Then for each file type both quantize the twin at the same thread count; the table gives
how many tensors have llama.cpp's type and bytes, whether the whole files are equal, both wall
times (llama.cpp: the llama_model_quantize call in its child process; ours: model_quantize; the
best of --reps runs taken in turn) and ours / llama.cpp. Needs llama-cpp-python (pip install -e '.[compare]').
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ggmlx import gguf  # noqa: E402
from llm import hub  # noqa: E402
from llm import quantize as q  # noqa: E402
from llm.research import quantize_llamacpp  # noqa: E402

# Every file type both can make without an importance matrix.
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
         "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M", "TQ1_0", "TQ2_0", "MXFP4_MOE", "F16",
         "BF16", "F32")
IMATRIX_TYPES = ("Q2_K_S", "IQ3_XS", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")


def file_sha(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def tensor_agreement(ours: str, theirs: str) -> tuple[int, int, int]:
    """(tensors with llama.cpp's type, tensors with its type and bytes, tensors in llama.cpp's file)."""
    with gguf.GGUFReader(ours) as a, gguf.GGUFReader(theirs) as b:
        same_type = same_bytes = 0
        for name, tb in b.tensors.items():
            ta = a.tensors.get(name)
            if ta is not None and ta.type == tb.type:
                same_type += 1
                same_bytes += bool(np.array_equal(ta.data, tb.data))
        return same_type, same_bytes, len(b.tensors)


def twin(src: Path, tmp: Path, nthread: int) -> Path:
    """llama.cpp's F32 twin of src, checked against ours."""
    theirs, ours = tmp / "twin-llamacpp.gguf", tmp / "twin-ours.gguf"
    quantize_llamacpp.quantize_file(src, theirs, int(q.LlamaFType.ALL_F32), nthread, allow_requantize=True)
    q.model_quantize(src, ours, q.QuantizeParams(ftype=q.LlamaFType.ALL_F32, allow_requantize=True, nthread=nthread))
    print(f"F32 twin of {src.name}: ours {'equals' if file_sha(ours) == file_sha(theirs) else 'DIFFERS FROM'} "
          f"llama.cpp's", flush=True)
    ours.unlink()
    return theirs


def seeded_imatrix(path: Path) -> dict[str, np.ndarray]:
    """A log-normal importance per column (and expert) of every matrix: not a measured one, but
    it takes the weighted quantizers the same way."""
    rng = np.random.default_rng(7)
    with gguf.GGUFReader(path) as r:
        return {n: np.exp(rng.standard_normal(t.ne[0] * (t.ne[2] if len(t.ne) > 2 else 1))).astype(np.float32)
                for n, t in r.tensors.items() if len(t.ne) >= 2 and t.ne[1] > 1}


def bench_type(name: str, inp: Path, tmp: Path, nthread: int, reps: int,
               imatrix: dict[str, np.ndarray] | None) -> str:
    """One table row; each time is the best of `reps` runs, taken in turn (ours, llama.cpp, ...)
    so that a change in the machine's load hits both."""
    ftype, _ = q.parse_ftype(name)
    theirs, ours = tmp / f"llamacpp-{name}.gguf", tmp / f"ours-{name}.gguf"
    t_theirs = t_ours = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        q.model_quantize(inp, ours, q.QuantizeParams(ftype=ftype, nthread=nthread, imatrix=imatrix))
        t_ours = min(t_ours, time.perf_counter() - t0)
        t_theirs = min(t_theirs, quantize_llamacpp.quantize_file(inp, theirs, int(ftype), nthread, imatrix=imatrix))
    same_type, same_bytes, n = tensor_agreement(str(ours), str(theirs))
    identical = file_sha(ours) == file_sha(theirs)
    theirs.unlink()
    ours.unlink()
    return (f"| {name:9s} | {same_type:3d}/{n} | {same_bytes:3d}/{n} | {'yes' if identical else 'NO':3s} | "
            f"{t_theirs:8.2f} | {t_ours:8.2f} | {t_ours / t_theirs:5.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="GGUF path or known model name")
    ap.add_argument("--types", default="all", help="comma-separated llama-quantize types, or all")
    ap.add_argument("--nthread", type=int, default=1, help="threads for both")
    ap.add_argument("--reps", type=int, default=3, help="runs of each; the best time counts")
    ap.add_argument("--imatrix", action="store_true",
                    help="both quantize with the same seeded importance matrix (the weighted quantizers; "
                         "adds the types that need one: Q2_K_S, IQ3_XS, IQ3_XXS, IQ2_*, IQ1_*)")
    a = ap.parse_args(argv)
    import logging
    logging.getLogger("llm.quantize").setLevel(logging.ERROR)      # the per-model fallback warnings
    types = TYPES + (IMATRIX_TYPES if a.imatrix else ()) if a.types == "all" else \
        tuple(t.strip().upper() for t in a.types.split(","))
    src = Path(hub.model_file(a.model))
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        tmp = Path(d)
        inp = twin(src, tmp, a.nthread)
        imatrix = seeded_imatrix(inp) if a.imatrix else None
        print(f"\n{inp.stat().st_size / 2**20:.0f} MiB F32 input, {a.nthread} thread(s)"
              f"{', seeded imatrix' if imatrix else ''}\n")
        print("| type      | same type | same bytes | file | llama.cpp s | ours s | ours/llama.cpp |")
        print("|-----------|---------|---------|-----|----------|----------|-------|")
        for name in types:
            print(bench_type(name, inp, tmp, a.nthread, a.reps, imatrix), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
