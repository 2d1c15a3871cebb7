"""Start-up: a cold process says on stderr which graph it is compiling, and a warm second
process finds every executable in the on-disk executable cache (default on) and compiles
nothing; an executable that XLA's own cache served first still loads and runs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_model import TinySpec, write_model

ROOT = Path(__file__).parent.parent


def _env(cache: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GGMLX_NO_PERSISTENT_CACHE", "GGMLX_EXE_CACHE")}
    env.update(GGMLX_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **extra)
    return env


@pytest.mark.slow
def test_cold_cli_run_shows_what_it_compiles_and_warm_run_compiles_nothing(tmp_path):
    model = write_model(tmp_path / "tiny.gguf", TinySpec(arch="llama", n_layer=1, seed=3))
    cmd = [sys.executable, "-m", "llm", "generate", "-m", str(model), "-p", "hello world", "-n", "3",
           "--temp", "0", "-c", "256", "--perf"]

    def run() -> subprocess.CompletedProcess:
        res = subprocess.run(cmd, env=_env(tmp_path / "cache"), capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
        assert res.returncode == 0, res.stderr
        return res

    cold = run()
    assert "compiling decode graph (1 token, kv 256) ..." in cold.stderr, cold.stderr
    assert re.search(r"compiling prefill graph \(\d+ tokens, kv 256\) \.\.\.", cold.stderr), cold.stderr
    assert list((tmp_path / "cache" / "exe").glob("*.bin"))
    warm = run()
    assert "compiling" not in warm.stderr.replace("compile:", ""), warm.stderr
    assert warm.stdout == cold.stdout


XLA_FIRST = textwrap.dedent("""
    import json
    import jax, numpy as np
    import ggmlx
    ggmlx.init()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.jit(lambda v: v + 1)(np.ones(3))    # JAX now takes its cache as on for the whole process
    from ggmlx import ops, compile as C
    from ggmlx.graph import Graph
    from ggmlx.tensor import new_input
    from ggmlx.types import GGMLType as T
    cache = C.GraphCache()
    x = new_input(T.F32, (64, 8), "x")
    w = new_input(T.F32, (64, 32), "w")
    y = ops.rms_norm(ops.silu(ops.mul_mat(w, x)).set_name("a"), 1e-5).set_name("b")
    out, _ = C.compute(Graph().build_forward_expand(y), {x: np.arange(512.0).reshape(8, 64) / 512,
                                                        w: np.ones((32, 64))}, cache=cache)
    print(json.dumps({"disk_hits": cache.stats.disk_hits, "out": np.asarray(out[y]).tolist()}))
""")


@pytest.mark.slow
def test_exe_cache_entry_written_after_an_xla_cache_hit_still_runs(tmp_path):
    """Serializing an executable that XLA's cache had loaded lost some of its functions (the
    next process failed with "Function ... not found"): the executable cache compiles its
    entries itself."""
    def run(exe: str) -> dict:
        res = subprocess.run([sys.executable, "-c", XLA_FIRST], env=_env(tmp_path / "c", GGMLX_EXE_CACHE=exe),
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    first = run("0")          # fills XLA's cache only
    assert list((tmp_path / "c" / "xla").iterdir()) and not (tmp_path / "c" / "exe").exists()
    second = run("1")         # writes the executable cache
    third = run("1")          # loads from it
    assert (second["disk_hits"], third["disk_hits"]) == (0, 1)
    assert first["out"] == second["out"] == third["out"]


def test_a_graph_holding_a_python_function_stays_out_of_the_executable_cache(tmp_path, monkeypatch):
    """map_custom1's function is known by its address only, which another process may give
    to a different function: such a graph is compiled in every process."""
    import numpy as np

    from ggmlx import ops
    from ggmlx.compile import GraphCache, compute
    from ggmlx.graph import Graph
    from ggmlx.tensor import new_input
    from ggmlx.types import GGMLType as T
    monkeypatch.delenv("GGMLX_NO_PERSISTENT_CACHE", raising=False)
    monkeypatch.setenv("GGMLX_EXE_CACHE", "1")
    monkeypatch.setenv("GGMLX_CACHE_DIR", str(tmp_path))
    x = new_input(T.F32, (8, 2), "x")
    compute(Graph().build_forward_expand(ops.map_custom1(x, lambda v: v * 3)), {x: np.ones((2, 8))},
            cache=GraphCache())
    assert not (tmp_path / "exe").exists()
    compute(Graph().build_forward_expand(ops.scale(x, 3.0)), {x: np.ones((2, 8))}, cache=GraphCache())
    assert len(list((tmp_path / "exe").glob("*.bin"))) == 1
