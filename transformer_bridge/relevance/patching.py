"""`attribution_patching`: a first-order estimate of activation patching at every hook point.

What it computes: for each hook point ``h`` and position, ``Σ (a_clean − a_corrupt) · ∂m/∂a`` with the
gradient taken on the corrupted run: the linear estimate of how much the metric ``m`` moves when
the clean activation is patched into the corrupted run (Nanda 2023). Sums run over every axis but
batch and position (heads included; for ``hook_pattern``/``hook_attn_scores`` per query position).
As a relevance method the metric is the target of each explained token and ``corrupted_tokens``
(same shape as the sequences) is required. Cost: one clean forward (or the cache), one corrupted
forward, one backward per round.
"""

import contextlib
from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..cache.activation_cache import ActivationCache
from ..checks import ArgumentTypeError, describe
from ..core import BridgeCore
from ..hooks.points import HookPoint
from .backprop import rounds
from .protocol import Method, Option, Request
from .result import MethodOutput


def default_patching_hooks(model: BridgeCore) -> list[str]:
    """``hook_resid_pre`` of every layer: where a token's information sits before each block."""
    return [f"blocks.{layer}.hook_resid_pre" for layer in range(model.cfg.n_layers)]


def attribution_patching(
    model: BridgeCore,
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
    clean = check_tokens(model, "clean_tokens", clean_tokens)
    corrupted = check_tokens(model, "corrupted_tokens", corrupted_tokens, like=clean)
    if not callable(metric):
        raise ArgumentTypeError(
            f"`metric` must be a function `metric(logits) -> scalar tensor`, got {describe(metric)}."
        )
    if clean_cache is not None and not isinstance(clean_cache, ActivationCache):
        raise ArgumentTypeError(f"`clean_cache` must be an ActivationCache or None, got {describe(clean_cache)}.")
    _, mask = model.prepare_input(clean, attention_mask)
    scores, _ = _patching(model, clean, corrupted, [metric], names, mask, clean_cache)
    return {name: s[0] for name, s in scores.items()}


def check_tokens(model: BridgeCore, name: str, tokens: object, like: Tensor | None = None) -> Tensor:
    """``tokens`` (a tensor or nested lists) as a ``[batch, pos]`` tensor of ids in the vocabulary, shaped like
    ``like``, or an error naming ``name``. One device sync (the id range)."""
    given = tokens
    if isinstance(tokens, (list, tuple)):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):  # ragged or not numbers: reported below
            tokens = torch.as_tensor(tokens)
    if not isinstance(tokens, Tensor):
        raise ArgumentTypeError(
            f"`{name}` must be a tensor of token ids [batch, pos], got {describe(given)}. Use `model.to_tokens(text)`."
        )
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ArgumentTypeError(
            f"`{name}` must hold integer token ids, got {describe(tokens)}. Use `model.to_tokens(text)`, or `.long()` "
            "if they are ids stored as floats."
        )
    tokens = tokens[None] if tokens.dim() == 1 else tokens
    want = "[batch, pos]" if like is None else f"{tuple(like.shape)}, the clean tokens' (so activations line up)"
    if tokens.dim() != 2 or 0 in tokens.shape or (like is not None and tokens.shape != like.shape):
        raise ValueError(f"`{name}` must have shape {want}, got {describe(tokens)}.")
    low, high = torch.stack(torch.aminmax(tokens)).tolist()
    d_vocab = model.cfg.d_vocab
    if low < 0 or high >= d_vocab:
        raise ValueError(
            f"`{name}` holds token id {low if low < 0 else high}, outside the vocabulary [0, {d_vocab - 1}]."
        )
    return tokens.to(model.device).long()


def _patching(
    model: BridgeCore,
    clean: Tensor,
    corrupted: Tensor,
    metrics: Sequence[Callable[[Tensor], Tensor]],
    names: Sequence[str] | None,
    mask: Tensor | None,
    clean_cache: ActivationCache | None,
) -> tuple[dict[str, Tensor], Tensor]:
    """``{name: [len(metrics), batch, pos]}``, each metric backpropagated once on the corrupted run, and that
    run's logits (detached)."""
    names = hook_names(model, names)
    if mask is None:
        mask = torch.ones_like(clean)
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
        value = _scalar(metric(logits))
        grads = torch.autograd.grad(
            value, [corrupt_acts[n] for n in order], retain_graph=j < len(metrics) - 1, allow_unused=True
        )
        for name, grad in zip(order, grads, strict=True):
            if grad is None:
                continue
            delta = (clean_acts[name].to(grad.device) - corrupt_acts[name].detach()) * grad
            out[name][j] = _per_position(name, delta).float().cpu()
    return out, logits.detach()


def hook_names(model: BridgeCore, names: object) -> list[str]:
    """Canonical hook names in the order given (a shorthand expands to every layer); unknown names fail with
    suggestions. ``None``: `default_patching_hooks`."""
    if names is None:
        return default_patching_hooks(model)
    items = [names] if isinstance(names, (str, tuple)) else names
    allowed = "a hook name or a non-empty list of them (or None for every `hook_resid_pre`)"
    if not isinstance(items, Sequence):
        raise ArgumentTypeError(f"`names` must be {allowed}, got {describe(names)}.")
    if not items:
        raise ValueError(f"`names` must be {allowed}, got an empty list.")
    out: list[str] = []
    for item in items:
        out += [n for n in model.names_matching(item, param="names") if n not in out]
    return out


def _scalar(value: object) -> Tensor:
    """The metric's value, which must be one differentiable float (checks without a device sync)."""
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise ArgumentTypeError(
            f"`metric` must return a float tensor computed from the logits, got {describe(value)}. "
            "Example: `lambda logits: logits[0, -1, paris] - logits[0, -1, rome]`."
        )
    if value.numel() != 1:
        raise ValueError(
            f"`metric` must return a scalar (one value), got {describe(value)}; reduce it, e.g. with `.sum()` or "
            "`.mean()`, or index one position and token."
        )
    if not value.requires_grad:
        raise ValueError("`metric`'s result does not depend on the logits (it has no gradient); compute it from them.")
    return value.reshape(())


def _per_position(name: str, t: Tensor) -> Tensor:
    if name.endswith(("hook_pattern", "hook_attn_scores")):  # [batch, head, query_pos, key_pos]
        return t.sum((1, 3))
    return t.flatten(2).sum(-1)


def attribution_patching_method(request: Request) -> MethodOutput:
    """Relevance-method form: the target of each explained token is the metric; scores ``[explained, hook, pos]``."""
    model, tokens, explained, target = request.model, request.tokens, request.explained, request.target
    names = request.options["names"]
    # One metric per round: the targets of one round sit in different rows, so their sum separates.
    groups = rounds(explained)

    def make_metric(group: list[int]) -> Callable[[Tensor], Tensor]:
        def metric(logits: Tensor) -> Tensor:
            return sum(target(logits[explained[j].batch_index, explained[j].logit_position], explained[j].token_id)
                       .float() for j in group)  # fmt: skip

        return metric

    corrupted, mask = request.options["corrupted_tokens"], request.attention_mask
    per_round, logits = _patching(model, tokens, corrupted, [make_metric(g) for g in groups], names, mask,
                                  request.cache)  # fmt: skip
    # The target on the corrupted run (with the sequences themselves as `corrupted_tokens`, the run's own value).
    values = torch.stack([target(logits[e.batch_index, e.logit_position], e.token_id).float() for e in explained])
    scores = torch.zeros(len(explained), len(names), tokens.shape[1])
    for r, group in enumerate(groups):
        for j in group:
            e = explained[j]
            for h, name in enumerate(names):
                scores[j, h] = per_round[name][r, e.batch_index]
    return MethodOutput(scores, values, kind="hooks", labels=names)


ATTRIBUTION_PATCHING = Method(
    "attribution_patching",
    attribution_patching_method,
    "(clean − corrupted) × gradient per hook point",
    options=(
        Option("corrupted_tokens", Tensor, None, required=True,
               doc="a [batch, pos] tensor like the sequences with the prompt corrupted (e.g. a different subject), "
                   "passed as relevance_pass(..., corrupted_tokens=...).",
               check=lambda value, model, tokens: check_tokens(model, "corrupted_tokens", value, like=tokens)),
        Option("names", list, None, "hook points to score (a name, a shorthand or a list; None: every "
               "`hook_resid_pre`)", optional=False, check=lambda value, model, tokens: hook_names(model, value)),
    ),
)  # fmt: skip
