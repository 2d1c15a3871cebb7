"""Programs and the compiled-graph cache.

A `Program` is a run of nodes (a whole graph, or one scheduler split) as one pure function
`f(weights, inputs, state) -> (outputs, new_state)`, jitted once with the state donated so a
`set_rows` into the KV cache updates it in place. The cache key is the program's structural
signature (ops, shapes, strides, types, op params, names, leaf roles, weight formats,
device), never weight values: two separately built but identical graphs share one
executable, like llama.cpp reusing a graph when `can_reuse` holds.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jaxlib
import numpy as np
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from ggmlx import flags, lower, native, weights
from ggmlx.graph import Graph
from ggmlx.tensor import Flag, Op, Tensor

log = logging.getLogger(__name__)

_CACHE_READ_ERROR = "Error reading persistent compilation cache entry"


def remove_damaged_entries(path: str) -> list[str]:
    """Delete the XLA cache entries in `path` that do not decompress (a torn or overwritten
    file). JAX never replaces an existing entry, so a damaged one would otherwise be read,
    rejected and recompiled on every run. Returns the names removed."""
    from ggmlx._jax_private import cache_entry_reader
    read_cache_entry = cache_entry_reader()
    removed = []
    for name in sorted(os.listdir(path)):
        if not name.endswith("-cache"):
            continue
        full = os.path.join(path, name)
        try:
            with open(full, "rb") as f:
                read_cache_entry(f.read())
        except OSError:
            continue
        except Exception:
            os.unlink(full)
            removed.append(name)
    return removed


def _state_root(t: Tensor) -> Tensor:
    while t.op is Op.SET_ROWS:
        t = t.src[0]
    return t


@dataclass
class Program:
    """Nodes to evaluate in order and the tensors they read from outside."""
    nodes: list[Tensor]
    weights: list[Tensor]
    inputs: list[Tensor]
    states: list[Tensor]
    outputs: list[Tensor]
    device: jax.Device | None = None
    state_writes: dict[int, Tensor] = field(default_factory=dict)   # state leaf id -> last writer
    mesh: jax.sharding.Mesh | None = None   # one SPMD program over a mesh (split_mode "row")

    @classmethod
    def from_nodes(cls, nodes: list[Tensor], outputs: list[Tensor], device=None,
                   mesh: jax.sharding.Mesh | None = None) -> Program:
        inside = {n.id for n in nodes}
        ext: dict[int, Tensor] = {}
        for n in nodes:
            for s in n.src:
                if s.id not in inside:
                    ext.setdefault(s.id, s)
        for o in outputs:
            if o.id not in inside:
                ext.setdefault(o.id, o)
        exts = list(ext.values())
        w = [t for t in exts if t.is_leaf and t.flags & Flag.WEIGHT]
        st = [t for t in exts if t.is_leaf and t.flags & Flag.STATE]
        inp = [t for t in exts if t not in w and t not in st]
        writes = {}
        for n in nodes:
            if n.op is Op.SET_ROWS:
                root = _state_root(n)
                if root.flags & Flag.STATE:
                    writes[root.id] = n
        return cls(nodes, w, inp, st, list(outputs), device, writes, mesh)

    @classmethod
    def from_graph(cls, graph: Graph, extra_outputs: Sequence[Tensor] = (), device=None) -> Program:
        outs = list(graph.outputs())
        outs += [t for t in extra_outputs if t not in outs]
        return cls.from_nodes(graph.nodes, outs, device)

    # ---- signature -------------------------------------------------------------------

    def signature(self) -> list[tuple]:
        """Everything that decides the compiled code, one readable entry per item."""
        ref: dict[int, str] = {}
        sig: list[tuple] = [("device", str(self.device)), ("matmul_precision", flags.matmul_precision()),
                              ("native", native.available()), ("block_isa", flags.BLOCK_ISA.get())]
        if self.mesh is not None:
            sig.append(("mesh", tuple(d.id for d in self.mesh.devices.flat), self.mesh.axis_names))
        for role, ts in (("weight", self.weights), ("input", self.inputs), ("state", self.states)):
            for j, t in enumerate(ts):
                ref[t.id] = f"{role}{j}"
                fmt = t.data.spec if isinstance(t.data, weights.DeviceWeight) else None
                sig.append((role, j, t.name, t.type.name, t.ne, t.nb, fmt))
        for k, n in enumerate(self.nodes):
            ref[n.id] = f"node{k}"
            sig.append(("node", k, n.name, n.op.value, n.type.name, n.ne, n.nb, n.op_params,
                        n.view_offs, tuple(ref[s.id] for s in n.src)))
        sig.append(("outputs", tuple(ref[o.id] for o in self.outputs)))
        sig.append(("state_writes", tuple(ref[self.state_writes[s.id].id] if s.id in self.state_writes
                                          else None for s in self.states)))
        return sig

    # ---- the function ----------------------------------------------------------------

    def make_fn(self, w_treedef, index: tuple[int, ...] | None = None):
        """f(weight array leaves, inputs, state); the weights' pytree is rebuilt inside, so a
        call passes flat arrays (flattening ~300 DeviceWeights per call costs ~1.5 ms). With
        index, f takes each distinct array once and leaf j of the pytree is argument index[j]
        (`shared_leaves`)."""
        nodes, outs = self.nodes, self.outputs
        w_leaves, in_leaves, st_leaves = self.weights, self.inputs, self.states
        writes = self.state_writes

        def fn(w_flat, in_vals, st_vals):
            if index is not None:
                w_flat = [w_flat[k] for k in index]
            w_vals = jax.tree.unflatten(w_treedef, w_flat)
            env = {}
            env.update(zip(w_leaves, w_vals, strict=False))
            env.update(zip(in_leaves, in_vals, strict=False))
            env.update(zip(st_leaves, st_vals, strict=False))
            lower.run_nodes(nodes, env)
            new_state = tuple(env[writes[s.id]] if s.id in writes else env[s] for s in st_leaves)
            return tuple(env[o] for o in outs), new_state

        return fn


def _abstract(x, device):
    sharding = jax.sharding.SingleDeviceSharding(device) if device is not None else None
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _abstract_on_mesh(x, mesh):
    """An argument of a mesh program: weights and state keep their own layout over the mesh,
    anything else (inputs) is replicated."""
    sh = getattr(x, "sharding", None)
    if not isinstance(sh, jax.sharding.NamedSharding):
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh)


def shared_leaves(w_leaves) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(keep, index) for the weights' flat array leaves: keep, the position of the first leaf
    of each distinct array; index, for every leaf the kept argument that holds it. Fused
    weights (wq/wk/wv, gate/up) share one array, which an executable then takes once: each
    argument costs the call about 2 us (SmolLM2-135M: 693 leaves, 423 arrays; the weights'
    part of a decode step's call 1.55 -> 0.7 ms)."""
    first: dict[int, int] = {}
    keep: list[int] = []
    index = []
    for j, x in enumerate(w_leaves):
        k = first.setdefault(id(x), len(keep))
        if k == len(keep):
            keep.append(j)
        index.append(k)
    return tuple(keep), tuple(index)


class CompiledProgram:
    """An executable plus the order in which it takes its arguments. Weights go in as the
    distinct arrays among the flat leaves of their DeviceWeights (`weight_args`: the leaves at
    positions `keep`, see shared_leaves), which callers make once and keep."""

    def __init__(self, executable, key: str, compile_seconds: float, keep: tuple[int, ...], on_disk: bool = False):
        self.executable = executable
        self.key = key
        self.compile_seconds = compile_seconds
        self.keep = keep
        self.on_disk = on_disk      # stored on disk: dropping it costs a reload, not a compile

    def weight_args(self, w_vals) -> tuple:
        leaves = jax.tree.leaves(tuple(w_vals))
        return tuple(leaves[k] for k in self.keep)

    def __call__(self, w_args, in_vals, st_vals):
        return self.executable(tuple(w_args), tuple(in_vals), tuple(st_vals))


log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0
    evictions: int = 0
    rewritten: int = 0      # damaged persistent-cache entries found and written again
    disk_hits: int = 0      # misses served by the on-disk executable cache (GGMLX_EXE_CACHE)


DEFAULT_MAX_ENTRIES = 64


def hash_sources(paths: Sequence[str]) -> str:
    """A hash of these files' names and contents, in this order: what a cache entry derived by
    that code is keyed by, so an upgraded (or edited) engine never reads an older entry."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + f.read())
    return h.hexdigest()


@functools.cache
def _code_version() -> str:
    """hash_sources of ggmlx's own sources (with the native kernels' C++, whose custom calls an
    executable names): a signature means the same program only under the same lowering code."""
    root = os.path.dirname(__file__)
    return hash_sources([os.path.join(d, name) for d, _, files in sorted(os.walk(root)) for name in sorted(files)
                         if name.endswith((".py", ".cc", ".h"))])


def _exe_cache_on() -> bool:
    """Whether executables are stored on disk (GGMLX_EXE_CACHE, and persistent caching on)."""
    return flags.EXE_CACHE.on() and not flags.NO_PERSISTENT_CACHE.on()


def write_cache_file(path: str, data: bytes, what: str) -> None:
    """data as the file at path, whole or not at all (a temporary file renamed over it: a
    concurrent reader sees either); a failure (a full disk, a read-only cache) only warns:
    the entry is built again next time."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not store %s in %s: %s", what, path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@functools.cache
def _host_cpu() -> str:
    """The host CPU's model and instruction-set flags: XLA:CPU compiles for the CPU it runs on,
    so an executable from a cache folder shared with another machine must not be loaded."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return hashlib.sha256("".join(sorted(set(lines))).encode()).hexdigest()
    except OSError:
        return platform.machine() + "|" + platform.processor()


_PLAIN = (int, float, str, bool, type(None), np.generic)


def _plain(v) -> bool:
    """Whether v's repr says all of it (numbers, strings, tuples of them): not a function,
    whose repr holds an address another process may give a different function."""
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(_plain(x) for x in v))


def _disk_path(key: str, program: Program, args) -> str | None:
    """Where the serialized executable of signature key lives: under cache_root()/exe, named
    by the key plus everything else that decides the machine code (ggmlx's sources, JAX and
    jaxlib versions, XLA_FLAGS, x64 mode, the device kind, the host CPU's model and flags, the
    arguments' shapes and dtypes). None when GGMLX_EXE_CACHE or persistent caching is off,
    the process has several devices, or the program holds a Python callable (map_custom1:
    identified by address only)."""
    if not _exe_cache_on():
        return None
    if len(jax.devices()) != 1:
        # a deserialized executable is loaded for every local device ("Expected args to have
        # 4 shards" on a process with 4 CPU devices): several devices compile, or use XLA's cache
        return None
    dev = jax.devices()[0]      # the only device (checked above)
    if not all(_plain(n.op_params) for n in program.nodes):
        return None
    avals = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args)]
    tag = "|".join([key, _code_version(), jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""),
                    str(jax.dtypes.canonicalize_dtype(np.float64)), dev.platform, dev.device_kind,
                    _host_cpu() if dev.platform == "cpu" else "", repr(avals)])
    return os.path.join(flags.cache_root(), "exe", hashlib.sha256(tag.encode()).hexdigest() + ".bin")


def _load_executable(path: str | None):
    """The executable stored at path, or None (absent, or unreadable: then it is recompiled)."""
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            blob, in_tree, out_tree = pickle.load(f)
        executable = deserialize_and_load(blob, in_tree, out_tree)
        del blob
        # the deserialization's freed temporaries stay resident in the C heap (25-45 MB a
        # Gemma3 executable, measured by malloc_trim's release) until given back
        weights.trim_heap()
        return executable
    except Exception as e:  # a stale or truncated entry must never stop a run
        log.warning("ignoring unreadable cached executable %s: %s", path, e)
        return None


# Stored executables being read in worker threads, by path (prefetch_executables): the ones a
# reserve is about to use (GraphCache.preload), and at a model's start those its last run with
# the same settings used, while the model loads; GraphCache.get takes them from here.
_prefetched: dict[str, concurrent.futures.Future] = {}


def prefetch_executables(paths: Sequence[str]) -> None:
    """Start reading the stored executables at these paths side by side (up to a thread per
    core; absent ones are skipped), for the GraphCache lookups that will ask for them: XLA
    releases the GIL for part of a deserialization."""
    todo = [p for p in dict.fromkeys(paths) if p not in _prefetched and os.path.exists(p)]
    if not todo:
        return
    native.available()      # their FFI targets must be registered before XLA loads them
    pool = concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1),
                                                 thread_name_prefix="ggmlx-prefetch")
    for p in todo:
        _prefetched[p] = pool.submit(_load_executable, p)
    pool.shutdown(wait=False)


def _take_prefetched(path: str | None):
    """The executable prefetch_executables read from path (waiting for it), or None."""
    fut = _prefetched.pop(path, None) if path is not None else None
    return fut.result() if fut is not None else None


def _run_manifest_path(run_key: str) -> str:
    return os.path.join(flags.cache_root(), "runs", hashlib.sha256(run_key.encode()).hexdigest() + ".json")


def prefetch_run(run_key: str) -> list[str]:
    """Prefetch the executables that the last run under run_key (a caller's string naming a
    model file and every setting its graphs depend on) used; returns their paths ([] when there
    is no record, or the persistent cache is off)."""
    if not _exe_cache_on():
        return []
    try:
        with open(_run_manifest_path(run_key)) as f:
            paths = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        return []
    prefetch_executables(paths)
    return paths


def remember_run(run_key: str, paths: Sequence[str]) -> None:
    """Record the executables a run under run_key used, for the next one's prefetch_run."""
    if _exe_cache_on():
        write_cache_file(_run_manifest_path(run_key), json.dumps(list(paths)).encode(), "the run's executables")


def _store_executable(path: str | None, executable) -> None:
    if path is None:
        return
    try:
        data = pickle.dumps(serialize(executable))
    except Exception as e:  # an unserializable executable only costs the next start its compile
        log.warning("could not serialize the executable for %s: %s", path, e)
        return
    write_cache_file(path, data, "the executable")


# XLA:CPU (jaxlib 0.10) hands the rms_norm reductions of a few rows to YNNPACK, at 9-15 us a call
# against ~1.5 us for its own loops (8 rows x 576: a step's 120 norms 1.03 -> 0.32 ms, a fifth of
# what batched decode adds over one row): its library fusions are turned off where the jaxlib
# has the option (the only ones in these graphs).
_CPU_COMPILE_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
_cpu_options_known = True


def _compiled(lowered, on_cpu: bool):
    """lowered.compile(), with _CPU_COMPILE_OPTIONS on a CPU where the jaxlib knows them."""
    global _cpu_options_known
    if on_cpu and _cpu_options_known:
        try:
            return lowered.compile(compiler_options=_CPU_COMPILE_OPTIONS)
        except jax.errors.JaxRuntimeError as e:
            if "No such compile option" not in str(e):
                raise
            _cpu_options_known = False
    return lowered.compile()


class GraphCache:
    """Compiled programs keyed by structural signature, at most `max_entries` of them (the
    least recently used is dropped first); counts hits, misses, evictions and compile time
    and can say why the last lookup missed."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"GraphCache: max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, CompiledProgram] = OrderedDict()
        self._sigs: dict[str, list[tuple]] = {}
        # the stored executables got (read or written), each once, in order: LLM's remember_run
        self.disk_paths: dict[str, None] = {}
        self.stats = CacheStats()
        self.last_miss_reason: str | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        """Always true: an empty cache is still a cache (`cache or default` must keep it)."""
        return True

    def programs(self) -> list[CompiledProgram]:
        """The cached executables, oldest first (benchmarks read their HLO)."""
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()
        self._sigs.clear()

    @staticmethod
    def key_of(sig: list[tuple]) -> str:
        return hashlib.sha256(repr(sig).encode()).hexdigest()

    def _identify(self, program: Program, w_vals, in_vals, st_vals):
        """The cache key of program with these arguments, its signature, the arguments as the
        executable takes them and how to rebuild the weights' tree."""
        w_leaves, w_treedef = jax.tree.flatten(tuple(w_vals))
        keep, index = shared_leaves(w_leaves)
        sig = program.signature() + [("weight_arrays", index)]
        args = (tuple(w_leaves[k] for k in keep), tuple(in_vals), tuple(st_vals))
        return self.key_of(sig), sig, args, (w_treedef, index, keep)

    def preload(self, requests: Sequence[tuple[Program, object, object, object]]) -> None:
        """Start reading the executables on disk of those (program, w_vals, in_vals, st_vals)
        not in memory side by side (prefetch_executables), for the get calls that follow
        (Gemma3's two executables of a short generation: 0.31 -> 0.22 s)."""
        todo = []
        for program, w_vals, in_vals, st_vals in requests:
            key, _, args, _ = self._identify(program, w_vals, in_vals, st_vals)
            if key in self._entries or program.mesh is not None:
                continue
            path = _disk_path(key, program, args)
            if path is not None:
                todo.append(path)
        if len(todo) >= 2:      # one alone is read by get
            prefetch_executables(todo)

    def get(self, program: Program, w_vals, in_vals, st_vals,
            on_compile: Callable[[], None] | None = None) -> CompiledProgram:
        """The executable for program, compiling it (for these argument shapes) on a miss;
        on_compile is called just before a compilation (a miss not served from disk)."""
        key, sig, args, (w_treedef, index, keep) = self._identify(program, w_vals, in_vals, st_vals)
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return hit
        self.stats.misses += 1
        self.last_miss_reason = self._explain_miss(sig)
        dev, mesh = program.device, program.mesh
        t0 = time.perf_counter()
        path = _disk_path(key, program, args) if mesh is None else None     # mesh programs: XLA's cache only
        executable = _take_prefetched(path) or _load_executable(path)
        if executable is not None:
            self.stats.disk_hits += 1
        else:
            if on_compile is not None:
                on_compile()
            out_shardings = None
            if mesh is None:
                abstract = jax.tree.map(lambda x: _abstract(x, dev), args)
            else:
                # outputs replicated (every process can read them), state back in its own layout
                abstract = jax.tree.map(lambda x: _abstract_on_mesh(x, mesh), args)
                replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                out_shardings = (tuple(replicated for _ in program.outputs), tuple(a.sharding for a in abstract[2]))
            fn = program.make_fn(w_treedef, index)
            first = mesh.devices.flat[0] if mesh is not None else dev or jax.devices()[0]
            on_cpu = first.platform == "cpu"
            executable = self._compile(
                lambda: _compiled(jax.jit(fn, donate_argnums=(2,), out_shardings=out_shardings).lower(*abstract),
                                  on_cpu),
                xla_cache=path is None)
            _store_executable(path, executable)
        dt = time.perf_counter() - t0
        self.stats.compile_seconds += dt
        on_disk = path is not None and os.path.exists(path)
        if path is not None and on_disk:
            self.disk_paths[path] = None
        entry = CompiledProgram(executable, key, dt, keep, on_disk=on_disk)
        self._entries[key] = entry
        self._sigs[key] = sig
        while len(self._entries) > self.max_entries:
            old, _ = self._entries.popitem(last=False)
            del self._sigs[old]
            self.stats.evictions += 1
        return entry

    def discard(self, key: str) -> None:
        """Forget the executable of signature key, so that XLA frees it once its last holder
        lets go (a later get reads it from disk again, or compiles it)."""
        if self._entries.pop(key, None) is not None:
            del self._sigs[key]

    def _compile(self, compile_fn, xla_cache: bool = True):
        """compile_fn() (lower and compile); when JAX reports a damaged persistent-cache entry,
        delete the damaged entries and compile once more so the entry is written again (JAX never overwrites).
        Without xla_cache, XLA's on-disk cache is neither read nor written: an executable
        that is to be serialized must come from a real compilation (one loaded from XLA's
        cache serializes without some of its functions: "Function ... not found" when run)."""
        from jax.experimental.compilation_cache.compilation_cache import reset_cache

        from ggmlx._jax_private import compilation_cache_dir, enable_compilation_cache
        cache_dir = compilation_cache_dir()     # set by ggmlx.init()
        if not xla_cache:
            # JAX decides once per process whether its cache is used: reset that decision so it
            # is taken again with the cache off, and once more after, with it back on
            reset_cache()
            try:
                with enable_compilation_cache(False):
                    return compile_fn()
            finally:
                reset_cache()
        if not cache_dir:
            return compile_fn()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            executable = compile_fn()
        damaged = False
        for w in caught:
            if _CACHE_READ_ERROR in str(w.message):
                damaged = True
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if not damaged:
            return executable
        removed = remove_damaged_entries(cache_dir)
        log.warning("compile cache: %d damaged entr%s in %s removed and written again", len(removed),
                    "y" if len(removed) == 1 else "ies", cache_dir)
        self.stats.rewritten += len(removed)
        if not removed:
            return executable
        jax.clear_caches()      # else JAX hands back its in-memory executable and writes nothing
        return compile_fn()

    def _explain_miss(self, sig: list[tuple]) -> str:
        if not self._sigs:
            return "cache is empty"
        same_len = [s for s in self._sigs.values() if len(s) == len(sig)]
        other = (same_len or list(self._sigs.values()))[-1]
        for a, b in zip(sig, other, strict=False):
            if a != b:
                return f"{_describe(a)} differs from the cached {_describe(b)}"
        return f"signature has {len(sig)} entries, the closest cached one {len(other)}"


def _describe(entry: tuple) -> str:
    kind = entry[0]
    if kind == "node":
        _, k, name, op, typ, ne, nb, params, offs, srcs = entry
        return f"node {k} {name!r} ({op} {typ} ne={list(ne)} nb={list(nb)} params={params} src={srcs})"
    if kind in ("weight", "input", "state"):
        _, j, name, typ, ne, nb, fmt = entry
        return f"{kind} {j} {name!r} ({typ} ne={list(ne)} format={fmt})"
    return repr(entry)


default_cache: GraphCache | None = None


def get_default_cache() -> GraphCache:
    global default_cache
    if default_cache is None:
        default_cache = GraphCache()
    return default_cache


def compute(graph: Graph, inputs: dict[Tensor, object] | None = None,
            state: dict[Tensor, jax.Array] | None = None, *, cache: GraphCache | None = None,
            device=None, extra_outputs: Sequence[Tensor] = ()):
    """Run a whole graph on one device. Returns ({output tensor: value}, {state leaf: new value}).
    State arrays passed in are donated: use the returned ones afterwards."""
    cache = cache or get_default_cache()
    device = device or jax.devices()[0]
    prog = Program.from_graph(graph, list(extra_outputs), device)
    inputs = inputs or {}
    state = state or {}
    missing = [t.name for t in prog.inputs if t not in inputs] + [t.name for t in prog.states if t not in state]
    if missing:
        raise ValueError(f"compute: no value given for {missing}")
    unbound = [t.name for t in prog.weights if not isinstance(t.data, weights.DeviceWeight)]
    if unbound:
        raise ValueError(f"compute: weights without device data: {unbound}")
    w_vals = [t.data for t in prog.weights]
    in_vals = [jax.device_put(np.asarray(inputs[t]).reshape(t.shape).astype(lower.jnp_dtype(t.type)), device)
               for t in prog.inputs]
    st_vals = [state[t] for t in prog.states]
    exe = cache.get(prog, w_vals, in_vals, st_vals)
    outs, new_state = exe(exe.weight_args(w_vals), in_vals, st_vals)
    return dict(zip(prog.outputs, outs, strict=False)), dict(zip(prog.states, new_state, strict=False))
