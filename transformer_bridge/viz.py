"""Pictures of relevance: HTML for notebooks and browsers, matplotlib figures for PNG files.

Both read a `transformer_bridge.relevance.Relevance` and say on the picture what is drawn: axis and
colour-bar labels, what each component label means (``L29H1`` = layer 29, head 1), and token labels
with their whitespace made visible (``␣`` space, ``↵`` newline, ``⇥`` tab), so ``' Paris'`` and
``'Paris'`` differ. Token heatmaps are row-normalised (each explained token's scores divided by their
largest magnitude), red for positive and blue for negative; raw values are in the HTML tooltips.
"""

import html
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# A `transformer_bridge.relevance.Relevance`; not imported, because `Relevance` draws itself with this module.
Relevance = Any

_MAX_PNG_COLS = 160  # beyond this, ticks are thinned so labels stay legible
_RED, _BLUE, _NOT_SEEN = "#dc2626", "#2563eb", "#d4d4d4"
_WHITESPACE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
_LOG_FLOOR = -8  # logit-lens HTML: probabilities at or below 1e-8 are left uncoloured

# What component and hook labels mean: (pattern, explanation with {0} the label and {1}.. its groups).
_LABEL_FORMS = [
    (r"L(\d+)H(\d+)", "{0} = layer {1}, attention head {2}"),
    (r"L(\d+)\.mlp", "{0} = layer {1} MLP"),
    (r"L(\d+)\.attn_bias", "{0} = layer {1} attention output bias"),
    (r"L(\d+)", "{0} = residual stream after layer {1}"),
    (r"embed", "embed = token embedding"),
    (r"pos_embed", "pos_embed = position embedding"),
    (r"bias:ln_final", "bias:ln_final = final norm's bias, read out by the unembedding"),
    (r"bias:unembed", "bias:unembed = unembedding bias"),
    (
        r"edit:(blocks\.\d+\.hook_\w+|ln_final\.hook_normalized)",
        "{0} = what hooks added at {1} during the cached forward (an edit, e.g. steering), in no block's output",
    ),
    (r"edit:unlocated", "edit:unlocated = what hooks added to the residual stream between points the cache lacks"),
    (r"blocks\.(\d+)\.hook_resid_pre", "{0} = residual stream entering layer {1}"),
    (r"blocks\.(\d+)\.hook_resid_mid", "{0} = residual stream between layer {1}'s attention and MLP"),
    (r"blocks\.(\d+)\.hook_resid_post", "{0} = residual stream after layer {1}"),
    (r"blocks\.(\d+)\.hook_attn_out", "{0} = layer {1} attention output"),
    (r"blocks\.(\d+)\.hook_mlp_out", "{0} = layer {1} MLP output"),
]


def visible_token(token: str) -> str:
    """``token`` with its whitespace drawn: ``␣`` space, ``↵`` newline, ``⇥`` tab, ``␍`` carriage return.

    Example:
        >>> visible_token(" Paris"), visible_token("\\n\\t")
        ('␣Paris', '↵⇥')
    """
    return "".join(_WHITESPACE.get(ch, ch) for ch in token)


def label_legend(labels: list[str]) -> list[str]:
    """One line per kind of label in ``labels``, explained on its first example (layers count from 0).

    Example:
        >>> label_legend(["L29H1", "L3.mlp", "L29H0"])
        ['L29H1 = layer 29, attention head 1', 'L3.mlp = layer 3 MLP', 'layers and heads count from 0']
    """
    lines, counted = [], set()
    for pattern, text in _LABEL_FORMS:
        match = next((m for m in map(re.compile(pattern).fullmatch, labels) if m), None)
        if match:
            lines.append(text.format(match.group(0), *match.groups()))
            counted.update(["layers", "heads"][: len(match.groups())])
    return [*lines, f"{' and '.join(sorted(counted, reverse=True))} count from 0"] if counted else lines


def in_notebook() -> bool:
    """Whether this runs in a Jupyter-style kernel that renders HTML (not a script or terminal IPython)."""
    ipython = sys.modules.get("IPython")  # a kernel has always imported it; never import it ourselves
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return False
    # Jupyter, VS Code and Colab shells are (subclasses of) ZMQInteractiveShell started by IPKernelApp.
    kernel_shell = any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)
    return kernel_shell or "IPKernelApp" in getattr(shell, "config", {})


def default_html_path(rel: Relevance) -> Path:
    """A new ``.html`` file in the temporary folder: where `Relevance.show` writes ``rel`` outside notebooks."""
    with tempfile.NamedTemporaryFile(prefix=f"relevance_{rel.method}_", suffix=".html", delete=False) as f:
        return Path(f.name)


# -- words shared by both kinds of picture ----------------------------------------------------------
def _target_words(target: str) -> str:
    contrast = re.fullmatch(r"logit_diff\(contrast=(\d+)\)", target)
    if contrast:
        return f"logit difference (token − token id {contrast.group(1)})"
    return {"logit": "logit", "logprob": "log-probability"}.get(target, f"target {target}")


def _score_words(rel: Relevance) -> str:
    """What one score of a token method is, e.g. 'relevance for the logit'."""
    fixed = {"attention": "attention weight", "random": "random baseline score"}
    if rel.method == "grad_norm":
        return f"gradient norm of the {_target_words(rel.target)}"
    return fixed.get(rel.method, f"relevance for the {_target_words(rel.target)}")


def _sign_words(rel: Relevance) -> str:
    if rel.method in ("attention", "random", "grad_norm"):
        return "darker = larger"
    return f"red raises the {_target_words(rel.target)}, blue lowers it"


def _row_label(rel: Relevance, i: int, with_row: bool = True) -> str:
    """``step 0 → "␣Paris"`` (``row 1, step 0 → …`` in batches, ``pos 7 → …`` outside generation)."""
    e = rel.explained[i]
    where = f"step {e.step_index}" if e.step_index is not None else f"pos {e.position}"
    if with_row and rel.tokens.shape[0] > 1:
        where = f"row {e.batch_index}, {where}"
    return f'{where} → "{visible_token(rel.str_tokens[e.batch_index][e.position])}"'


def _header_words(rel: Relevance) -> str:
    if rel.kind == "layers":
        return f"probability and rank of {len(rel)} explained token(s) after each layer"
    if rel.method in ("attention", "random"):
        return f"{_score_words(rel)}s for {len(rel)} token(s)"
    return f"explains the {_target_words(rel.target)} of {len(rel)} token(s)"


def sum_words(rel: Relevance, i: int, digits: int = 4) -> str:
    """What the components of explained token ``i`` sum to, and whether that is the target: checked against
    ``rel.values`` (the value the forward computed), never assumed.

    Example:
        >>> sum_words(rel, 0)   # 'all 301 sum to 13.2, the logit'
    """
    n = len(rel.labels or [])
    total = float(rel.scores[i].float().sum())
    target = _target_words(rel.target)
    if rel.values is None:
        why = "the cache lacks the final residual stream" if rel.extras.get("checked") is False else "no value given"
        return f"all {n} sum to {total:.{digits}g} (not checked against the {target}: {why})"
    value = float(rel.values[i])
    if abs(total - value) <= 1e-4 * max(1.0, abs(value)):
        return f"all {n} sum to {total:.{digits}g}, the {target}"
    return f"all {n} sum to {total:.{digits}g}, but the {target} is {value:.{digits}g}: no component holds the gap"


def _shown(rel: Relevance, limit: int) -> list[int]:
    return list(range(min(len(rel), limit)))


def _not_all(rel: Relevance, shown: list[int]) -> list[str]:
    return [f"first {len(shown)} of {len(rel)} explained tokens shown"] if len(shown) < len(rel) else []


# -- HTML ---------------------------------------------------------------------------------------------
def relevance_html(rel: Relevance, max_tokens: int | None = None) -> str:
    """HTML: for each explained token, its source tokens coloured by relevance (wrapping lines), the
    largest components (``dla``, ``attribution_patching``) or a layer × token grid (``logit_lens``),
    under a legend that says what colours, numbers and labels mean.

    ``max_tokens`` keeps only the last that many source tokens of each row (long prompts).

    Example:
        >>> html_text = relevance_html(rel)   # or rel.show(): inline in a notebook, an .html file elsewhere
    """
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"`max_tokens` must be a positive int or None, got {max_tokens!r}.")
    body = {"tokens": _html_tokens, "components": _html_bars, "layers": _html_layers, "hooks": _html_bars}
    return (
        "<div style='font-family:monospace;font-size:13px;line-height:1.9'>"
        f"<div><b>{html.escape(rel.method)}</b> · {html.escape(_header_words(rel))}</div>"
        f"{body[rel.kind](rel, max_tokens)}</div>"
    )


def _legend(lines: list[str], swatch: str = "") -> str:
    items = "".join(f"<div>{html.escape(line)}</div>" for line in lines)
    return f"<div style='color:#444;font-size:12px;line-height:1.5;margin:2px 0 6px'>{swatch}{items}</div>"


def _gradient_swatch(left: str, right: str, colours: str) -> str:
    bar = f"<span style='display:inline-block;width:140px;height:10px;margin:0 6px;background:{colours}'></span>"
    return f"<div>{html.escape(left)}{bar}{html.escape(right)}</div>"


def _cell(v: float) -> str:
    """Background and text colour of a token whose normalised score is ``v`` in [-1, 1]."""
    a = min(abs(v), 1.0)
    rgb = "220, 38, 38" if v >= 0 else "37, 99, 235"
    return f"background:rgba({rgb}, {a:.3f});color:{'white' if a > 0.6 else 'black'}"


def _html_token(token: str) -> str:
    """Escaped token, its whitespace marks drawn faintly so words still read as words."""
    return "".join(
        f"<span style='opacity:0.55'>{_WHITESPACE[ch]}</span>" if ch in _WHITESPACE else html.escape(ch) for ch in token
    )


def _html_tokens(rel: Relevance, max_tokens: int | None) -> str:
    swatch = _gradient_swatch("−1", "+1", f"linear-gradient(to right, {_BLUE}, white, {_RED})")
    parts = [
        _legend(
            [
                f"colour: {_score_words(rel)} ÷ the largest |value| in its row ({_sign_words(rel)})",
                "hover a token for its raw score · ␣ space, ↵ newline, ⇥ tab · the boxed token is the one explained",
            ],
            swatch,
        )
    ]
    for i, step in enumerate(rel):
        extra = ""
        if step.conservation_error is not None and step.target_value is not None:
            extra = (
                f" · Σ relevance {float(step.relevance.sum()):.3g} vs {_target_words(rel.target)} "
                f"{step.target_value:.3g} (off by {step.conservation_error:.0%})"
            )
        parts.append(f"<div style='margin-top:6px'><b>{html.escape(_row_label(rel, i))}</b>{extra}</div>")
        parts.append(_token_line(step.source_tokens or [], step.relevance, max_tokens, step.token))
    return "".join(parts)


def _token_line(tokens: list[str], scores: Tensor, max_tokens: int | None, explained: str) -> str:
    scale = (float(scores.abs().max()) if scores.numel() else 0.0) or 1.0
    start = 0 if max_tokens is None else max(0, len(tokens) - max_tokens)
    spans = ["<div style='display:flex;flex-wrap:wrap;gap:1px'>"]
    if start:
        spans.append(f"<span style='color:#888'>… {start} earlier tokens </span>")
    for tok, v in zip(tokens[start:], scores[start:].tolist(), strict=True):
        spans.append(
            f"<span title='{v:.4g}' style='white-space:pre;padding:0 1px;border-radius:2px;{_cell(v / scale)}'>"
            f"{_html_token(tok)}</span>"
        )
        if "\n" in tok:  # break the line where the text does, so multi-line prompts keep their shape
            spans.append("<span style='flex-basis:100%;height:0'></span>")
    spans.append(
        f"<span title='explained token' style='white-space:pre;padding:0 2px;border:1px dashed #555;"
        f"border-radius:2px'>{_html_token(explained)}</span></div>"
    )
    return "".join(spans)


def _html_bars(rel: Relevance, max_tokens: int | None, top: int = 12) -> str:
    labels = rel.labels or []
    target = _target_words(rel.target)
    if rel.kind == "hooks":
        top = max(top, 40)  # hooks keep model order, so a layer profile reads top to bottom
        largest = f" (the {top} largest by |value|)" if len(labels) > top else ""
        lines = [f"bar: estimated change in the {target} from patching in the clean activation, summed over "
                 f"positions (attribution patching); hook points in model order{largest}"]  # fmt: skip
    else:
        lines = [f"bar: direct contribution to the {target} (red raises it, blue lowers it); "
                 f"top {top} of {len(labels)} by |value|"]  # fmt: skip
    rows = []
    for i in range(len(rel)):
        scores = rel.scores[i].float()
        total = ""
        if rel.kind == "hooks":
            scores = scores.sum(-1)
            order = sorted(scores.abs().argsort(descending=True)[:top].tolist())
        else:
            order = scores.abs().argsort(descending=True)[:top].tolist()
            total = f" · {sum_words(rel, i, 4)}"
        rows.append(([labels[j] for j in order], scores[order], total))
    parts = [_legend(lines + label_legend([label for shown, _, _ in rows for label in shown]))]
    for i, (shown, values, total) in enumerate(rows):
        parts.append(f"<div style='margin-top:6px'><b>{html.escape(_row_label(rel, i))}</b>{total}</div>")
        parts.append(_bar_table(shown, values))
    return "".join(parts)


def _bar_table(labels: list[str], values: Tensor) -> str:
    """Bars that grow left (negative, blue) or right (positive, red) of a zero line."""
    scale = (float(values.abs().max()) if values.numel() else 0.0) or 1.0
    rows = ["<table style='border-collapse:collapse'>"]
    for label, v in zip(labels, values.tolist(), strict=True):
        bar = f"<div style='display:inline-block;width:{int(120 * abs(v) / scale)}px;height:10px;background:"
        neg, pos = (f"{bar}{_BLUE}'></div>", "") if v < 0 else ("", f"{bar}{_RED}'></div>")
        rows.append(
            f"<tr><td style='padding-right:8px'>{html.escape(label)}</td><td style='text-align:right;"
            f"padding-right:6px'>{v:.4g}</td><td style='width:120px;text-align:right;line-height:0'>{neg}</td>"
            f"<td style='width:120px;border-left:1px solid #333;line-height:0'>{pos}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _html_layers(rel: Relevance, max_tokens: int | None) -> str:
    rank = rel.extras.get("rank")
    swatch = _gradient_swatch(f"p ≤ 1e{_LOG_FLOOR}", "p = 1", "linear-gradient(to right, white, #15803d)")
    lines = [
        "cell colour: probability of the explained token if the model stopped after that layer (log scale)",
        "number in the cell: its rank among all tokens (1 = most likely; k = thousands); hover for the values",
    ]
    parts = [_legend(lines if rank is not None else lines[:1], swatch)]
    head = "".join(f"<th style='font-weight:normal;padding:0 3px'>{label}</th>" for label in rel.labels or [])
    parts.append(f"<table style='border-collapse:collapse'><tr><th>layer →</th>{head}</tr>")
    for i in range(len(rel)):
        cells = []
        for layer, p in enumerate(rel.scores[i].float().tolist()):
            alpha = min(max(math.log10(max(p, 1e-30)) / -_LOG_FLOOR + 1, 0.0), 1.0)
            r = None if rank is None else int(rank[i, layer]) + 1
            text = "" if r is None else (f"{r}" if r < 1000 else f"{r // 1000}k")
            tip = f"p = {p:.3g}" + ("" if r is None else f", rank {r}")
            cells.append(
                f"<td title='{tip}' style='text-align:center;padding:0 3px;background:rgba(21, 128, 61, {alpha:.3f});"
                f"color:{'white' if alpha > 0.6 else 'black'}'>{text}</td>"
            )
        label = html.escape(_row_label(rel, i))
        parts.append(f"<tr><td style='padding-right:8px;white-space:pre'>{label}</td>{''.join(cells)}</tr>")
    parts.append("</table>")
    return "".join(parts)


# -- matplotlib ---------------------------------------------------------------------------------------
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
