"""Per-call overhead of running a cached ggmlx graph versus the equivalent hand-written
`jax.jit` function.

The model is a small MLP stack (per layer: rms_norm, * norm weight, up, silu, down,
residual add) at one token, so the math itself costs a few microseconds and what is
measured is dispatch. Paths, all on already-compiled code and already-placed weights:

  jit        the hand-written jitted function, called with device arrays
  program    the cached CompiledProgram called directly (what a scheduler does per split)
  compute    ggmlx.compile.compute(graph, inputs): Program.from_graph + signature + hash
             + cache lookup + device_put of the inputs + the call
  rebuild    building the graph from scratch and then compute (a decode step that cannot
             reuse its previous graph)

and, for compute, where its time goes (from_graph, signature, key hash).

    python benchmarks/bench_graph_overhead.py [--layers 2 8 32] [--iters 1000]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import ggmlx
from ggmlx import ops, weights
from ggmlx.compile import GraphCache, Program, compute
from ggmlx.graph import Graph
from ggmlx.tensor import new_input, new_weight
from ggmlx.types import GGMLType as T

N_EMBD, N_FF, EPS = 64, 256, 1e-5


def make_weights(n_layer: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"norm": rng.uniform(0.5, 1.5, N_EMBD).astype(np.float32),
             "up": (rng.standard_normal((N_FF, N_EMBD)) / 8).astype(np.float32),
             "down": (rng.standard_normal((N_EMBD, N_FF)) / 16).astype(np.float32)} for _ in range(n_layer)]


def bind(ws: list[dict[str, np.ndarray]]) -> list[dict[str, weights.DeviceWeight]]:
    return [{"norm": weights.to_device(w["norm"], T.F32, (N_EMBD,)),
             "up": weights.to_device(w["up"], T.F32, (N_EMBD, N_FF)),
             "down": weights.to_device(w["down"], T.F32, (N_FF, N_EMBD))} for w in ws]


def build(dws: list[dict[str, weights.DeviceWeight]]):
    """The ggmlx graph of the MLP stack; returns (graph, input leaf, output node)."""
    x = new_input(T.F32, (N_EMBD, 1), "inp_embd")
    cur = x
    for il, w in enumerate(dws):
        norm = new_weight(T.F32, (N_EMBD,), f"blk.{il}.ffn_norm.weight", w["norm"])
        up = new_weight(T.F32, (N_EMBD, N_FF), f"blk.{il}.ffn_up.weight", w["up"])
        down = new_weight(T.F32, (N_FF, N_EMBD), f"blk.{il}.ffn_down.weight", w["down"])
        h = ops.mul(ops.rms_norm(cur, EPS).set_name(f"norm-{il}"), norm).set_name(f"ffn_norm-{il}")
        h = ops.silu(ops.mul_mat(up, h).set_name(f"ffn_up-{il}")).set_name(f"ffn_act-{il}")
        h = ops.mul_mat(down, h).set_name(f"ffn_out-{il}")
        cur = ops.add(h, cur).set_name(f"l_out-{il}")
    return Graph().build_forward_expand(cur), x, cur


def hand_written(params, x):
    """The same MLP stack written directly in JAX (numpy order: x [1, n_embd])."""
    for w in params:
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w["norm"]
        h = jax.nn.silu(jnp.dot(h, w["up"].T, precision=jax.lax.Precision.HIGHEST))
        x = jnp.dot(h, w["down"].T, precision=jax.lax.Precision.HIGHEST) + x
    return x


def per_call_us(fn, iters: int, repeats: int = 5) -> float:
    """Median over repeats of the mean wall time per call, in microseconds."""
    for _ in range(min(iters, 200)):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(runs)


def bench(n_layer: int, iters: int) -> dict[str, float]:
    ws = make_weights(n_layer)
    dws = bind(ws)
    xv = np.random.default_rng(1).standard_normal((1, N_EMBD)).astype(np.float32)
    dev = jax.devices()[0]

    params = [{k: jax.device_put(v, dev) for k, v in w.items()} for w in ws]
    x_dev = jax.device_put(xv, dev)
    jitted = jax.jit(hand_written)

    cache = GraphCache()
    graph, x, out = build(dws)
    res, _ = compute(graph, {x: xv}, cache=cache)
    ref = np.asarray(jitted(params, x_dev))
    np.testing.assert_allclose(np.asarray(res[out]).reshape(ref.shape), ref, rtol=1e-4, atol=1e-4)

    prog = Program.from_graph(graph, device=dev)
    w_vals = [t.data for t in prog.weights]
    in_vals = [jax.device_put(xv.reshape(x.shape), dev)]
    exe = cache.get(prog, w_vals, in_vals, [])
    w_args = exe.weight_args(w_vals)

    results = {
        "nodes": float(graph.n_nodes),
        "jit": per_call_us(lambda: jitted(params, x_dev)[0].block_until_ready(), iters),
        "program": per_call_us(lambda: exe(w_args, in_vals, [])[0][0].block_until_ready(), iters),
        "compute": per_call_us(lambda: compute(graph, {x: xv}, cache=cache)[0][out].block_until_ready(), iters),
    }

    def rebuild_and_compute():
        g, xx, o = build(dws)
        compute(g, {xx: xv}, cache=cache)[0][o].block_until_ready()

    results["rebuild"] = per_call_us(rebuild_and_compute, max(iters // 4, 50))
    results["from_graph"] = per_call_us(lambda: Program.from_graph(graph, device=dev), iters)
    results["signature"] = per_call_us(prog.signature, iters)
    sig = prog.signature()
    results["key_hash"] = per_call_us(lambda: GraphCache.key_of(sig), iters)
    results["device_put"] = per_call_us(lambda: jax.device_put(xv.reshape(x.shape), dev), iters)
    return results


def main() -> None:
    ggmlx.init()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--iters", type=int, default=1000)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; n_embd={N_EMBD} n_ff={N_FF}, 1 token; "
          f"microseconds per call (median of 5 x {args.iters})")
    head = (f"{'layers':>6} {'nodes':>5} {'jit':>8} {'program':>8} {'compute':>8} {'rebuild':>8} "
            f"{'prog/jit':>8} {'comp/jit':>8} | {'from_graph':>10} {'signature':>9} {'key_hash':>8} {'dev_put':>7}")
    print(head)
    for n_layer in args.layers:
        r = bench(n_layer, args.iters)
        print(f"{n_layer:>6} {int(r['nodes']):>5} {r['jit']:>8.1f} {r['program']:>8.1f} {r['compute']:>8.1f} "
              f"{r['rebuild']:>8.1f} {r['program'] / r['jit']:>8.2f} {r['compute'] / r['jit']:>8.2f} | "
              f"{r['from_graph']:>10.1f} {r['signature']:>9.1f} {r['key_hash']:>8.1f} {r['device_put']:>7.1f}")


if __name__ == "__main__":
    main()
