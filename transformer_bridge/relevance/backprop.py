"""One forward with a gradient leaf at an input hook point, then one backward per round of targets.

Every gradient-based method (`attnlrp`, `cp_lrp`, `grad_x_input`, `grad_norm`,
`integrated_gradients`) is this engine plus the forward hooks that set its rules. Batch rows do
not interact, so a *round* backpropagates the sum of at most one target per row: explaining ``k``
tokens in each of ``B`` rows costs one forward and ``k`` backwards, not ``B * k``.
"""

from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from ..hooks.points import HookPoint
from .protocol import Request
from .targets import ExplainedToken

# reduce(inputs [replicas, pos, d_model], grads [replicas, pos, d_model]) -> scores [pos]
Reduce = Callable[[Tensor, Tensor], Tensor]
LogitsFn = Callable[[Tensor], Tensor]


def rounds(explained: Sequence[ExplainedToken]) -> list[list[int]]:
    """Indices of ``explained`` grouped so that no round holds two tokens of the same row."""
    out: list[list[int]] = []
    used: list[set[int]] = []
    for j, e in enumerate(explained):
        for r, rows in enumerate(used):
            if e.batch_index not in rows:
                out[r].append(j)
                rows.add(e.batch_index)
                break
        else:
            out.append([j])
            used.append({e.batch_index})
    return out


def backprop_scores(
    request: Request,
    leaf: str,
    reduce: Reduce,
    hooks: Sequence[tuple[str, Callable]] = (),
    leaf_fn: Callable[[Tensor], Tensor] | None = None,
    logits_fn: LogitsFn | None = None,
    replicas: int = 1,
) -> tuple[Float[Tensor, "explained pos"], Float[Tensor, "explained"]]:
    """Scores over source positions for each explained token, and the target values.

    ``leaf`` is the hook point whose output becomes the gradient leaf (``leaf_fn`` may transform
    it first, e.g. scale it for integrated gradients). ``hooks`` are extra forward hooks (the
    rules of a method). ``replicas`` > 1 means each row of ``tokens`` is repeated that many times
    consecutively and a target is the sum over its replicas. ``logits_fn`` maps the logits read at
    the explained positions before the target (Gemma 2's soft-cap rule).
    """
    model, tokens, attention_mask = request.model, request.tokens, request.attention_mask
    explained, target = request.explained, request.target
    stash: dict[str, Tensor] = {}

    def make_leaf(x: Tensor, hook: HookPoint) -> Tensor:
        value = x.detach() if leaf_fn is None else leaf_fn(x.detach())
        value = value.requires_grad_(True)
        stash["leaf"] = value
        return value

    rows = tokens.repeat_interleave(replicas, 0) if replicas > 1 else tokens
    mask = attention_mask.repeat_interleave(replicas, 0) if replicas > 1 else attention_mask
    n = len(explained)
    scores = torch.zeros(n, tokens.shape[1], device=tokens.device)
    values = torch.zeros(n, device=tokens.device)
    with torch.enable_grad(), model.hooks(fwd_hooks=[(leaf, make_leaf), *hooks]):
        logits = model.forward_tokens(rows, mask)
    if "leaf" not in stash:  # pragma: no cover - the bridge always serves its own points
        raise RuntimeError(f"The leaf hook point {leaf!r} was not reached in the forward pass.")
    x = stash.pop("leaf")
    groups = rounds(explained)
    for r, group in enumerate(groups):
        total = logits.new_zeros((), dtype=torch.float32)
        for j in group:
            e = explained[j]
            sl = slice(e.batch_index * replicas, (e.batch_index + 1) * replicas)
            read = logits[sl, e.logit_position]
            if logits_fn is not None:
                read = logits_fn(read)
            value = target(read, e.token_id)
            values[j] = value.detach().float().mean()
            total = total + value.float().sum()
        (grad,) = torch.autograd.grad(total, x, retain_graph=r < len(groups) - 1)
        for j in group:
            e = explained[j]
            sl = slice(e.batch_index * replicas, (e.batch_index + 1) * replicas)
            scores[j] = reduce(x[sl].detach(), grad[sl]).float()
            # Causality makes later positions zero already; padding is zeroed for a clean matrix.
            scores[j, e.position :] = 0.0
            scores[j] *= attention_mask[e.batch_index].to(scores.dtype)
    return scores, values


def grad_times_input(x: Tensor, g: Tensor) -> Tensor:
    """Gradient × input summed over ``d_model``, for one replica."""
    return (x[0].float() * g[0].float()).sum(-1)


def scale_gradient(x: Tensor, factor: float) -> Tensor:
    """``x`` unchanged in value; its gradient multiplied by ``factor`` on the way back."""
    detached = x.detach()
    return detached + (x - detached) * factor


def safe_ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` as a constant, 0 where ``den`` is exactly 0 (there the relevance is 0 anyway)."""
    num, den = num.detach(), den.detach()
    zero = den == 0
    return torch.where(zero, torch.zeros_like(num), num / torch.where(zero, torch.ones_like(den), den))
