"""matplotlib figures for traces: logit lens, attention maps, image attention overlays, saliency,
per-node diffs.
matplotlib is imported when a figure is drawn, not with llm."""
from __future__ import annotations

import numpy as np


def _axes(ax, figsize):
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def _short(piece: str, n: int = 8) -> str:
    """The piece with control characters escaped (no font has glyphs for them), cut to n."""
    piece = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in piece)
    return piece if len(piece) <= n else piece[:n - 1] + "…"


def token_labels(llm, tokens: list[int]) -> list[str]:
    return [_short(llm.vocab.token_to_piece(int(t), 0, True).decode("utf-8", "replace")) for t in tokens]


def logit_lens(lens, tokens_text: list[str] | None = None, ax=None, annotate: bool = True):
    """Layers x positions heatmap of the top-1 probability (or of the chosen token's
    probability when the lens has one), each cell labelled with its top-1 token."""
    ax = _axes(ax, (1.0 + 0.9 * lens.top_ids.shape[1], 0.8 + 0.3 * len(lens.layers)))
    val = lens.token_prob if lens.token_prob is not None else lens.top_probs[:, :, 0]
    im = ax.imshow(val, aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_yticks(range(len(lens.layers)), [str(il) for il in lens.layers])
    ax.set_ylabel("layer (l_out)")
    ax.set_xlabel("position")
    if tokens_text is not None:
        ax.set_xticks(range(len(tokens_text)), tokens_text, rotation=60, ha="right")
    if annotate:
        for i in range(val.shape[0]):
            for j in range(val.shape[1]):
                ax.text(j, i, _short(lens.pieces[i][j][0], 6), ha="center", va="center", fontsize=6,
                        color="white" if val[i, j] < 0.5 else "black")
    what = f"p(token {lens.token})" if lens.token_prob is not None else "top-1 probability"
    ax.set_title(f"logit lens: {what}")
    ax.figure.colorbar(im, ax=ax)
    return ax


def attention(trace, layer: int, head: int, ax=None):
    """The attention probabilities (kq_soft_max-layer) of one head: queries x keys."""
    name = f"kq_soft_max-{layer}"
    if name not in trace:
        raise ValueError(f"{name} was not captured: trace with capture=['kq_soft_max-*'] (unfused attention)")
    p = trace[name]
    if not 0 <= head < p.shape[0]:
        raise ValueError(f"head {head} is outside [0, {p.shape[0]}) for {name} {list(p.shape)}")
    labels = token_labels(trace._llm, trace.tokens)
    ax = _axes(ax, (4.5, 4))
    im = ax.imshow(p[head], cmap="magma", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(f"layer {layer} head {head}")
    ax.figure.colorbar(im, ax=ax)
    return ax


def attention_grid(trace, layer: int, heads: list[int] | None = None):
    """All (or the given) heads of one layer side by side."""
    import matplotlib.pyplot as plt
    p = trace[f"kq_soft_max-{layer}"]
    heads = list(range(p.shape[0])) if heads is None else heads
    fig, axes = plt.subplots(1, len(heads), figsize=(2.2 * len(heads), 2.4), squeeze=False)
    for ax, h in zip(axes[0], heads, strict=True):
        ax.imshow(p[h], cmap="magma", vmin=0.0, vmax=1.0)
        ax.set_title(f"L{layer} H{h}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    return fig


def image_attention(trace, token: int, *, layer: int | None = None, head: int | None = None, image: int = 0,
                    ax=None, alpha: float = 0.6):
    """The attention the query at position `token` puts on an image's tokens
    (Trace.image_attention), laid over the picture the encoder read (the preprocessed
    image, normalization undone), one cell per image token."""
    grid = trace.image_attention(token, layer=layer, head=head, image=image)
    m = trace.media[image]
    img = m.chunk.image
    hp = trace._llm.mtmd.clip.hparams
    picture = img.pixels * np.asarray(hp.image_std, np.float32)[:, None, None] \
        + np.asarray(hp.image_mean, np.float32)[:, None, None]
    h, w = picture.shape[1:]
    ax = _axes(ax, (4, 4 * h / w))
    ax.imshow(np.clip(picture.transpose(1, 2, 0), 0.0, 1.0))
    im = ax.imshow(grid, extent=(0, w, h, 0), cmap="magma", alpha=alpha, interpolation="nearest")
    piece = token_labels(trace._llm, [trace.tokens[token]])[0]
    where = ("all layers" if layer is None else f"layer {layer}") + (", mean of heads" if head is None
                                                                     else f", head {head}")
    ax.set_title(f"attention of {piece!r} (position {token % len(trace.tokens)}) on the image\n{where}", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.figure.colorbar(im, ax=ax)
    return ax


def saliency(scores: np.ndarray, tokens_text: list[str], ax=None, title: str = "saliency (gradient x input)"):
    """One bar per prompt token."""
    ax = _axes(ax, (0.5 + 0.5 * len(scores), 3))
    colours = ["tab:red" if s < 0 else "tab:blue" for s in scores]
    ax.bar(range(len(scores)), scores, color=colours)
    ax.set_xticks(range(len(tokens_text)), tokens_text, rotation=60, ha="right")
    ax.axhline(0.0, color="black", lw=0.5)
    ax.set_title(title)
    return ax


def node_diff(rows, ax=None, metric: str = "rel_err"):
    """A per-node diff table (llm.diff_llamacpp.NodeDiff rows) as a line over graph order."""
    ax = _axes(ax, (10, 3))
    vals = [getattr(r, metric) for r in rows]
    ax.semilogy(range(len(vals)), np.maximum(vals, 1e-12), marker=".", lw=0.8)
    ax.set_xlabel("node (graph order)")
    ax.set_ylabel(metric)
    jump = next((i for i, r in enumerate(rows) if r.jump), None)
    if jump is not None:
        ax.axvline(jump, color="tab:red", lw=0.8)
        ax.text(jump, max(vals), f" {rows[jump].name}", color="tab:red", fontsize=8, va="top")
    return ax


def graph(nodes, ax=None, placement=None):
    """Draw a run of graph nodes (e.g. one layer's) as a top-down DAG, the picture
    `Graph.dump_dot` describes: each box shows name (or op) and shape, edges go from source
    to consumer, colours by backend when `placement(t)` is given. For a few dozen nodes;
    graphviz renders the full DOT."""
    import matplotlib.pyplot as plt
    inside = {n.id: n for n in nodes}
    depth: dict[int, int] = {}
    for n in nodes:
        depth[n.id] = 1 + max((depth[s.id] for s in n.src if s.id in depth), default=-1)
    rows: dict[int, list] = {}
    for n in nodes:
        rows.setdefault(depth[n.id], []).append(n)
    pos = {}
    width = max(len(r) for r in rows.values())
    for d, row in rows.items():
        for j, n in enumerate(row):
            pos[n.id] = ((j + 0.5) * width / len(row), -d)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.2 * width + 1, 16), 0.75 * len(rows) + 1))
    palette = ["#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6"]
    colours: dict[str, str] = {}
    for n in nodes:
        x, y = pos[n.id]
        for s in n.src:
            if s.id in inside:
                sx, sy = pos[s.id]
                ax.annotate("", xy=(x, y + 0.18), xytext=(sx, sy - 0.18),
                            arrowprops=dict(arrowstyle="->", lw=0.6, color="grey"))
        fc = colours.setdefault(placement(n), palette[len(colours) % len(palette)]) if placement else "#eeeeee"
        label = f"{n.name or n.op.value}\n{n.op.value} {list(d for d in n.ne if d > 1)}"
        ax.text(x, y, label, ha="center", va="center", fontsize=6,
                bbox=dict(boxstyle="round", fc=fc, ec="grey", lw=0.5))
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-max(rows) - 0.6, 0.6)
    ax.axis("off")
    return ax
