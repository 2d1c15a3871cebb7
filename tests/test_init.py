"""ggmlx.init(): importing ggmlx changes neither XLA_FLAGS nor jax.config; init() sets both,
is idempotent, and warns once (still working) when JAX's backends already exist without its XLA flag.
Each case runs in a fresh interpreter, since the test session itself is already initialised."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

SCRIPT = textwrap.dedent("""
    import json, os
    import jax
    report = {}
    import ggmlx, ggmlx.compile, ggmlx.sched, ggmlx.lower
    report["after_import"] = [os.environ.get("XLA_FLAGS"), jax.config.jax_compilation_cache_dir]
    if MODE == "init_twice":
        ggmlx.init()
        first = [os.environ.get("XLA_FLAGS"), jax.config.jax_compilation_cache_dir]
        ggmlx.init()
        report["after_init"] = [first, [os.environ.get("XLA_FLAGS"), jax.config.jax_compilation_cache_dir]]
        jax.numpy.ones(2).block_until_ready()
        ggmlx.init()          # backends exist now, with the flag: still fine
        report["ok"] = True
    else:
        import logging
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("ggmlx").addHandler(handler)
        jax.numpy.ones(2).block_until_ready()
        ggmlx.init()
        ggmlx.init()
        report["warnings"] = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
        report["sum"] = float(jax.numpy.ones(3).sum())
    print(json.dumps(report))
""")


def _run(mode: str, tmp_path: Path, xla_flags: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GGMLX_NO_PERSISTENT_CACHE")}
    env["GGMLX_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    res = subprocess.run([sys.executable, "-c", f"MODE = {mode!r}\n" + SCRIPT], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_has_no_side_effects_and_init_is_idempotent(tmp_path):
    r = _run("init_twice", tmp_path)
    assert r["after_import"] == [None, None]
    first, second = r["after_init"]
    assert first == second == ["--xla_cpu_enable_concurrency_optimized_scheduler=false", str(tmp_path / "xla")]
    assert r["ok"]


@pytest.mark.slow
def test_init_after_jax_started_without_the_flag_warns_once_and_works(tmp_path):
    """Listing jax.devices() to choose them before load_model is a normal thing to do: the
    flag can no longer apply, which costs speed, not correctness, so it is one warning."""
    r = _run("late", tmp_path)
    assert r["after_import"] == [None, None]
    assert len(r["warnings"]) == 1 and "before ggmlx.init()" in r["warnings"][0]
    assert r["sum"] == 3.0


@pytest.mark.slow
def test_init_keeps_a_users_own_setting(tmp_path):
    """A user who set the scheduler flag either way keeps it, even after JAX started."""
    mine = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    r = _run("late", tmp_path, xla_flags=mine)
    assert r["after_import"][0] == mine
    assert r["warnings"] == []


@pytest.mark.slow
def test_llm_contract_modules_are_attributes_after_import():
    """`import llm` then llm.sampling.grammar / llm.distributed.initialize / llm.hub.pull, as
    the API contract writes them, although llm's names load lazily."""
    code = ("import llm; print(llm.sampling.grammar.__name__, llm.distributed.initialize.__name__, "
            "llm.hub.pull.__name__, llm.LLM.__name__)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["grammar", "initialize", "pull", "LLM"]
