"""llama.cpp's sequence state of the mamba2 and mamba fixtures, for tests/test_recurrent.py's
state-layout check.

    .venv/bin/python benchmarks/reference/recurrent_state_llamacpp.py

For each fixture (tests/data/fixtures/<arch>-F32.gguf), llama.cpp 0.3.36 in a child process
(llm.research.llamacpp_child) decodes the first N_PREFIX tokens of the fixture's sequence 0 in
one batch and returns llama_state_seq_get_data of sequence 0: io_magic u32, seq_id i32, then
llama_memory_recurrent::state_write (the layout llm.state writes for recurrent cells).
Writes tests/data/state/<arch>-seq.bin.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "data" / "fixtures"
OUT = ROOT / "tests" / "data" / "state"
ARCHS = ("mamba2", "mamba")
N_PREFIX = 6


def seq_state(model: str, toks: list[int]) -> bytes:
    import ctypes

    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=64, n_batch=64, n_threads=1, verbose=False)
    llm.eval(toks)
    n = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
    buf = (ctypes.c_uint8 * n)()
    written = llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buf, n, 0)
    return bytes(buf[:written])


def main() -> int:
    from llm.research import llamacpp_child
    OUT.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        model = FIXTURES / f"{arch}-F32.gguf"
        toks = [int(t) for t in np.load(FIXTURES / f"{arch}.npz")["tokens_0"][:N_PREFIX]]
        data = llamacpp_child.call(seq_state, str(model), toks, model_path=model)
        (OUT / f"{arch}-seq.bin").write_bytes(data)
        print(f"{arch}: {len(data)} bytes after {N_PREFIX} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
