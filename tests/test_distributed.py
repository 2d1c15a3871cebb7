"""Multi-host runs through jax.distributed on localhost: 2 processes with 2 simulated CPU
devices each (gloo collectives) and a tiny model split by rows over all 4 devices generate
the greedy tokens of one process; a process count mismatch, an unreachable coordinator and
a killed process are clear errors within a timeout. Each process runs
tests/distributed_check.py."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed_check import PROMPT
from tiny_model import TinySpec, write_model

import llm
from llm import distributed

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "distributed_check.py"
# 4 heads / 4 KV heads: attention and the KV cache divided by heads over the 4 devices
SPEC = TinySpec(arch="llama", n_layer=2, n_head=4, n_head_kv=4, seed=21)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"),
                                                                     os.environ.get("PYTHONPATH")])))
    e.pop("XLA_FLAGS", None)
    return e


def start(coordinator: str, n: int, pid: int, model: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), coordinator, str(n), str(pid), str(model), str(out),
                             *extra], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("dist") / "tiny.gguf", SPEC)


# ---- argument errors (no JAX involved) ---------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    (dict(coordinator="localhost", num_processes=2, process_id=0), "must be 'host:port'"),
    (dict(coordinator="localhost:1234", num_processes=2, process_id=2), r"process_id must be in \[0, 2\)"),
    (dict(coordinator="localhost:1234", num_processes=0, process_id=0), "num_processes must be >= 1"),
])
def test_bad_arguments(kw, msg):
    with pytest.raises(distributed.DistributedError, match=msg):
        distributed.initialize(**kw)


def test_missing_arguments_name_the_env_vars(monkeypatch):
    for k in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(distributed.DistributedError, match="JAX_COORDINATOR_ADDRESS"):
        distributed.initialize()
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(distributed.DistributedError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        distributed.initialize("localhost:1", process_id=0)


# ---- real processes ------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_generate_the_one_process_tokens(model, tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    out = tmp_path / "tokens.json"
    procs = [start(coord, 2, pid, model, out) for pid in (0, 1)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-4000:]
    got = json.loads(out.read_text())
    assert got["n_devices"] == 4 and got["local"] == 2
    assert len(got["held"]) == 2 + 7 * SPEC.n_layer
    for name, (local, total) in got["held"].items():
        assert local * 2 == total, name          # process 0 loaded only its 2 of 4 shards
    one = llm.LLM(model, n_ctx=64, n_batch=16, n_ubatch=16, devices=[])
    assert got["first"] == one.generate(PROMPT, max_tokens=8, temperature=0.0).tokens
    assert got["second"] == one.generate(PROMPT[:5] + [5, 6], max_tokens=8, temperature=0.0).tokens
    assert "followed" in results[1][1]


@pytest.mark.slow
def test_process_count_mismatch_is_an_error_on_both_sides(model, tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    p0 = start(coord, 2, 0, model, tmp_path / "x.json")
    p1 = start(coord, 3, 1, model, tmp_path / "x.json")
    err0, err1 = p0.communicate(timeout=120)[1], p1.communicate(timeout=120)[1]
    assert time.monotonic() - t0 < 90
    assert p0.returncode != 0 and p1.returncode != 0
    assert "process 0 was started with num_processes=2, process 1 with num_processes=3" in err0
    assert "process 1 was started with num_processes=3, process 0 with num_processes=2" in err1


@pytest.mark.slow
def test_unreachable_coordinator_is_an_error_within_the_timeout():
    code = ("import llm.distributed as d\n"
            f"d.initialize('127.0.0.1:{free_port()}', 2, 1, timeout_s=3)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    assert "DistributedError: coordinator 127.0.0.1:" in proc.stderr and "not reachable after 3 s" in proc.stderr


@pytest.mark.slow
def test_killed_process_stops_the_other_with_an_error_naming_it(model, tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    p0 = start(coord, 2, 0, model, tmp_path / "x.json", "-1")     # generates until it fails
    p1 = start(coord, 2, 1, model, tmp_path / "x.json")
    try:
        deadline = time.monotonic() + 300
        line = ""
        while "generating" not in line and time.monotonic() < deadline:
            line = p0.stderr.readline()
            assert line or p0.poll() is None, "process 0 ended before generating"
        time.sleep(2)
        p1.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        _, err = p0.communicate(timeout=120)
        assert time.monotonic() - t_kill < 60         # heartbeat timeout 5 s in the check script
        assert p0.returncode != 0
        assert "unhealthy" in err and "stopped sending heartbeats" in err and "\n1\n" in err, err[-3000:]
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
                p.wait()
