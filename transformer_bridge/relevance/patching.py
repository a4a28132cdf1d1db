"""`attribution_patching`: a first-order estimate of activation patching at every hook point.

What it computes: for each hook point ``h`` and position, ``Σ (a_clean − a_corrupt) · ∂m/∂a`` with the
gradient taken on the corrupted run: the linear estimate of how much the metric ``m`` moves when
the clean activation is patched into the corrupted run (Nanda 2023). Sums run over every axis but
batch and position (heads included; for ``hook_pattern``/``hook_attn_scores`` per query position).
As a relevance method the metric is the target of each explained token and ``corrupted_tokens``
(same shape as the sequences) is required. Cost: one clean forward (or the cache), one corrupted
forward, one backward per round.
"""

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..cache import ActivationCache
from ..hook_points import HookPoint
from .backprop import rounds
from .result import MethodOutput
from .targets import ExplainedToken, Target

if TYPE_CHECKING:
    from ..bridge import TransformerBridge


def default_patching_hooks(model: "TransformerBridge") -> list[str]:
    """``hook_resid_pre`` of every layer: where a token's information sits before each block."""
    return [f"blocks.{layer}.hook_resid_pre" for layer in range(model.cfg.n_layers)]


def attribution_patching(
    model: "TransformerBridge",
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "batch pos"],
    metric: Callable[[Float[Tensor, "batch pos d_vocab"]], Float[Tensor, ""]],
    names: Sequence[str] | None = None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    clean_cache: ActivationCache | None = None,
) -> dict[str, Float[Tensor, "batch pos"]]:
    """Attribution-patching scores ``{hook name: [batch, pos]}`` for a scalar ``metric(logits)``.

    Example:
        >>> paris, rome = model.to_single_token(" Paris"), model.to_single_token(" Rome")
        >>> metric = lambda logits: logits[0, -1, paris] - logits[0, -1, rome]
        >>> scores = attribution_patching(model, clean, corrupted, metric)
    """
    scores = _patching(model, clean_tokens, corrupted_tokens, [metric], names, attention_mask, clean_cache)
    return {name: s[0] for name, s in scores.items()}


def _patching(
    model: "TransformerBridge",
    clean: Tensor,
    corrupted: Tensor,
    metrics: Sequence[Callable[[Tensor], Tensor]],
    names: Sequence[str] | None,
    mask: Tensor | None,
    clean_cache: ActivationCache | None,
) -> dict[str, Tensor]:
    """``{name: [len(metrics), batch, pos]}``; each metric backpropagates once on the corrupted run."""
    names = list(names) if names is not None else default_patching_hooks(model)
    if mask is None:
        mask = torch.ones_like(clean)
    if corrupted.shape != clean.shape:
        raise ValueError(
            f"`corrupted_tokens` shape {tuple(corrupted.shape)} must equal the clean tokens' shape "
            f"{tuple(clean.shape)} (same positions, so activations line up)."
        )
    for name in names:
        model.resolve(name)  # unknown names fail here, with suggestions
    if clean_cache is not None and all(n in clean_cache for n in names):
        clean_acts = {n: clean_cache[n].to(model.device) for n in names}
    else:
        _, cache = model.run_with_cache(clean, names_filter=names, attention_mask=mask)
        clean_acts = {n: cache[n] for n in names}
    corrupt_acts: dict[str, Tensor] = {}

    def keep(x: Tensor, hook: HookPoint) -> Tensor:
        # A fresh alias that the site writes back: sites show some points as views (heads split
        # out), and a view the model never consumes would get no gradient.
        alias = x.view_as(x)
        corrupt_acts[hook.name] = alias
        return alias

    with torch.enable_grad(), model.hooks(fwd_hooks=[(n, keep) for n in names]):
        logits = model.forward_tokens(corrupted, mask)
    order = list(corrupt_acts)
    out = {n: torch.zeros(len(metrics), *clean.shape) for n in names}
    for j, metric in enumerate(metrics):
        grads = torch.autograd.grad(
            metric(logits), [corrupt_acts[n] for n in order], retain_graph=j < len(metrics) - 1, allow_unused=True
        )
        for name, grad in zip(order, grads, strict=True):
            if grad is None:
                continue
            delta = (clean_acts[name].to(grad.device) - corrupt_acts[name].detach()) * grad
            out[name][j] = _per_position(name, delta).float().cpu()
    return out


def _per_position(name: str, t: Tensor) -> Tensor:
    if name.endswith(("hook_pattern", "hook_attn_scores")):  # [batch, head, query_pos, key_pos]
        return t.sum((1, 3))
    return t.flatten(2).sum(-1)


def attribution_patching_method(
    model: "TransformerBridge",
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"],
    explained: Sequence[ExplainedToken],
    target: Target,
    cache: ActivationCache | None = None,
    corrupted_tokens: Tensor | None = None,
    names: Sequence[str] | None = None,
) -> MethodOutput:
    """Relevance-method form: the target of each explained token is the metric; scores ``[explained, hook, pos]``."""
    if corrupted_tokens is None:
        raise ValueError(
            "Method 'attribution_patching' needs `corrupted_tokens`: a [batch, pos] tensor like the sequences "
            "with the prompt corrupted (e.g. a different subject), passed as relevance_pass(..., corrupted_tokens=...)."
        )
    corrupted = torch.as_tensor(corrupted_tokens, device=tokens.device)
    corrupted = corrupted[None] if corrupted.dim() == 1 else corrupted
    names = list(names) if names is not None else default_patching_hooks(model)
    # One metric per round: the targets of one round sit in different rows, so their sum separates.
    groups = rounds(explained)

    def make_metric(group: list[int]) -> Callable[[Tensor], Tensor]:
        def metric(logits: Tensor) -> Tensor:
            return sum(target(logits[explained[j].batch_index, explained[j].logit_position], explained[j].token_id)
                       .float() for j in group)  # fmt: skip

        return metric

    per_round = _patching(model, tokens, corrupted, [make_metric(g) for g in groups], names, attention_mask, cache)
    scores = torch.zeros(len(explained), len(names), tokens.shape[1])
    for r, group in enumerate(groups):
        for j in group:
            e = explained[j]
            for h, name in enumerate(names):
                scores[j, h] = per_round[name][r, e.batch_index]
    return MethodOutput(scores, kind="hooks", labels=names)
