"""The command line on tiny models: one-line errors with exit code 2 for usage mistakes,
size checks with the estimate, llama.cpp's -s -1 / -n -1, defaults in --help, a status line
per phase, dump-graph filters, and Ctrl-C exiting 130 with one line at any moment."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny_model import TinySpec, write_model

from llm.cli import commands as cli

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", TinySpec(n_layer=3))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def bad_models(tmp_path: Path, tiny: Path) -> dict[str, str]:
    (tmp_path / "not.gguf").write_text("hello world, not a model")
    data = tiny.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[:len(data) // 2])
    return {"missing": str(tmp_path / "missing.gguf"), "directory": str(tmp_path),
            "non-gguf": str(tmp_path / "not.gguf"), "truncated": str(tmp_path / "trunc.gguf"),
            "unknown name": "gemma-9000"}


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "dump-graph", "info"])
def test_bad_model_is_one_line_and_exit_2(capsys, tmp_path, tiny, command, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    for kind, model in bad_models(tmp_path, tiny).items():
        argv = [command, model] if command == "info" else [command, "-m", model]
        if command == "generate":
            argv += ["-p", "hi"]
        rc, _, err = run(capsys, *argv)
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert rc == 2, (kind, err)
        assert len(errors) == 1 and "Traceback" not in err, (kind, err)
        if kind in ("missing", "truncated"):
            assert model in errors[0] or Path(model).name in errors[0], errors
        if kind == "unknown name":
            assert "unknown model name" in errors[0] and "gemma3-270m" in errors[0]


def test_huge_context_is_refused_with_the_estimate(capsys, tiny):
    rc, _, err = run(capsys, "generate", "-m", str(tiny), "-p", "hi", "-c", "100000000")
    assert rc == 2 and "Traceback" not in err
    assert re.search(r"error: n_ctx = 100000000: the KV cache needs [\d.]+ GiB .* GiB available", err), err


def test_bench_prompt_beyond_the_training_context_is_refused(capsys, tiny):
    t0 = time.monotonic()
    rc, _, err = run(capsys, "bench", "-m", str(tiny), "-p", "100000", "-n", "4", "-r", "1")
    assert rc == 2 and "training context (512)" in err and "100004 tokens" in err
    assert time.monotonic() - t0 < 60


def test_bench_prompt_test_that_fills_the_context(capsys, tiny):
    """A pp test alone may end exactly at -c (its timed first token takes one cell more), on a
    vocabulary of fewer than 1000 tokens (the bench's tokens start at half of it)."""
    rc, out, err = run(capsys, "bench", "-m", str(tiny), "-p", "16", "-n", "0", "-d", "16", "-c", "32", "-r", "1",
                       "-ub", "16", "-o", "csv")
    assert rc == 0, err
    assert "pp16 @ d16" in out


@pytest.mark.parametrize("argv, match", [
    (["-c", "0"], "-c must be >= 1"), (["-n", "-2"], "-n must be >= 0, or -1"), (["-s", "-2"], "-s must be"),
    (["-ub", "0"], "-ub must be >= 1")])
def test_bad_values_are_usage_errors(capsys, tiny, argv, match):
    rc, _, err = run(capsys, "generate", "-m", str(tiny), "-p", "hi", *argv)
    assert rc == 2 and match in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_seed_minus_one_is_random_and_n_minus_one_fills_the_context(capsys, tiny):
    rc, out, err = run(capsys, "generate", "-m", str(tiny), "-p", "hello", "-s", "-1", "-n", "-1", "-c", "40",
                       "--temp", "1.0", "--top-k", "0", "--min-p", "0", "--perf")
    assert rc == 0, err
    m = re.search(r"generation: (\d+) tokens", err)
    n_prompt = int(re.search(r"prompt: (\d+) tokens", err)[1])
    # until the context is full (random tokens of a tiny model rarely hit end-of-generation)
    assert m and int(m[1]) + n_prompt in range(2, 41), err
    assert "no KV cache slot" not in err
    seeds = set()
    for _ in range(2):
        rc, out, _ = run(capsys, "generate", "-m", str(tiny), "-p", "hello", "-s", "-1", "-n", "12",
                         "--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0")
        seeds.add(out)
    assert len(seeds) == 2, "-s -1 gave the same text twice"


def test_help_shows_defaults(capsys):
    for command, expect in (("generate", ["(default: 0.8)", "(default: -1)", "(default: 2048)", "(default: 128)"]),
                            ("bench", ["(default: 512)", "(default: 5)"]),
                            ("dump-graph", ["(default: text)", "(default: 512)"])):
        with pytest.raises(SystemExit) as e:
            cli.main([command, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        for s in expect:
            assert s in text, (command, s)


@pytest.mark.slow
def test_one_status_line_per_phase_when_not_a_terminal(capsys, tiny):
    rc, out, err = run(capsys, "generate", "-m", str(tiny), "-p", "hello world", "-n", "3", "-c", "256")
    assert rc == 0, err
    lines = err.splitlines()
    assert lines[0] == f"loading {tiny.name} (0 MiB)" or lines[0].startswith(f"loading {tiny.name} (")
    # a graph compiled by no earlier test (the executable cache is shared) says so on its own line
    assert all(re.fullmatch(r"compiling (decode|prefill) graph \(\d+ tokens?, kv \d+\) \.\.\.", ln)
               for ln in lines[1:-1]), lines
    assert re.fullmatch(r"first token after [\d.]+ s", lines[-1]), lines
    assert "\r" not in err      # plain lines, no progress bar


def test_dump_graph_layers_and_name_filters(capsys, tiny):
    rc, full, _ = run(capsys, "dump-graph", "-m", str(tiny), "-c", "64")
    assert rc == 0
    rc, part, _ = run(capsys, "dump-graph", "-m", str(tiny), "-c", "64", "--layers", "1")
    assert rc == 0
    n_full = int(re.search(r"n_nodes = (\d+)", full)[1])
    n_part = int(re.search(r"n_nodes = (\d+)", part)[1])
    assert n_part < n_full / 2
    names = re.findall(r"(\S+-\d+)\b", part)
    assert names and all(n.endswith("-1") for n in names if re.search(r"-\d+$", n)), names
    assert "attn_norm-1" in part and "attn_norm-0" not in part and "result_output" in part
    rc, dot, _ = run(capsys, "dump-graph", "-m", str(tiny), "-c", "64", "--format", "dot", "--filter", "attn_norm*",
                     "--filter", "ffn_out-?")
    assert rc == 0 and dot.startswith("digraph")
    shown = set(re.findall(r"(attn_norm-\d|ffn_out-\d|Qcur-\d)", dot))
    assert shown == {"attn_norm-0", "attn_norm-1", "attn_norm-2", "ffn_out-0", "ffn_out-1", "ffn_out-2"}, shown
    rc, _, err = run(capsys, "dump-graph", "-m", str(tiny), "--layers", "7-9")
    assert rc == 2 and "the model has 3 layers" in err
    with pytest.raises(SystemExit):
        cli.main(["dump-graph", "-m", str(tiny), "--layers", "2-1"])


# ---- Ctrl-C ---------------------------------------------------------------------------

def _interrupt_at(tiny: Path, moment: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run generate in a child and send SIGINT when `moment` comes: "importing" (once jaxlib
    is mapped into the process: JAX is being imported), a stderr status line ("loading", "compiling", "first
    token"), "compiling+X" (X s after the compile line: compiling or prefill), or
    "generating" (after 40 characters of output)."""
    argv = [sys.executable, "-m", "llm", "generate", "-m", str(tiny), "-p", "hello " * 150, "-n", "-1",
            "-c", "4096", "-ub", "4", "--temp", "1.0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GGMLX_CACHE_DIR": str(tmp_path / moment.replace(" ", "_"))}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    err_lines: list[bytes] = []
    out_chars: list[bytes] = []
    seen = threading.Event()

    def read_err():
        for line in proc.stderr:
            err_lines.append(line)
            if moment.split("+")[0] in line.decode(errors="replace"):
                seen.set()

    def read_out():
        while b := proc.stdout.read(1):
            out_chars.append(b)
            if moment == "generating" and len(out_chars) >= 40:
                seen.set()

    threads = [threading.Thread(target=read_err, daemon=True), threading.Thread(target=read_out, daemon=True)]
    for t in threads:
        t.start()
    if moment == "importing":
        maps = Path(f"/proc/{proc.pid}/maps")
        deadline = time.monotonic() + 120
        while "jaxlib" not in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.005)
    else:
        assert seen.wait(240), f"never reached {moment!r}: {b''.join(err_lines).decode()}"
        if "+" in moment:
            time.sleep(float(moment.split("+")[1]))
    proc.send_signal(signal.SIGINT)
    proc.wait(120)
    for t in threads:
        t.join(10)
    return subprocess.CompletedProcess(argv, proc.returncode, b"".join(out_chars).decode(errors="replace"),
                                       b"".join(err_lines).decode(errors="replace"))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["importing", "loading", "compiling", "compiling+1.0", "compiling+3.0",
                                    "first token", "generating"])
def test_ctrl_c_exits_130_with_one_line(tiny, tmp_path, moment):
    r = _interrupt_at(tiny, moment, tmp_path)
    assert r.returncode == 130, (moment, r.returncode, r.stderr[-3000:])
    assert r.stderr.rstrip().splitlines()[-1] == "interrupted", r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Segmentation" not in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_unusable_cache_dir_does_not_stop_the_cli(tiny, tmp_path):
    a_file = tmp_path / "cache-is-a-file"
    a_file.write_text("x")
    r = subprocess.run([sys.executable, "-m", "llm", "generate", "-m", str(tiny), "-p", "hi", "-n", "3", "-c", "64"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "GGMLX_CACHE_DIR": str(a_file)})
    assert r.returncode == 0, r.stderr
    assert "warning: compile cache" in r.stderr and "not usable" in r.stderr
    assert r.stdout.strip()


@pytest.mark.slow
def test_ctrl_c_while_chat_waits_for_input(tiny, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "llm", "chat", "-m", str(tiny), "-c", "64"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "GGMLX_CACHE_DIR": str(tmp_path)})
    assert proc.stderr.readline().startswith(b"loading")
    time.sleep(5)       # loaded: now blocked reading stdin (which stays open)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.decode().strip().splitlines()[-1] == "interrupted" and b"Traceback" not in err
