"""Relevance: explain generated tokens from one cache and one recomputed forward.

Two steps: ``run = model.forward_pass(input, max_new_tokens=...)`` generates and keeps the tokens and
the cache; ``run.relevance_pass(token_indices, method=..., target=...)`` explains chosen generated
tokens, as often as wanted, without regenerating. ``model.relevance(run_or_cache, ...)`` is the
same in one call. Methods (see `METHODS`): ``attnlrp`` (default), ``cp_lrp``, ``grad_x_input``,
``integrated_gradients``, ``grad_norm``, ``attention``, ``random``, ``dla``, ``logit_lens``,
``attribution_patching``. Everything runs through the bridge's hook points; no model code is changed.
Every method is one function over a `Request`, registered as a `Method` with its `Option`s declared once.

It is a function package over the core bridge: it may import the core, `cache`, `hooks`, `sites` and `viz`, never
compat or the CLI.
"""

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..cache.activation_cache import ActivationCache
from ..checks import ArgumentTypeError, describe
from ..core import BridgeCore, NamesFilter
from ..generation import generate
from ..generation.checks import QUIET_GREEDY
from ..inputs import is_text
from .cache_access import MissingHookError
from .methods import METHODS, explain, get_method, method_options, relevance_hooks
from .patching import attribution_patching
from .protocol import Method, Option, Request
from .result import MethodOutput, Relevance, StepRelevance
from .run import ClearedRunError, RelevanceRun
from .targets import ExplainedToken, Target, explained_from_positions


def forward_pass(
    model: BridgeCore,
    input: Any,
    max_new_tokens: int = 20,
    names_filter: NamesFilter = None,
    device: str | torch.device | None = "cpu",
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    **generate_kwargs: Any,
) -> RelevanceRun:
    """Generate (KV-cached, every decoding control of `generate`) and keep tokens and cache.

    The cache of prompt + output is stored on ``device`` (CPU by default, to spare accelerator
    memory); ``names_filter`` limits it (``relevance_hooks(model, "dla")`` gives what a cache
    method needs; gradient methods need no cache at all).

    Example:
        >>> run = model.forward_pass("The capital of France is", max_new_tokens=8, temperature=0)
        >>> rel = run.relevance_pass(token_indices=[0, 4])
    """
    fixed = [f"`{k}={generate_kwargs[k]!r}`" for k in ("return_cache", "return_dict") if k in generate_kwargs]
    if fixed:
        raise TypeError(
            f"`forward_pass` always generates with `return_cache=True` and `return_dict=True`; got "
            f"{', '.join(fixed)}. Drop it, or call `model.generate` for other returns."
        )
    tokens, mask = model.prepare_input(input, attention_mask, padding_side="left" if is_text(input) else None)
    quiet = QUIET_GREEDY.set(True)  # TransformerLens has no forward_pass: its generate's default is no reference
    try:
        output, cache = generate(
            model,
            tokens,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            return_cache=True,
            names_filter=names_filter,
            device=device,
            return_dict=True,
            **generate_kwargs,
        )
    finally:
        QUIET_GREEDY.reset(quiet)
    return _run_from_generation(model, output, cache, default_width=tokens.shape[1])


def relevance(
    model: BridgeCore,
    cache_or_run: "RelevanceRun | ActivationCache | tuple",
    method: str = "attnlrp",
    token_indices: Sequence[int] | int | None = None,
    target: Any = "logit",
    tokens: Int[Tensor, "batch pos"] | None = None,
    **method_kwargs: Any,
) -> Relevance:
    """Explain generated tokens from a `RelevanceRun`, a ``(output, cache)`` pair from
    ``generate(..., return_cache=True)`` (token ids, a `GenerationOutput`, or text: the ids are then read
    from the cache, see `cache_tokens`), or a generation cache plus its ``tokens``.

    Example:
        >>> out, cache = model.generate(tokens, max_new_tokens=8, return_cache=True)
        >>> rel = model.relevance((out, cache), method="dla", token_indices=[0])
        >>> text, cache = model.generate("The capital of France is", max_new_tokens=8, return_cache=True)
        >>> rel = model.relevance((text, cache), method="dla", token_indices=[0])
    """
    run = _relevance_run(model, cache_or_run, tokens)
    return run._explain(token_indices, method, target, method_kwargs, stacklevel=3)


def _relevance_run(model: BridgeCore, cache_or_run: Any, tokens: Tensor | None) -> RelevanceRun:
    if isinstance(cache_or_run, RelevanceRun):
        if tokens is not None:
            raise ValueError("A RelevanceRun holds its own tokens; `tokens=` only goes with an ActivationCache.")
        return cache_or_run
    if isinstance(cache_or_run, tuple) and len(cache_or_run) == 2 and isinstance(cache_or_run[1], ActivationCache):
        output, cache = cache_or_run
        if tokens is None and _is_text(output):  # generate(text, return_cache=True): the ids are not in the text
            return _run_from_generation(model, cache_tokens(model, cache), cache)
        if tokens is None:
            return _run_from_generation(model, output, cache)
        cache_or_run = cache
    if not isinstance(cache_or_run, ActivationCache):
        raise TypeError(
            "`cache_or_run` must be a RelevanceRun (from `model.forward_pass`), the (output, cache) pair of "
            f"`generate(..., return_cache=True)`, or an ActivationCache with `tokens=`; got "
            f"{type(cache_or_run).__name__}."
        )
    if tokens is None:
        raise ValueError(
            "An ActivationCache alone does not hold the token ids; pass `tokens=` (the generated sequences) "
            "or the (output, cache) pair."
        )
    if not isinstance(tokens, Tensor):
        raise ArgumentTypeError(f"`tokens` must be the generated token ids [batch, pos], got {describe(tokens)}.")
    tokens = tokens[None] if tokens.dim() == 1 else tokens
    width = prompt_width(cache_or_run, tokens)
    hooks = getattr(cache_or_run, "generation_hooks", None)
    return RelevanceRun(model, tokens, cache_or_run.attention_mask, width, cache_or_run, hooks=hooks)


def _run_from_generation(
    model: BridgeCore, output: Any, cache: ActivationCache, default_width: int | None = None
) -> RelevanceRun:
    """A run from `generate`'s ``(output, cache)``: a `GenerationOutput` (``return_dict=True``) or the tokens."""
    sequences = getattr(output, "sequences", output)
    if not isinstance(sequences, Tensor):
        raise TypeError(
            f"Expected `generate`'s output (a GenerationOutput or a token tensor), got {type(output).__name__}; "
            "generate with token input or return_dict=True."
        )
    sequences = sequences[None] if sequences.dim() == 1 else sequences
    mask = getattr(output, "attention_mask", None)
    if mask is None:
        mask = cache.attention_mask
    width = getattr(output, "prompt_width", None)
    if width is None:
        width = default_width if default_width is not None else prompt_width(cache, sequences)
    hooks = getattr(cache, "generation_hooks", None)
    return RelevanceRun(model, sequences, mask, int(width), cache=cache, output=output, hooks=hooks)


def _is_text(output: object) -> bool:
    return isinstance(output, str) or (isinstance(output, list) and bool(output) and isinstance(output[0], str))


def cache_tokens(model: BridgeCore, cache: ActivationCache) -> Int[Tensor, "batch pos"]:
    """The token ids of the sequences a generation cache holds, for ``generate(text, return_cache=True)``, whose
    output is text (decoded without special tokens, so re-tokenizing it need not give the generated ids).

    A cache that carries its ids (``cache.tokens``) gives them. Otherwise they are read from the cached token
    embedding (``hook_embed``, or ``blocks.0.hook_resid_pre`` in families without a position embedding): each
    real position's vector is matched to the embedding matrix row it is a multiple of (Gemma scales it by √d),
    and the match is checked; an ambiguous or inexact match raises instead of guessing. Padding positions get
    the pad id.

    Example:
        >>> text, cache = model.generate("The capital of France is", max_new_tokens=4, return_cache=True,
        ...                              names_filter=relevance_hooks(model, "dla"))
        >>> tokens = cache_tokens(model, cache)   # what model.relevance((text, cache)) explains
    """
    given = getattr(cache, "tokens", None)
    if isinstance(given, Tensor):
        return given
    how = (
        "Generate with `return_dict=True` (its output holds the ids: `model.relevance((output, cache))`), or pass "
        "`tokens=` with the cache."
    )
    name = "hook_embed" if "hook_embed" in cache else None
    if name is None and "hook_pos_embed" not in model.hook_dict and "blocks.0.hook_resid_pre" in cache:
        name = "blocks.0.hook_resid_pre"
    if name is None:
        raise ValueError(f"The generation output is text and the cache holds no token embedding (`hook_embed`) to "
                         f"read the token ids from. {how}")  # fmt: skip
    embedded = cache[name].detach().float()
    table = model.hf_model.get_input_embeddings().weight.detach().float().to(embedded.device)
    flat = embedded.reshape(-1, embedded.shape[-1])
    similarity = torch.nn.functional.normalize(flat, dim=-1) @ torch.nn.functional.normalize(table, dim=-1).T
    best = similarity.topk(2, dim=-1)
    ids = best.indices[:, 0]
    rows = table[ids]
    factor = (flat * rows).sum(-1, keepdim=True) / (rows * rows).sum(-1, keepdim=True).clamp_min(1e-30)
    exact = (flat - factor * rows).norm(dim=-1) <= 1e-4 * flat.norm(dim=-1) + 1e-6
    unique = best.values[:, 1] < 1 - 1e-6
    mask = cache.attention_mask
    real = (torch.ones(embedded.shape[:-1], dtype=torch.bool) if mask is None else mask.bool()).reshape(-1).cpu()
    bad = real & ~(exact & unique).cpu()
    if bool(bad.any()):
        where = int(bad.nonzero()[0])
        raise ValueError(
            f"The generation output is text, and the token id at flat position {where} could not be read exactly from "
            f"the cached `{name}` (no embedding row matches it, or several do). {how}"
        )
    pad = model.tokenizer.pad_token_id if model.tokenizer is not None else None
    ids = torch.where(real.to(ids.device), ids, torch.full_like(ids, pad if pad is not None else 0))
    return ids.reshape(embedded.shape[:-1]).long()


def prompt_width(cache: ActivationCache, tokens: Int[Tensor, "batch pos"]) -> int:
    """The column where generation starts, from the cache's ``prompt_lengths`` and left-padded mask."""
    lengths = cache.prompt_lengths
    if lengths is None:
        raise ValueError(
            "The cache has no `prompt_lengths`, so the generated part is unknown. Use a cache from "
            "`generate(..., return_cache=True)`, or `model.forward_pass` to build a RelevanceRun."
        )
    mask = cache.attention_mask if cache.attention_mask is not None else torch.ones_like(tokens)
    first_real = mask.long().argmax(-1).cpu()
    widths = (first_real + lengths.cpu().long()).unique()
    if widths.numel() != 1:
        raise ValueError(f"The prompts do not end at one column (left padding expected); ends: {widths.tolist()}.")
    return int(widths)


__all__ = [
    "METHODS",
    "ClearedRunError",
    "ExplainedToken",
    "Method",
    "MethodOutput",
    "MissingHookError",
    "Option",
    "Relevance",
    "RelevanceRun",
    "Request",
    "StepRelevance",
    "Target",
    "attribution_patching",
    "cache_tokens",
    "explain",
    "explained_from_positions",
    "forward_pass",
    "get_method",
    "method_options",
    "relevance",
    "relevance_hooks",
]
