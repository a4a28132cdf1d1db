"""The method registry and `explain`, the one entry point every API path goes through."""

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..cache import ActivationCache
from ..checks import ArgumentIndexError, ArgumentTypeError, describe, did_you_mean
from ..core import BridgeCore
from . import baselines, dla, gradients, logit_lens, lrp, patching
from .result import MethodOutput, Relevance
from .targets import ExplainedToken, parse_target


@dataclass(frozen=True)
class Method:
    """A registered method: its function, the cache hook points it reads, and a one-line summary."""

    fn: Callable[..., MethodOutput]
    summary: str
    reads: Callable[..., list[str]] | None = None


METHODS: dict[str, Method] = {
    "attnlrp": Method(lrp.attnlrp, "attention-aware LRP (gradient × input with AttnLRP rules)"),
    "cp_lrp": Method(lrp.cp_lrp, "conservative LRP: attention, gates and norm scales constant"),
    "grad_x_input": Method(gradients.grad_x_input, "gradient × token embedding"),
    "integrated_gradients": Method(gradients.integrated_gradients, "integrated gradients, zero baseline"),
    "grad_norm": Method(gradients.grad_norm, "L2 norm of the gradient at each token embedding"),
    "attention": Method(baselines.attention, "attention weights: last layer or rollout", baselines.attention_hooks),
    "random": Method(baselines.random, "seeded uniform scores (baseline)"),
    "dla": Method(dla.dla, "direct logit attribution per head, MLP and embedding", dla.dla_hooks),
    "logit_lens": Method(logit_lens.logit_lens, "token probability and rank per layer", logit_lens.logit_lens_hooks),
    "attribution_patching": Method(
        patching.attribution_patching_method, "(clean − corrupted) × gradient per hook point"
    ),
}


def get_method(name: Any) -> Method:
    """The registered method ``name``; `ValueError` listing the valid names (and the closest) otherwise."""
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"`method` must be a method name (str), got {describe(name)}. Valid: {', '.join(METHODS)}."
        )
    if name in METHODS:
        return METHODS[name]
    hint = did_you_mean(name, METHODS)
    raise ValueError(f"`method`={name!r} does not exist.{hint} Valid methods: {', '.join(METHODS)}.")


def relevance_hooks(model: BridgeCore, method: str, **method_kwargs: Any) -> list[str]:
    """Hook points ``method`` reads from the cache; pass them as ``names_filter`` when generating.

    Methods that recompute a forward (the LRP and gradient methods) read nothing and return ``[]``.

    Example:
        >>> run = model.forward_pass("Hi", max_new_tokens=4, names_filter=relevance_hooks(model, "dla"))
    """
    spec = get_method(method)
    _check_options(method, method_kwargs)
    if spec.reads is None:
        return []
    accepted = set(inspect.signature(spec.reads).parameters) - {"model"}
    return spec.reads(model, **{k: v for k, v in method_kwargs.items() if k in accepted})


def method_options(name: str) -> list[str]:
    """The extra keyword arguments ``name`` accepts (e.g. ``steps`` for integrated gradients)."""
    params = list(inspect.signature(get_method(name).fn).parameters)
    return [p for p in params if p not in ("model", "tokens", "attention_mask", "explained", "target", "cache")]


def explain(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None,
    explained: Sequence[ExplainedToken],
    method: str = "attnlrp",
    target: Any = "logit",
    cache: ActivationCache | None = None,
    **method_kwargs: Any,
) -> Relevance:
    """Explain ``explained`` tokens of ``tokens`` with ``method``: the common path of every API.

    Example:
        >>> from transformer_bridge.relevance import explain, explained_from_positions
        >>> tokens, mask = model.to_tokens_and_mask("The capital of France is Paris", padding_side="left")
        >>> rel = explain(model, tokens, mask, explained_from_positions(tokens, mask, [(0, tokens.shape[1] - 1)]))
        >>> rel[0].top(3)
    """
    spec = get_method(method)
    _check_options(method, method_kwargs)
    if not explained:
        raise ValueError("Nothing to explain: the list of tokens to explain is empty.")
    _check_explained(explained, tokens)
    spec_target = parse_target(target, model)
    tokens = tokens.to(model.device)
    mask = torch.ones_like(tokens) if attention_mask is None else attention_mask.to(model.device).long()
    start = time.perf_counter()
    out = spec.fn(model, tokens, mask, list(explained), spec_target, cache, **method_kwargs)
    seconds = time.perf_counter() - start
    tokens_cpu, mask_cpu = tokens.detach().cpu(), mask.detach().cpu()
    return Relevance(
        method=method,
        target=str(spec_target),
        kind=out.kind,
        scores=out.scores.detach().cpu(),
        explained=list(explained),
        tokens=tokens_cpu,
        attention_mask=mask_cpu,
        str_tokens=_str_tokens(model, tokens_cpu),
        values=None if out.values is None else out.values.detach().cpu(),
        conservation_error=None if out.conservation_error is None else out.conservation_error.detach().cpu(),
        labels=out.labels,
        extras=out.extras,
        seconds=seconds,
    )


def _check_options(method: str, method_kwargs: dict[str, Any]) -> None:
    options = method_options(method)
    unknown = [k for k in method_kwargs if k not in options]
    if unknown:
        names = ", ".join(f"`{k}`" for k in unknown)
        accepts = f"It accepts {options}." if options else "It accepts no options."
        raise TypeError(
            f"Method {method!r} got unknown option(s) {names}.{did_you_mean(unknown[0], options)} {accepts}"
        )


def _check_explained(explained: Sequence[ExplainedToken], tokens: Tensor) -> None:
    """Each entry an `ExplainedToken` whose row and position exist (position 0 has no logits before it)."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        raise ArgumentTypeError(f"`tokens` must be a tensor of token ids [batch, pos], got {describe(tokens)}.")
    batch, width = tokens.shape
    for e in explained:
        if not isinstance(e, ExplainedToken):
            raise ArgumentTypeError(
                f"`explained` must hold ExplainedToken entries (see `explained_from_positions`), got {describe(e)}."
            )
        if not (0 <= e.batch_index < batch and 1 <= e.position < width):
            raise ArgumentIndexError(
                f"`explained` has {e}, outside the tokens [batch {batch}, pos {width}]: rows 0..{batch - 1}, "
                f"positions 1..{width - 1}."
            )


def _str_tokens(model: BridgeCore, tokens: Tensor) -> list[list[str]]:
    if model.tokenizer is None:
        return [[str(t) for t in row.tolist()] for row in tokens]
    return [model.to_str_tokens(row) for row in tokens]
