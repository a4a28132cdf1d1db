"""`RelevanceRun`: generated sequences plus their cache, kept so any token can be explained later."""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..cache import ActivationCache
from .methods import explain
from .result import Relevance
from .targets import ExplainedToken

if TYPE_CHECKING:
    from ..bridge import TransformerBridge


class ClearedRunError(RuntimeError):
    """The run was cleared with `RelevanceRun.clear`; generate again with `model.forward_pass`."""


class RelevanceRun:
    """Step one of the two-step API: the generated ``sequences``, their mask and (optionally) cache.

    Step two, `relevance_pass`, explains chosen generated tokens from them without regenerating.
    Columns ``[0, prompt_width)`` hold the left-padded prompts, column ``prompt_width + i`` the
    ``i``-th generated token of every row (its step index). Rows that stopped early have padding
    (mask 0) after their end; those steps are skipped for that row.

    Example:
        >>> run = model.forward_pass("The capital of France is", max_new_tokens=8)
        >>> rel = run.relevance_pass(token_indices=[0, 4], method="attnlrp")
        >>> rel[0].step_index, rel[0].token, rel[0].top(3)
        >>> run.clear()
    """

    def __init__(
        self,
        model: "TransformerBridge",
        sequences: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None,
        prompt_width: int,
        cache: ActivationCache | None = None,
        output: Any = None,
    ) -> None:
        sequences = sequences[None] if sequences.dim() == 1 else sequences
        if attention_mask is None:
            attention_mask = torch.ones_like(sequences)
        attention_mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
        if attention_mask.shape != sequences.shape:
            raise ValueError(
                f"`attention_mask` shape {tuple(attention_mask.shape)} must equal `sequences` shape "
                f"{tuple(sequences.shape)}."
            )
        if not 1 <= prompt_width <= sequences.shape[1]:
            raise ValueError(f"`prompt_width`={prompt_width} must be in 1..{sequences.shape[1]} (the sequence width).")
        self.model: TransformerBridge | None = model
        self._sequences: Tensor | None = sequences
        self._mask: Tensor | None = attention_mask.long()
        self.prompt_width = prompt_width
        self._cache = cache
        self.output = output

    # -- state --------------------------------------------------------------------------------
    def _alive(self) -> tuple["TransformerBridge", Tensor, Tensor]:
        if self._sequences is None or self._mask is None or self.model is None:
            raise ClearedRunError(
                "This RelevanceRun was cleared (`run.clear()`), so its tokens and cache are gone. Generate again "
                "with `run = model.forward_pass(...)` to explain more tokens."
            )
        return self.model, self._sequences, self._mask

    @property
    def sequences(self) -> Int[Tensor, "batch pos"]:
        """Prompt (left-padded) plus generated tokens."""
        return self._alive()[1]

    @property
    def attention_mask(self) -> Int[Tensor, "batch pos"]:
        return self._alive()[2]

    @property
    def cache(self) -> ActivationCache | None:
        """The prompt + output activations cached during generation (``None`` if none were kept)."""
        self._alive()
        return self._cache

    @property
    def n_generated(self) -> int:
        """Number of generation steps (columns after the prompt)."""
        return self.sequences.shape[1] - self.prompt_width

    def clear(self) -> None:
        """Free the tokens, the cache and the generation output; explaining afterwards raises `ClearedRunError`."""
        self._sequences = self._mask = self._cache = self.output = None
        self.model = None

    def __repr__(self) -> str:
        if self._sequences is None:
            return "RelevanceRun(cleared)"
        cached = "no cache" if self._cache is None else repr(self._cache)
        return (
            f"RelevanceRun(batch={self._sequences.shape[0]}, prompt_width={self.prompt_width}, "
            f"generated={self.n_generated}, {cached})"
        )

    # -- explaining ---------------------------------------------------------------------------
    def explained_tokens(self, token_indices: Sequence[int] | int | None = None) -> list[ExplainedToken]:
        """The `ExplainedToken` of each selected step in every row that generated it."""
        _, seqs, mask = self._alive()
        n = self.n_generated
        if n == 0:
            raise ValueError("This run generated no tokens, so there is nothing to explain.")
        if token_indices is None:
            steps = list(range(n))
        else:
            steps = [token_indices] if isinstance(token_indices, int) else list(token_indices)
            bad = [s for s in steps if not isinstance(s, int) or isinstance(s, bool) or not -n <= s < n]
            if bad or not steps:
                raise ValueError(
                    f"`token_indices` must be step indices of generated tokens in 0..{n - 1} (or -{n}..-1), got "
                    f"{bad if bad else token_indices!r}; this run generated {n} token(s) per row."
                )
            steps = [s % n for s in steps]
        out = []
        for b in range(seqs.shape[0]):
            for s in steps:
                col = self.prompt_width + s
                if bool(mask[b, col]) and bool(mask[b, col - 1]):
                    out.append(ExplainedToken(b, col, int(seqs[b, col]), step_index=s))
        if not out:
            raise ValueError(f"`token_indices`={token_indices!r}: no row has a real generated token at those steps.")
        return out

    def relevance_pass(
        self,
        token_indices: Sequence[int] | int | None = None,
        method: str = "attnlrp",
        target: Any = "logit",
        **method_kwargs: Any,
    ) -> Relevance:
        """Explain the generated tokens at ``token_indices`` (all when None) with ``method``.

        ``target`` is ``"logit"`` (default), ``"logprob"`` or ``("logit_diff", contrast_token)``.
        Gradient methods recompute one forward over the stored sequences (never regenerate) and
        one backward per selected step; cache methods (``dla``, ``logit_lens``, ``attention``) read
        ``run.cache``. Returns one `StepRelevance` per (row, step), in row-major order.

        Example:
            >>> rel = run.relevance_pass([0, 4, 9], method="cp_lrp", target="logprob")
        """
        model, seqs, mask = self._alive()
        explained = self.explained_tokens(token_indices)
        return explain(model, seqs, mask, explained, method, target, self._cache, **method_kwargs)
