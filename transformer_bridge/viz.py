"""Pictures of relevance: an HTML heatmap for notebooks and matplotlib PNGs for files.

Both read a `transformer_bridge.relevance.Relevance`. Scores are shown row-normalised (each
explained token's scores divided by their largest magnitude), red for positive and blue for
negative; the raw value is in each token's tooltip (HTML) or the colour bar (PNG).
"""

import html
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .relevance.result import Relevance

_MAX_PNG_COLS = 160  # beyond this, ticks are thinned so labels stay legible


def _visible(token: str) -> str:
    return token.replace("\n", "↵").replace("\t", "⇥")


def _colour(v: float) -> str:
    """Background for a normalised score in [-1, 1]: white → red (positive) or blue (negative)."""
    a = min(abs(v), 1.0)
    if v >= 0:
        return f"rgba(220, 38, 38, {a:.3f})"
    return f"rgba(37, 99, 235, {a:.3f})"


def relevance_html(rel: "Relevance", max_tokens: int | None = None) -> str:
    """HTML: for each explained token, its source tokens coloured by relevance (wrapping lines).

    ``max_tokens`` keeps only the last that many source tokens of each row (long prompts).

    Example:
        >>> html_text = relevance_html(rel)   # or rel.show() in a notebook
    """
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"`max_tokens` must be a positive int or None, got {max_tokens!r}.")
    head = (
        f"<div style='font-family:monospace;font-size:13px;line-height:1.9'>"
        f"<div><b>{html.escape(rel.method)}</b> · target {html.escape(rel.target)} · {len(rel)} token(s)</div>"
    )
    parts = [head]
    for step in rel:
        label = f"step {step.step_index}" if step.step_index is not None else f"pos {step.position}"
        extra = ""
        if step.conservation_error is not None:
            extra = f" · Σ/target gap {step.conservation_error:.2g}"
        parts.append(
            f"<div style='margin-top:6px'><b>row {step.batch_index}, {label} → "
            f"{html.escape(repr(step.token))}</b>{extra}</div>"
        )
        if rel.kind == "tokens":
            parts.append(_token_line(step.source_tokens or [], step.relevance, max_tokens))
        else:
            parts.append(_bars(step.labels or [], step.relevance, rel.kind))
    parts.append("</div>")
    return "".join(parts)


def _token_line(tokens: list[str], scores: Tensor, max_tokens: int | None) -> str:
    scale = float(scores.abs().max()) if scores.numel() else 0.0
    scale = scale or 1.0
    start = 0 if max_tokens is None else max(0, len(tokens) - max_tokens)
    spans = ["<div style='display:flex;flex-wrap:wrap;gap:1px'>"]
    if start:
        spans.append(f"<span style='color:#888'>… {start} earlier tokens </span>")
    for tok, v in zip(tokens[start:], scores[start:].tolist(), strict=True):
        spans.append(
            f"<span title='{v:.4g}' style='white-space:pre;padding:0 1px;border-radius:2px;"
            f"background:{_colour(v / scale)}'>{html.escape(_visible(tok))}</span>"
        )
    spans.append("</div>")
    return "".join(spans)


def _bars(labels: list[str], scores: Tensor, kind: str, top: int = 12) -> str:
    if kind == "hooks":  # [hook, pos]: show each hook's total
        scores = scores.sum(-1)
    order = scores.abs().argsort(descending=True)[:top].tolist() if kind != "layers" else range(len(labels))
    scale = float(scores.abs().max()) or 1.0
    rows = ["<table style='border-collapse:collapse'>"]
    for i in order:
        v = float(scores[i])
        width = int(120 * abs(v) / scale)
        rows.append(
            f"<tr><td style='padding-right:8px'>{html.escape(labels[i])}</td><td style='text-align:right;"
            f"padding-right:6px'>{v:.4g}</td><td><div style='width:{width}px;height:10px;"
            f"background:{_colour(math.copysign(1.0, v) * 0.8)}'></div></td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def save_relevance_png(
    rel: "Relevance", path: str | Path, top_k: int = 20, max_tokens: int | None = None, dpi: int = 120
) -> Path:
    """Save ``rel`` as a PNG: heatmap (explained × source tokens, one panel per batch row), bar charts
    of the ``top_k`` components per explained token (``dla``), probability per layer (``logit_lens``),
    or hook × position heatmaps (``attribution_patching``).

    Example:
        >>> save_relevance_png(rel, "relevance.png")
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if len(rel) == 0:
        raise ValueError("Nothing to draw: the Relevance holds no explained token.")
    path = Path(path)
    draw = {"tokens": _draw_tokens, "components": _draw_components, "layers": _draw_layers, "hooks": _draw_hooks}
    fig: Figure = draw[rel.kind](rel, Figure, top_k=top_k, max_tokens=max_tokens)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def _labels_for(rel: "Relevance", index: list[int]) -> list[str]:
    out = []
    for i in index:
        s = rel[i]
        label = f"{s.step_index}" if s.step_index is not None else f"p{s.position}"
        out.append(f"{label}: {_visible(s.token)!r}")
    return out


def _draw_tokens(rel: "Relevance", figure_cls, top_k: int, max_tokens: int | None):
    by_row: dict[int, list[int]] = {}
    for i, e in enumerate(rel.explained):
        by_row.setdefault(e.batch_index, []).append(i)
    panels = []
    for b, idx in by_row.items():
        last = max(rel.explained[i].position for i in idx)
        cols = torch.nonzero(rel.attention_mask[b, :last].bool()).flatten().tolist()
        if max_tokens is not None:
            cols = cols[-max_tokens:]
        mat = rel.scores[idx][:, cols].float()
        norm = mat.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        panels.append((b, idx, cols, mat / norm))
    n_cols = max(len(p[2]) for p in panels)
    n_rows = sum(len(p[1]) for p in panels)
    width = min(4 + 0.28 * min(n_cols, _MAX_PNG_COLS), 40)
    height = min(1.5 + 0.32 * n_rows + 1.2 * len(panels), 60)
    fig = figure_cls(figsize=(width, height))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    font = 8 if n_cols <= 60 else 6
    for ax, (b, idx, cols, mat) in zip(axes, panels, strict=True):
        image = ax.imshow(mat.numpy(), cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
        step = max(1, math.ceil(len(cols) / _MAX_PNG_COLS))
        ticks = list(range(0, len(cols), step))
        ax.set_xticks(ticks, [_visible(rel.str_tokens[b][cols[t]]) for t in ticks], rotation=90, fontsize=font)
        ax.set_yticks(range(len(idx)), _labels_for(rel, idx), fontsize=font)
        ax.set_title(f"{rel.method} ({rel.target}), row {b}: explained tokens × source tokens, row-normalised",
                     fontsize=9)  # fmt: skip
        fig.colorbar(image, ax=ax, fraction=0.025, pad=0.01)
    return fig


def _draw_components(rel: "Relevance", figure_cls, top_k: int, max_tokens: int | None):
    n = min(len(rel), 8)
    fig = figure_cls(figsize=(8, 0.4 + 0.22 * top_k * n + 0.5 * n))
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    labels = rel.labels or []
    for i, ax in enumerate(axes):
        scores = rel.scores[i].float()
        order = scores.abs().argsort(descending=True)[:top_k].flip(0).tolist()
        values = [float(scores[j]) for j in order]
        ax.barh(range(len(order)), values, color=["#dc2626" if v >= 0 else "#2563eb" for v in values])
        ax.set_yticks(range(len(order)), [labels[j] for j in order], fontsize=7)
        ax.axvline(0, color="black", linewidth=0.5)
        total = float(scores.sum())
        ax.set_title(f"{_labels_for(rel, [i])[0]} — top {len(order)} of {len(labels)} components, sum {total:.3g}",
                     fontsize=9)  # fmt: skip
    return fig


def _draw_layers(rel: "Relevance", figure_cls, top_k: int, max_tokens: int | None):
    fig = figure_cls(figsize=(8, 4))
    ax = fig.subplots()
    names = _labels_for(rel, list(range(len(rel))))
    for i in range(min(len(rel), 12)):
        ax.plot(rel.scores[i].float().numpy(), marker="o", markersize=3, label=names[i])
    ax.set_xlabel("layer")
    ax.set_ylabel("probability of the explained token")
    ax.set_title(f"{rel.method}: probability after each layer", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def _draw_hooks(rel: "Relevance", figure_cls, top_k: int, max_tokens: int | None):
    n = min(len(rel), 4)
    fig = figure_cls(figsize=(10, 2 + 0.25 * len(rel.labels or []) * n))
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for i, ax in enumerate(axes):
        e = rel.explained[i]
        cols = rel.source_positions(i)
        mat = rel.scores[i][:, cols].float()
        lim = float(mat.abs().max()) or 1.0
        image = ax.imshow(mat.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_yticks(range(len(rel.labels or [])), rel.labels or [], fontsize=6)
        step = max(1, math.ceil(len(cols) / _MAX_PNG_COLS))
        ax.set_xticks(range(0, len(cols), step),
                      [_visible(rel.str_tokens[e.batch_index][cols[t]]) for t in range(0, len(cols), step)],
                      rotation=90, fontsize=6)  # fmt: skip
        ax.set_title(f"{_labels_for(rel, [i])[0]}: hook × position", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.025, pad=0.01)
    return fig
