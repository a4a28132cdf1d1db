"""Result objects: `Relevance` (one explanation pass) and `StepRelevance` (one explained token)."""

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import viz
from ..convertible import Convertible
from .targets import ExplainedToken

logger = logging.getLogger(__name__)
Kind = Literal["tokens", "components", "layers", "hooks"]
TopBy = Literal["value", "abs"]
TOP_BY: tuple[str, ...] = ("value", "abs")


@dataclass
class MethodOutput:
    """What a method function returns; `Relevance` adds the tokens and labels around it.

    ``scores`` is ``[explained, pos]`` for source-token methods (``kind="tokens"``),
    ``[explained, component]`` for ``components``/``layers`` and ``[explained, hook, pos]`` for ``hooks``.
    """

    scores: Tensor
    values: Tensor | None = None
    conservation_error: Tensor | None = None
    kind: Kind = "tokens"
    labels: list[str] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepRelevance(Convertible):
    """The explanation of one token.

    Attributes:
        step_index: index among the row's generated tokens (``None`` outside generation).
        batch_index, position: where the token is in the sequences.
        token_id, token: the explained token and its string.
        relevance: for source-token methods, one score per real source token before ``position``
            (``source_tokens`` / ``source_positions`` say which); otherwise one score per label.
        labels: component, layer or hook labels (non-token methods).
        target_value: the explained scalar (logit, log-probability or logit difference).
        conservation_error: ``|Σ relevance − target| / |target|`` where the method defines it.
    """

    step_index: int | None
    batch_index: int
    position: int
    token_id: int
    token: str
    relevance: Tensor
    source_tokens: list[str] | None = None
    source_positions: list[int] | None = None
    labels: list[str] | None = None
    target_value: float | None = None
    conservation_error: float | None = None

    def as_tensor(self) -> Tensor:
        """``relevance``: what ``torch.as_tensor(step)`` and ``np.asarray(step)`` give."""
        return self.relevance

    def top(self, k: int = 5, by: TopBy = "value") -> list[tuple[str, float]]:
        """The ``k`` top sources (token strings or labels) with their (signed) scores.

        ``by="value"`` ranks the highest scores first; ``by="abs"`` the largest magnitudes, so
        strong negative contributions (a head that suppresses the token) rank too.

        Example:
            >>> dla[0].top(3, by="abs")   # [('L29H0', -3.17), ('L28.mlp', 3.17), ('L29H1', 3.05)]
        """
        if by not in TOP_BY:
            raise ValueError(f"`by`={by!r} is not valid; use one of {TOP_BY}: 'value' (highest first) or 'abs' "
                             "(largest magnitude first, signs kept).")  # fmt: skip
        names = self.source_tokens if self.source_tokens is not None else self.labels
        if names is None or self.relevance.dim() != 1:
            raise ValueError("`top` needs one score per source token or component.")
        key = self.relevance.abs() if by == "abs" else self.relevance
        order = key.argsort(descending=True, stable=True)[:k].tolist()
        return [(names[i], float(self.relevance[i])) for i in order]


@dataclass
class Relevance(Convertible, Sequence[StepRelevance]):
    """Relevance of the explained tokens: one `StepRelevance` per token, plus the full matrix.

    ``scores`` is ``[explained, pos]`` over the columns of ``tokens`` (0 on padding and on positions at
    or after the explained token), or ``[explained, component]`` for component methods (``dla``) and
    ``[explained, layer]`` for ``logit_lens``. Iterate or index to get per-token results.

    Example:
        >>> rel = run.relevance_pass(token_indices=[0, 2])
        >>> rel[0].step_index, rel[0].token, rel[0].top(3)
        >>> rel.save_png("relevance.png")
        >>> rel.show()   # inline in a notebook; in a script, writes an .html file and returns its path
    """

    method: str
    target: str
    kind: Kind
    scores: Tensor
    explained: list[ExplainedToken]
    tokens: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    str_tokens: list[list[str]]
    values: Tensor | None = None
    conservation_error: Tensor | None = None
    labels: list[str] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.explained)

    def as_tensor(self) -> Tensor:
        """``scores``: what ``torch.as_tensor(rel)`` and ``np.asarray(rel)`` give."""
        return self.scores

    def __getitem__(self, i: int) -> StepRelevance:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} explained tokens.")
        i %= len(self)
        e = self.explained[i]
        row = self.str_tokens[e.batch_index]
        value = None if self.values is None else float(self.values[i])
        error = None if self.conservation_error is None else float(self.conservation_error[i])
        common = dict(
            step_index=e.step_index,
            batch_index=e.batch_index,
            position=e.position,
            token_id=e.token_id,
            token=row[e.position],
            target_value=value,
            conservation_error=error,
        )
        if self.kind == "tokens":
            cols = self.source_positions(i)
            return StepRelevance(
                relevance=self.scores[i, cols],
                source_tokens=[row[c] for c in cols],
                source_positions=cols,
                **common,
            )
        return StepRelevance(relevance=self.scores[i], labels=self.labels, **common)

    def __iter__(self) -> Iterator[StepRelevance]:
        return (self[i] for i in range(len(self)))

    def source_positions(self, i: int) -> list[int]:
        """Columns of the real tokens before explained token ``i``."""
        e = self.explained[i]
        real = self.attention_mask[e.batch_index, : e.position].bool()
        return torch.nonzero(real).flatten().tolist()

    @property
    def matrix(self) -> Float[Tensor, "explained pos"]:
        """The per-token matrix (explained tokens × source columns); ``scores`` for token methods."""
        if self.kind != "tokens":
            raise ValueError(
                f"`matrix` is the explained × source-token matrix; method {self.method!r} gives "
                f"{self.kind}, read `scores` and `labels` instead."
            )
        return self.scores

    def __repr__(self) -> str:
        steps = ", ".join(f"{s.step_index}:{s.token!r}" for s in list(self)[:6])
        more = "…" if len(self) > 6 else ""
        return f"Relevance(method={self.method!r}, target={self.target!r}, {len(self)} tokens [{steps}{more}])"

    # -- pictures -----------------------------------------------------------------------------
    @overload
    def show(self, max_tokens: int | None = None, *, path: str | Path) -> Path: ...
    @overload
    def show(self, max_tokens: int | None = None, path: str | Path | None = None) -> "HTMLView | Path": ...
    def show(self, max_tokens: int | None = None, path: str | Path | None = None) -> "HTMLView | Path":
        """The HTML picture: in a notebook, an `HTMLView` that displays inline; elsewhere (scripts,
        terminals) it is written to an ``.html`` file, its path is printed (and logged at INFO by
        ``transformer_bridge.relevance.result``) and that `Path` is returned.

        ``path`` writes the file there (in notebooks too); by default a new file in the temporary
        folder. ``max_tokens`` keeps the last that many source tokens of each row.

        Example:
            >>> print(rel.show())          # a script: /tmp/relevance_attnlrp_….html, open it in a browser
            >>> rel.show(path="why.html")  # Path('why.html')
        """
        view = HTMLView(viz.relevance_html(self, max_tokens=max_tokens))
        if path is None and viz.in_notebook():
            return view
        written = view.save(viz.default_html_path(self) if path is None else path)
        if not viz.in_notebook():  # a script or terminal shows nothing, so say where the picture is
            print(f"Relevance picture written to {written} (open it in a browser)")
        logger.info("relevance picture written to %s", written)
        return written

    def _repr_html_(self) -> str:
        return viz.relevance_html(self)

    def save_png(self, path: str | Path, **kwargs: Any) -> Path:
        """Save a labelled matplotlib figure: heatmap (tokens × sources), bar charts (``dla``), probability
        and rank per layer (``logit_lens``) or hook × position heatmaps; ``kwargs`` go to `save_relevance_png`."""
        return viz.save_relevance_png(self, path, **kwargs)


class HTMLView:
    """HTML text that renders in Jupyter (``_repr_html_``); ``str(view)`` is the HTML."""

    def __init__(self, html: str) -> None:
        self.html = html

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return self.html

    def save(self, path: str | Path) -> Path:
        """Write a standalone UTF-8 HTML page (the ␣ ↵ marks need the charset) and return its path."""
        path = Path(path)
        path.write_text(f"<!doctype html><meta charset='utf-8'>\n{self.html}\n", encoding="utf-8")
        return path
