"""`RelevanceRun`: generated sequences plus their cache, kept so any token can be explained later."""

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..cache.activation_cache import ActivationCache
from ..checks import ArgumentIndexError, ArgumentTypeError, check_int, describe, is_int
from ..core import BridgeCore
from ..hooks.entries import HookEntry
from ..hooks.recorded import describe_hooks, hooks_besides, only
from .methods import explain, get_method
from .result import Relevance
from .targets import ExplainedToken


class ClearedRunError(RuntimeError):
    """The run was cleared with `RelevanceRun.clear`; generate again with `model.forward_pass`."""


class RelevanceRun:
    """Step one of the two-step API: the generated ``sequences``, their mask and (optionally) cache.

    Step two, `relevance_pass`, explains chosen generated tokens from them without regenerating.
    ``hooks`` are the forward hooks the run was generated under (`generate` records them on its cache): gradient
    methods recompute under exactly those, whatever hooks are active when they are called.
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
        model: BridgeCore,
        sequences: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None,
        prompt_width: int,
        cache: ActivationCache | None = None,
        output: Any = None,
        hooks: Sequence[HookEntry] | None = None,
    ) -> None:
        if not isinstance(sequences, Tensor) or sequences.is_floating_point() or sequences.is_complex():
            raise ArgumentTypeError(
                f"`sequences` must be a tensor of token ids [batch, pos], got {describe(sequences)}."
            )
        sequences = sequences[None] if sequences.dim() == 1 else sequences
        if sequences.dim() != 2 or 0 in sequences.shape:
            raise ValueError(f"`sequences` must have shape [batch, pos] (both >= 1), got {describe(sequences)}.")
        if attention_mask is None:
            attention_mask = torch.ones_like(sequences)
        if not isinstance(attention_mask, Tensor):
            raise ArgumentTypeError(
                f"`attention_mask` must be a tensor [batch, pos] or None, got {describe(attention_mask)}."
            )
        attention_mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
        if attention_mask.shape != sequences.shape:
            raise ValueError(
                f"`attention_mask` shape {tuple(attention_mask.shape)} must equal `sequences` shape "
                f"{tuple(sequences.shape)}."
            )
        width = sequences.shape[1]
        hint = f"It is the column where generation starts; the sequences are {width} wide."
        prompt_width = check_int("prompt_width", prompt_width, minimum=1, maximum=width, hint=hint)
        self.model: TransformerBridge | None = model
        self._sequences: Tensor | None = sequences
        self._mask: Tensor | None = attention_mask.long()
        self.prompt_width = prompt_width
        self._cache = cache
        self.output = output
        # The forward hooks the run was generated under (None: unknown, gradient methods use those active then).
        self.hooks: tuple[HookEntry, ...] | None = None if hooks is None else tuple(hooks)

    # -- state --------------------------------------------------------------------------------
    def _alive(self) -> tuple[BridgeCore, Tensor, Tensor]:
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
        self._sequences = self._mask = self._cache = self.output = self.hooks = None
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
        steps = list(range(n)) if token_indices is None else [s % n for s in _steps(token_indices, n)]
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
        one backward per selected step, under the forward hooks the run was generated under (``run.hooks``);
        other hooks active at the call are set aside meanwhile, with a warning naming them. Cache methods
        (``dla``, ``logit_lens``, ``attention``) read ``run.cache``. Returns one `StepRelevance` per (row, step),
        in row-major order.

        Example:
            >>> rel = run.relevance_pass([0, 4, 9], method="cp_lrp", target="logprob")
        """
        return self._explain(token_indices, method, target, method_kwargs, stacklevel=3)

    def _explain(
        self, token_indices: Any, method: str, target: Any, method_kwargs: dict[str, Any], stacklevel: int
    ) -> Relevance:
        """`relevance_pass`; ``stacklevel`` points the warning about set-aside hooks at the user's call."""
        model, seqs, mask = self._alive()
        explained = self.explained_tokens(token_indices)
        if self.hooks is None or get_method(method).reads is not None:  # unknown hooks, or a cache method
            return explain(model, seqs, mask, explained, method, target, self._cache, **method_kwargs)
        others = hooks_besides(model, self.hooks)
        if others:
            warnings.warn(
                f"Method {method!r} explains the run as it was generated, under the forward hooks active then "
                f"({describe_hooks(self.hooks) or 'none'}); the hooks active now are set aside while it runs: "
                f"{describe_hooks(others)}. To explain a run under them, generate it under them.",
                stacklevel=stacklevel,
            )
        with only(model, self.hooks):
            return explain(model, seqs, mask, explained, method, target, self._cache, **method_kwargs)


def _steps(token_indices: object, n: int) -> list[int]:
    """``token_indices`` as a list of ints in ``[-n, n)``; numpy and tensor integers are accepted."""
    valid = f"step indices of generated tokens in 0..{n - 1} (or -{n}..-1); this run generated {n} token(s) per row"
    # Tensors and numpy arrays become lists (of floats for float dtypes, which are then rejected).
    steps = token_indices.tolist() if hasattr(token_indices, "tolist") else token_indices
    steps = [steps] if is_int(steps) else steps
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or not all(is_int(s) for s in steps):
        raise ArgumentTypeError(
            f"`token_indices` must be an int or a list of ints ({valid}), got {describe(token_indices)}."
        )
    if not steps:
        raise ValueError(f"`token_indices` is empty; give {valid}, or None for all.")
    bad = [s for s in steps if not -n <= s < n]
    if bad:
        raise ArgumentIndexError(f"`token_indices` must be {valid}; got {bad} out of range.")
    return [int(s) for s in steps]
