"""The module layering of ggmlx/ and llm/, read from the source with `ast` (nothing is imported).

An edge A -> B is any import in A of a project module B: `import x.y`, `from x.y import z`
(to x.y.z when that is a module, else to x.y), relative imports, at module level and inside
functions alike (a deferred import still ties A to B); imports under `if TYPE_CHECKING:` are
not edges. Old module paths that llm/__init__.py's `_MOVED` finder aliases (llm.trace, ...)
count as their new module, and `from llm import Context` counts as the module `_EXPORTS`
names for it (llm.context), as llm/__init__ itself imports nothing until a name is used. Other
importlib.import_module calls are not seen (the one in llm/hub.py loads model packages).

Packages: importing x.y.z runs the __init__ of x and x.y first, but that is not counted as an
edge to them. So a package __init__ that re-exports its submodules (llm/sampling/__init__ ->
llm.sampling.samplers) is no cycle with them; it is one only when a submodule imports the
package itself (`import x.y`, or `from x.y import name` for a name x/y/__init__.py defines).

Layers, lowest first; a module may import its own layer and the ones below:
    ggmlx   the mini-ggml (never imports llm)
    core    the flat llama.cpp-like modules (CORE, with params: ContextParams is
            llama_context_params) and the packages llm.models, llm.tokenizers
    middle  the rest of llm: the package itself, sampling, generation, chat
    upper   llm.serving, llm.research, llm.cli, llm.api, llm.__main__
INVERSIONS lists the imports that break this today, each with the change that removes it; the
test fails on any other one, and on a listed one once it is gone (delete its entry then).
"""
from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ggmlx", "llm")
MAX_FUNCTION_LINES = 100

CORE = {f"llm.{name}" for name in (
    "adapter", "arch", "batch", "context", "cvec", "distributed", "errors", "graph", "hparams", "hub", "kv_cache",
    "kv_cells", "layer", "loader", "memory_hybrid", "memory_recurrent", "model", "params", "prompt_cache", "state",
    "vocab")}
CORE_PACKAGES = ("llm.models", "llm.tokenizers")
UPPER = ("llm.serving", "llm.research", "llm.cli", "llm.api", "llm.__main__")

LAYERS = ("ggmlx", "core", "middle", "upper")
INVERSIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The package a relative import starts from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def find_modules() -> dict[str, Module]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            out[name] = Module(name, path, is_package)
    return out


def llm_init_table(name: str) -> dict[str, str]:
    """A dict literal assigned at module level in llm/__init__.py (_MOVED, _EXPORTS)."""
    tree = ast.parse((ROOT / "llm" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]:
            table = ast.literal_eval(node.value)
            assert isinstance(table, dict) and table, f"llm/__init__.py: {name} is not a non-empty dict literal"
            return table
    raise AssertionError(f"llm/__init__.py assigns no {name} (this test reads it to resolve imports)")


MODULES = find_modules()
MOVED = llm_init_table("_MOVED")
EXPORTS = llm_init_table("_EXPORTS")


def unalias(name: str) -> str:
    """The module an old path (llm._MOVED) stands for: llm.trace.x -> llm.research.trace.x."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


def is_project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def deepest_module(name: str) -> str:
    """The longest prefix of a dotted name that is a module (ggmlx.native._kernels, a compiled
    extension, -> ggmlx.native)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    assert parts, f"{name} is in no module of {PACKAGES}"
    return ".".join(parts)


def is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, in source order, except under `if TYPE_CHECKING:`."""
    return imports_in(ast.iter_child_nodes(tree))


def imports_in(nodes: Iterable[ast.AST]) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and is_type_checking(node):
            out.extend(imports_in(node.orelse))
        else:
            out.extend(imports_in(ast.iter_child_nodes(node)))
    return out


def targets(mod: Module, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The project modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [unalias(a.name) for a in node.names]
        return [deepest_module(n) for n in names if is_project(n)]
    if node.level:
        base = mod.package.split(".")
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    source = unalias(source)
    if not is_project(source):
        return []
    out = []
    for alias in node.names:
        sub = unalias(f"{source}.{alias.name}")
        if sub in MODULES:
            out.append(sub)
        elif source == "llm" and alias.name in EXPORTS:
            out.append(EXPORTS[alias.name])
        else:
            out.append(deepest_module(source))
    return out


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of its first import there}."""
    graph: dict[str, dict[str, int]] = {}
    for name, mod in MODULES.items():
        edges: dict[str, int] = {}
        for node in import_nodes(ast.parse(mod.path.read_text(), str(mod.path))):
            for t in targets(mod, node):
                if t != name:
                    edges[t] = min(edges.get(t, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def where(a: str, b: str) -> str:
    return f"{MODULES[a].path.relative_to(ROOT)}:{import_graph()[a][b]}"


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [shortest_cycle(graph, comp) for comp in components]


def shortest_cycle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """The shortest cycle through comp's first module, staying inside comp (breadth first)."""
    start, members = comp[0], set(comp)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {comp}")


def layer(name: str) -> str:
    if name.startswith("ggmlx"):
        return "ggmlx"
    if name in CORE or name.startswith(tuple(p + "." for p in CORE_PACKAGES)) or name in CORE_PACKAGES:
        return "core"
    if name in UPPER or name.startswith(tuple(p + "." for p in UPPER)):
        return "upper"
    return "middle"


def test_the_walk_finds_the_project():
    assert {"ggmlx.ops", "llm.context", "llm.models.llama", "llm.research.trace"} <= set(MODULES)
    assert "ggmlx.ops" in import_graph()["llm.graph"], "llm/graph.py builds with ggmlx.ops: the walk lost imports"
    missing = sorted(m for m in CORE if m not in MODULES)
    assert not missing, f"CORE names modules that do not exist: {missing}"
    gone = sorted(f"{old} -> {new}" for old, new in MOVED.items() if new not in MODULES)
    assert not gone, f"llm._MOVED points to modules that do not exist: {gone}"


def test_the_resolution_rules():
    here = MODULES["llm.generation.core"]

    def resolve(code: str) -> list[str]:
        return [t for node in import_nodes(ast.parse(code)) for t in targets(here, node)]

    assert resolve("from llm.sampling import structured, SamplingParams") == [
        "llm.sampling.structured", "llm.sampling"]
    assert resolve("import llm.trace") == ["llm.research.trace"]
    assert resolve("from llm import trace, Context, hub") == ["llm.research.trace", "llm.context", "llm.hub"]
    assert resolve("from .speculative import Draft\nfrom ..sampling.samplers import Sampler") == [
        "llm.generation.speculative", "llm.sampling.samplers"]
    assert resolve("from ggmlx.native import _kernels\nimport numpy") == ["ggmlx.native"]
    assert resolve("def f():\n    from llm import batch\nif TYPE_CHECKING:\n    import llm.api") == ["llm.batch"]


def test_the_cycle_finder_names_each_cycle():
    graph: dict[str, dict[str, int]] = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {"e": 1},
                                        "e": {"d": 1}, "f": {"a": 1}}
    assert cycles(graph) == [["d", "e", "d"], ["a", "b", "c", "a"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    lines = []
    for cycle in found:
        lines.append(" -> ".join(cycle))
        lines.extend(f"    {a} -> {b} at {where(a, b)}" for a, b in zip(cycle, cycle[1:], strict=False))
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_ggmlx_never_imports_llm():
    bad = sorted(f"{a} -> {b} at {where(a, b)}" for a, edges in import_graph().items()
                 if layer(a) == "ggmlx" for b in edges if layer(b) != "ggmlx")
    assert not bad, "ggmlx imports llm:\n" + "\n".join(bad)


def test_lower_layers_never_import_upper_ones():
    """core imports neither middle nor upper, middle not upper (INVERSIONS aside)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    found = {(a, b) for a, edges in import_graph().items() for b in edges
             if layer(a) != "ggmlx" and rank[layer(b)] > rank[layer(a)]}
    new = sorted(f"{a} ({layer(a)}) -> {b} ({layer(b)}) at {where(a, b)}" for a, b in found - INVERSIONS.keys())
    assert not new, "a lower layer imports an upper one:\n" + "\n".join(new)
    fixed = sorted(f"{a} -> {b}" for a, b in INVERSIONS.keys() - found)
    assert not fixed, f"no longer imported, delete from INVERSIONS: {fixed}"


def function_lengths() -> list[tuple[str, int, str, int]]:
    """(file, line, qualified name, lines) of every function and method."""
    out = []
    for mod in MODULES.values():
        rel = str(mod.path.relative_to(ROOT))
        todo: list[tuple[ast.AST, str]] = [(ast.parse(mod.path.read_text(), rel), "")]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}."
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert child.end_lineno is not None
                    out.append((rel, child.lineno, name[:-1], child.end_lineno - child.lineno + 1))
                todo.append((child, name))
    return sorted(out)


def test_no_function_is_longer_than_100_lines():
    long = [f"{file}:{line} {name}: {n} lines" for file, line, name, n in function_lengths() if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)
