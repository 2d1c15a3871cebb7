"""llama.cpp control vectors as interventions (llm.cvec) on a tiny generated model, in the API
and the CLI; against llama.cpp itself where llama-cpp-python is installed (test_diff_llamacpp)."""
from __future__ import annotations

import numpy as np
import pytest
from tiny_model import TinySpec, prompt_tokens, write_model

import llm
from llm import cvec
from llm.cli import commands as cli

N_LAYER, N_EMBD = 3, 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("cvec")
    path = write_model(d / "tiny.gguf", TinySpec(arch="llama", n_layer=N_LAYER, seed=7))
    rng = np.random.default_rng(3)
    dirs = {il: rng.standard_normal(N_EMBD).astype(np.float32) for il in (1, 2, 5)}
    cvec.write(d / "a.gguf", dirs, "llama")
    cvec.write(d / "b.gguf", {2: np.ones(N_EMBD, np.float32)})
    return llm.LLM(str(path), n_ctx=64), d, dirs, path


@pytest.mark.slow
def test_direction_is_added_to_l_out(setup):
    m, d, dirs, _ = setup
    toks = prompt_tokens(6)
    base = m.trace(toks, capture=["l_out-*"])
    tr = m.trace(toks, capture=["l_out-*"], interventions=m.control_vector(d / "a.gguf"))
    assert np.array_equal(tr["l_out-0"], base["l_out-0"])          # layer 0 never gets one
    assert np.abs(tr["l_out-1"] - (base["l_out-1"] + dirs[1])).max() < 1e-4
    assert np.abs(tr["l_out-2"] - base["l_out-2"]).max() > 1e-2


@pytest.mark.slow
def test_scaled_files_sum_and_layer_range(setup):
    m, d, dirs, _ = setup
    iv = m.control_vector([(d / "a.gguf", 0.5), (d / "b.gguf", -2.0)])
    data = cvec.load([(d / "a.gguf", 0.5), (d / "b.gguf", -2.0)], N_EMBD, N_LAYER).data
    assert np.allclose(data[2], 0.5 * dirs[2] - 2.0)
    assert np.all(data[0] == 0) and sorted(iv) == ["l_out-1", "l_out-2"]
    only2 = m.control_vector(d / "a.gguf", 2, 2)
    assert sorted(only2) == ["l_out-2"]
    toks = prompt_tokens(6)
    base = m.trace(toks, capture=["l_out-*"])
    tr = m.trace(toks, capture=["l_out-*"], interventions=only2)
    assert np.array_equal(tr["l_out-1"], base["l_out-1"])
    assert np.abs(tr["l_out-2"] - (base["l_out-2"] + dirs[2])).max() < 1e-4


def test_bad_control_vector_files(setup, tmp_path):
    m, d, _, _ = setup
    cvec.write(tmp_path / "wide.gguf", {1: np.ones(N_EMBD + 1, np.float32)})
    with pytest.raises(cvec.ControlVectorError, match=r"wide.gguf.*direction.1.*F32 \[64\]"):
        m.control_vector(tmp_path / "wide.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(cvec.ControlVectorError, match="junk.gguf"):
        m.control_vector(tmp_path / "junk.gguf")
    cvec.write(tmp_path / "zero.gguf", {0: np.ones(N_EMBD, np.float32)})
    with pytest.raises(cvec.ControlVectorError, match="layer index 0"):
        m.control_vector(tmp_path / "zero.gguf")


@pytest.mark.slow
def test_cli_control_vector_matches_api(setup, capsys):
    m, d, _, path = setup
    prompt = "hello world"
    ref = m.generate(prompt, max_tokens=5, temperature=0.0,
                     interventions=m.control_vector([(d / "a.gguf", 2.0)], 1, 2))
    assert cli.main(["generate", "-m", str(path), "-p", prompt, "-n", "5", "--temp", "0", "-c", "64",
                     "--control-vector-scaled", str(d / "a.gguf"), "2.0",
                     "--control-vector-layer-range", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert out == ref.text + "\n"
