"""The node-by-node diff against llama.cpp (llm.diff_llamacpp).

- table logic and the ctypes reader, always;
- stored llama.cpp activations (tests/data/activations, written by make_activations.py):
  every committed synthetic model's named nodes, and SmolLM2 / Gemma3 per layer and position;
- live llama.cpp through llama-cpp-python (in a child process: tests/test_llamacpp_child.py
  checks its crash and error paths), skipped cleanly without it.
"""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llm
from llm.research import diff_llamacpp as D

DATA = Path(__file__).parent / "data"
ACT = DATA / "activations"
INDEX = json.loads((ACT / "index.json").read_text())
SYNTH = sorted(k for k, v in INDEX.items() if isinstance(v, dict) and k.startswith("synth-"))

def load_ref(name: str) -> dict[str, np.ndarray]:
    """llama.cpp's stored activations of one model (float32, unscaled)."""
    z = np.load(ACT / f"{name}.npz")
    nodes = INDEX[name]["nodes"]
    return {n: z[n].astype(np.float32) * s for n, s in zip(nodes, z["__scales"], strict=True)}


needs_llamacpp = pytest.mark.skipif(not D.llama_cpp_available(), reason="llama-cpp-python is not installed")


# ---- table logic -----------------------------------------------------------------------

def test_compare_marks_the_first_jump_and_shape_drift():
    rng = np.random.default_rng(0)
    a = {f"n{i}": rng.standard_normal((4, 8)).astype(np.float32) for i in range(5)}
    b = {k: v + 1e-6 * rng.standard_normal(v.shape) for k, v in a.items()}
    b["n3"] = rng.standard_normal((4, 8))          # a name on another node
    b["n4"] = rng.standard_normal((4, 9))
    rows = D.compare(a, b)
    assert [r.name for r in rows] == ["n0", "n1", "n2", "n3", "n4"]
    assert rows[0].cosine > 0.999999 and rows[0].rel_err < 1e-5
    assert [r.jump for r in rows] == [False, False, False, True, False]
    assert rows[4].note.startswith("shape differs") and rows[4].rel_err == float("inf")
    table = D.format_table(rows, ["only_ours"], ["only_theirs"])
    assert "n3" in table and "<-- first jump" in table and "only in llama.cpp (1): only_theirs" in table


def test_compare_cuts_llamacpp_kv_padding():
    p = np.random.default_rng(1).random((2, 3, 3)).astype(np.float32)
    padded = np.zeros((1, 2, 3, 256), np.float32)        # llama.cpp: [1, n_head, n_tokens, n_kv padded]
    padded[0, :, :, :3] = p
    (row,) = D.compare({"kq_soft_max-0": p}, {"kq_soft_max-0": padded}, {"kq_soft_max-0": 2})
    assert row.cosine == pytest.approx(1.0) and row.max_abs == 0.0


def test_mark_jump_ignores_a_steady_error():
    rows = [D.NodeDiff(f"n{i}", (1,), 1.0, 0.0, e) for i, e in enumerate([5e-3, 6e-3, 8e-3, 1e-2, 2e-2])]
    assert D.mark_jump(rows) == 0            # the first error above the 1e-4 floor x 10
    rows = [D.NodeDiff(f"n{i}", (1,), 1.0, 0.0, e) for i, e in enumerate([1e-6, 2e-6, 0.5, 0.6])]
    assert D.mark_jump(rows) == 2


def test_read_tensor_follows_ggml_strides():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)      # numpy order: ne = [4, 3, 2, 1]
    t = D.GGMLTensor()
    t.type = D.GGML_TYPE_F32
    t.ne[:] = [4, 3, 2, 1]
    t.nb[:] = [4, 16, 48, 96]
    t.data = x.ctypes.data
    assert np.array_equal(D.read_tensor(t), x.reshape(1, 2, 3, 4))
    t.ne[:] = [3, 4, 2, 1]                                    # a transposed view: swap ne0/ne1 and nb0/nb1
    t.nb[:] = [16, 4, 48, 96]
    assert np.array_equal(D.read_tensor(t)[0], x.transpose(0, 2, 1))
    h = np.arange(6, dtype=np.float16)
    t16 = D.GGMLTensor(type=D.GGML_TYPE_F16)
    t16.ne[:] = [6, 1, 1, 1]
    t16.nb[:] = [2, 12, 12, 12]
    t16.data = h.ctypes.data
    assert np.array_equal(D.read_tensor(t16).ravel(), h.astype(np.float32))
    t16.type = 2                                              # Q4_0: not read
    assert D.read_tensor(t16) is None
    assert ctypes.sizeof(D.GGMLTensor) == 336                 # sizeof(struct ggml_tensor) on 64-bit


@pytest.mark.slow
def test_without_llama_cpp_python_prints_how_to_install_and_exits_2():
    code = ("import sys; sys.modules['llama_cpp'] = None; from llm.cli.commands import main; "
            "sys.exit(main(['diff-llamacpp', '-p', 'hi']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stdout == "" and r.stderr.strip().count("\n") == 0 and "pip install" in r.stderr


# ---- stored llama.cpp activations --------------------------------------------------------

def _ours(path: Path | str, tokens: list[int], names: list[str]) -> tuple[llm.Trace, dict]:
    m = llm.LLM(str(path), n_ctx=256)
    table = m.node_table(False)
    tr = m.trace(tokens, capture=[n for n in names if n in table], flash_attn=False)
    return tr, table


@pytest.mark.parametrize("name", SYNTH)
@pytest.mark.slow
def test_stored_synthetic_nodes_sit_where_llamacpp_has_them(name):
    """Every F32 node llama.cpp names on a committed synthetic model exists here under the same
    name (llama.cpp's `embd` is our `inp_embd`) with the same shape and close values."""
    info = INDEX[name]
    ref = load_ref(name)
    tr, table = _ours(DATA / "synthetic" / info["model"], info["tokens"], info["nodes"])
    missing = [n for n in info["nodes"] if n not in table and n != "embd"]
    assert not missing, f"llama.cpp names not in our graph: {missing}"
    rows = D.compare({n: tr[n] for n in tr.names}, ref,
                     {n: table[n].axis(table[n].kv_dim) for n in tr.names})
    bad = [(r.name, r.cosine, r.note) for r in rows if not r.cosine >= 0.99]
    assert not bad, D.format_table(rows)
    assert not any(r.note for r in rows)


REAL = {"smollm2-q4_1": 0.99, "smollm2-f32-twin": 0.9999, "gemma3-q4_k_m": 0.98}


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in REAL if n in INDEX])
def test_stored_real_model_activations(name, request):
    info = INDEX[name]
    from llm import hub
    path = hub.pull(info["known_model"])
    if info["f32_twin"]:
        path = D.f32_twin_path(path)
    ref = load_ref(name)
    tr, _ = _ours(path, info["tokens"], info["nodes"])
    worst = {}
    for n in info["nodes"]:
        cos = D.row_cosines(tr[n], ref[n].reshape(tr[n].shape))
        worst[n] = float(cos.min())
    lows = {n: c for n, c in worst.items() if not c >= REAL[name]}
    print(f"\n{name}: min cosine over every layer and position "
          + ", ".join(f"{p} {min(c for n, c in worst.items() if n.startswith(p)):.6f}"
                      for p in ("attn_norm", "ffn_out", "l_out")))
    assert not lows, lows


# ---- live llama.cpp ----------------------------------------------------------------------

@needs_llamacpp
@pytest.mark.parametrize("stem", ["synth-llama-Q4_0", "synth-gemma3-Q4_K_M"])
@pytest.mark.slow
def test_live_diff_on_synthetic_models(stem):
    rows, only_ours, only_theirs, extra = D.diff(str(DATA / "synthetic" / f"{stem}.gguf"), [1, 45, 80, 120, 7],
                                                 ["*"])
    assert rows and all(r.cosine >= 0.99 for r in rows), D.format_table(rows)
    assert only_theirs == ["embd"]
    assert extra["top1_agree"] == 1.0


@needs_llamacpp
@pytest.mark.slow
def test_control_vector_matches_llamacpp_cvec(tmp_path):
    from llm import cvec
    path = DATA / "synthetic" / "synth-llama-Q4_0.gguf"
    m = llm.LLM(str(path), n_ctx=256)
    hp = m.model.hparams
    rng = np.random.default_rng(4)
    dirs = {il: rng.standard_normal(hp.n_embd).astype(np.float32) for il in range(1, hp.n_layer)}
    cvec.write(tmp_path / "cv.gguf", dirs)
    tokens = [1, 45, 80, 120, 7]
    data = cvec.load([(tmp_path / "cv.gguf", 1.5)], hp.n_embd, hp.n_layer).data
    theirs, logits = D.run_llamacpp(str(path), tokens, ["l_out-*"], False, control_vector=data)
    _, plain = D.run_llamacpp(str(path), tokens, [], False)
    ours = m.trace(tokens, capture=["l_out-*"], interventions=m.control_vector([(tmp_path / "cv.gguf", 1.5)]),
                   flash_attn=False)
    for il in range(hp.n_layer):
        cos = D.row_cosines(ours[f"l_out-{il}"], theirs[f"l_out-{il}"].reshape(ours[f"l_out-{il}"].shape))
        assert cos.min() > 0.99
    moved = np.abs(logits - plain).max()
    err = np.abs(ours.logits - logits).max()
    print(f"\ncontrol vector: llama.cpp logits moved by {moved:.3g}; ours vs llama.cpp max |d| {err:.3g}")
    assert err < 0.1 * moved
