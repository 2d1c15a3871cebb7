"""llm.hub: a model assembled into the cache is written whole or not at all, verified (size
and sha256, remembered in a stamp) before first use, and assembled again when it is damaged."""
from __future__ import annotations

import hashlib
import logging
import os
import sys

import pytest
from tiny_model import TinySpec, write_model

import llm
from llm import hub


@pytest.fixture
def tiny_known(tmp_path, monkeypatch):
    """A known model 'tiny' whose package holds a tiny GGUF in two chunks, like the gemma
    package; the cache is a fresh folder."""
    src = write_model(tmp_path / "src.gguf", TinySpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32))
    data = src.read_bytes()
    pkg = tmp_path / "site" / "tiny_chunks_pkg"
    pkg.mkdir(parents=True)
    (pkg / "part0").write_bytes(data[:len(data) // 2])
    (pkg / "part1").write_bytes(data[len(data) // 2:])
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\n"
        "def chunk_paths():\n"
        "    d = Path(__file__).parent\n"
        "    return [d / 'part0', d / 'part1']\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("tiny_chunks_pkg", None)
    km = hub.KnownModel("tiny", "tiny-chunks-pkg", "tiny_chunks_pkg", "tiny.gguf",
                        hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny", km)
    monkeypatch.setenv("GGMLX_CACHE_DIR", str(tmp_path / "cache"))
    return km, data, pkg


def test_assembles_verifies_and_stamps(tiny_known):
    km, data, _ = tiny_known
    path = hub.locate("tiny")
    assert path.read_bytes() == data
    assert (path.parent / "verified" / "tiny.gguf.json").is_file()
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".part")] == []
    llm.load_model(path, vocab_only=True)


def test_second_use_trusts_the_stamp_instead_of_hashing(tiny_known, monkeypatch):
    hub.locate("tiny")
    hashed = []
    real = hub._sha256
    monkeypatch.setattr(hub, "_sha256", lambda p: hashed.append(p) or real(p))
    hub.locate("tiny")
    assert hashed == []


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_file_is_assembled_again_with_one_line(tiny_known, caplog, damage):
    km, data, _ = tiny_known
    path = hub.locate("tiny")
    if damage == "truncate":       # what an interrupted first run used to leave
        path.write_bytes(data[:len(data) // 3])
    else:                          # same size, one byte changed
        b = bytearray(data)
        b[len(b) // 2] ^= 0xFF
        path.write_bytes(bytes(b))
    with caplog.at_level(logging.WARNING, logger="llm.hub"):
        again = hub.locate("tiny")
    assert again.read_bytes() == data
    lines = [r.getMessage() for r in caplog.records if r.name == "llm.hub" and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "assembling it again" in lines[0], lines
    llm.load_model(again, vocab_only=True)


def test_interrupted_assembly_leaves_no_file(tiny_known):
    """A copy that fails half-way (here: the second chunk is missing) leaves neither the
    model file nor a temporary file behind."""
    _, _, pkg = tiny_known
    (pkg / "part1").unlink()
    with pytest.raises(FileNotFoundError):
        hub.locate("tiny")
    cache = hub.cache_dir()
    assert not (cache / "tiny.gguf").exists()
    assert list(cache.glob(".tiny.gguf.*")) == []


def test_stale_part_of_a_dead_process_is_removed(tiny_known):
    cache = hub.cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    stale = cache / ".tiny.gguf.999999999.part"
    stale.write_bytes(b"partial")
    hub.locate("tiny")
    assert not stale.exists()


def test_wrong_chunks_are_rejected_not_installed(tiny_known):
    _, data, pkg = tiny_known
    (pkg / "part1").write_bytes(b"\0" * (len(data) - len(data) // 2))
    with pytest.raises(hub.ModelNotFoundError, match="assemble to a wrong file"):
        hub.locate("tiny")
    assert not (hub.cache_dir() / "tiny.gguf").exists()


@pytest.mark.slow
def test_truncated_gemma_in_the_cache_is_rebuilt(gemma3_path, tmp_path, monkeypatch):
    """The real case of the issue: a 4 MB prefix of the Gemma file left by Ctrl-C."""
    monkeypatch.setenv("GGMLX_CACHE_DIR", str(tmp_path))
    with open(gemma3_path, "rb") as f:
        (tmp_path / hub.KNOWN_MODELS["gemma3-270m"].file_name).write_bytes(f.read(4 << 20))
    path = hub.locate("gemma3-270m")
    assert os.path.getsize(path) == hub.KNOWN_MODELS["gemma3-270m"].size
    assert hub.verify(hub.KNOWN_MODELS["gemma3-270m"], path) is None


def test_cli_says_when_it_assembles_and_when_it_repairs(tiny_known, capsys):
    from llm.cli import commands as cli
    km, data, _ = tiny_known
    assert cli.main(["info", "tiny"]) == 0
    err = capsys.readouterr().err
    assert "assembling tiny.gguf" in err
    (hub.cache_dir() / "tiny.gguf").write_bytes(data[:100])
    assert cli.main(["info", "tiny"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("warning: ") and "incomplete or damaged (100 bytes" in lines[0], lines
    assert lines[1].startswith("assembling tiny.gguf"), lines
