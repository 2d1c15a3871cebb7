"""llama.cpp's logits with each KV cache type, for tests/test_kv_quant.py's parity check.

    .venv/bin/python benchmarks/reference/kv_quant_llamacpp.py

The model is the committed synthetic llama (tests/data/synthetic/synth-llama-Q4_0.gguf, head
size 64) as an F32 twin (its Q4_0 weights dequantized, written to a temporary file), so that
llama.cpp's matmuls do not quantize activations and what differs between the engines is the
cache: the rows each writes with set_rows and how its flash attention reads them. llama.cpp
runs with flash attention on (it needs it for a quantized V cache), K and V of the same type,
in a child process (llm.research.llamacpp_child): 16 prompt tokens in one batch, then 4 more
one at a time. Writes tests/data/kv_quant/llamacpp.npz: tokens [20] and logits_<type> [20, 512]
for each type; for the quantized ones also k0_<type> and v0_<type> [20, row bytes], the
bytes of layer 0's K and V cache rows (from llama_state_seq_get_data), which depend on
nothing the engines compute differently (layer 0's K and V are plain f32 products).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "data" / "synthetic" / "synth-llama-Q4_0.gguf"
OUT = ROOT / "tests" / "data" / "kv_quant" / "llamacpp.npz"
TYPES = ("f16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
N_PROMPT, N_DECODE = 16, 4


def tokens() -> list[int]:
    """BOS, then seeded ids among the non-special tokens (the same in the test)."""
    rng = np.random.default_rng(33)
    return [1] + [int(x) for x in rng.integers(3, 512, N_PROMPT + N_DECODE - 1)]


def write_f32_twin(src: Path, dst: Path) -> None:
    """src with every tensor dequantized to F32 (ggmlx's dequantize is bit-exact with ggml's)."""
    from ggmlx import gguf, quants
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter()
    for k, v in r.kv.items():
        if k != "general.file_type":
            w.add_kv(k, v, r.kv_types[k], r.kv_array_types.get(k))
    for name, t in r.tensors.items():
        w.add_tensor(name, quants.dequantize(t.data, t.type, t.ne))
    w.write(dst)


def llamacpp_run(model: str, toks: list[int], type_name: str) -> tuple[np.ndarray, bytes]:
    """llama.cpp's logits of every token (prompt in one batch, then one token per decode) and
    its sequence state (llama_state_seq_get_data of sequence 0)."""
    import ctypes

    import llama_cpp
    t = getattr(llama_cpp, f"GGML_TYPE_{type_name.upper()}")
    llm = llama_cpp.Llama(model_path=model, n_ctx=64, n_batch=64, n_threads=1, logits_all=True, verbose=False,
                          flash_attn=True, type_k=t, type_v=t)
    llm.eval(toks[:N_PROMPT])
    for tok in toks[N_PROMPT:]:
        llm.eval([tok])
    n = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
    buf = (ctypes.c_uint8 * n)()
    llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buf, n, 0)
    return np.array(llm.scores[:len(toks)], dtype=np.float32), bytes(buf)


def layer0_rows(state: bytes, n_layer: int, n_cells: int, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0's K and V rows from the end of a sequence state: n_layer K sections then n_layer
    V sections, each its type (i32), row size (u64) and n_cells rows (llama_kv_cache's
    state_write_data with V not transposed)."""
    section = 12 + n_cells * row_bytes
    k0 = len(state) - 2 * n_layer * section
    v0 = k0 + n_layer * section

    def rows(at: int) -> np.ndarray:
        assert int.from_bytes(state[at + 4:at + 12], "little") == row_bytes, "unexpected state layout"
        return np.frombuffer(state[at + 12:at + section], np.uint8).reshape(n_cells, row_bytes)
    return rows(k0), rows(v0)


def main() -> int:
    from ggmlx.types import row_size
    from llm.kv_cache import KV_TYPES
    from llm.research import llamacpp_child
    toks = tokens()
    out: dict[str, np.ndarray] = {"tokens": np.array(toks, np.int32)}
    with tempfile.TemporaryDirectory() as d:
        twin = Path(d) / "synth-llama-F32.gguf"
        write_f32_twin(MODEL, twin)
        for name in TYPES:
            logits, state = llamacpp_child.call(llamacpp_run, str(twin), toks, name, model_path=twin)
            out[f"logits_{name}"] = logits
            if name != "f16":
                out[f"k0_{name}"], out[f"v0_{name}"] = layer0_rows(state, 2, len(toks), row_size(KV_TYPES[name], 128))
            print(f"{name}: logits {logits.shape}, top-1 {logits.argmax(-1)[-4:]}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
