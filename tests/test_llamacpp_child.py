"""llm.research.llamacpp_child: llama.cpp's crash in the child is a typed error here.

The child entry points below stand in for llama.cpp (no llama-cpp-python needed): one
returns arrays, one raises, one dies of SIGSEGV as a natively built llama-cpp-python does on
a VM without AMX state, one exits from "native code" without replying."""
from __future__ import annotations

import argparse
import os
import resource
import signal

import numpy as np
import pytest

from llm.research import diff_llamacpp as D
from llm.research import llamacpp_child as C


def _arrays(n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    return {"l_out-0": np.arange(n, dtype=np.float32)}, np.full((2, n), os.getpid(), np.int64)


def _raises(what: str) -> None:
    raise ValueError(f"bad request: {what}")


def _segfault() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))     # no core file
    os.kill(os.getpid(), signal.SIGSEGV)


def _exits() -> None:
    os._exit(3)


def test_the_child_returns_arrays():
    values, logits = C.call(_arrays, 5, model_path="m.gguf")
    assert np.array_equal(values["l_out-0"], np.arange(5, dtype=np.float32))
    assert logits.shape == (2, 5) and logits[0, 0] != os.getpid()       # computed in another process


def test_an_exception_in_the_child_is_raised_here():
    with pytest.raises(ValueError, match="bad request: x") as e:
        C.call(_raises, "x", model_path="m.gguf")
    assert any("in llama.cpp's child process" in note and "_raises" in note for note in e.value.__notes__)


def test_a_segfault_in_the_child_is_llamacpp_crashed():
    with pytest.raises(C.LlamaCppCrashed) as e:
        C.call(_segfault, model_path="/models/m.gguf")
    assert isinstance(e.value, RuntimeError)
    assert e.value.signal == signal.SIGSEGV and e.value.exitcode == -signal.SIGSEGV
    msg = str(e.value)
    assert "SIGSEGV" in msg and "/models/m.gguf" in msg and C.REBUILD_HINT in msg
    assert "-DGGML_NATIVE=OFF" in msg and "-DGGML_AMX_INT8=OFF" in msg


def test_an_exit_without_a_reply_is_llamacpp_crashed():
    with pytest.raises(C.LlamaCppCrashed, match="exited with code 3 before replying") as e:
        C.call(_exits, model_path="m.gguf")
    assert e.value.signal is None


def test_without_llama_cpp_python_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(C, "llama_cpp_available", lambda: False)
    with pytest.raises(C.LlamaCppMissing, match=r"\.\[compare\]") as e:
        D.run_llamacpp("m.gguf", [1, 2], ["*"], False)
    assert isinstance(e.value, ImportError) and e.value.name == "llama_cpp"


def test_the_diff_command_reports_a_crash(monkeypatch, capsys):
    def crash(*args, **kwargs):
        raise C.LlamaCppCrashed("m.gguf", -signal.SIGSEGV)

    monkeypatch.setattr(D, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(D, "diff", crash)
    args = argparse.Namespace(model="m.gguf", prompt="hi", nodes="*", flash_attn=False, f32_twin=False, threads=2,
                              numerics="exact")
    assert D.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("diff-llamacpp: llama.cpp crashed with SIGSEGV") and C.REBUILD_HINT in err
