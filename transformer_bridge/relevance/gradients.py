"""Gradient baselines at the token embedding (``hook_embed``): plain model gradients, no rules.

- ``grad_x_input``: ``Σ_d e_{i,d} · ∂f/∂e_{i,d}`` (signed, unnormalised; inseq's ``input_x_gradient``
  with ``attributed_fn="logit"``). Cost: one forward + one backward per round.
- ``grad_norm``: ``‖∂f/∂e_i‖₂`` (non-negative, the saliency of Simonyan et al.). Same cost.
- ``integrated_gradients``: ``Σ_d e_{i,d} · mean_α ∂f/∂e_{i,d}(α e)`` with a zero-embedding
  baseline (``keep_first=True``: the first token stays at its embedding) and the midpoint rule over
  ``steps`` values of α, the α batched along the batch axis
  (``internal_batch_size`` α values per forward). Position embeddings (GPT-2, OPT) are not scaled.
  Cost: ``steps`` forwards + ``steps`` backwards per round. Completeness: Σ IG ≈ f(e) − f(0); the
  gap is reported as ``conservation_error``.
"""

import torch
from torch import Tensor

from .backprop import backprop_scores, grad_times_input
from .lrp import relative_gap
from .protocol import Method, Option, Request
from .result import MethodOutput

EMBED_POINT = "hook_embed"


def grad_x_input(request: Request) -> MethodOutput:
    """Gradient × token embedding, summed over ``d_model``."""
    scores, values = backprop_scores(request, leaf=EMBED_POINT, reduce=grad_times_input)
    return MethodOutput(scores, values, conservation_error=relative_gap(scores.sum(-1), values))


def grad_norm(request: Request) -> MethodOutput:
    """L2 norm of the gradient at each token embedding."""

    def norm(x: Tensor, g: Tensor) -> Tensor:
        return g[0].float().norm(dim=-1)

    scores, values = backprop_scores(request, leaf=EMBED_POINT, reduce=norm)
    return MethodOutput(scores, values)


def integrated_gradients(request: Request) -> MethodOutput:
    """Integrated gradients from a zero token embedding, ``steps`` midpoint α values.

    ``internal_batch_size`` is the number of α values per forward (each forward has batch rows ×
    that many); by default all ``steps`` α values go through together. ``keep_first=True`` holds each row's first
    real token (the attention sink) at its own embedding along the whole path, so only the other
    tokens move from 0; the first token's score is then 0.
    """
    tokens, attention_mask, explained = request.tokens, request.attention_mask, request.explained
    steps = request.options["steps"]
    chunk = request.options["internal_batch_size"] or steps
    # moving[b, p]: 1 where the embedding follows the path α·e, 0 where it stays e (kept first token).
    moving = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    if request.options["keep_first"]:
        first = attention_mask.long().argmax(-1)  # left padding: the first 1 of each row
        moving[torch.arange(tokens.shape[0], device=tokens.device), first] = 0.0
    alphas = (torch.arange(steps, dtype=torch.float32, device=tokens.device) + 0.5) / steps
    total = torch.zeros(len(explained), tokens.shape[1], device=tokens.device)
    for start in range(0, steps, chunk):
        part = alphas[start : start + chunk]

        def scaled(x: Tensor, part: Tensor = part) -> Tensor:
            a = part.repeat(x.shape[0] // len(part))[:, None]  # [rows, 1]
            factor = 1.0 - moving.repeat_interleave(len(part), 0) * (1.0 - a)  # α where moving, else 1
            return x * factor[..., None].to(x.dtype)

        def reduce(x: Tensor, g: Tensor, part: Tensor = part) -> Tensor:
            # x holds α·e per replica at moving positions; e = x[0] / α[0] is recovered there.
            e = x[0].float() / float(part[0])
            return (e * g.float().sum(0)).sum(-1)

        scores, _ = backprop_scores(request, leaf=EMBED_POINT, reduce=reduce, leaf_fn=scaled, replicas=len(part))
        total += scores
    rows = torch.tensor([e.batch_index for e in explained], device=tokens.device)
    scores = total / steps * moving[rows]  # a kept token does not move: its attribution is 0
    values, baseline = _endpoint_values(request, moving)
    return MethodOutput(scores, values, conservation_error=relative_gap(scores.sum(-1), values - baseline))


def _endpoint_values(request: Request, moving: Tensor) -> tuple[Tensor, Tensor]:
    """Target values at the real embedding and at the baseline (one forward of twice the batch).

    The baseline is 0 where ``moving`` is 1 and the real embedding where it is 0.
    """
    model, tokens, mask = request.model, request.tokens, request.attention_mask
    explained, target = request.explained, request.target

    def zero_second_half(x: Tensor, hook) -> Tensor:
        half = x.shape[0] // 2
        return torch.cat([x[:half], x[half:] * (1.0 - moving)[..., None].to(x.dtype)])

    both = torch.cat([tokens, tokens])
    with torch.no_grad(), model.hooks(fwd_hooks=[(EMBED_POINT, zero_second_half)]):
        logits = model.forward_tokens(both, torch.cat([mask, mask]))
    b = tokens.shape[0]
    rows = torch.tensor([e.batch_index for e in explained], device=tokens.device)
    cols = torch.tensor([e.logit_position for e in explained], device=tokens.device)
    ids = torch.tensor([e.token_id for e in explained], device=tokens.device)
    real = target(logits[rows, cols], ids).float()
    base = target(logits[rows + b, cols], ids).float()
    return real, base


GRAD_X_INPUT = Method("grad_x_input", grad_x_input, "gradient × token embedding")
GRAD_NORM = Method("grad_norm", grad_norm, "L2 norm of the gradient at each token embedding")
INTEGRATED_GRADIENTS = Method(
    "integrated_gradients",
    integrated_gradients,
    "integrated gradients, zero baseline",
    options=(
        Option("steps", int, 32, "number of midpoint α values on the path from 0 to the embedding", minimum=1,
               hint="More steps approximate the path integral better (32 default)."),
        Option("internal_batch_size", int, None, "α values per forward (None: all `steps` at once)", minimum=1,
               optional=True, hint="It is how many α values go through one forward; None sends all `steps` at once."),
        Option("keep_first", bool, False, "hold each row's first real token at its embedding along the path"),
    ),
)  # fmt: skip
