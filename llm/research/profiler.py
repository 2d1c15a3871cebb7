"""`python -m llm bench --profile` / `llm.profile(...)`: where the time of a decode step and of
a prefill ubatch goes.

Two views of the same steps:
- the device side, from a `jax.profiler` trace: every XLA:CPU thunk (a fusion, a dot, a
  custom call, a copy) is one event carrying its `hlo_op` name; events are summed per HLO
  op over all threads and divided by the number of steps. Each HLO op is labelled with the
  ggml node it came from (the `jax.named_scope` every node runs in; `-3` becomes `-*`, so a
  label sums all layers), read from the optimized HLO's metadata.
- the host side, from the context's own timers: Python (batch split, cells, graph reuse,
  set_input, output copy), input transfer (device_put of the inputs) and device wait (from
  the dispatch until the logits are on the host).
Op times are summed over the threads that ran them, so on several cores their total can
exceed the wall time of a step; shares are of that total.
"""
from __future__ import annotations

import glob
import os
import re
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field

import jax

from ggmlx import types
from llm.batch import Batch
from llm.context import Context
from llm.model import Model, load_model

_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_META = re.compile(r'metadata=\{op_name="([^"]*)"')
_ARGS = re.compile(r"\b[a-z][\w-]*\(([^)]*)\)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CONTROL = re.compile(r"(?<![\w-])(?:while|conditional|call)\(")   # not custom-call(
_LAYER = re.compile(r"-\d+\b")


@dataclass
class OpRow:
    """One HLO op (fusion, dot, custom call, copy) of a step."""
    hlo_op: str
    label: str            # the ggml node it computes, layers merged ("ffn_up-*")
    calls: float          # executions per step (ops inside loops run several times)
    us: float             # microseconds per step, summed over threads
    share: float          # fraction of the step's summed op time


@dataclass
class StepProfile:
    """Where one kind of step spends its time, averaged over n_steps steps."""
    label: str                    # "decode (1 token, n_kv 256)", "prefill ubatch (512 tokens)"
    n_steps: int
    wall_ms: float                # per step, measured without the profiler running
    python_ms: float              # host Python around the computation
    input_ms: float               # device_put of the graph inputs
    wait_ms: float                # dispatch until the logits are back on the host
    n_kernels: float              # HLO op executions per step
    op_ms: float                  # summed op time per step (all threads)
    weight_bytes: float = 0.0     # per step: held weight bytes read (token_embd: one row per token)
    kv_bytes: float = 0.0         # per step: KV-cache bytes the attention reads (n_kv cells)
    flops: float = 0.0            # per token: 2 x weight elements (matmuls) + attention
    n_tokens: int = 1             # tokens per step
    ops: list[OpRow] = field(default_factory=list)          # every HLO op, largest first
    by_label: list[OpRow] = field(default_factory=list)     # the same, summed per ggml node label

    def format(self, top: int = 20) -> str:
        lines = [f"### {self.label}: {self.wall_ms:.2f} ms per step over {self.n_steps} steps",
                 f"host: Python {self.python_ms:.2f} ms, input transfer {self.input_ms:.2f} ms, "
                 f"device wait {self.wait_ms:.2f} ms; {self.n_kernels:.0f} kernels per step, "
                 f"op time {self.op_ms:.2f} ms per step (summed over threads)",
                 self.cost_model(), "", f"top {top} HLO ops", "| # | HLO op | node | calls | us/step | share |",
                 "|---:|---|---|---:|---:|---:|"]
        for i, r in enumerate(self.ops[:top]):
            lines.append(f"| {i + 1} | {r.hlo_op} | {r.label} | {r.calls:.0f} | {r.us:.1f} | {100 * r.share:.1f}% |")
        lines += ["", f"top {top} ggml nodes (all layers)", "| # | node | kernels | us/step | share |",
                  "|---:|---|---:|---:|---:|"]
        for i, r in enumerate(self.by_label[:top]):
            lines.append(f"| {i + 1} | {r.label} | {r.calls:.0f} | {r.us:.1f} | {100 * r.share:.1f}% |")
        return "\n".join(lines)


    def cost_model(self) -> str:
        """Bytes and flops per token against the measured time per token."""
        t = self.wall_ms / 1e3 / self.n_tokens
        mb = (self.weight_bytes + self.kv_bytes) / self.n_tokens / 1e6
        gf = self.flops / 1e9
        return (f"cost model per token: weights {self.weight_bytes / self.n_tokens / 1e6:.1f} MB + KV "
                f"{self.kv_bytes / self.n_tokens / 1e6:.1f} MB read, {gf:.3f} GFLOP; measured {t * 1e3:.2f} ms/token = "
                f"{mb / 1e3 / t:.1f} GB/s, {gf / t:.1f} GFLOP/s")


def token_costs(model: Model, n_kv: int) -> tuple[float, float, float]:
    """(weight bytes read per step, KV bytes read per token, flops per token) of one step:
    every 2-d weight is read once per step in its held format (token_embd: one row per
    token, unless it is also the output matrix); the attention reads n_kv cells per layer."""
    hp = model.hparams
    w_bytes = 0.0
    flops = 0.0
    seen: set[int] = set()
    for t in model.weight_tensors():
        if id(t) in seen:       # a tied output matrix is listed as token_embd and as output
            continue
        seen.add(id(t))
        n_el = t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]
        nbytes = t.data.nbytes if t.data is not None else 0
        if t is model.tok_embd and model.output is not model.tok_embd:
            w_bytes += nbytes / t.ne[1]
            continue
        w_bytes += nbytes
        if t.ne[1] > 1:
            flops += 2.0 * n_el
    kv = 0.0
    for il in range(hp.n_layer):
        kv += n_kv * (hp.n_embd_k_gqa(il) + hp.n_embd_v_gqa(il)) * 4
        flops += 2.0 * n_kv * hp.n_head(il) * (hp.n_embd_head_k + hp.n_embd_head_v)
    return w_bytes, kv, flops


def hlo_labels(hlo_text: str) -> tuple[dict[str, str], set[str]]:
    """HLO instruction name -> the ggml node label of its first named scope (an instruction
    without metadata, like a dot, takes the label of its last labelled operand, the weight),
    and the names of control-flow instructions (while, conditional, call), whose events
    contain their bodies' events and are left out of the totals."""
    labels: dict[str, str] = {}
    containers: set[str] = set()
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        meta = _META.search(rest)
        if _CONTROL.search(rest.split("metadata=")[0]):
            containers.add(name)
        if meta:
            parts = meta.group(1).split("/")
            scope = parts[1] if len(parts) > 1 and parts[0].startswith("jit(") else parts[0]
            labels[name] = _LAYER.sub("-*", scope)
            continue
        args = _ARGS.search(rest)
        for operand in reversed(_OPERAND.findall(args.group(1)) if args else []):
            if operand in labels:
                labels[name] = labels[operand]
                break
    return labels, containers


def _trace_ops(run, n_steps: int, labels: dict[str, str],
               containers: set[str]) -> tuple[list[OpRow], list[OpRow], float, float]:
    """Run `run()` under the profiler; per-step HLO op rows, label rows, kernels and op ms."""
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    with tempfile.TemporaryDirectory(prefix="ggmlx-profile-") as d:
        jax.profiler.start_trace(d, profiler_options=opts)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError(f"profile: jax.profiler wrote no trace under {d}")
        data = jax.profiler.ProfileData.from_file(files[0])
    t_ns: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                op = stats.get("hlo_op")
                if op is None or ev.name.startswith("end:") or str(op) in containers:
                    continue
                t_ns[str(op)] += ev.duration_ns
                calls[str(op)] += 1
    total = sum(t_ns.values()) or 1.0
    ops = sorted((OpRow(op, labels.get(op, "?"), calls[op] / n_steps, t / n_steps / 1e3, t / total)
                  for op, t in t_ns.items()), key=lambda r: -r.us)
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in ops:
        agg[r.label][0] += r.calls
        agg[r.label][1] += r.us
    by_label = sorted((OpRow("", lab, c, us, us * 1e3 * n_steps / total) for lab, (c, us) in agg.items()),
                      key=lambda r: -r.us)
    return ops, by_label, sum(calls.values()) / n_steps, total / n_steps / 1e6


def _labels_of(ctx: Context) -> tuple[dict[str, str], set[str]]:
    _, plan = ctx.last_graph
    labels: dict[str, str] = {}
    containers: set[str] = set()
    for s in plan.splits:
        if s.compiled is not None:
            lab, cont = hlo_labels(s.compiled.executable.as_text())
            labels.update(lab)
            containers |= cont
    return labels, containers


def _decode_ok(ctx: Context, batch: Batch) -> None:
    rc = ctx.decode(batch)
    if rc != 0:
        raise RuntimeError(f"profile: decode failed with {rc}: {ctx.last_error}")


def _measure(ctx: Context, steps, label: str, n_steps: int, n_tokens: int) -> StepProfile:
    """Time `steps()` (n_steps ubatches) with the host timers, then again under the profiler."""
    ctx.perf_reset()
    t0 = time.perf_counter()
    steps()
    wall = (time.perf_counter() - t0) / n_steps
    p = ctx.perf()
    wait_ms, input_ms = p["t_wait_ms"] / n_steps, p["t_inputs_ms"] / n_steps
    labels, containers = _labels_of(ctx)
    ops, by_label, n_kernels, op_ms = _trace_ops(steps, n_steps, labels, containers)
    w_bytes, kv_bytes, flops = token_costs(ctx.model, ctx.memory.n_kv())
    kv = ctx.memory.mem_attn
    k = kv.k_l[0] if kv is not None else None       # token_costs counts f32 cells; a block type's bytes per value
    kv_bytes = kv_bytes * types.row_size(k.type, k.ne[0]) / (4 * k.ne[0]) if k is not None else 0.0
    return StepProfile(label, n_steps, wall * 1e3, python_ms=wall * 1e3 - wait_ms - input_ms, input_ms=input_ms,
                       wait_ms=wait_ms, n_kernels=n_kernels, op_ms=op_ms, weight_bytes=w_bytes,
                       kv_bytes=kv_bytes, flops=flops,
                       n_tokens=n_tokens, ops=ops, by_label=by_label)


def profile(model: Model | str, n_ctx: int = 2048, n_prompt: int = 512, n_decode: int = 32,
            n_prefill: int = 3, n_ubatch: int = 512, weight_format: str = "auto", type_k: str = "f32",
            type_v: str = "f32", numerics: str = "exact") -> list[StepProfile]:
    """Profiles of a prefill ubatch of n_prompt tokens (0 skips it) and of a decode step after
    it (averaged over n_prefill ubatches and n_decode steps). Everything is compiled by a warm-up first."""
    if isinstance(model, str):
        model = load_model(model, weight_format=weight_format, numerics=numerics)
    n_prompt = min(n_prompt, n_ubatch)
    ctx = Context(model, n_ctx=n_ctx, n_batch=max(n_ubatch, 1), n_ubatch=n_ubatch, type_k=type_k, type_v=type_v)
    n_vocab = model.n_vocab
    lo = min(1000, n_vocab // 2)     # avoid the low ids where special tokens usually sit
    prompt = [lo + (i * 7919) % (n_vocab - lo) for i in range(max(n_prompt, 1))]
    out = []

    def prefill():
        ctx.memory_clear()
        _decode_ok(ctx, Batch(tokens=prompt, pos=list(range(len(prompt))),
                              logits=[j == len(prompt) - 1 for j in range(len(prompt))]))

    prefill()                                       # warm-up: compiles
    if n_prompt > 1:
        out.append(_measure(ctx, lambda: [prefill() for _ in range(n_prefill)],
                            f"prefill ubatch ({n_prompt} tokens)", n_prefill, n_prompt))
    n0 = len(prompt)

    def decode():
        # a KV cache drops the last run's tokens; a recurrent state cannot, so it runs on from them
        start = n0 if ctx.memory.seq_rm(0, n0, -1) else ctx.memory.seq_pos_max(0) + 1
        for i in range(n_decode):
            _decode_ok(ctx, Batch(tokens=[lo + (i * 31) % (n_vocab - lo)], pos=[start + i], logits=[True]))

    decode()                                        # warm-up
    out.append(_measure(ctx, decode, f"decode (1 token, n_kv {ctx.memory.n_kv()})", n_decode, 1))
    return out
