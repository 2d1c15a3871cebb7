"""The scheduler, like ggml_backend_sched: place every node on a backend, cut the graph into
splits of consecutive nodes on one backend, copy tensors between backends, compile each
split through the compiled-graph cache and run the splits in order.

Placement passes (as ggml's):
1. a node that reads a weight or writes a state buffer goes where that buffer lives, and a
   view goes where the tensor it views lives;
2. the rest take the backend of the node before them (expanding assignments forward), and
   leading unassigned nodes take the first assigned backend.
An eval callback `cb_eval(tensor, ask) -> bool` picks named tensors to observe while the
graph is allocated (ask=True); they become extra outputs of their split, and after the run
the callback receives an `Observed` (the tensor and its value) with ask=False; returning
False there stops the computation (returns False from `compute`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from ggmlx import flags, lower, weights
from ggmlx.backend import Backend, backend_of, backends
from ggmlx.compile import CompiledProgram, GraphCache, Program, get_default_cache
from ggmlx.graph import Graph
from ggmlx.tensor import VIEW_OPS, Flag, Op, Tensor

EvalCallback = Callable[[object, bool], bool]

log = logging.getLogger(__name__)


@dataclass
class Observed:
    """An observed tensor and its value (numpy order), passed to cb_eval with ask=False."""
    tensor: Tensor
    value: np.ndarray

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def ne(self):
        return self.tensor.ne


@dataclass
class Split:
    backend: Backend
    nodes: list[Tensor]
    copies: list[Tensor] = field(default_factory=list)   # tensors from other backends
    program: Program | None = None
    compiled: CompiledProgram | None = None
    w_vals: list | None = None       # the weights on this backend, gathered on the first run
    w_leaves: tuple | None = None    # ... and their flat arrays, what the executable takes


@dataclass
class Plan:
    """The result of alloc_graph: placement, splits and their programs (ready to compute)."""
    graph: Graph
    splits: list[Split]
    placement: dict[int, Backend]
    observed: list[Tensor]
    outputs: list[Tensor] = field(default_factory=list)    # the graph's outputs

    @property
    def n_splits(self) -> int:
        return len(self.splits)

    @property
    def n_copies(self) -> int:
        return sum(len(s.copies) for s in self.splits)

    def backend_name(self, t: Tensor) -> str:
        b = self.placement.get(t.id)
        return b.name if b else "host"

    def dump(self) -> str:
        """Each split with its backend, nodes and the copies it needs (GGML_SCHED_DEBUG)."""
        lines = [f"## SPLIT GRAPH: {len(self.splits)} splits, {self.n_copies} copies"]
        for i, s in enumerate(self.splits):
            copies = ", ".join(f"{c.name or c.op.value} ({self.backend_name(c)}->{s.backend.name})"
                               for c in s.copies)
            lines.append(f"## SPLIT #{i}: {s.backend.name} # {len(s.nodes)} nodes, "
                         f"{len(s.copies)} inputs copied: {copies or '-'}")
            for n in s.nodes:
                srcs = " ".join(f"{x.name or x.op.value}[{self.backend_name(x)}]" for x in n.src)
                lines.append(f"node #{n.id:5d} ({n.op.value:>14}): {n.name:28} [{s.backend.name}] <- {srcs}")
        return "\n".join(lines)


def _buffer_backend(t: Tensor) -> Backend | None:
    """Where a weight's or state's buffer lives, if it is bound to one."""
    if t.flags & Flag.WEIGHT and isinstance(t.data, weights.DeviceWeight):
        return backend_of(next(iter(t.data.array.devices())))
    if t.flags & Flag.STATE and t.data is not None:
        return backend_of(next(iter(t.data.devices())))
    return None


def _state_buffer(t: Tensor, state: dict[Tensor, jax.Array]) -> jax.Array:
    """The buffer given for state leaf t, checked against its shape (numpy order) and type:
    a mismatch would otherwise fail deep inside tracing, naming no tensor."""
    if t not in state:
        raise ValueError(f"no buffer for state {t.name!r}")
    buf = state[t]
    want = lower.jnp_dtype(t.type)
    if tuple(buf.shape) != t.shape or buf.dtype != want:
        raise ValueError(f"state {t.name!r}: buffer is {buf.dtype}{list(buf.shape)}, "
                         f"the graph needs {want}{list(t.shape)} (ne={list(t.ne)})")
    return buf


def _on_device(x, device: jax.Device):
    """x (an array or a DeviceWeight) on device, copied only when it lives elsewhere: a
    state already there must be passed as is, so that donating it updates it in place."""
    arr = x.array if isinstance(x, weights.DeviceWeight) else x
    return x if arr.devices() == {device} else jax.device_put(x, device)


class Scheduler:
    """Places graphs over a list of backends and runs them through a GraphCache."""

    def __init__(self, backend_list: list[Backend] | None = None, cache: GraphCache | None = None,
                 cb_eval: EvalCallback | None = None):
        self.backends = backend_list or backends()
        self.cache = cache or get_default_cache()
        self.cb_eval = cb_eval
        self.debug = flags.SCHED_DEBUG.on()

    # ---- placement -------------------------------------------------------------------

    def assign(self, graph: Graph) -> dict[int, Backend]:
        place: dict[int, Backend] = {}
        for leaf in graph.leafs:
            b = _buffer_backend(leaf)
            if b is not None:
                place[leaf.id] = b
        for n in graph.nodes:
            b = None
            if n.op in VIEW_OPS or n.op is Op.SET_ROWS:
                b = place.get(n.src[0].id)
            if b is None:
                for s in n.src:
                    if s.is_leaf and s.flags & (Flag.WEIGHT | Flag.STATE) and s.id in place:
                        b = place[s.id]
                        break
            if b is not None:
                place[n.id] = b
        cur = None
        for n in graph.nodes:
            if n.id in place:
                cur = place[n.id]
            elif cur is not None:
                place[n.id] = cur
        first = next((place[n.id] for n in graph.nodes if n.id in place), self.backends[0])
        for n in graph.nodes:
            place.setdefault(n.id, first)
        return place

    def alloc_graph(self, graph: Graph) -> Plan:
        """Assign backends, split, and build each split's program (not yet compiled)."""
        place = self.assign(graph)
        observed = []
        if self.cb_eval is not None:
            observed = [n for n in graph.nodes if self.cb_eval(n, True)]
        wanted = set(t.id for t in graph.outputs()) | set(t.id for t in observed)
        splits: list[Split] = []
        for n in graph.nodes:
            b = place[n.id]
            if not splits or splits[-1].backend != b:
                splits.append(Split(b, []))
            splits[-1].nodes.append(n)
        split_of = {n.id: i for i, s in enumerate(splits) for n in s.nodes}
        needed_later: dict[int, set[int]] = {}
        for i, s in enumerate(splits):
            seen = set()
            for n in s.nodes:
                for src in n.src:
                    j = split_of.get(src.id)
                    if j is not None and j != i:
                        needed_later.setdefault(j, set()).add(src.id)
                    # a node from another backend's split, or a weight/state living elsewhere
                    home = splits[j].backend if j is not None else place.get(src.id)
                    if home is not None and home != s.backend and src.id not in seen:
                        s.copies.append(src)
                        seen.add(src.id)
        for i, s in enumerate(splits):
            outs = [n for n in s.nodes if n.id in wanted or n.id in needed_later.get(i, ())]
            s.program = Program.from_nodes(s.nodes, outs, s.backend.device)
        plan = Plan(graph, splits, place, observed, graph.outputs())
        if self.debug:
            # WARNING, so that the dump asked for with the flag shows without any logging setup
            log.warning("%s", plan.dump())
        return plan

    # ---- running ---------------------------------------------------------------------

    def _args(self, split: Split, values: dict[int, jax.Array], host_inputs: dict[Tensor, object],
              state: dict[Tensor, jax.Array]):
        prog = split.program
        assert prog is not None   # alloc_graph built it
        dev = split.backend.device
        if split.w_leaves is None:
            w_vals = []
            for t in prog.weights:
                if not isinstance(t.data, weights.DeviceWeight):
                    raise ValueError(f"weight {t.name!r} has no device data")
                w_vals.append(_on_device(t.data, dev))
            split.w_leaves = CompiledProgram.weight_leaves(w_vals)
            split.w_vals = w_vals
        in_vals = []
        for t in prog.inputs:
            if t.id in values:
                in_vals.append(jax.device_put(values[t.id], dev))
            elif t in host_inputs:
                v = np.asarray(host_inputs[t]).reshape(t.shape).astype(lower.jnp_dtype(t.type))
                in_vals.append(jax.device_put(v, dev))
            else:
                raise ValueError(f"no value for input {t.name!r}")
        st_vals = [_on_device(_state_buffer(t, state), dev) for t in prog.states]
        return split.w_vals, in_vals, st_vals

    def reserve(self, plan: Plan, host_inputs: dict[Tensor, object], state: dict[Tensor, jax.Array]) -> None:
        """Compile every split ahead of time (like ggml_backend_sched_reserve)."""
        for s in plan.splits:
            if s.compiled is None:
                assert s.program is not None   # alloc_graph built it
                w, i, st = self._abstract_args(s, host_inputs, state)
                s.compiled = self.cache.get(s.program, w, i, st)

    def _abstract_args(self, split: Split, host_inputs, state):
        prog = split.program
        assert prog is not None   # alloc_graph built it
        w = [t.data for t in prog.weights]
        i = [np.zeros(t.shape, lower.jnp_dtype(t.type)) for t in prog.inputs]
        st = [_state_buffer(t, state) for t in prog.states]
        return w, i, st

    def compute(self, plan: Plan, host_inputs: dict[Tensor, object], state: dict[Tensor, jax.Array]):
        """Run the splits in order. Returns (outputs {tensor: value}, new state, completed):
        completed is False when cb_eval asked to stop; state passed in is donated."""
        values: dict[int, jax.Array] = {}
        state = dict(state)
        for s in plan.splits:
            prog = s.program
            assert prog is not None   # alloc_graph built it
            w, i, st = self._args(s, values, host_inputs, state)
            if s.compiled is None:
                s.compiled = self.cache.get(prog, w, i, st)
            outs, new_st = s.compiled(s.w_leaves, i, st)
            for t, v in zip(prog.outputs, outs, strict=False):
                values[t.id] = v
            copied = {c.id for c in s.copies}
            for t, v in zip(prog.states, new_st, strict=False):
                if t.id not in copied:      # a copied-in state is only read here; its home keeps it
                    state[t] = v
            if self.cb_eval is not None:
                for t in prog.outputs:
                    if t in plan.observed and not self.cb_eval(Observed(t, np.asarray(values[t.id])), False):
                        return self._outputs(plan, values), state, False
        return self._outputs(plan, values), state, True

    @staticmethod
    def _outputs(plan: Plan, values: dict[int, jax.Array]) -> dict[Tensor, jax.Array]:
        return {t: values[t.id] for t in plan.outputs if t.id in values}
