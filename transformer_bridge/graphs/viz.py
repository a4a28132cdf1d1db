"""Pictures of a pruned graph: a PNG (matplotlib) and a self-contained HTML page (inline SVG, a tooltip per node).

Layout: columns are token positions, rows are layers (token embeddings at the bottom, targets at the top); nodes
that share a cell are spread across it. Edges are blue when positive and red when negative, their width and
opacity following ``|weight|``. The scores printed in the title are computed from the graph.
"""

import html
from pathlib import Path

KIND_STYLE = {  # marker, colour
    "feature": ("o", "#f28e2b"),
    "error": ("s", "#9c9c9c"),
    "token": ("D", "#59a14f"),
    "target": ("^", "#7b4fa3"),
}


def _layout(graph, node_threshold: float, edge_threshold: float, max_nodes: int):
    kept = graph.prune(node_threshold, edge_threshold)
    nodes = kept.node_mask.nonzero()[:, 0].tolist()
    infl = kept.cumulative
    inner = sorted((n for n in nodes if graph.node_kind(n) in ("feature", "error")), key=lambda n: float(infl[n]))
    inner = set(inner[:max_nodes])
    nodes = [n for n in nodes if n in inner or graph.node_kind(n) in ("token", "target")]
    cells: dict[tuple[int, int], list[int]] = {}
    info = {n: graph.node_info(n) for n in nodes}
    for n in nodes:
        cells.setdefault((info[n]["pos"], info[n]["layer"] + 1), []).append(n)
    xy = {}
    for (pos, row), members in cells.items():
        for i, n in enumerate(members):
            xy[n] = (pos + (i + 1) / (len(members) + 1) - 0.5, row)
    alive = set(nodes)
    rows, cols = graph.edge_index[:, kept.edge_mask]
    weights = graph.edge_weight[kept.edge_mask]
    pairs = zip(rows.tolist(), cols.tolist(), weights.tolist(), strict=True)
    edges = [(c, r, w) for r, c, w in pairs if r in alive and c in alive]
    return nodes, info, xy, edges


def _title(graph, tokenizer) -> str:
    replacement, completeness = graph.scores()
    return (f"{graph.n_features} features, {graph.n_targets} targets; replacement score {replacement:.2f}, "
            f"completeness {completeness:.2f}")  # fmt: skip


def _token_text(tokenizer, token: int) -> str:
    text = tokenizer.decode([token]) if tokenizer is not None else str(token)
    return text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "→")


def save_png(
    graph, path: str | Path, *, tokenizer=None, node_threshold: float = 0.8, edge_threshold: float = 0.98,
    max_nodes: int = 200,
) -> Path:  # fmt: skip
    """Draw the graph pruned at the thresholds (at most ``max_nodes`` features and errors) into a PNG.

    Example:
        >>> save_png(graph, "graph.png", tokenizer=model.tokenizer)
    """
    import matplotlib.pyplot as plt

    nodes, info, xy, edges = _layout(graph, node_threshold, edge_threshold, max_nodes)
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * graph.n_pos + 3), 1.1 * graph.n_layers + 3.5), dpi=110)
    top = max((abs(w) for _, _, w in edges), default=1.0) or 1.0
    for src, dst, w in edges:
        (x0, y0), (x1, y1) = xy[src], xy[dst]
        ax.plot([x0, x1], [y0, y1], color="#1f77b4" if w > 0 else "#d62728", lw=0.3 + 2.5 * abs(w) / top,
                alpha=0.15 + 0.7 * abs(w) / top, zorder=1)  # fmt: skip
    for kind, (marker, colour) in KIND_STYLE.items():
        members = [n for n in nodes if info[n]["kind"] == kind]
        if members:
            ax.scatter([xy[n][0] for n in members], [xy[n][1] for n in members], marker=marker, c=colour, s=45,
                       edgecolors="black", linewidths=0.4, zorder=2, label=kind)  # fmt: skip
    for n in nodes:
        if info[n]["kind"] == "target":
            ax.annotate(
                f"{info[n]['label']!r} {info[n]['weight']:.2f}",
                xy[n],
                xytext=(0, 7),
                textcoords="offset points",
                ha="left",
                fontsize=7,
                rotation=45,
            )
    ax.set_xticks(range(graph.n_pos))
    ax.set_xticklabels([_token_text(tokenizer, t) for t in graph.tokens.tolist()], rotation=60, fontsize=7)
    ax.set_yticks(range(graph.n_layers + 2))
    ax.set_yticklabels(["emb", *[f"L{i}" for i in range(graph.n_layers)], "logit"])
    ax.set_xlim(-0.7, graph.n_pos - 0.3)
    ax.set_ylim(-0.6, graph.n_layers + 1.8)
    ax.grid(alpha=0.2)
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    ax.set_title(_title(graph, tokenizer), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def to_html(
    graph, path: str | Path, *, tokenizer=None, node_threshold: float = 0.8, edge_threshold: float = 0.98,
    max_nodes: int = 200,
) -> Path:  # fmt: skip
    """A self-contained HTML page: the pruned graph as SVG, hover a node for what it is and its influence.

    Example:
        >>> to_html(graph, "graph.html", tokenizer=model.tokenizer)
    """
    nodes, info, xy, edges = _layout(graph, node_threshold, edge_threshold, max_nodes)
    cw, rh, left, bottom = 70, 70, 60, 90
    width, height = left + cw * graph.n_pos + 20, rh * (graph.n_layers + 2) + bottom
    px = lambda x, y: (left + (x + 0.5) * cw, height - bottom - y * rh)  # noqa: E731
    top = max((abs(w) for _, _, w in edges), default=1.0) or 1.0
    parts = []
    for src, dst, w in edges:
        (x0, y0), (x1, y1) = px(*xy[src]), px(*xy[dst])
        parts.append(f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}" stroke="'
                     f'{"#1f77b4" if w > 0 else "#d62728"}" stroke-width="{0.4 + 3 * abs(w) / top:.2f}" '
                     f'opacity="{0.2 + 0.7 * abs(w) / top:.2f}"><title>{w:+.4g}</title></line>')  # fmt: skip
    shape = {"feature": "circle", "error": "rect", "token": "rect", "target": "circle"}
    for n in nodes:
        i = info[n]
        x, y = px(*xy[n])
        tip = html.escape(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in i.items()))
        colour = KIND_STYLE[i["kind"]][1]
        if shape[i["kind"]] == "circle":
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="{colour}" stroke="black"><title>{tip}'
                         "</title></circle>")  # fmt: skip
        else:
            parts.append(f'<rect x="{x - 6:.1f}" y="{y - 6:.1f}" width="12" height="12" fill="{colour}" '
                         f'stroke="black"><title>{tip}</title></rect>')  # fmt: skip
        if i["kind"] == "target":
            at = f'x="{x:.1f}" y="{y - 10:.1f}" transform="rotate(-45 {x:.1f} {y - 10:.1f})"'
            parts.append(f"<text {at} font-size='11'>{html.escape(repr(i['label']))} {i['weight']:.2f}</text>")
    for pos, tok in enumerate(graph.tokens.tolist()):
        x, y = px(pos, -0.6)
        label = html.escape(_token_text(tokenizer, tok))
        parts.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="11" text-anchor="end" '
                     f'transform="rotate(-45 {x:.1f} {y:.1f})">{label}</text>')  # fmt: skip
    for row, name in enumerate(["emb", *[f"L{i}" for i in range(graph.n_layers)], "logit"]):
        x, y = px(-0.9, row)
        parts.append(f'<text x="{x:.1f}" y="{y + 4:.1f}" font-size="11">{name}</text>')
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>attribution graph</title></head>"
            f"<body style='font-family:sans-serif'><h3>{html.escape(_title(graph, tokenizer))}</h3>"
            f"<p>blue: positive edge, red: negative; orange circles: features, grey: errors, green: tokens, "
            f"purple: targets. Hover for details.</p><svg width='{width}' height='{height}' "
            f"xmlns='http://www.w3.org/2000/svg'>{''.join(parts)}</svg></body></html>")  # fmt: skip
    Path(path).write_text(page, encoding="utf-8")
    return Path(path)
