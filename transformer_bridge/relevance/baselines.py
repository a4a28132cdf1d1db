"""Baselines that need no gradient: attention weights (last layer or rollout) and seeded random scores.

- ``attention``: ``mode="last"`` averages the last layer's pattern over heads and reads the row of
  the position that predicted the token; ``mode="rollout"`` (Abnar & Zuidema 2020) multiplies
  ``0.5 · mean_heads(pattern) + 0.5 · I`` (rows renormalised) over all layers. Reads
  ``blocks.L.attn.hook_pattern`` from the cache. Cost: no forward.
- ``random``: uniform scores in [0, 1) on real source positions from ``torch.Generator`` seeded with
  ``seed``: the floor every faithful method must beat. Cost: none.
"""

from collections.abc import Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from ..cache import ActivationCache
from ..checks import check_int, describe
from ..core import BridgeCore
from .cache_access import require
from .result import MethodOutput
from .targets import ExplainedToken, Target

ATTENTION_MODES = ("last", "rollout")


def attention_hooks(model: BridgeCore, mode: str = "last") -> list[str]:
    """The hook points `attention` reads from the cache for ``mode``."""
    _check_mode(mode)
    layers = [model.cfg.n_layers - 1] if mode == "last" else range(model.cfg.n_layers)
    return [f"blocks.{layer}.attn.hook_pattern" for layer in layers]


def attention(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"],
    explained: Sequence[ExplainedToken],
    target: Target,
    cache: ActivationCache | None = None,
    mode: str = "last",
) -> MethodOutput:
    """Head-averaged attention of the predicting position (last layer) or attention rollout.

    Example:
        >>> out = attention(model, tokens, mask, explained, Target(), cache, mode="rollout")
    """
    names = attention_hooks(model, mode)
    patterns = require(cache, names, "attention", f"mode={mode!r}")
    rows = sorted({e.batch_index for e in explained})
    flows: dict[int, Tensor] = {}
    for b in rows:
        mixed = [patterns[n][b].float().mean(0) for n in names]  # [query_pos, key_pos] per layer
        if mode == "last":
            flows[b] = mixed[0]
        else:
            eye = torch.eye(mixed[0].shape[-1], device=mixed[0].device)
            flow = eye
            for a in mixed:
                a = 0.5 * a + 0.5 * eye
                flow = (a / a.sum(-1, keepdim=True)) @ flow
            flows[b] = flow
    scores = torch.zeros(len(explained), tokens.shape[1])
    for j, e in enumerate(explained):
        scores[j, : e.position] = flows[e.batch_index][e.logit_position, : e.position].cpu()
        scores[j] *= attention_mask[e.batch_index].cpu().to(scores.dtype)
    return MethodOutput(scores.to(tokens.device))


def random(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"],
    explained: Sequence[ExplainedToken],
    target: Target,
    cache: ActivationCache | None = None,
    seed: int = 0,
) -> MethodOutput:
    """Seeded uniform scores on the real source positions of each explained token."""
    seed = check_int("seed", seed, minimum=0, maximum=2**64 - 1, hint="torch seeds are unsigned 64-bit.")
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(len(explained), tokens.shape[1], generator=g)
    for j, e in enumerate(explained):
        scores[j, e.position :] = 0.0
        scores[j] *= attention_mask[e.batch_index].cpu().to(scores.dtype)
    return MethodOutput(scores.to(tokens.device))


def _check_mode(mode: object) -> None:
    if not isinstance(mode, str) or mode not in ATTENTION_MODES:
        raise ValueError(f"`mode`={describe(mode)} is not valid for method 'attention'; use one of {ATTENTION_MODES}.")
