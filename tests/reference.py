"""Where the llama.cpp reference data outside the repo lives (one option for the whole suite).

`pytest --reference DIR` or `GGMLX_REFERENCE=DIR`; the default is `../shared/reference` beside
the checkout. Tests that need it skip when it is absent: the committed subsets in tests/data
are what CI checks.
"""
from __future__ import annotations

from pathlib import Path

from ggmlx import flags

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "reference"


def reference_dir() -> Path:
    return Path(flags.REFERENCE.get() or DEFAULT)
