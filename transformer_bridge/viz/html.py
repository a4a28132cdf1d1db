"""Relevance as HTML for notebooks and browsers: token heatmaps (row-normalised, red positive, blue negative, raw
values in the tooltips), component bars and per-layer tables."""

import html
import math
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    pass

from .words import (
    _BLUE,
    _LOG_FLOOR,
    _RED,
    _WHITESPACE,
    _header_words,
    _row_label,
    _score_words,
    _sign_words,
    _target_words,
    label_legend,
    sum_words,
)

# A `transformer_bridge.relevance.Relevance`; not imported, because `Relevance` draws itself with this module.
Relevance = Any


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
