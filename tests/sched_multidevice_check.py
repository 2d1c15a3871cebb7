"""A small transformer-like graph for the scheduler tests, and its multi-device checks.

Imported (by tests/test_sched.py, on the pytest process's one device) it offers the graph
builder and a float64 numpy reference of every named intermediate. Run as a script with an
output path, it first makes JAX see 4 CPU devices (before any other JAX use), runs the
graph with its layers spread over 1, 2, 3 and 4 devices through `ggmlx.sched.Scheduler`,
and writes the facts the tests assert on (split and copy counts, cache stats, values,
devices, dumps) as one JSON file, a check that raised as its traceback: the assertions
live in test_sched.py.
"""
from __future__ import annotations

import json
import math
import sys
import traceback
from dataclasses import dataclass

import jax
import numpy as np

import ggmlx
from ggmlx import ops, weights
from ggmlx.backend import Backend, backend_of, backends
from ggmlx.compile import GraphCache
from ggmlx.graph import Graph
from ggmlx.sched import Observed, Plan, Scheduler
from ggmlx.tensor import Tensor, new_input, new_state, new_weight
from ggmlx.types import GGMLType

F32 = GGMLType.F32
N_EMBD = 32
N_TOKENS = 4
N_KV = 8            # rows of each layer's cache
N_KV_READ = 7       # rows the attention reads back through a view (a padded n_kv in llama)
N_VOCAB = 24
N_LAYER = 8
EPS = 1e-5
KQ_SCALE = 1.0 / math.sqrt(N_EMBD)
N_DEVICES = 4


@dataclass
class ModelValues:
    """Weights, the initial cache and the inputs, numpy order, fixed by a seed."""
    attn_norm: list[np.ndarray]     # [N_EMBD] per layer
    wk: list[np.ndarray]            # [N_EMBD, N_EMBD] per layer
    wo: list[np.ndarray]            # [N_EMBD, N_EMBD] per layer
    cache: list[np.ndarray]         # [N_KV, N_EMBD] per layer: what earlier tokens left there
    output_norm: np.ndarray         # [N_EMBD]
    output: np.ndarray              # [N_VOCAB, N_EMBD]
    x: np.ndarray                   # [N_TOKENS, N_EMBD] input embeddings
    rows: np.ndarray                # [N_TOKENS] int32 cache rows the tokens are written to


def make_values(seed: int = 0) -> ModelValues:
    rng = np.random.default_rng(seed)

    def mat(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return ModelValues(
        attn_norm=[1.0 + mat(N_EMBD, scale=0.1) for _ in range(N_LAYER)],
        wk=[mat(N_EMBD, N_EMBD, scale=N_EMBD ** -0.5) for _ in range(N_LAYER)],
        wo=[mat(N_EMBD, N_EMBD, scale=N_EMBD ** -0.5) for _ in range(N_LAYER)],
        cache=[mat(N_KV, N_EMBD) for _ in range(N_LAYER)],
        output_norm=1.0 + mat(N_EMBD, scale=0.1),
        output=mat(N_VOCAB, N_EMBD, scale=N_EMBD ** -0.5),
        x=mat(N_TOKENS, N_EMBD),
        rows=np.array([3, 4, 5, 6], dtype=np.int32),
    )


@dataclass
class ModelGraph:
    graph: Graph
    x: Tensor
    rows: Tensor
    cache: list[Tensor]             # the state leaves, one per layer
    result: Tensor
    values: ModelValues

    def inputs(self) -> dict[Tensor, np.ndarray]:
        return {self.x: self.values.x, self.rows: self.values.rows}

    def fresh_state(self) -> dict[Tensor, jax.Array]:
        """New cache buffers on each layer's device (compute donates the ones it is given)."""
        return {t: jax.device_put(self.values.cache[il].reshape(t.shape), _device_of(t.data))
                for il, t in enumerate(self.cache)}


def _device_of(x: jax.Array) -> jax.Device:
    (d,) = x.sharding.device_set
    return d


def _weight(name: str, value: np.ndarray, device: jax.Device) -> Tensor:
    ne = tuple(reversed(value.shape))
    return new_weight(F32, ne, name, weights.to_device(value, F32, ne, device))


def build_model(values: ModelValues, layer_devices: list[jax.Device], output_device: jax.Device) -> ModelGraph:
    """Per layer: rms_norm * attn_norm, Kcur = wk x, Kcur written into the layer's cache
    (a state) with set_rows, the first N_KV_READ cache rows read back through a view for a
    soft-maxed attention, wo, residual add. Each layer's weights and cache live on
    layer_devices[il]; output_norm and output on output_device."""
    x = new_input(F32, (N_EMBD, N_TOKENS), "inp_embd")
    rows = new_input(GGMLType.I32, (N_TOKENS,), "kv_rows")
    caches = []
    inp = x
    for il, dev in enumerate(layer_devices):
        cache = new_state(F32, (N_EMBD, N_KV), f"cache_k_l{il}")
        cache.data = jax.device_put(values.cache[il].reshape(cache.shape), dev)
        caches.append(cache)
        cur = ops.rms_norm(inp, EPS).set_name(f"norm-{il}")
        cur = ops.mul(cur, _weight(f"blk.{il}.attn_norm.weight", values.attn_norm[il], dev)).set_name(f"attn_norm-{il}")
        kcur = ops.mul_mat(_weight(f"blk.{il}.attn_k.weight", values.wk[il], dev), cur).set_name(f"Kcur-{il}")
        stored = ops.set_rows(cache, kcur, rows).set_name(f"k_stored-{il}")
        k = ops.view_2d(stored, N_EMBD, N_KV_READ, stored.nb[1], 0).set_name(f"k-{il}")
        kq = ops.mul_mat(k, cur).set_name(f"kq-{il}")
        kq = ops.soft_max_ext(kq, None, KQ_SCALE, 0.0).set_name(f"kq_soft_max-{il}")
        kt = ops.cont(ops.transpose(k).set_name(f"kT-{il}")).set_name(f"kT_cont-{il}")
        kqv = ops.mul_mat(kt, kq).set_name(f"kqv-{il}")
        ffn = ops.mul_mat(_weight(f"blk.{il}.attn_output.weight", values.wo[il], dev), kqv).set_name(f"attn_out-{il}")
        inp = ops.add(ffn, inp).set_name(f"l_out-{il}")
    cur = ops.rms_norm(inp, EPS).set_name("norm")
    cur = ops.mul(cur, _weight("output_norm.weight", values.output_norm, output_device)).set_name("result_norm")
    result = ops.mul_mat(_weight("output.weight", values.output, output_device), cur).set_name("result_output")
    result.set_output()
    graph = Graph().build_forward_expand(result)
    return ModelGraph(graph, x, rows, caches, result, values)


def reference(values: ModelValues) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """float64 values of the named intermediates (numpy order, 2-d) and the new caches."""
    def rms_norm(a):
        return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + EPS)

    named: dict[str, np.ndarray] = {}
    caches = []
    inp = values.x.astype(np.float64)
    for il in range(N_LAYER):
        cur = rms_norm(inp) * values.attn_norm[il]
        kcur = cur @ values.wk[il].T.astype(np.float64)
        cache = values.cache[il].astype(np.float64)
        cache[values.rows] = kcur
        k = cache[:N_KV_READ]
        kq = cur @ k.T * KQ_SCALE
        p = np.exp(kq - kq.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        kqv = p @ k
        l_out = kqv @ values.wo[il].T.astype(np.float64) + inp
        named.update({f"attn_norm-{il}": cur, f"Kcur-{il}": kcur, f"k-{il}": k, f"kq_soft_max-{il}": p,
                      f"kqv-{il}": kqv, f"l_out-{il}": l_out})
        caches.append(cache)
        inp = l_out
    cur = rms_norm(inp) * values.output_norm
    named["result_norm"] = cur
    named["result_output"] = cur @ values.output.T.astype(np.float64)
    return named, caches


def layer_devices(devices: list[jax.Device], n_spread: int) -> list[jax.Device]:
    """Contiguous runs of layers per device, as llama.cpp's tensor_split assigns them."""
    return [devices[il * n_spread // N_LAYER] for il in range(N_LAYER)]


def split_keys(plan: Plan) -> list[str]:
    return [GraphCache.key_of(s.program.signature()) for s in plan.splits]


def split_output_names(plan: Plan) -> list[list[str]]:
    return [[t.name for t in s.program.outputs] for s in plan.splits]


def _array(x) -> list:
    return np.asarray(x, dtype=np.float64).tolist()


# ---- the checks run on 4 devices ----------------------------------------------------------

def check_spread(values: ModelValues, bk: list[Backend], n_spread: int) -> dict:
    """One run, then a rebuilt identical graph through the same cache."""
    devices = [b.device for b in bk]
    devs = layer_devices(devices, n_spread)
    cache = GraphCache()
    sched = Scheduler(bk, cache)
    m = build_model(values, devs, devices[0])
    plan = sched.alloc_graph(m.graph)
    outs, state_out, completed = sched.compute(plan, m.inputs(), m.fresh_state())
    misses_first = cache.stats.misses
    hits_first = cache.stats.hits
    rebuilt = build_model(values, devs, devices[0])
    plan2 = sched.alloc_graph(rebuilt.graph)
    outs2, _, _ = sched.compute(plan2, rebuilt.inputs(), rebuilt.fresh_state())
    return {
        "completed": completed,
        "n_splits": plan.n_splits,
        "n_copies": plan.n_copies,
        "split_backends": [s.backend.name for s in plan.splits],
        "split_copies": [[c.name for c in s.copies] for s in plan.splits],
        "layer_backends": [backend_of(d).name for d in devs],
        "result": _array(outs[m.result]),
        "cache": [_array(state_out[t]) for t in m.cache],
        "cache_backends": [backend_of(_device_of(state_out[t])).name for t in m.cache],
        "misses_first": misses_first,
        "hits_first": hits_first,
        "rebuilt_misses": cache.stats.misses - misses_first,
        "rebuilt_hits": cache.stats.hits - hits_first,
        "rebuilt_result": _array(outs2[rebuilt.result]),
        "dump": plan.dump(),
        "dot": m.graph.dump_dot(placement=plan.backend_name),
    }


def check_eval_callback(values: ModelValues, bk: list[Backend], wanted: list[str]) -> dict:
    """Observe `wanted` on the 4-device spread: every node is asked once, values come back."""
    devices = [b.device for b in bk]
    m = build_model(values, layer_devices(devices, N_DEVICES), devices[0])
    asked, got = [], []

    def cb(t, ask: bool) -> bool:
        if ask:
            asked.append(t.name if isinstance(t, Tensor) else repr(t))
            return t.name in wanted
        got.append({"name": t.name, "observed": isinstance(t, Observed), "ne": list(t.ne),
                    "value": _array(t.value)})
        return True

    cache = GraphCache()
    plain = Scheduler(bk, cache).alloc_graph(m.graph)
    none = Scheduler(bk, cache, cb_eval=lambda t, ask: not ask).alloc_graph(m.graph)
    some = Scheduler(bk, cache, cb_eval=cb).alloc_graph(m.graph)
    Scheduler(bk, cache).compute(plain, m.inputs(), m.fresh_state())
    misses_plain = cache.stats.misses
    Scheduler(bk, cache, cb_eval=lambda t, ask: not ask).compute(none, m.inputs(), m.fresh_state())
    misses_none = cache.stats.misses - misses_plain
    outs, _, completed = Scheduler(bk, cache, cb_eval=cb).compute(some, m.inputs(), m.fresh_state())
    return {
        "node_names": [n.name for n in m.graph.nodes],
        "asked": asked,
        "got": got,
        "completed": completed,
        "result": _array(outs[m.result]),
        "keys_plain": split_keys(plain), "keys_none": split_keys(none), "keys_some": split_keys(some),
        "outputs_plain": split_output_names(plain), "outputs_none": split_output_names(none),
        "outputs_some": split_output_names(some),
        "misses_plain": misses_plain, "misses_none": misses_none,
    }


def check_stop(values: ModelValues, bk: list[Backend]) -> dict:
    """cb_eval returns False at l_out-1 (first split of 4): the later splits must not run."""
    devices = [b.device for b in bk]
    m = build_model(values, layer_devices(devices, N_DEVICES), devices[0])
    seen = []

    def cb(t, ask: bool) -> bool:
        if ask:
            return t.name in ("l_out-1", "l_out-5")
        seen.append(t.name)
        return t.name != "l_out-1"

    sched = Scheduler(bk, GraphCache(), cb_eval=cb)
    plan = sched.alloc_graph(m.graph)
    outs, state_out, completed = sched.compute(plan, m.inputs(), m.fresh_state())
    return {
        "completed": completed,
        "seen": seen,
        "output_names": [t.name for t in outs],
        "cache_changed": [bool(not np.array_equal(np.asarray(state_out[t]), values.cache[il].reshape(t.shape)))
                          for il, t in enumerate(m.cache)],
    }


def check_reserve(values: ModelValues, bk: list[Backend]) -> dict:
    devices = [b.device for b in bk]
    m = build_model(values, layer_devices(devices, N_DEVICES), devices[0])
    cache = GraphCache()
    sched = Scheduler(bk, cache)
    plan = sched.alloc_graph(m.graph)
    sched.reserve(plan, m.inputs(), m.fresh_state())
    after_reserve = cache.stats.misses
    outs, _, _ = sched.compute(plan, m.inputs(), m.fresh_state())
    return {"n_splits": plan.n_splits, "misses_after_reserve": after_reserve,
            "misses_after_compute": cache.stats.misses, "result": _array(outs[m.result])}


def check_state_home(bk: list[Backend]) -> dict:
    """A cache on CPU2 written by set_rows stays on CPU2, though the weights are on CPU0; a
    state on CPU3 that a CPU0 node only reads is copied in, and stays unchanged on CPU3."""
    devices = [b.device for b in bk]
    rng = np.random.default_rng(1)
    w_val = rng.standard_normal((8, 8)).astype(np.float32)
    w2_val = rng.standard_normal((8, 8)).astype(np.float32)
    s_val = rng.standard_normal((4, 8)).astype(np.float32)
    r_val = rng.standard_normal((2, 8)).astype(np.float32)
    x_val = rng.standard_normal((2, 8)).astype(np.float32)
    rows_val = np.array([1, 2], dtype=np.int32)

    x = new_input(F32, (8, 2), "x")
    rows = new_input(GGMLType.I32, (2,), "rows")
    s = new_state(F32, (8, 4), "written_state")
    s.data = jax.device_put(s_val.reshape(s.shape), devices[2])
    r = new_state(F32, (8, 2), "read_state")
    r.data = jax.device_put(r_val.reshape(r.shape), devices[3])
    cur = ops.mul_mat(_weight("w", w_val, devices[0]), x).set_name("cur")
    stored = ops.set_rows(s, cur, rows).set_name("stored")
    v = ops.view_2d(stored, 8, 2, stored.nb[1], stored.nb[1]).set_name("stored_view")
    mm = ops.mul_mat(_weight("w2", w2_val, devices[0]), r).set_name("read")
    y = ops.add(v, mm).set_name("y")
    g = Graph().build_forward_expand(y)
    sched = Scheduler(bk, GraphCache())
    plan = sched.alloc_graph(g)
    r_in = jax.device_put(r_val.reshape(r.shape), devices[3])
    outs, state_out, completed = sched.compute(
        plan, {x: x_val, rows: rows_val}, {s: jax.device_put(s_val.reshape(s.shape), devices[2]), r: r_in})

    cur_ref = x_val.astype(np.float64) @ w_val.T
    s_ref = s_val.astype(np.float64)
    s_ref[rows_val] = cur_ref
    y_ref = s_ref[1:3] + r_val.astype(np.float64) @ w2_val.T
    return {
        "completed": completed,
        "n_splits": plan.n_splits,
        "n_copies": plan.n_copies,
        "split_backends": [sp.backend.name for sp in plan.splits],
        "split_copies": [[c.name for c in sp.copies] for sp in plan.splits],
        "written_backend": backend_of(_device_of(state_out[s])).name,
        "read_backend": backend_of(_device_of(state_out[r])).name,
        "read_is_input_buffer": state_out[r] is r_in,
        "written": _array(state_out[s]), "written_ref": _array(s_ref),
        "read": _array(state_out[r]), "read_ref": _array(r_val),
        "y": _array(outs[y]), "y_ref": _array(y_ref),
        "dump": plan.dump(),
    }


def _run(check, *args) -> dict:
    """A check's facts, or {"error": traceback}: one failing check must not hide the others."""
    try:
        return check(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def main(out_path: str) -> None:
    ggmlx.init()
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
    bk = [b for b in backends() if b.kind == "cpu"]
    if len(bk) != N_DEVICES:
        raise RuntimeError(f"expected {N_DEVICES} CPU devices, JAX shows {len(bk)}")
    values = make_values()
    report = {
        "backends": [b.name for b in bk],
        "spreads": {str(n): _run(check_spread, values, bk, n) for n in range(1, N_DEVICES + 1)},
        "eval_callback": _run(check_eval_callback, values, bk, ["Kcur-1", "k-3", "l_out-4", "kq_soft_max-6"]),
        "stop": _run(check_stop, values, bk),
        "reserve": _run(check_reserve, values, bk),
        "state_home": _run(check_state_home, bk),
    }
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
