"""llm imatrix against llama-imatrix's statistic computed over llama.cpp's own graph.

The references (tests/data/imatrix/*.npz) come from benchmarks/reference/imatrix_llamacpp.py:
llama-imatrix's collector redone in llama.cpp's eval callback (llama-cpp-python, in a child
process) over the same chunks of tests/data/text/declaration.txt, on F32 twins of the models,
an F32 KV cache and unfused attention on both sides, so what differs is float summation order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggmlx import gguf
from llm.cli.commands import main
from llm.context import ContextParams
from llm.imatrix import Imatrix, ImatrixError, ImatrixParams, compute_imatrix, imatrix_chunks
from llm.model import load_model
from llm.quantize import QuantizeParams, load_imatrix, model_quantize, parse_ftype
from llm.research.diff_llamacpp import f32_twin_path

DATA = Path(__file__).parent / "data"
TEXT = DATA / "text" / "declaration.txt"
SYNTH = DATA / "synthetic" / "synth-llama-Q4_0.gguf"
SUMMATION = 3e-6        # float32 sums of a few hundred squares in another order, through the layers


def reference(case: str) -> tuple[dict[str, dict[str, np.ndarray]], int, int]:
    ref = np.load(DATA / "imatrix" / f"{case}.npz")
    n_ctx, n_chunks = (int(v) for v in ref["meta"])
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in ref.files:
        if "|" in key:
            name, part = key.split("|")
            out.setdefault(name, {})[part] = ref[key]
    return out, n_ctx, n_chunks


def ours(path: Path, n_ctx: int, n_chunks: int) -> Imatrix:
    model = load_model(f32_twin_path(path))
    tokens = model.vocab.tokenize(TEXT.read_text(), True, False)
    return compute_imatrix(model, tokens, ImatrixParams(n_chunks=n_chunks),
                           ContextParams(n_ctx=n_ctx, flash_attn=False), dataset=TEXT.name)


def worst_relative(im: Imatrix, ref: dict[str, dict[str, np.ndarray]]) -> float:
    """Names and counts equal; the largest per-tensor max |ours - llama.cpp| / max |llama.cpp|
    (over the columns, or over each column sum's total where only totals are kept)."""
    assert sorted(im.sums) == sorted(ref)
    worst = 0.0
    for name, r in ref.items():
        assert np.array_equal(im.counts[name], r["counts"]), name
        a, b = (im.sums[name], r["sums"]) if "sums" in r else (im.sums[name].sum(axis=1, dtype=np.float64), r["total"])
        assert a.shape == b.shape, name
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    return worst


@pytest.fixture(scope="module")
def synth() -> tuple[Imatrix, dict]:
    ref, n_ctx, n_chunks = reference("synth-llama")
    return ours(SYNTH, n_ctx, n_chunks), ref


def test_synthetic_matrix_equals_llamacpp(synth):
    im, ref = synth
    assert im.chunk_count == 4 and im.chunk_size == 64 and im.datasets == [TEXT.name]
    assert all(c.tolist() == [4 * 64] for c in im.counts.values())     # every token of every chunk
    worst = worst_relative(im, ref)
    print(f"synth-llama: {len(ref)} tensors, max relative difference {worst:.2e}")
    assert worst < SUMMATION


def test_moe_matrix_equals_llamacpp_per_expert():
    """mul_mat_id: one row of sums and one count per expert, a token counted for each expert
    it is routed to (the qwen3moe fixture: 4 experts, 2 used)."""
    ref, n_ctx, n_chunks = reference("qwen3moe")
    im = ours(DATA / "fixtures" / "qwen3moe-F32.gguf", n_ctx, n_chunks)
    counts = im.counts["blk.0.ffn_up_exps.weight"]
    assert im.sums["blk.0.ffn_up_exps.weight"].shape == (4, 64) and counts.sum() == 2 * 3 * 32
    worst = worst_relative(im, ref)
    print(f"qwen3moe: {len(ref)} tensors, max relative difference {worst:.2e}")
    assert worst < SUMMATION


@pytest.mark.slow
def test_smollm2_matrix_equals_llamacpp(smollm2_path):
    ref, n_ctx, n_chunks = reference("smollm2")
    im = ours(smollm2_path, n_ctx, n_chunks)
    worst = worst_relative(im, ref)
    print(f"SmolLM2-135M: {len(ref)} tensors, max relative difference {worst:.2e}")
    assert worst < SUMMATION


def test_files_are_read_back_by_quantize(synth, tmp_path):
    """Both formats load as llama-quantize loads them: the mean squared input per column."""
    im, _ = synth
    want = im.values()
    im.write(tmp_path / "i.gguf")
    with gguf.GGUFReader(tmp_path / "i.gguf") as r:
        assert r.kv["general.type"] == "imatrix" and r.kv["imatrix.chunk_size"] == 64
        assert r.tensors["blk.0.ffn_down.weight.in_sum2"].ne == (512, 1)
        assert r.tensors["blk.0.ffn_down.weight.counts"].ne == (1, 1)
        assert list(r.tensors) == [f"{n}.{part}" for n in sorted(im.sums) for part in ("in_sum2", "counts")]
    g = load_imatrix(tmp_path / "i.gguf")
    assert g.datasets == [TEXT.name] and g.chunk_count == 4
    assert all(np.array_equal(g.values[n], v) for n, v in want.items())
    im.write(tmp_path / "i.dat", "dat")
    d = load_imatrix(tmp_path / "i.dat")
    assert d.chunk_count == 4 and d.datasets == [TEXT.name]
    assert all(np.allclose(d.values[n], v, rtol=1e-6) for n, v in want.items())
    with pytest.raises(ImatrixError, match="output format"):
        im.write(tmp_path / "i.bin", "bin")


def test_quantize_with_our_matrix_is_nearly_llamacpp_statistic_bytes(synth, tmp_path):
    """The same quantized bytes as with llama.cpp's statistic but where the last-bit differences
    of the matrix tip a quantizer's search (measured: 2e-6 .. 6e-4 of the bytes, Q4_K_M most)."""
    im, ref = synth
    theirs = {n: (r["sums"] / r["counts"][:, None].astype(np.float32)).reshape(-1) for n, r in ref.items()}
    twin = f32_twin_path(SYNTH)
    for ftype in ("Q4_K_M",):
        files = []
        for tag, values in (("ours", im.values()), ("theirs", theirs)):
            out = tmp_path / f"{ftype}-{tag}.gguf"
            model_quantize(twin, out, QuantizeParams(ftype=parse_ftype(ftype)[0], imatrix=values))
            with gguf.GGUFReader(out) as r:
                files.append({n: np.asarray(t.data).copy() for n, t in r.tensors.items()})
        n_diff = sum(int((files[0][n] != files[1][n]).sum()) for n in files[0])
        n_all = sum(a.size for a in files[0].values())
        assert n_diff / n_all < 1e-3, f"{ftype}: {n_diff} of {n_all} bytes differ"


def test_chunks_as_llama_imatrix_cuts_them():
    assert imatrix_chunks(list(range(10)), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert imatrix_chunks(list(range(10)), 4, n_chunks=1).tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ImatrixError, match="you need at least 8 tokens for a context of 4 tokens; "
                                           "the text tokenizes to only 7"):
        imatrix_chunks(list(range(7)), 4)


def test_cli_writes_both_formats(synth, tmp_path, capsys):
    im, _ = synth
    argv = ["imatrix", "-m", str(f32_twin_path(SYNTH)), "-f", str(TEXT), "-c", "64", "--chunks", "4", "--no-flash-attn"]
    assert main(argv + ["-o", str(tmp_path / "i.gguf")]) == 0
    assert main(argv + ["-o", str(tmp_path / "i.dat")]) == 0
    assert "14 entries over 4 chunks of 64 tokens" in capsys.readouterr().err
    g, d = load_imatrix(tmp_path / "i.gguf"), load_imatrix(tmp_path / "i.dat")
    assert g.datasets == [str(TEXT)] and d.datasets == [str(TEXT)]
    assert all(np.array_equal(g.values[n], v) for n, v in im.values().items())
    assert sorted(d.values) == sorted(g.values)


@pytest.mark.parametrize("case, message", [
    ("short", "you need at least 1024 tokens for a context of 512 tokens"),
    ("model", "no such model file"),
    ("text", "cannot read"),
    ("output", "is not a writable directory"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, message):
    short = tmp_path / "short.txt"
    short.write_text("We hold these truths to be self-evident.")
    argv = {"short": ["-f", str(short)], "model": ["-m", str(tmp_path / "none.gguf")],
            "text": ["-f", str(tmp_path / "none.txt")], "output": ["-o", str(tmp_path / "none" / "i.gguf")]}[case]
    base = {"-m": str(SYNTH), "-f": str(TEXT), "-o": str(tmp_path / "i.gguf")}
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    assert main(["imatrix", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


@pytest.mark.slow
def test_gradient_matrix_is_the_fisher_row_sum():
    """--gradient: per column N * sum_t |dL/dy_t|^2 x_tj^2 / sum_t |dL/dy_t|^2 (L the chunk's
    next-token NLL), checked against LLM.gradient at the matmuls' outputs and LLM.trace of their
    inputs, for one chunk of the synthetic llama."""
    import jax
    import jax.numpy as jnp

    from llm import LLM
    llm = LLM(f32_twin_path(SYNTH))
    tokens = llm.tokenize(TEXT.read_text())
    c = 64
    chunk = [llm.model.vocab.bos] + list(tokens[1:c])
    targets = jnp.asarray(chunk[1:])

    def nll(logits):
        lp = jax.nn.log_softmax(logits[:-1], axis=-1)
        return -jnp.sum(jnp.take_along_axis(lp, targets[:, None], axis=1))

    pairs = {"blk.0.ffn_down.weight": ("ffn_out-0", "ffn_swiglu-0"),
             "blk.0.attn_output.weight": ("attn_out-0", "kqv_out-0"), "blk.1.attn_q.weight": ("Qcur-1", "attn_norm-1")}
    grads = llm.gradient(chunk, nll, wrt=[o for o, _ in pairs.values()])
    trace = llm.trace(chunk, capture=[i for _, i in pairs.values()], flash_attn=False)
    im = compute_imatrix(llm.model, tokens, ImatrixParams(n_chunks=1, gradient=True),
                         ContextParams(n_ctx=c, flash_attn=False))
    act = compute_imatrix(llm.model, tokens, ImatrixParams(n_chunks=1), ContextParams(n_ctx=c, flash_attn=False))
    assert sorted(im.sums) == sorted(act.sums) and all(np.array_equal(im.counts[n], act.counts[n]) for n in im.sums)
    for name, (out, inp) in pairs.items():
        w = np.square(grads[out].reshape(c, -1), dtype=np.float64).sum(axis=1)
        x2 = np.square(trace[inp].reshape(c, -1), dtype=np.float64)
        want = c * (w[:, None] * x2).sum(axis=0) / w.sum()
        assert np.abs(im.sums[name][0] - want).max() / np.abs(want).max() < 1e-6, name


def test_ggml_reads_our_file(synth, tmp_path):
    """llama-quantize's loader (common_imatrix_load) reads the file through ggml's GGUF reader:
    run on llama-cpp-python's ggml, it finds the provenance keys and F32 in_sum2 [n_col, n_mat]
    and counts [1, n_mat] holding our values."""
    from llm.research.llamacpp_child import llama_cpp_available
    if not llama_cpp_available():
        pytest.skip("needs llama-cpp-python")
    from llm.research.quantize_llamacpp import read_imatrix_ggml
    im, _ = synth
    im.write(tmp_path / "i.gguf")
    kv, tensors = read_imatrix_ggml(tmp_path / "i.gguf")
    assert kv == {"general.type": "imatrix", "imatrix.datasets": [TEXT.name], "imatrix.chunk_count": 4,
                  "imatrix.chunk_size": 64}
    assert sorted(tensors) == sorted(f"{n}.{p}" for n in im.sums for p in ("in_sum2", "counts"))
    for name, sums in im.sums.items():
        t, ne, v = tensors[f"{name}.in_sum2"]
        assert t == 0 and ne == (sums.shape[1], sums.shape[0], 1, 1) and np.array_equal(v, sums.reshape(-1))
        t, ne, v = tensors[f"{name}.counts"]
        assert t == 0 and ne == (1, sums.shape[0], 1, 1) and np.array_equal(v, im.counts[name].astype(np.float32))


@pytest.mark.slow
def test_llamacpp_quantizer_with_our_file_writes_our_bytes(synth, tmp_path):
    """Our file, loaded as llama-quantize loads it, makes llama_model_quantize (llama-cpp-python,
    in a child) write the same tensors as llm quantize --imatrix with the same file."""
    from llm.research.llamacpp_child import llama_cpp_available
    if not llama_cpp_available():
        pytest.skip("needs llama-cpp-python")
    from llm.research.quantize_llamacpp import quantize_file
    im, _ = synth
    im.write(tmp_path / "i.gguf")
    values = load_imatrix(tmp_path / "i.gguf").values
    twin = f32_twin_path(SYNTH)
    for ftype in ("IQ2_XXS", "Q3_K_M"):
        ft = parse_ftype(ftype)[0]
        quantize_file(twin, tmp_path / "theirs.gguf", int(ft), imatrix=values)
        model_quantize(twin, tmp_path / "ours.gguf", QuantizeParams(ftype=ft, imatrix=values))
        with gguf.GGUFReader(tmp_path / "theirs.gguf") as a, gguf.GGUFReader(tmp_path / "ours.gguf") as b:
            assert list(a.tensors) == list(b.tensors)
            for name, t in a.tensors.items():
                assert t.type == b.tensors[name].type and np.array_equal(t.data, b.tensors[name].data), (ftype, name)
        (tmp_path / "theirs.gguf").unlink()
        (tmp_path / "ours.gguf").unlink()


@pytest.mark.slow
def test_process_output_adds_output_weight():
    """--process-output: output.weight too (its input is every token's final norm), the rest unchanged."""
    model = load_model(f32_twin_path(SYNTH))
    tokens = model.vocab.tokenize(TEXT.read_text(), True, False)
    cp = ContextParams(n_ctx=64, flash_attn=False)
    plain = compute_imatrix(model, tokens, ImatrixParams(n_chunks=2), cp)
    more = compute_imatrix(model, tokens, ImatrixParams(n_chunks=2, process_output=True), cp)
    assert set(more.sums) - set(plain.sums) == {"output.weight"}
    assert more.sums["output.weight"].shape == (1, model.hparams.n_embd)
    assert more.counts["output.weight"].tolist() == [2 * 64]
    assert all(np.array_equal(more.sums[n], plain.sums[n]) for n in plain.sums)
