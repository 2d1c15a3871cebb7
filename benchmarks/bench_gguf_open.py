"""Time opening a GGUF file and listing its tensors: ggmlx.gguf against gguf-py's reader.

Usage: python benchmarks/bench_gguf_open.py [FILE]   (default: the Gemma 3 270M model)

Ours parses and validates the whole header (including the 262144-entry vocabulary arrays)
and maps the tensor data without copying it; the target is well under a second.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ggmlx import gguf


def open_and_list_ours(path: Path) -> int:
    with gguf.GGUFReader(path) as f:
        return len([(t.name, t.type, t.ne, t.offset, t.nbytes) for t in f.tensors.values()])


def open_and_list_gguf_py(path: Path) -> int:
    import gguf as gguf_py  # test-only oracle
    r = gguf_py.GGUFReader(path)
    return len([(t.name, t.tensor_type, tuple(t.shape), t.data_offset, t.n_bytes) for t in r.tensors])


def best_of(fn, path: Path, repeats: int) -> tuple[float, int]:
    best, n = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = fn(path)
        best = min(best, time.perf_counter() - t0)
    return best, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", type=Path)
    parser.add_argument("--repeats", type=int, default=5, help="runs of ours; best is reported")
    args = parser.parse_args()
    if args.file is None:
        from llm import hub
        args.file = hub.pull("gemma3-270m")
    size_mb = args.file.stat().st_size / 1e6
    ours, n_ours = best_of(open_and_list_ours, args.file, args.repeats)
    theirs, n_theirs = best_of(open_and_list_gguf_py, args.file, 1)
    assert n_ours == n_theirs, (n_ours, n_theirs)
    print(f"{args.file.name}: {size_mb:.0f} MB, {n_ours} tensors")
    print(f"ggmlx.gguf   open + list: {ours * 1e3:8.1f} ms (best of {args.repeats})")
    print(f"gguf-py      open + list: {theirs * 1e3:8.1f} ms")
    print(f"speed-up: {theirs / ours:.0f}x")


if __name__ == "__main__":
    main()
