"""Relevance as matplotlib figures for PNG files: token heatmaps, component bars and per-layer grids, with axis
and colour-bar labels that say what is drawn."""

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from .words import (
    _BLUE,
    _MAX_PNG_COLS,
    _NOT_SEEN,
    _RED,
    _not_all,
    _row_label,
    _score_words,
    _shown,
    _sign_words,
    _target_words,
    label_legend,
    sum_words,
    visible_token,
)

# A `transformer_bridge.relevance.Relevance`; not imported, because `Relevance` draws itself with this module.
Relevance = Any


def relevance_figure(rel: Relevance, top_k: int = 20, max_tokens: int | None = None) -> "Figure":
    """A matplotlib figure of ``rel``: heatmap (explained × source tokens, one panel per batch row), bar
    charts of the ``top_k`` components per explained token (``dla``), probability and rank per layer
    on log axes (``logit_lens``), or hook × position heatmaps (``attribution_patching``). Every axis and
    colour bar is labelled; a caption under the panels explains colours and labels.

    Example:
        >>> fig = relevance_figure(rel)
        >>> fig.axes[0].get_xlabel()
        'source token (␣ space, ↵ newline, ⇥ tab)'
    """
    if len(rel) == 0:
        raise ValueError("Nothing to draw: the Relevance holds no explained token.")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"`top_k` must be a positive int, got {top_k!r}.")
    draw = {"tokens": _draw_tokens, "components": _draw_components, "layers": _draw_layers, "hooks": _draw_hooks}
    return draw[rel.kind](rel, top_k=top_k, max_tokens=max_tokens)


def save_relevance_png(
    rel: Relevance, path: str | Path, top_k: int = 20, max_tokens: int | None = None, dpi: int = 120
) -> Path:
    """Save `relevance_figure` of ``rel`` as a PNG at ``path``.

    Example:
        >>> save_relevance_png(rel, "relevance.png")
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = relevance_figure(rel, top_k=top_k, max_tokens=max_tokens)
    FigureCanvasAgg(fig)
    path = Path(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def _figure(width: float, height: float, caption: list[str]) -> "Figure":
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height + 0.17 * len(caption)), layout="constrained")
    if caption:
        fig.supxlabel("\n".join(caption), x=0.0, ha="left", fontsize=8, color="#333", linespacing=1.5)
    return fig


def _colorbar(fig: "Figure", image, ax, label: str) -> None:
    # The bar's thickness is its length / aspect: sized from the panel so it spans the panel's height.
    height = ax.get_position().height * fig.get_figheight()
    fig.colorbar(image, ax=ax, fraction=0.025, pad=0.01, aspect=max(10.0, height / 0.16)).set_label(label, fontsize=8)


def _token_ticks(ax, rel: Relevance, b: int, cols: list[int], font: float) -> None:
    step = max(1, math.ceil(len(cols) / _MAX_PNG_COLS))
    ticks = list(range(0, len(cols), step))
    ax.set_xticks(ticks, [visible_token(rel.str_tokens[b][cols[t]]) for t in ticks], rotation=90, fontsize=font)
    ax.set_xlabel("source token (␣ space, ↵ newline, ⇥ tab)", fontsize=8)


def _draw_tokens(rel: Relevance, top_k: int, max_tokens: int | None) -> "Figure":
    from matplotlib import colormaps

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
        mat = mat / mat.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        # Columns at or after an explained token cannot affect it: grey, not a white "zero".
        seen = torch.tensor(cols)[None] < torch.tensor([rel.explained[i].position for i in idx])[:, None]
        panels.append((b, idx, cols, mat.masked_fill(~seen, math.nan)))
    n_cols = max(len(p[2]) for p in panels)
    n_rows = sum(len(p[1]) for p in panels)
    caption = [
        f"colour: {_score_words(rel)} ÷ the largest |value| in its row ({_sign_words(rel)}); "
        "rows are not comparable in size",
        "grey: at or after the explained token, so it cannot contribute"
        + (" · dashed line: end of the prompt" if rel.explained[0].step_index is not None else ""),
    ]
    fig = _figure(min(4 + 0.28 * min(n_cols, _MAX_PNG_COLS), 40), min(1.5 + 0.32 * n_rows + 1.3 * len(panels), 60),
                  caption)  # fmt: skip
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    font = 8 if n_cols <= 60 else 6
    signed = any(bool((p[3] < 0).any()) for p in panels)  # all ≥ 0 (attention, gradient norms): one-sided scale
    cmap = colormaps["RdBu_r" if signed else "Reds"].with_extremes(bad=_NOT_SEEN)
    for ax, (b, idx, cols, mat) in zip(axes, panels, strict=True):
        image = ax.imshow(
            mat.numpy(), cmap=cmap, vmin=-1 if signed else 0, vmax=1, aspect="auto", interpolation="nearest"
        )
        _token_ticks(ax, rel, b, cols, font)
        ax.set_yticks(range(len(idx)), [_row_label(rel, i, with_row=False) for i in idx], fontsize=font)
        ax.set_ylabel("explained token", fontsize=8)
        e = rel.explained[idx[0]]
        if e.step_index is not None:  # generated tokens: mark where the prompt ends
            prompt_end = sum(c < e.position - e.step_index for c in cols)
            if 0 < prompt_end < len(cols):
                ax.axvline(prompt_end - 0.5, color="black", linestyle="--", linewidth=0.8)
        row = f", batch row {b}" if rel.tokens.shape[0] > 1 else ""
        target = "" if rel.method in ("attention", "random") else f" ({_target_words(rel.target)})"
        ax.set_title(f"{rel.method}{target}{row}: which source tokens each token drew on", fontsize=9)
        _colorbar(fig, image, ax, f"{_score_words(rel)}\n÷ row's largest |value|")
    return fig


def _draw_components(rel: Relevance, top_k: int, max_tokens: int | None) -> "Figure":
    shown = _shown(rel, 8)
    labels = rel.labels or []
    orders = [rel.scores[i].float().abs().argsort(descending=True)[:top_k].flip(0).tolist() for i in shown]
    used = [labels[j] for order in orders for j in reversed(order)]  # largest first: the legend's examples
    what = f"direct contribution to the {_target_words(rel.target)}"
    caption = [
        f"red raises the {_target_words(rel.target)}, blue lowers it",
        *label_legend(used),
        *_not_all(rel, shown),
    ]
    fig = _figure(8, 0.4 + 0.22 * top_k * len(shown) + 0.9 * len(shown), caption)
    axes = fig.subplots(len(shown), 1, squeeze=False)[:, 0]
    for i, ax, order in zip(shown, axes, orders, strict=True):
        values = [float(rel.scores[i, j]) for j in order]
        ax.barh(range(len(order)), values, color=[_RED if v >= 0 else _BLUE for v in values])
        ax.set_yticks(range(len(order)), [labels[j] for j in order], fontsize=7)
        ax.axvline(0, color="black", linewidth=0.5)
        ax.set_xlabel(what, fontsize=8)
        ax.set_ylabel("component", fontsize=8)
        total = sum_words(rel, i, 3)
        ax.set_title(f"{_row_label(rel, i)}: top {len(order)} of {len(labels)} by |contribution| ({total})", fontsize=9)
    return fig


def _draw_layers(rel: Relevance, top_k: int, max_tokens: int | None) -> "Figure":
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    shown = _shown(rel, 12)
    rank = rel.extras.get("rank")
    caption = [
        "each layer's residual stream (blocks.L.hook_resid_post) read through the final norm and unembedding; "
        "the last layer is the model's own output",
        *_not_all(rel, shown),
    ]
    fig = _figure(9, 6.5 if rank is not None else 4, caption)
    axes = fig.subplots(1 if rank is None else 2, 1, sharex=True, squeeze=False)[:, 0]
    layers = list(range(rel.scores.shape[1]))
    for i in shown:
        axes[0].plot(layers, rel.scores[i].float().numpy(), marker="o", markersize=3, label=_row_label(rel, i))
        if rank is not None:
            axes[1].plot(layers, (rank[i] + 1).numpy(), marker="o", markersize=3)
    axes[0].set_yscale("log", nonpositive="mask")
    axes[0].set_ylabel("probability of the explained token\n(log scale)", fontsize=8)
    axes[0].set_title(f"{rel.method}: the explained token if the model stopped after each layer", fontsize=9)
    axes[0].legend(title="explained token", fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    if rank is not None:
        axes[1].set_yscale("log")
        axes[1].invert_yaxis()  # rank 1 on top, like probability 1
        axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axes[1].set_ylabel("rank of the explained token\n(1 = most likely; log scale)", fontsize=8)
    axes[-1].set_xlabel("layer (0 = first)", fontsize=8)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
    return fig


def _draw_hooks(rel: Relevance, top_k: int, max_tokens: int | None) -> "Figure":
    shown = _shown(rel, 4)
    labels = rel.labels or []
    what = f"estimated change in the {_target_words(rel.target)}"
    caption = [
        f"colour: {what} when the clean activation is patched into the corrupted run (attribution patching)",
        *label_legend(labels),
        *_not_all(rel, shown),
    ]
    fig = _figure(10, 2 + 0.25 * len(labels) * len(shown), caption)
    axes = fig.subplots(len(shown), 1, squeeze=False)[:, 0]
    for i, ax in zip(shown, axes, strict=True):
        e = rel.explained[i]
        cols = rel.source_positions(i)
        mat = rel.scores[i][:, cols].float()
        lim = float(mat.abs().max()) or 1.0
        image = ax.imshow(mat.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.set_ylabel("hook point", fontsize=8)
        _token_ticks(ax, rel, e.batch_index, cols, 6)
        ax.set_title(f"{_row_label(rel, i)}: hook point × source position", fontsize=9)
        _colorbar(fig, image, ax, what)
    return fig
