"""Caching hooks and the losses a caching run backpropagates: each tensor stored once, where asked."""

import weakref
from collections.abc import Container, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..checks import describe
from ..hooks.names import tl4_spelling
from ..hooks.points import HookPoint


class CachingDict(dict):
    """The dict caches are filled into (`CacheWriter`, `get_caching_hooks`): keyed by canonical hook names, each
    tensor stored once.

    A TransformerLens 4 spelling of a point reads its entry (``d["blocks.0.hook_out"]``, ``in``, ``get``);
    iteration, ``len`` and ``keys()`` see the canonical names only. Writes go under the key given. ``known``: the
    model's points, for the spellings whose point depends on the family (`tl4_spelling`); without it those read
    nothing.

    Example:
        >>> d = CachingDict({"blocks.0.hook_resid_post": torch.zeros(1)})
        >>> d["blocks.0.hook_out"] is d["blocks.0.hook_resid_post"], "blocks.0.hook_out" in d, len(d)
        (True, True, 1)
    """

    known: Container[str] | None = None

    def __missing__(self, key: Any) -> Tensor:
        canonical = tl4_spelling(key, self.known) if isinstance(key, str) else key
        if canonical != key and dict.__contains__(self, canonical):
            return dict.__getitem__(self, canonical)
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or (
            isinstance(key, str) and dict.__contains__(self, tl4_spelling(key, self.known))
        )

    def get(self, key: Any, default: Any = None) -> Any:
        """``self[key]`` (a TransformerLens 4 spelling included) if present, else ``default``."""
        try:
            return self[key]
        except KeyError:
            return default


class CacheWriter:
    """Caching hook: stores each tensor once on ``device``; aliases of one tensor share storage."""

    def __init__(self, device: torch.device | None, pos_slice: int | slice | Sequence[int] | None = None) -> None:
        self.device = device
        self.pos_slice = pos_slice
        self.tensors: dict[str, Tensor] = CachingDict()
        self._seen: dict[int, tuple[Any, Tensor]] = {}

    def _store(self, key: str, tensor: Tensor) -> None:
        hit = self._seen.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            self.tensors[key] = hit[1]
            return
        stored = tensor.detach()
        if self.pos_slice is not None:
            stored = _slice_positions(key, stored, self.pos_slice)
        if self.device is not None:
            stored = stored.to(self.device)
        self._seen[id(tensor)] = (weakref.ref(tensor), stored)
        self.tensors[key] = stored

    def hook(self, tensor: Tensor, hook: HookPoint) -> None:
        self._store(hook.name, tensor)

    def grad_hook(self, grad: Tensor, hook: HookPoint) -> None:
        self._store(hook.name + "_grad", grad)


def _slice_positions(name: str, t: Tensor, pos_slice: int | slice | Sequence[int]) -> Tensor:
    query_axis_second = name.removesuffix("_grad").endswith(("hook_pattern", "hook_attn_scores"))
    dim = 2 if query_axis_second else 1
    if isinstance(pos_slice, int):
        return t.narrow(dim, pos_slice % t.shape[dim], 1)
    if isinstance(pos_slice, slice):
        index = [slice(None)] * t.dim()
        index[dim] = pos_slice
        return t[tuple(index)]
    return t.index_select(dim, torch.as_tensor(list(pos_slice), device=t.device))


def _next_token_nll(
    logits: Float[Tensor, "batch pos d_vocab"], targets: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"]
) -> tuple[Float[Tensor, "batch pos_minus_1"], Bool[Tensor, "batch pos_minus_1"]]:
    """Per prediction: the cross-entropy of ``targets[:, p]`` from the logits at ``p - 1`` (0 where not counted)
    and whether it counts: both tokens real, and the target not -100 (HF's ignored label)."""
    real = mask.bool()
    counted = (targets[:, 1:] != -100) & real[:, 1:] & real[:, :-1]
    logprobs = logits[:, :-1].float().log_softmax(-1)
    nll = -logprobs.gather(-1, targets[:, 1:].clamp_min(0)[..., None])[..., 0]
    return torch.where(counted, nll, nll.new_zeros(())), counted


def next_token_loss(
    logits: Float[Tensor, "batch pos d_vocab"], targets: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"]
) -> Float[Tensor, ""]:
    """Mean cross-entropy of predicting each real token (or HF ``labels``: -100 ignored) from the one before it.

    Example:
        >>> float(next_token_loss(torch.zeros(1, 3, 4), torch.tensor([[-100, 1, -100]]), torch.ones(1, 3)))
        1.3862943649291992
    """
    nll, counted = _next_token_nll(logits, targets, mask)
    return nll.sum() / counted.sum().clamp_min(1)


def next_token_losses(
    logits: Float[Tensor, "batch pos d_vocab"], targets: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"]
) -> Float[Tensor, "batch pos_minus_1"]:
    """Cross-entropy of predicting each token (or HF ``labels``) from the one before it; 0 where either is padding
    or the label is -100."""
    return _next_token_nll(logits, targets, mask)[0]


def backpropagate(target: Any) -> None:
    """Backpropagate ``run_with_cache(..., incl_bwd=True)``'s scalar (``metric(logits)`` or the loss), refusing what
    cannot be: a non-scalar, or a value with no graph (a metric that ignores the logits, a frozen model)."""
    if not isinstance(target, Tensor) or target.numel() != 1:
        raise ValueError(
            f"`metric` must return a scalar tensor to backpropagate, got {describe(target)}"
            + (f" of shape {tuple(target.shape)}" if isinstance(target, Tensor) else "")
            + "; reduce it, e.g. with .sum() or .mean()."
        )
    if not target.requires_grad:
        raise ValueError(
            "The value to backpropagate has no grad_fn: `metric` does not use the logits, or no "
            "parameter requires grad (a frozen model); use the logits, or unfreeze the parameters."
        )
    target.reshape(()).backward()
