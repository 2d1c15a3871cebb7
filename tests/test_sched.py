"""Scheduler tests: placement over several devices, splits and copies, the compiled-graph
cache across rebuilt graphs, state buffers staying home, the eval callback, reserve and the
placement dumps.

The multi-device checks run once, in a subprocess that sees 4 simulated CPU devices
(tests/sched_multidevice_check.py writes what it measured as JSON); this pytest process
keeps its one device and tests the single-device behaviour directly.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import sched_multidevice_check as model

from ggmlx import ops
from ggmlx.backend import Backend, backend_of, backends, cpu_backend
from ggmlx.compile import GraphCache
from ggmlx.graph import Graph
from ggmlx.sched import Scheduler
from ggmlx.tensor import new_input, new_state
from ggmlx.types import GGMLType

ROOT = Path(__file__).resolve().parent.parent
MULTIDEV_SCRIPT = Path(__file__).resolve().parent / "sched_multidevice_check.py"

# splits and copies of the 8-layer model with layers spread over n devices and the output
# on CPU0: each device boundary copies the next layer's rms_norm result (that norm still runs
# where the previous layer ran, as ggml's forward expansion places it) and the residual.
EXPECTED_SPLITS = {
    1: (["CPU0"], [[]]),
    2: (["CPU0", "CPU1", "CPU0"], [[], ["norm-4", "l_out-3"], ["norm"]]),
    3: (["CPU0", "CPU1", "CPU2", "CPU0"], [[], ["norm-3", "l_out-2"], ["norm-6", "l_out-5"], ["norm"]]),
    4: (["CPU0", "CPU1", "CPU2", "CPU3", "CPU0"],
        [[], ["norm-2", "l_out-1"], ["norm-4", "l_out-3"], ["norm-6", "l_out-5"], ["norm"]]),
}
OBSERVED = ["Kcur-1", "k-3", "l_out-4", "kq_soft_max-6"]   # what the subprocess's callback asks for


def nmse(a, b) -> float:
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


@pytest.fixture(scope="module")
def multidev(tmp_path_factory) -> tuple[dict, str]:
    """(the JSON report, stderr) of one run of the 4-device checks with GGMLX_SCHED_DEBUG=1."""
    out = tmp_path_factory.mktemp("sched") / "report.json"
    env = dict(os.environ, GGMLX_SCHED_DEBUG="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)      # the script sets the device count itself
    proc = subprocess.run([sys.executable, str(MULTIDEV_SCRIPT), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"multi-device checks failed:\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc.stderr


def section(multidev, *path: str) -> dict:
    """One check's facts from the report; fails with the check's traceback if it raised."""
    facts = multidev[0]
    for key in path:
        facts = facts[key]
    if "error" in facts:
        pytest.fail(f"multi-device check {'/'.join(path)} raised:\n{facts['error']}")
    return facts


@pytest.fixture(scope="module")
def ref():
    return model.reference(model.make_values())


# ---- several devices ----------------------------------------------------------------------

def test_subprocess_sees_four_cpu_backends(multidev):
    report, _ = multidev
    assert report["backends"] == ["CPU0", "CPU1", "CPU2", "CPU3"]
    assert len(jax.devices()) == 1, "this pytest process must keep one device"


def test_one_device_run_matches_numpy_reference(multidev, ref):
    named, caches = ref
    one = section(multidev, "spreads", "1")
    assert nmse(one["result"], named["result_output"]) <= 1e-10
    for il, cache in enumerate(caches):
        assert nmse(one["cache"][il], cache) <= 1e-10, f"cache of layer {il}"


@pytest.mark.parametrize("n_spread", [2, 3, 4])
def test_spread_over_devices_matches_one_device(multidev, n_spread):
    run, one = section(multidev, "spreads", str(n_spread)), section(multidev, "spreads", "1")
    assert run["completed"]
    assert nmse(run["result"], one["result"]) <= 1e-12
    for il in range(model.N_LAYER):
        assert nmse(run["cache"][il], one["cache"][il]) <= 1e-12, f"cache of layer {il}"


@pytest.mark.parametrize("n_spread", [1, 2, 3, 4])
def test_splits_and_copies_are_as_expected(multidev, n_spread):
    run = section(multidev, "spreads", str(n_spread))
    split_backends, split_copies = EXPECTED_SPLITS[n_spread]
    assert run["split_backends"] == split_backends
    assert run["split_copies"] == split_copies
    assert run["n_splits"] == len(split_backends)
    assert run["n_copies"] == sum(len(c) for c in split_copies) == (0 if n_spread == 1 else 2 * n_spread - 1)


@pytest.mark.parametrize("n_spread", [1, 2, 3, 4])
def test_rebuilt_identical_graph_compiles_nothing_new(multidev, n_spread):
    run = section(multidev, "spreads", str(n_spread))
    assert run["misses_first"] == run["n_splits"]       # one executable per split
    assert run["hits_first"] == 0
    assert run["rebuilt_misses"] == 0
    assert run["rebuilt_hits"] == run["n_splits"]
    assert run["rebuilt_result"] == run["result"]


@pytest.mark.parametrize("n_spread", [2, 3, 4])
def test_cache_state_is_updated_on_its_own_device(multidev, n_spread):
    run = section(multidev, "spreads", str(n_spread))
    assert run["cache_backends"] == run["layer_backends"]
    assert len(set(run["layer_backends"])) == n_spread


def test_state_placed_apart_from_the_weights_stays_home(multidev):
    home = section(multidev, "state_home")
    assert home["completed"]
    # set_rows follows the written state to CPU2; the CPU3 state is copied into the CPU0 split
    assert home["split_backends"] == ["CPU0", "CPU2", "CPU0"]
    assert home["split_copies"] == [[], ["cur"], ["read_state", "stored_view"]]
    assert home["n_copies"] == 3
    assert home["written_backend"] == "CPU2"
    assert nmse(home["written"], home["written_ref"]) <= 1e-12
    assert home["read_backend"] == "CPU3"
    assert home["read_is_input_buffer"], "a state only read elsewhere must keep its own buffer"
    assert home["read"] == np.asarray(home["read_ref"]).reshape(1, 1, 2, 8).tolist()
    assert nmse(home["y"], home["y_ref"]) <= 1e-12


def test_eval_callback_asks_every_node_once(multidev):
    cb = section(multidev, "eval_callback")
    assert cb["asked"] == cb["node_names"]
    assert len(cb["asked"]) == len(set(cb["asked"]))


def test_eval_callback_gets_exactly_the_asked_tensors_with_their_values(multidev, ref):
    named, _ = ref
    cb = section(multidev, "eval_callback")
    assert [g["name"] for g in cb["got"]] == OBSERVED      # graph order, each once
    for g in cb["got"]:
        assert g["observed"], "ask=False must pass an Observed"
        value = np.asarray(g["value"])
        assert value.shape == tuple(reversed(g["ne"]))
        assert nmse(value, named[g["name"]]) <= 1e-10, g["name"]
    assert cb["completed"]
    assert cb["result"] == section(multidev, "spreads", "4")["result"], "observing must not change the result"


def test_eval_callback_asking_for_none_costs_no_extra_outputs(multidev):
    cb = section(multidev, "eval_callback")
    assert cb["keys_none"] == cb["keys_plain"]
    assert cb["outputs_none"] == cb["outputs_plain"]
    assert cb["misses_plain"] == len(cb["keys_plain"])
    assert cb["misses_none"] == 0
    # observed tensors are extra outputs of the splits that compute them: other cache entries
    pairs = zip(cb["outputs_some"], cb["outputs_plain"], strict=True)
    extra = [[n for n in some if n not in plain] for some, plain in pairs]
    assert extra == [["Kcur-1"], ["k-3"], ["l_out-4"], ["kq_soft_max-6"], []]
    assert [a != b for a, b in zip(cb["keys_some"], cb["keys_plain"], strict=False)] == [True, True, True, True, False]


def test_eval_callback_returning_false_stops_the_computation(multidev):
    stop = section(multidev, "stop")
    assert not stop["completed"]
    assert stop["seen"] == ["l_out-1"]                    # l_out-5 is never reported
    assert stop["output_names"] == []                     # result_output was not computed
    # only the first split (layers 0 and 1 on CPU0) ran
    assert stop["cache_changed"] == [True, True] + [False] * (model.N_LAYER - 2)


def test_reserve_compiles_every_split_ahead(multidev, ref):
    res = section(multidev, "reserve")
    assert res["misses_after_reserve"] == res["n_splits"] == 5
    assert res["misses_after_compute"] == res["misses_after_reserve"]
    assert nmse(res["result"], ref[0]["result_output"]) <= 1e-10


def test_debug_env_prints_the_split_dump(multidev):
    stderr = multidev[1]
    dump = section(multidev, "spreads", "4")["dump"]
    assert dump in stderr
    lines = dump.splitlines()
    assert lines[0] == "## SPLIT GRAPH: 5 splits, 7 copies"
    assert "## SPLIT #1: CPU1 # 24 nodes, 2 inputs copied: norm-2 (CPU0->CPU1), l_out-1 (CPU0->CPU1)" in lines
    assert "## SPLIT #4: CPU0 # 2 nodes, 1 inputs copied: norm (CPU3->CPU0)" in lines
    assert sum(1 for ln in lines if ln.startswith("node #")) == len(section(multidev, "eval_callback")["node_names"])


def test_dot_dump_colours_nodes_by_backend(multidev):
    dot = section(multidev, "spreads", "2")["dot"]
    colour_of: dict[str, set[str]] = {}
    for m in re.finditer(r'shape=record, style="rounded,filled", fillcolor="([^"]+)", label="([^"]*)"', dot):
        colour_of.setdefault(m.group(2).split(" | ")[-1], set()).add(m.group(1))
    assert sorted(colour_of) == ["CPU0", "CPU1"]
    assert all(len(c) == 1 for c in colour_of.values()), colour_of
    assert colour_of["CPU0"] != colour_of["CPU1"]


# ---- this process's one device --------------------------------------------------------

def _one_device_model():
    dev = jax.devices()[0]
    return model.build_model(model.make_values(), [dev] * model.N_LAYER, dev)


def test_backends_list_the_jax_devices():
    bk = backends()
    assert [b.device for b in bk if b.kind == "cpu"] == jax.devices("cpu")
    assert cpu_backend().name == "CPU0" and cpu_backend().kind == "cpu"
    assert backend_of(jax.devices("cpu")[0]) == cpu_backend()


def test_debug_env_logs_the_dump(monkeypatch, caplog):
    """GGMLX_SCHED_DEBUG=1 logs the split dump at WARNING on ggmlx.sched (shown without any
    logging setup; the subprocess checks see it on stderr); unset, nothing is logged."""
    m = _one_device_model()
    monkeypatch.setenv("GGMLX_SCHED_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="ggmlx.sched"):
        plan = Scheduler([cpu_backend()], GraphCache()).alloc_graph(m.graph)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == \
        [("ggmlx.sched", logging.WARNING, plan.dump())]
    assert plan.dump().startswith("## SPLIT GRAPH: 1 splits, 0 copies")
    caplog.clear()
    monkeypatch.delenv("GGMLX_SCHED_DEBUG")
    with caplog.at_level(logging.DEBUG, logger="ggmlx.sched"):
        Scheduler([cpu_backend()], GraphCache()).alloc_graph(m.graph)
    assert caplog.records == []


def test_reserve_then_compute_on_one_device(ref):
    m = _one_device_model()
    cache = GraphCache()
    sched = Scheduler([cpu_backend()], cache)
    plan = sched.alloc_graph(m.graph)
    sched.reserve(plan, m.inputs(), m.fresh_state())
    assert (cache.stats.misses, cache.stats.hits) == (1, 0)
    outs, _, completed = sched.compute(plan, m.inputs(), m.fresh_state())
    assert completed and cache.stats.misses == 1
    assert nmse(outs[m.result], ref[0]["result_output"]) <= 1e-10


def test_state_buffer_with_wrong_shape_or_type_is_named():
    x = new_input(GGMLType.F32, (4, 2), "x")
    rows = new_input(GGMLType.I32, (2,), "rows")
    st = new_state(GGMLType.F32, (4, 3), "cache_k_l0")
    st.data = jax.device_put(np.zeros(st.shape, np.float32))
    y = ops.view_2d(ops.set_rows(st, x, rows), 4, 3, 16, 0)
    g = Graph().build_forward_expand(ops.scale(y, 2.0))
    sched = Scheduler([cpu_backend()], GraphCache())
    plan = sched.alloc_graph(g)
    inputs = {x: np.ones((2, 4), np.float32), rows: np.array([0, 2], np.int32)}
    with pytest.raises(ValueError, match=r"state 'cache_k_l0'.*float32\[3, 4\].*float32\[1, 1, 3, 4\]"):
        sched.compute(plan, inputs, {st: jax.device_put(np.zeros((3, 4), np.float32))})
    with pytest.raises(ValueError, match=r"state 'cache_k_l0'.*float16"):
        sched.reserve(plan, inputs, {st: jax.device_put(np.zeros(st.shape, np.float16))})
    with pytest.raises(ValueError, match=r"no buffer for state 'cache_k_l0'"):
        sched.compute(plan, inputs, {})
    outs, state, completed = sched.compute(plan, inputs, {st: jax.device_put(np.zeros(st.shape, np.float32))})
    assert completed
    np.testing.assert_array_equal(np.asarray(state[st])[0, 0], [[1] * 4, [0] * 4, [1] * 4])
    # the state the run returned goes back unchecked; any other buffer is checked again
    outs, state, completed = sched.compute(plan, inputs, state)
    assert completed
    with pytest.raises(ValueError, match=r"state 'cache_k_l0'.*float32\[3, 4\]"):
        sched.compute(plan, inputs, {st: jax.device_put(np.zeros((3, 4), np.float32))})


def test_scheduler_uses_the_backend_list_given():
    g = Graph().build_forward_expand(ops.scale(new_input(GGMLType.F32, (4,), "x"), 3.0))
    only = Backend("CPU0", "cpu", jax.devices("cpu")[0])
    plan = Scheduler([only], GraphCache()).alloc_graph(g)
    assert [s.backend for s in plan.splits] == [only]
    assert plan.backend_name(g.nodes[0]) == "CPU0"
    assert plan.backend_name(g.leafs[0]) == "host"
