"""Baselines that need no gradient: attention weights (last layer or rollout) and seeded random scores.

- ``attention``: ``mode="last"`` averages the last layer's pattern over heads and reads the row of
  the position that predicted the token; ``mode="rollout"`` (Abnar & Zuidema 2020) multiplies
  ``0.5 · mean_heads(pattern) + 0.5 · I`` (rows renormalised) over all layers. Reads
  ``blocks.L.attn.hook_pattern`` from the cache. Cost: no forward.
- ``random``: uniform scores in [0, 1) on real source positions from ``torch.Generator`` seeded with
  ``seed``: the floor every faithful method must beat. Cost: none.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..core import BridgeCore
from .cache_access import require
from .protocol import Method, Option, Request
from .result import MethodOutput

ATTENTION_MODES = ("last", "rollout")


def attention_hooks(model: BridgeCore, mode: str = "last") -> list[str]:
    """The hook points `attention` reads from the cache for ``mode``."""
    layers = [model.cfg.n_layers - 1] if mode == "last" else range(model.cfg.n_layers)
    return [f"blocks.{layer}.attn.hook_pattern" for layer in layers]


def attention(request: Request) -> MethodOutput:
    """Head-averaged attention of the predicting position (last layer) or attention rollout."""
    mode, explained, tokens = request.options["mode"], request.explained, request.tokens
    names = attention_hooks(request.model, mode)
    patterns = require(request.cache, names, "attention", f"mode={mode!r}")
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
        scores[j] *= request.attention_mask[e.batch_index].cpu().to(scores.dtype)
    return MethodOutput(scores.to(tokens.device))


def random(request: Request) -> MethodOutput:
    """Seeded uniform scores on the real source positions of each explained token."""
    g = torch.Generator().manual_seed(request.options["seed"])
    scores = torch.rand(len(request.explained), request.tokens.shape[1], generator=g)
    for j, e in enumerate(request.explained):
        scores[j, e.position :] = 0.0
        scores[j] *= request.attention_mask[e.batch_index].cpu().to(scores.dtype)
    return MethodOutput(scores.to(request.tokens.device))


def _reads(model: BridgeCore, options: Mapping[str, Any]) -> list[str]:
    return attention_hooks(model, options["mode"])


ATTENTION = Method(
    "attention",
    attention,
    "attention weights: last layer or rollout",
    options=(Option("mode", str, "last", "'last': the last layer's pattern; 'rollout': Abnar & Zuidema's rollout",
                    choices=ATTENTION_MODES),),
    reads=_reads,
)  # fmt: skip
RANDOM = Method(
    "random",
    random,
    "seeded uniform scores (baseline)",
    options=(Option("seed", int, 0, "the torch.Generator seed", minimum=0, maximum=2**64 - 1,
                    hint="torch seeds are unsigned 64-bit."),),
)  # fmt: skip
