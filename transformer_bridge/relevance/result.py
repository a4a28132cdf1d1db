"""Result objects: `Relevance` (one explanation pass) and `StepRelevance` (one explained token)."""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .targets import ExplainedToken

Kind = Literal["tokens", "components", "layers", "hooks"]


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
class StepRelevance:
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

    def top(self, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` highest-scoring sources (token strings or labels) with their scores."""
        names = self.source_tokens if self.source_tokens is not None else self.labels
        if names is None or self.relevance.dim() != 1:
            raise ValueError("`top` needs one score per source token or component.")
        order = self.relevance.argsort(descending=True)[:k].tolist()
        return [(names[i], float(self.relevance[i])) for i in order]


@dataclass
class Relevance(Sequence[StepRelevance]):
    """Relevance of the explained tokens: one `StepRelevance` per token, plus the full matrix.

    ``scores`` is ``[explained, pos]`` over the columns of ``tokens`` (0 on padding and on positions at
    or after the explained token), or ``[explained, component]`` for component methods (``dla``) and
    ``[explained, layer]`` for ``logit_lens``. Iterate or index to get per-token results.

    Example:
        >>> rel = run.relevance_pass(token_indices=[0, 2])
        >>> rel[0].step_index, rel[0].token, rel[0].top(3)
        >>> rel.save_png("relevance.png")
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
    def show(self, max_tokens: int | None = None) -> "HTMLView":
        """An HTML heatmap of source tokens per explained token (displays itself in notebooks)."""
        from ..viz import relevance_html

        return HTMLView(relevance_html(self, max_tokens=max_tokens))

    def _repr_html_(self) -> str:
        return self.show()._repr_html_()

    def save_png(self, path: str | Path, **kwargs: Any) -> Path:
        """Save a matplotlib figure: heatmap (tokens × sources), bar charts (``dla``) or curves (``logit_lens``)."""
        from ..viz import save_relevance_png

        return save_relevance_png(self, path, **kwargs)


class HTMLView:
    """HTML text that renders in Jupyter (``_repr_html_``); ``str(view)`` is the HTML."""

    def __init__(self, html: str) -> None:
        self.html = html

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return self.html

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(f"<!doctype html><meta charset='utf-8'>\n{self.html}\n", encoding="utf-8")
        return path
