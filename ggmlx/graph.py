"""Graphs: the nodes reachable from the tensors expanded into it, in execution order, with
text and Graphviz dumps (like ggml_graph_print and ggml_graph_dump_dot)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from ggmlx.tensor import Flag, Tensor


class Graph:
    """Leafs (op NONE) and nodes in the order ggml's build_forward_expand visits them:
    sources before the node that reads them, earlier expansions first."""

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()

    def build_forward_expand(self, t: Tensor) -> Graph:
        stack = [(t, False)]
        while stack:
            cur, ready = stack.pop()
            if cur.id in self._seen:
                continue
            if ready or cur.is_leaf:
                self._seen.add(cur.id)
                (self.leafs if cur.is_leaf else self.nodes).append(cur)
                continue
            stack.append((cur, True))
            for s in reversed(cur.src):
                if s.id not in self._seen:
                    stack.append((s, False))
        return self

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def get_tensor(self, name: str) -> Tensor:
        """The node or leaf with this name (ggml_graph_get_tensor); KeyError if absent."""
        for t in self.nodes + self.leafs:
            if t.name == name:
                return t
        raise KeyError(f"no tensor named {name!r} in the graph")

    def outputs(self) -> list[Tensor]:
        """Nodes flagged as outputs; the last node when none is flagged (ggml's result)."""
        outs = [n for n in self.nodes if n.flags & Flag.OUTPUT]
        return outs or self.nodes[-1:]

    # ---- dumps -----------------------------------------------------------------------

    def _selected(self, keep: Callable[[Tensor], bool] | None) -> tuple[list[Tensor], list[Tensor]]:
        """(nodes, leafs) to dump: the nodes `keep` accepts and the leafs they read."""
        if keep is None:
            return self.nodes, self.leafs
        nodes = [n for n in self.nodes if keep(n)]
        read = {s.id for n in nodes for s in n.src}
        return nodes, [t for t in self.leafs if t.id in read]

    def dump_text(self, placement: Callable[[Tensor], str] | None = None,
                  keep: Callable[[Tensor], bool] | None = None) -> str:
        """One line per node and leaf: index, shape (ne), op, type, name, [backend]. With
        `keep`, only the nodes it accepts and the leafs they read (indices stay the graph's)."""
        nodes, leafs = self._selected(keep)
        index = {t.id: i for i, t in enumerate(self.nodes)} | {t.id: i for i, t in enumerate(self.leafs)}
        lines = ["=== GRAPH ===", f"n_nodes = {len(nodes)}"]
        for n in nodes:
            lines.append(_line(index[n.id], n, placement))
        lines.append(f"n_leafs = {len(leafs)}")
        for n in leafs:
            lines.append(_line(index[n.id], n, placement))
        lines.append("========================================")
        return "\n".join(lines)

    def dump_dot(self, placement: Callable[[Tensor], str] | None = None,
                 keep: Callable[[Tensor], bool] | None = None) -> str:
        """Graphviz DOT; leafs are boxes, nodes records; colour by backend when placed. With
        `keep`, only the nodes it accepts, the leafs they read and the edges between them."""
        nodes, leafs = self._selected(keep)
        shown = {t.id for t in nodes} | {t.id for t in leafs}
        palette = ["#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c"]
        colours: dict[str, str] = {}

        def colour(t: Tensor) -> str:
            if placement is None:
                return "white" if not t.is_leaf else "#eeeeee"
            return colours.setdefault(placement(t), palette[len(colours) % len(palette)])

        out = ["digraph G {", '  newrank = true;', '  rankdir = TB;']
        for t in leafs:
            out.append(f'  t{t.id} [shape=box, style=filled, fillcolor="{colour(t)}", '
                       f'label="{_label(t, placement)}"];')
        for t in nodes:
            out.append(f'  t{t.id} [shape=record, style="rounded,filled", fillcolor="{colour(t)}", '
                       f'label="{_label(t, placement)}"];')
        for t in nodes:
            for j, s in enumerate(t.src):
                if s.id in shown:
                    out.append(f'  t{s.id} -> t{t.id} [label="src{j}"];')
        out.append("}")
        return "\n".join(out)


def _role(t: Tensor) -> str:
    for flag, role in ((Flag.WEIGHT, "weight"), (Flag.STATE, "state"), (Flag.INPUT, "input")):
        if t.flags & flag:
            return role
    return "output" if t.flags & Flag.OUTPUT else ""


def _line(i: int, t: Tensor, placement) -> str:
    ne = ", ".join(f"{d:6d}" for d in t.ne)
    extra = f" [{placement(t)}]" if placement else ""
    role = _role(t)
    return f" - {i:4d}: [{ne}] {t.op.value:>16} {t.type.name:>6} {t.name}{' (' + role + ')' if role else ''}{extra}"


def _label(t: Tensor, placement) -> str:
    """Record fields name | op | type shape [| backend]; free text is escaped field by field."""
    where = f" | {_esc(placement(t))}" if placement else ""
    return f"{_esc(t.name or '?')} | {t.op.value} | {t.type.name} {list(t.ne)}{where}"


def _esc(s: str) -> str:
    """Escape DOT record-label specials (a '|' in a name must not start a new field)."""
    for c in '\\"<>{}|':
        s = s.replace(c, "\\" + c)
    return s


def build_graph(outputs: Iterable[Tensor]) -> Graph:
    g = Graph()
    for t in outputs:
        g.build_forward_expand(t)
    return g
