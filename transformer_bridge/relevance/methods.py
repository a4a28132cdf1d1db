"""The method registry and `explain`, the one entry point every API path goes through.

Each method module declares its `Method` (function, summary, options, hook points read) next to its
code; this module lists them, resolves names and options, and builds the `Request` a method runs on.
"""

import time
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..cache.activation_cache import ActivationCache
from ..checks import ArgumentIndexError, ArgumentTypeError, describe, did_you_mean
from ..core import BridgeCore
from . import baselines, dla, gradients, logit_lens, lrp, patching
from .protocol import Method, Request
from .result import Relevance
from .targets import ExplainedToken, parse_target

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        lrp.ATTNLRP,
        lrp.CP_LRP,
        gradients.GRAD_X_INPUT,
        gradients.INTEGRATED_GRADIENTS,
        gradients.GRAD_NORM,
        baselines.ATTENTION,
        baselines.RANDOM,
        dla.DLA,
        logit_lens.LOGIT_LENS,
        patching.ATTRIBUTION_PATCHING,
    )
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
    The options are checked as `explain` checks them (those that need the sequences excepted); a family
    without the points (e.g. no ``hook_pattern``) raises `ValueError`.

    Example:
        >>> run = model.forward_pass("Hi", max_new_tokens=4, names_filter=relevance_hooks(model, "dla"))
    """
    spec = get_method(method)
    return spec.hook_points(model, spec.resolve(method_kwargs, model))


def method_options(name: str) -> list[str]:
    """The extra keyword arguments ``name`` accepts (e.g. ``steps`` for integrated gradients).

    Each is declared once in the method's `Method.options` (type, default, range, doc).

    Example:
        >>> method_options("integrated_gradients")
        ['steps', 'internal_batch_size', 'keep_first']
    """
    return list(get_method(name).option_names)


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
    spec.check_names(method_kwargs)
    if not explained:
        raise ValueError("Nothing to explain: the list of tokens to explain is empty.")
    _check_explained(explained, tokens)
    spec_target = parse_target(target, model)
    tokens = tokens.to(model.device)
    mask = torch.ones_like(tokens) if attention_mask is None else attention_mask.to(model.device).long()
    options = spec.resolve(method_kwargs, model, tokens)
    spec.hook_points(model, options)  # a family without the points a cache method reads fails here, clearly
    request = Request(model, tokens, mask, tuple(explained), spec_target, cache, options)
    start = time.perf_counter()
    out = spec.fn(request)
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
