"""The compiled-graph cache: keyed by structure, never by weight values; misses say why;
state is donated so a set_rows into the KV cache stays in place; the persistent XLA
cache directory fills so a second process starts warm."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ggmlx import ops, weights
from ggmlx.compile import GraphCache, compute
from ggmlx.graph import Graph
from ggmlx.tensor import new_input, new_state, new_weight
from ggmlx.types import GGMLType as T

N_EMBD, N_FF = 8, 12


def mlp(w_up: np.ndarray, w_down: np.ndarray, n_tokens: int, eps: float = 1e-5):
    """rms_norm -> up -> silu -> down, built from scratch each call (new Tensor objects)."""
    x = new_input(T.F32, (N_EMBD, n_tokens), "inp_embd")
    up = new_weight(T.F32, (N_EMBD, N_FF), "ffn_up.weight", weights.to_device(w_up, T.F32, (N_EMBD, N_FF)))
    down = new_weight(T.F16, (N_FF, N_EMBD), "ffn_down.weight", weights.to_device(w_down, T.F16, (N_FF, N_EMBD)))
    cur = ops.rms_norm(x, eps).set_name("ffn_norm")
    cur = ops.silu(ops.mul_mat(up, cur).set_name("ffn_up")).set_name("ffn_act")
    out = ops.mul_mat(down, cur).set_name("ffn_out")
    return Graph().build_forward_expand(out), x, out


def mlp_ref(xv, w_up, w_down, eps=1e-5):
    x = xv.astype(np.float64)
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    h = x @ w_up.astype(np.float64).T
    h = h / (1 + np.exp(-h))
    return h @ w_down.astype(np.float16).astype(np.float64).T


def weights_pair(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N_FF, N_EMBD)).astype(np.float32),
            rng.standard_normal((N_EMBD, N_FF)).astype(np.float32))


def test_an_empty_cache_is_truthy_and_used():
    """`cache or default` must keep an empty cache: len() counts entries, bool() is always True."""
    cache = GraphCache()
    assert cache and len(cache) == 0
    wu, wd = weights_pair(0)
    g, x, _ = mlp(wu, wd, 2)
    compute(g, {x: np.ones((2, N_EMBD))}, cache=cache)
    assert (len(cache), cache.stats.misses) == (1, 1)


def test_identical_rebuild_hits_and_changed_shape_compiles_once():
    cache = GraphCache()
    wu, wd = weights_pair(0)
    xv = np.random.default_rng(1).standard_normal((3, N_EMBD))
    g, x, out = mlp(wu, wd, 3)
    compute(g, {x: xv}, cache=cache)
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (1, 0, 1)
    assert cache.stats.compile_seconds > 0

    g, x, out = mlp(wu, wd, 3)                          # same structure, new Tensor objects
    res, _ = compute(g, {x: xv}, cache=cache)
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (1, 1, 1)
    np.testing.assert_allclose(np.asarray(res[out])[0, 0], mlp_ref(xv, wu, wd), rtol=1e-5, atol=1e-5)

    g, x, out = mlp(wu, wd, 5)                          # another n_tokens: exactly one compile
    compute(g, {x: np.ones((5, N_EMBD))}, cache=cache)
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (2, 1, 2)
    reason = cache.last_miss_reason
    assert "inp_embd" in reason and "[8, 5, 1, 1]" in reason and "[8, 3, 1, 1]" in reason, reason
    for n in (3, 5, 5, 3):
        g, x, out = mlp(wu, wd, n)
        compute(g, {x: np.ones((n, N_EMBD))}, cache=cache)
    assert (cache.stats.misses, cache.stats.hits, len(cache)) == (2, 5, 2)


def test_miss_reason_names_the_changed_node():
    cache = GraphCache()
    wu, wd = weights_pair(0)
    g, x, _ = mlp(wu, wd, 3, eps=1e-5)
    compute(g, {x: np.ones((3, N_EMBD))}, cache=cache)
    g, x, _ = mlp(wu, wd, 3, eps=1e-6)                  # one op parameter differs
    compute(g, {x: np.ones((3, N_EMBD))}, cache=cache)
    assert cache.stats.misses == 2
    reason = cache.last_miss_reason
    assert "ffn_norm" in reason and "RMS_NORM" in reason and "1e-06" in reason and "1e-05" in reason, reason


def test_weight_values_do_not_enter_the_key():
    cache = GraphCache()
    xv = np.random.default_rng(2).standard_normal((3, N_EMBD))
    for seed in (10, 11, 12):
        wu, wd = weights_pair(seed)
        g, x, out = mlp(wu, wd, 3)
        res, _ = compute(g, {x: xv}, cache=cache)
        np.testing.assert_allclose(np.asarray(res[out])[0, 0], mlp_ref(xv, wu, wd), rtol=1e-5, atol=1e-5)
    assert (cache.stats.misses, cache.stats.hits) == (1, 2)


def test_a_shared_weight_array_is_one_argument():
    """Weights that share arrays (fused wq/wk/wv) pass each array once; the sharing is part of
    the key, so the same graph over separate arrays compiles its own executable."""
    wu, _ = weights_pair(3)
    xv = np.random.default_rng(4).standard_normal((2, N_EMBD))
    cache = GraphCache()

    def two_products(dw_a, dw_b):
        x = new_input(T.F32, (N_EMBD, 2), "inp_embd")
        a = new_weight(T.F32, (N_EMBD, N_FF), "a.weight", dw_a)
        b = new_weight(T.F32, (N_EMBD, N_FF), "b.weight", dw_b)
        out = ops.add(ops.mul_mat(a, x), ops.mul_mat(b, x)).set_name("out")
        return Graph().build_forward_expand(out), x, out

    shared = weights.to_device(wu, T.F32, (N_EMBD, N_FF))
    g, x, out = two_products(shared, shared)
    res, _ = compute(g, {x: xv}, cache=cache)
    (exe,) = cache.programs()
    assert exe.keep == (0,)
    separate = [weights.to_device(wu, T.F32, (N_EMBD, N_FF)) for _ in range(2)]
    g, x, out2 = two_products(*separate)
    res2, _ = compute(g, {x: xv}, cache=cache)
    assert cache.stats.misses == 2 and cache.programs()[-1].keep == (0, 1)
    ref = 2 * (xv @ wu.astype(np.float64).T)
    np.testing.assert_allclose(np.asarray(res[out])[0, 0], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(res[out]), np.asarray(res2[out2]))


def kv_graph(n_ctx: int, n_tokens: int):
    """Write n_tokens K rows into a state cache with set_rows and read the cache back
    through a view (as llama's attention does); the output is the scores, not the cache."""
    cache_k = new_state(T.F16, (N_EMBD, n_ctx), "cache_k_l0")
    k_cur = new_input(T.F32, (N_EMBD, n_tokens), "Kcur")
    k_idxs = new_input(T.I32, (n_tokens,), "k_idxs")
    k_stored = ops.set_rows(cache_k, k_cur, k_idxs).set_name("k_stored")
    k = ops.view_2d(k_stored, N_EMBD, n_ctx, k_stored.nb[1], 0).set_name("k")
    kq = ops.mul_mat(k, k_cur).set_name("kq").set_output()
    g = Graph()
    g.build_forward_expand(k_stored)
    g.build_forward_expand(kq)
    return g, cache_k, k_cur, k_idxs, kq


def test_state_updated_through_set_rows_is_donated_in_place():
    cache = GraphCache()
    n_ctx = 64
    kv = jax.device_put(jnp.zeros((1, 1, n_ctx, N_EMBD), jnp.float16))
    ptr = kv.unsafe_buffer_pointer()
    rng = np.random.default_rng(3)
    ref = np.zeros((n_ctx, N_EMBD))
    for step, rows in enumerate(([0, 1, 2], [3, 4, 5], [6, 7, 8])):
        g, cache_k, k_cur, k_idxs, kq = kv_graph(n_ctx, 3)
        kc = rng.standard_normal((3, N_EMBD)).astype(np.float32)
        outs, state = compute(g, {k_cur: kc, k_idxs: np.array(rows)}, {cache_k: kv}, cache=cache)
        ref[rows] = kc.astype(np.float16)
        assert kv.is_deleted(), f"step {step}: the old state buffer was not donated"
        kv = state[cache_k]
        assert kv.unsafe_buffer_pointer() == ptr, f"step {step}: the new state lives in another buffer"
        np.testing.assert_array_equal(np.asarray(kv)[0, 0].astype(np.float64), ref)
        np.testing.assert_allclose(np.asarray(outs[kq])[0, 0], kc.astype(np.float64) @ ref.T, rtol=2e-6, atol=2e-6)
    assert (cache.stats.misses, cache.stats.hits) == (1, 2)


PERSIST_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jax import monitoring
    events = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))
    import ggmlx
    ggmlx.init()
    from ggmlx import ops, compile as C
    from ggmlx.graph import Graph
    from ggmlx.tensor import new_input
    from ggmlx.types import GGMLType as T
    cache = C.GraphCache()
    # the 0.2 s threshold is policy; drop it so a small graph shows the directory's wiring
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    x = new_input(T.F32, (16, 4), "x")
    y = ops.rms_norm(ops.silu(x).set_name("a"), 1e-5).set_name("b")
    out, _ = C.compute(Graph().build_forward_expand(y), {x: np.ones((4, 16))}, cache=cache)
    print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"), "rewritten": cache.stats.rewritten,
                      "value": float(np.asarray(out[y]).sum()), "dir": jax.config.jax_compilation_cache_dir}))
""")


def _run_persist(env_extra: dict, with_stderr: bool = False) -> dict:
    # XLA's compilation cache on its own: ggmlx's executable cache (tested below) would serve
    # the second process before XLA's cache is asked
    env = {k: v for k, v in os.environ.items() if k != "GGMLX_NO_PERSISTENT_CACHE"}
    env["GGMLX_EXE_CACHE"] = "0"
    env.update(env_extra)
    res = subprocess.run([sys.executable, "-c", PERSIST_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent.parent)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if with_stderr:
        out["stderr"] = res.stderr
    return out


@pytest.mark.slow
def test_persistent_cache_directory_fills_and_second_process_starts_warm(tmp_path):
    root = tmp_path / "ggmlx-cache"
    first = _run_persist({"GGMLX_CACHE_DIR": str(root)})
    assert Path(first["dir"]) == root / "xla"
    entries = [p for p in (root / "xla").rglob("*") if p.is_file()]
    assert entries, "no entry written to the persistent compilation cache"
    assert first["hits"] == 0
    second = _run_persist({"GGMLX_CACHE_DIR": str(root)})
    assert second["hits"] >= 1, "the second process compiled instead of loading from disk"


@pytest.mark.slow
def test_persistent_cache_opt_out(tmp_path):
    root = tmp_path / "off"
    res = _run_persist({"GGMLX_CACHE_DIR": str(root), "GGMLX_NO_PERSISTENT_CACHE": "1"})
    assert not root.exists() and res["dir"] != str(root / "xla")



@pytest.mark.slow
def test_damaged_persistent_entry_is_rewritten_once(tmp_path):
    """JAX never replaces an existing entry: a damaged one used to be rejected and recompiled
    on every run. Now the run that finds it rewrites it, and the next one loads it."""
    root = tmp_path / "c"
    first = _run_persist({"GGMLX_CACHE_DIR": str(root)})
    entries = list((root / "xla").glob("*-cache"))
    assert entries
    for e in entries:
        e.write_bytes(b"torn write" * 10)
    second = _run_persist({"GGMLX_CACHE_DIR": str(root)}, with_stderr=True)
    assert second["rewritten"] == len(entries) and second["value"] == first["value"]
    assert "written again" in second["stderr"]
    third = _run_persist({"GGMLX_CACHE_DIR": str(root)}, with_stderr=True)
    assert third["hits"] >= 1 and third["rewritten"] == 0, third
    assert "Error reading" not in third["stderr"]


@pytest.mark.slow
def test_unusable_cache_dir_warns_and_runs_without(tmp_path):
    """GGMLX_CACHE_DIR naming a file (or a folder under a file) used to abort."""
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    for root in (a_file, a_file / "sub"):
        res = _run_persist({"GGMLX_CACHE_DIR": str(root)}, with_stderr=True)
        assert res["dir"] is None and res["value"] != 0
        assert "not usable" in res["stderr"] and "Traceback" not in res["stderr"]


def test_graph_cache_is_lru_bounded_and_counts_evictions():
    cache = GraphCache(max_entries=2)
    w_up, w_down = weights_pair(0)
    for n_tokens in (1, 2, 3):
        g, x, out = mlp(w_up, w_down, n_tokens)
        compute(g, {x: np.ones((n_tokens, N_EMBD), np.float32)}, cache=cache)
    assert len(cache) == 2 and cache.stats.evictions == 1 and cache.stats.misses == 3
    g, x, out = mlp(w_up, w_down, 3)                 # most recent: still cached
    compute(g, {x: np.ones((3, N_EMBD), np.float32)}, cache=cache)
    assert cache.stats.hits == 1
    g, x, out = mlp(w_up, w_down, 1)                 # least recent: was evicted
    compute(g, {x: np.ones((1, N_EMBD), np.float32)}, cache=cache)
    assert cache.stats.misses == 4 and cache.stats.evictions == 2 and len(cache) == 2


EXE_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import ggmlx
    ggmlx.init()
    from ggmlx import ops, compile as C
    from ggmlx.graph import Graph
    from ggmlx.tensor import new_input
    from ggmlx.types import GGMLType as T
    cache = C.GraphCache()
    x = new_input(T.F32, (16, 4), "x")
    y = ops.rms_norm(ops.silu(x).set_name("a"), 1e-5).set_name("b")
    out, _ = C.compute(Graph().build_forward_expand(y), {x: np.arange(64.0).reshape(4, 16)}, cache=cache)
    print(json.dumps({"disk_hits": cache.stats.disk_hits, "out": np.asarray(out[y]).tolist()}))
""")


@pytest.mark.slow
def test_exe_cache_second_process_loads_the_executable(tmp_path):
    """GGMLX_EXE_CACHE=1 (the default): the second process deserializes the executable (no tracing, no XLA
    compile), with the same result; a damaged entry is compiled again."""
    env = {k: v for k, v in os.environ.items() if k != "GGMLX_NO_PERSISTENT_CACHE"}
    env.update(GGMLX_CACHE_DIR=str(tmp_path / "c"), GGMLX_EXE_CACHE="1")

    def run() -> dict:
        res = subprocess.run([sys.executable, "-c", EXE_SCRIPT], env=env, capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).parent.parent)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    first = run()
    entries = list((tmp_path / "c" / "exe").glob("*.bin"))
    assert first["disk_hits"] == 0 and len(entries) == 1
    second = run()
    assert second["disk_hits"] == 1 and second["out"] == first["out"]
    entries[0].write_bytes(b"not a pickle")
    third = run()
    assert third["disk_hits"] == 0 and third["out"] == first["out"]


def _tiny_model_runs(script: str, tmp_path: Path) -> Callable[[], dict]:
    """A function running `script` (argv[1]: a tiny llama GGUF written here) in a fresh process
    with its caches under tmp_path / "c", returning the JSON its last line prints."""
    from tests import tiny_model
    path = tiny_model.write_model(tmp_path / "tiny.gguf", tiny_model.TinySpec(arch="llama", n_layer=2))
    env = {k: v for k, v in os.environ.items() if k != "GGMLX_NO_PERSISTENT_CACHE"}
    env.update(GGMLX_CACHE_DIR=str(tmp_path / "c"), GGMLX_EXE_CACHE="1")

    def run() -> dict:
        res = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True,
                             text=True, timeout=300, cwd=Path(__file__).parent.parent)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])
    return run


PRELOAD_SCRIPT = textwrap.dedent("""
    import json, sys, threading
    import numpy as np
    import llm
    from ggmlx import compile as C
    loads = []
    real = C._load_executable
    def counting(path):
        loads.append(threading.current_thread() is threading.main_thread())
        return real(path)
    C._load_executable = counting
    model = llm.load_model(sys.argv[1])
    ctx = llm.Context(model, n_ctx=64, n_ubatch=8, kv_bucket=32)
    ctx.reserve(n_tokens=(1, 8))
    assert ctx.decode(llm.Batch([1, 2, 3, 4, 5])) == 0, ctx.last_error
    print(json.dumps({"disk_hits": ctx.sched.cache.stats.disk_hits, "on_main": loads,
                      "logits": np.asarray(ctx.get_logits_ith(-1)).tolist()}))
""")


@pytest.mark.slow
def test_stored_executables_of_a_reserve_load_side_by_side(tmp_path):
    """A second process reserving two graph shapes reads both stored executables in worker
    threads (GraphCache.preload) before using them, with the first process's logits."""
    run = _tiny_model_runs(PRELOAD_SCRIPT, tmp_path)

    first = run()
    assert first["disk_hits"] == 0 and len(list((tmp_path / "c" / "exe").glob("*.bin"))) == 2
    second = run()
    assert second["disk_hits"] == 2 and second["on_main"] == [False, False]
    assert second["logits"] == first["logits"]


def _norm_graph(n_embd: int, n_tokens: int):
    x = new_input(T.F32, (n_embd, n_tokens), "inp_embd")
    out = ops.rms_norm(x, 1e-5).set_name("norm")
    return Graph().build_forward_expand(out), x, out


def test_cpu_graphs_compile_without_library_fusions():
    """A few rows' rms_norm stays in XLA's own loops: the jaxlib's YNNPACK reduce fusion cost
    9-15 us a call against ~1.5 (compile._CPU_COMPILE_OPTIONS); the values are the same."""
    cache = GraphCache()
    g, x, out = _norm_graph(576, 8)
    xv = np.random.default_rng(0).standard_normal((8, 576)).astype(np.float32)
    res, _ = compute(g, {x: xv}, cache=cache)
    (entry,) = cache._entries.values()
    assert "__ynn_fusion" not in entry.executable.as_text()
    ref = xv / np.sqrt(np.mean(xv.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(res[out]).reshape(8, 576), ref, rtol=2e-6, atol=2e-6)


def test_cpu_compile_options_unknown_to_the_jaxlib_are_left_out(monkeypatch):
    """A jaxlib without the option compiles as before (the error is XLA's 'No such compile
    option'), and later compiles stop asking."""
    from ggmlx import compile as compile_mod
    monkeypatch.setattr(compile_mod, "_CPU_COMPILE_OPTIONS", {"xla_cpu_no_such_option_in_any_jaxlib": ""})
    monkeypatch.setattr(compile_mod, "_cpu_options_known", True)
    g, x, out = _norm_graph(64, 3)
    res, _ = compute(g, {x: np.ones((3, 64), np.float32)}, cache=GraphCache())
    np.testing.assert_allclose(np.asarray(res[out]), 1.0, rtol=1e-5)
    assert compile_mod._cpu_options_known is False


PREFETCH_SCRIPT = textwrap.dedent("""
    import json, sys, threading
    import llm
    from ggmlx import compile as C
    loads = []
    real = C._load_executable
    def counting(path):
        loads.append(threading.current_thread() is threading.main_thread())
        return real(path)
    C._load_executable = counting
    m = llm.LLM(sys.argv[1], n_ctx=64, n_ubatch=8)
    prefetched = list(m._prefetched)
    out = m.generate([1, 2, 3, 4, 5], max_tokens=6, temperature=0.0)
    print(json.dumps({"prefetched": prefetched, "disk_hits": C.get_default_cache().stats.disk_hits,
                      "on_main": loads, "tokens": out.tokens}))
""")


@pytest.mark.slow
def test_a_start_reads_the_last_runs_executables_while_the_model_loads(tmp_path):
    """LLM records the stored executables its first generation used (compile.remember_run);
    the next process with the same model and settings reads them in worker threads from its
    start (prefetch_run), uses every one of them, and generates the same tokens. A damaged
    record is ignored (the executables load as before) and written again; a damaged executable
    among the prefetched ones is compiled again."""
    run = _tiny_model_runs(PREFETCH_SCRIPT, tmp_path)

    first = run()
    (record,) = (tmp_path / "c" / "runs").glob("*.json")
    stored = json.loads(record.read_text())
    assert first["prefetched"] == [] and first["disk_hits"] == 0
    assert sorted(stored) == sorted(str(p) for p in (tmp_path / "c" / "exe").glob("*.bin")) and len(stored) >= 2
    second = run()
    assert second["prefetched"] == stored and second["disk_hits"] == len(stored)
    assert second["on_main"] == [False] * len(stored) and second["tokens"] == first["tokens"]
    record.write_text("{not json")
    third = run()
    assert third["prefetched"] == [] and third["disk_hits"] == len(stored) and third["tokens"] == first["tokens"]
    assert json.loads(record.read_text()) == stored
    Path(stored[0]).write_bytes(b"not a pickle")       # a prefetched executable that does not load: compiled
    fourth = run()
    assert fourth["prefetched"] == stored and fourth["disk_hits"] == len(stored) - 1
    assert fourth["tokens"] == first["tokens"]


def test_prefetch_skips_what_is_not_there_and_ignores_bad_records(tmp_path, monkeypatch):
    """A record naming files that are gone, or not a list of paths, prefetches nothing."""
    from ggmlx import compile as C
    monkeypatch.setenv("GGMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GGMLX_NO_PERSISTENT_CACHE", raising=False)
    C.remember_run("run", [str(tmp_path / "gone.bin")])
    assert C.prefetch_run("run") == [str(tmp_path / "gone.bin")]
    assert str(tmp_path / "gone.bin") not in C._prefetched
    Path(C._run_manifest_path("other")).write_text('{"not": "a list"}')
    assert C.prefetch_run("other") == []
    assert C.prefetch_run("never recorded") == []


WARMUP_SCRIPT = textwrap.dedent("""
    import json, sys
    import llm
    from ggmlx import compile as C
    from llm.generation.batcher import Batcher
    m = llm.LLM(sys.argv[1], n_ctx=64, n_ubatch=8, n_seq_max=2)
    prefetched = list(m._prefetched)
    Batcher(m.ctx, m.vocab, 2).warmup()
    m.remember_executables()
    m.remember_executables()        # once: a second call records nothing new
    print(json.dumps({"prefetched": prefetched, "disk_hits": C.get_default_cache().stats.disk_hits,
                      "got": list(C.get_default_cache().disk_paths)}))
""")


@pytest.mark.slow
def test_a_servers_warmup_is_read_ahead_by_the_next_start(tmp_path):
    """`llm serve` records what its Batcher's warmup used (LLM.remember_executables); the next
    start with the same settings prefetches all of it and loads every graph from disk."""
    run = _tiny_model_runs(WARMUP_SCRIPT, tmp_path)

    first = run()
    (record,) = (tmp_path / "c" / "runs").glob("*.json")
    assert json.loads(record.read_text()) == first["got"] and len(first["got"]) >= 3
    second = run()
    assert second["prefetched"] == first["got"] and second["disk_hits"] == len(first["got"])
