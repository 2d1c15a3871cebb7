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
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from ggmlx import flags, lower, weights
from ggmlx.backend import Backend, backend_of_array, backends
from ggmlx.compile import CompiledProgram, GraphCache, Program, get_default_cache
from ggmlx.graph import Graph
from ggmlx.tensor import VIEW_OPS, Flag, Op, Tensor, buffer_layout

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
    w_args: tuple | None = None      # ... and the arrays of them the executable takes
    st_layouts: list | None = None   # buffer_layout of each state the program takes (fixed per tensor)
    st_returned: list | None = None  # weak references to the states its last run returned


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

    def shardings(self) -> dict[int, str]:
        """sharding_label of every node and leaf of the splits on a mesh backend."""
        labels: dict[int, str] = {}
        for s in self.splits:
            if s.backend.mesh is None:
                continue
            for n in s.nodes:
                for x in n.src:
                    if x.is_leaf and x.id not in labels:
                        labels[x.id] = sharding_label(x, labels, s.backend.mesh.devices.size)
                labels[n.id] = sharding_label(n, labels, s.backend.mesh.devices.size)
        return labels

    def dump(self) -> str:
        """Each split with its backend, nodes and the copies it needs (GGML_SCHED_DEBUG);
        on a mesh backend, each node's and source's sharding in braces."""
        labels = self.shardings()

        def sh(t: Tensor) -> str:
            return f"{{{labels[t.id]}}}" if t.id in labels else ""

        lines = [f"## SPLIT GRAPH: {len(self.splits)} splits, {self.n_copies} copies"]
        for i, s in enumerate(self.splits):
            copies = ", ".join(f"{c.name or c.op.value} ({self.backend_name(c)}->{s.backend.name})"
                               for c in s.copies)
            lines.append(f"## SPLIT #{i}: {s.backend.name} # {len(s.nodes)} nodes, "
                         f"{len(s.copies)} inputs copied: {copies or '-'}")
            for n in s.nodes:
                srcs = " ".join(f"{x.name or x.op.value}[{self.backend_name(x)}]{sh(x)}" for x in n.src)
                lines.append(f"node #{n.id:5d} ({n.op.value:>14}): {n.name:28} [{s.backend.name}]{sh(n)} <- {srcs}")
        return "\n".join(lines)


def _buffer_backend(t: Tensor) -> Backend | None:
    """Where a weight's or state's buffer lives, if it is bound to one (a device, or the
    mesh it is laid out over)."""
    if t.flags & Flag.WEIGHT and isinstance(t.data, weights.DeviceWeight):
        return backend_of_array(t.data.array)
    if t.flags & Flag.STATE and t.data is not None:
        return backend_of_array(t.data)
    return None


def sharding_label(t: Tensor, labels: dict[int, str], n_dev: int) -> str:
    """How a node of a mesh split is laid out over the mesh's n_dev devices, for the dump:
    "R" replicated, "S(d)" its ggml dim d divided over the devices, a weight's split
    ("rows", "rows+gather", "cols+reduce"), or "auto" where the rules below cannot tell and
    XLA's sharding propagation (GSPMD) decides. Weights, state and the products of split
    weights are laid out so by construction; the rest is what propagation is expected to do."""
    if t.flags & Flag.WEIGHT and isinstance(t.data, weights.DeviceWeight):
        return str(t.data.spec.split) if t.data.spec.split is not None else "R"
    if t.is_leaf and t.flags & Flag.STATE and t.data is not None:
        return _array_label(t.data)
    if t.is_leaf:
        return "R"
    w = t.src[0]
    if t.op in (Op.MUL_MAT, Op.GET_ROWS) and w.flags & Flag.WEIGHT \
            and isinstance(w.data, weights.DeviceWeight) and w.data.spec.split is not None:
        split = w.data.spec.split
        return "S(0)" if t.op is Op.MUL_MAT and split.dim == 1 and not split.gather else "R"
    srcs = [labels.get(x.id, "auto") for x in t.src]
    if all(x == "R" for x in srcs):
        return "R"
    src = srcs[0]
    if not src.startswith("S("):
        return "auto"
    d = int(src[2])
    if t.op is Op.PERMUTE:
        return f"S({t.op_params[d]})"
    if t.op in (Op.RESHAPE, Op.VIEW):
        # the divided dim's element strides [lo, hi) land on the outermost result dim inside
        # that range whose size still divides by the device count (n_head of [d, n_head, T]),
        lo = int(np.prod(w.ne[:d]))
        hi = lo * w.ne[d]
        # ...or on the result dim that merges it as its outermost part (the inverse)
        for e in range(3, -1, -1):
            below = int(np.prod(t.ne[:e]))
            if lo <= below and below * t.ne[e] <= hi and t.ne[e] % n_dev == 0 and t.ne[e] > 1:
                return f"S({e})"
            if below <= lo and below * t.ne[e] == hi and t.ne[e] > 1:
                return f"S({e})"
        return "auto"
    if t.op is Op.FLASH_ATTN_EXT:      # q [D, n_q, H] -> [D, H, n_q]: divided by heads
        return "S(1)" if d == 2 else "auto"
    if t.op in (Op.MUL_MAT, Op.SUM_ROWS, Op.SOFT_MAX, Op.CONCAT, Op.ARGSORT, Op.TOP_K):
        return "auto"
    return src


def _array_label(x: jax.Array) -> str:
    spec = getattr(x.sharding, "spec", None)
    if spec is None:
        return "R"
    axes = list(spec) + [None] * (x.ndim - len(spec))
    split = [x.ndim - 1 - i for i, a in enumerate(axes) if a is not None]
    return f"S({split[0]})" if split else "R"


def _state_buffer(t: Tensor, state: dict[Tensor, jax.Array],
                  layout: tuple[tuple[int, ...], np.dtype] | None = None) -> jax.Array:
    """The buffer given for state leaf t, checked against its shape (numpy order) and type
    (layout: buffer_layout(t), when the caller keeps it): a mismatch would otherwise fail deep
    inside tracing, naming no tensor."""
    if t not in state:
        raise ValueError(f"no buffer for state {t.name!r}")
    buf = state[t]
    shape, want = layout if layout is not None else buffer_layout(t)
    if tuple(buf.shape) != shape or buf.dtype != want:
        raise ValueError(f"state {t.name!r}: buffer is {buf.dtype}{list(buf.shape)}, "
                         f"the graph needs {want}{list(shape)} (ne={list(t.ne)})")
    return buf


def _on_device(x, backend: Backend):
    """x (an array or a DeviceWeight) on backend, copied only when it lives elsewhere: a
    state already there must be passed as is, so that donating it updates it in place."""
    arr = x.array if isinstance(x, weights.DeviceWeight) else x
    return x if arr.devices() == backend.devices else jax.device_put(x, backend.target)


class Scheduler:
    """Places graphs over a list of backends and runs them through a GraphCache."""

    def __init__(self, backend_list: list[Backend] | None = None, cache: GraphCache | None = None,
                 cb_eval: EvalCallback | None = None):
        self.backends = backend_list or backends()
        self.cache = cache or get_default_cache()
        self.cb_eval = cb_eval
        self.debug = flags.SCHED_DEBUG.on()
        self.t_inputs = 0.0     # seconds spent putting graph inputs on devices (for profiles)

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
            s.program = Program.from_nodes(s.nodes, outs, s.backend.device, s.backend.mesh)
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
        be = split.backend
        if split.w_vals is None:
            w_vals = []
            for t in prog.weights:
                if not isinstance(t.data, weights.DeviceWeight):
                    raise ValueError(f"weight {t.name!r} has no device data")
                w_vals.append(_on_device(t.data, be))
            split.w_vals = w_vals
        t0 = time.perf_counter()
        in_vals = []
        for t in prog.inputs:
            if t.id in values:
                in_vals.append(jax.device_put(values[t.id], be.target))
            elif t in host_inputs:
                v = np.asarray(host_inputs[t]).reshape(t.shape).astype(lower.jnp_dtype(t.type))
                # on one device the executable takes numpy itself: one transfer inside the call
                # (~0.1 ms for a decode step's inputs) instead of a device_put each (~1 ms)
                in_vals.append(v if be.mesh is None else be.put(v))
            else:
                raise ValueError(f"no value for input {t.name!r}")
        self.t_inputs += time.perf_counter() - t0
        if split.st_layouts is None:
            split.st_layouts = [buffer_layout(t) for t in prog.states]
        # a state this split's last run returned is on its device with its layout: only the
        # others are checked (60 checks were ~0.1 ms of a SmolLM2 decode step)
        returned = split.st_returned or [None] * len(prog.states)
        st_vals = [buf if (buf := state.get(t)) is not None and ref is not None and ref() is buf
                   else _on_device(_state_buffer(t, state, lay), be)
                   for t, lay, ref in zip(prog.states, split.st_layouts, returned, strict=True)]
        return split.w_vals, in_vals, st_vals

    def reserve(self, plan: Plan, host_inputs: dict[Tensor, object], state: dict[Tensor, jax.Array],
                on_compile: Callable[[], None] | None = None) -> None:
        """Compile every split ahead of time (like ggml_backend_sched_reserve); on_compile is
        called before each compilation the caches cannot serve."""
        for s in plan.splits:
            if s.compiled is None:
                assert s.program is not None   # alloc_graph built it
                w, i, st = self._abstract_args(s, host_inputs, state)
                s.compiled = self.cache.get(s.program, w, i, st, on_compile)

    def preload(self, plans: list[Plan], host_inputs: dict[Tensor, object], state: dict[Tensor, jax.Array]) -> None:
        """Read the stored executables of the plans' splits side by side (GraphCache.preload),
        before reserving the plans one by one."""
        self.cache.preload([(s.program, *self._abstract_args(s, host_inputs, state))
                            for plan in plans for s in plan.splits if s.compiled is None])

    def _abstract_args(self, split: Split, host_inputs, state):
        prog = split.program
        assert prog is not None   # alloc_graph built it
        w = [t.data for t in prog.weights]
        i = [np.zeros(t.shape, lower.jnp_dtype(t.type)) for t in prog.inputs]
        st = [_state_buffer(t, state) for t in prog.states]
        return w, i, st

    def compute(self, plan: Plan, host_inputs: dict[Tensor, object], state: dict[Tensor, jax.Array],
                on_compile: Callable[[], None] | None = None):
        """Run the splits in order. Returns (outputs {tensor: value}, new state, completed):
        completed is False when cb_eval asked to stop; state passed in is donated. on_compile
        as in reserve."""
        values: dict[int, jax.Array] = {}
        state = dict(state)
        for s in plan.splits:
            prog = s.program
            assert prog is not None   # alloc_graph built it
            w, i, st = self._args(s, values, host_inputs, state)
            if s.compiled is None:
                s.compiled = self.cache.get(prog, w, i, st, on_compile)
            if s.w_args is None:
                s.w_args = s.compiled.weight_args(w)
            outs, new_st = s.compiled(s.w_args, i, st)
            for t, v in zip(prog.outputs, outs, strict=False):
                values[t.id] = v
            s.st_returned = [weakref.ref(v) for v in new_st]   # (one per state: Program.make_fn)
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
