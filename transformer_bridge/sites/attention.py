"""Attention internals through HF's attention registry.

For each original implementation (``sdpa``, ``eager``) we register ``bridge_<original>`` with
`AttentionInterface` and the original mask function under the same name with
`AttentionMaskInterface` (without a mask function the causal mask is silently dropped). The
registered function delegates to the original unless an attention-internal hook point
(``hook_rot_q``, ``hook_rot_k``, ``hook_attn_scores``, ``hook_pattern``) of that layer is active;
then it computes attention explicitly so those points can be read and edited.

Families whose HF module calls torch's SDPA itself instead of the registry (Falcon) get the same points
through `SdpaSite`: while one of a layer's points is hooked, a `TorchFunctionMode` entered around that
layer's attention module routes its SDPA call through the same explicit computation.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..hooks.points import HookPoint
from ..versions import eager_attention, sdpa_drops_softcap
from .torch_hook import TorchHook

SUPPORTED_ORIGINALS = ("sdpa", "eager")
PREFIX = "bridge_"
# Keyword the attention module's forward pre-hook (`sites.AttnFnSite`) adds; HF passes it through to
# the attention function. A torch hook, not a lookup keyed by module: torch.compile shares one compiled
# attention frame across layers and does not guard a module-keyed lookup, so a lookup would run layer
# 0's hooks on every layer.
POINTS_KWARG = "bridge_attention_points"


@dataclass
class AttentionPoints:
    """The attention-internal hook points of one layer (``None`` where the family has none)."""

    rot_q: HookPoint | None
    rot_k: HookPoint | None
    scores: HookPoint
    pattern: HookPoint


def bridge_implementation(original: object) -> str:
    """Register (once) and return the bridge's attention implementation name for ``original``."""
    name = _BRIDGED.get(original)  # type: ignore[arg-type]
    if name is not None:
        return name
    if isinstance(original, str) and original.startswith(PREFIX):
        return original
    if original not in SUPPORTED_ORIGINALS:
        raise ValueError(
            f"The HF model uses attn_implementation={original!r}; the bridge supports {SUPPORTED_ORIGINALS}. "
            "Load it with `attn_implementation='sdpa'`, or call `hf_model.set_attn_implementation('sdpa')`."
        )
    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    _BRIDGED[original] = name
    return name


_BRIDGED: dict[str, str] = {}


def _original_function(original: str, module: nn.Module) -> Callable:
    # Eager is model-specific (Gemma 2 soft-caps); it lives next to the attention class.
    return eager_attention(module) if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]


def _make_attention(original: str) -> Callable:
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
        fn = _original_function(original, module)
        groups = kwargs.pop(POINTS_KWARG, None)
        if groups is None:
            return fn(module, query, key, value, attention_mask, **kwargs)
        if original == "sdpa" and kwargs.get("softcap") is not None and sdpa_drops_softcap():
            # Gemma 2 under sdpa before HF refused the combination: the kernel ignores the soft-cap, so the points
            # show (and an edit computes) the attention without it, as the model's output is.
            kwargs = {**kwargs, "softcap": None}
        edited = hooked_attention(module, query, key, value, attention_mask, groups, **kwargs)
        # Hooks that only read leave the output to the original kernel, so caching stays bitwise exact.
        return fn(module, query, key, value, attention_mask, **kwargs) if edited is None else edited

    attention.__name__ = f"{PREFIX}{original}_attention"
    return attention


def _run_heads_last(groups: list[AttentionPoints], which: str, x: Tensor) -> Tensor:
    """Run the ``which`` point of every group on ``[b, head, pos, d]`` data shown as ``[b, pos, head, d]``."""
    for points in groups:
        point = getattr(points, which)
        if point is not None and point.active:
            shown = x.transpose(1, 2)
            out = point.run(shown)
            # A view the hook asked to keep the gradient of (``retain_grad``) must be on the path.
            x = x if out is shown and not out.retains_grad else out.transpose(1, 2)
    return x


def _run(groups: list[AttentionPoints], which: str, x: Tensor) -> Tensor:
    for points in groups:
        point = getattr(points, which)
        if point.active:
            x = point.run(x)
    return x


def hooked_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    groups: list[AttentionPoints],
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    **_: object,
) -> tuple[Tensor, Tensor] | None:
    """Explicit attention exposing rotated q/k, masked scores and the pattern to hooks.

    Shapes follow HF: ``query [b, head, q, d]``, ``key/value [b, kv_head, kv, d]`` (the KV cache
    already updated). ``groups`` holds the points of each bridge over this model, run in the order
    the bridges registered. Returns ``([b, q, head, d], pattern)``, or None when no hook changed
    anything (no edit, no backward hook), in which case the caller runs the original kernel.
    """
    n_q, n_kv = query.shape[2], key.shape[2]
    new_query = _run_heads_last(groups, "rot_q", query)
    edited = new_query is not query
    query = new_query
    if any(g.rot_k is not None and g.rot_k.active for g in groups):
        # Hooks see only the new positions; an edit is written into the key tensor, which is the
        # KV cache's own storage during decoding, so it persists like an edit made at prefill.
        fresh = key[:, :, n_kv - n_q :]
        new = _run_heads_last(groups, "rot_k", fresh)
        if new is not fresh:
            edited = True
            if torch.is_grad_enabled() and (key.requires_grad or new.requires_grad):
                key = torch.cat([key[:, :, : n_kv - n_q], new], dim=2)
            elif new.data_ptr() != fresh.data_ptr():
                key[:, :, n_kv - n_q :] = new
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # `scores` is fresh here and nothing has seen it: scaling and masking edit it in place (matmul's backward
    # needs its inputs, not its output), which saves a copy of every layer's [b, head, q, kv] per step.
    scores = torch.matmul(query, key.transpose(2, 3)).mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # Hooks see blocked scores as -inf, as in TransformerLens; the softmax gets HF's fill, the dtype's minimum
    # (a row with every key blocked stays uniform, not NaN), so the pattern is HF's.
    shown = any(g.scores.active for g in groups)
    scores = _apply_mask(scores, attention_mask, n_q, n_kv, -torch.inf if shown else None)
    new_scores = _run(groups, "scores", scores)
    # A tensor kept for its gradient (``retain_grad``) is only on the path if the explicit kernel runs.
    edited |= new_scores is not scores or new_scores.retains_grad
    # Back to the dtype's minimum for the softmax, where a row may have every key blocked (a mask was given): without
    # a mask every query sees its own key, and the softmax of -inf entries is the softmax of the minimum's, bitwise.
    may_block_rows = attention_mask is not None or n_kv < n_q or new_scores is not scores
    scores = new_scores.clamp(min=torch.finfo(new_scores.dtype).min) if shown and may_block_rows else new_scores
    pattern = _softmax(scores, s_aux).to(query.dtype)
    new_pattern = _run(groups, "pattern", pattern)
    edited |= new_pattern is not pattern or new_pattern.retains_grad
    pattern = new_pattern
    if not edited:
        return None
    if dropout and module.training:
        pattern = nn.functional.dropout(pattern, p=dropout, training=True)
    if n_rep > 1:  # only an edit recomputes the output; hooks that only read leave it to the original kernel
        value = value.repeat_interleave(n_rep, dim=1)
    out = torch.matmul(pattern, value).transpose(1, 2).contiguous()
    return out, pattern


def _softmax(scores: Tensor, sinks: Tensor | None) -> Tensor:
    """Softmax over keys; with attention sinks (GPT-OSS: one learned logit per head, ``s_aux``) the sink
    takes part in the normalisation and is then dropped, so a row of the pattern sums to less than 1."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def _apply_mask(scores: Tensor, mask: Tensor | None, n_q: int, n_kv: int, fill: float | None = None) -> Tensor:
    """Blocked scores set to ``fill`` (default: the dtype's minimum, HF's fill); a float mask is added, and with
    ``fill`` its blocked entries (HF's minimum) become ``fill``."""
    minimum = torch.finfo(scores.dtype).min if fill is None else fill
    if mask is None:
        # The sdpa mask function returns None for a plain causal mask (no padding, no window):
        # query i sees keys up to i + (n_kv - n_q), aligned to the end.
        return scores.masked_fill_(_causal_blocked(n_q, n_kv, scores.device), minimum)
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask[..., :n_kv], minimum)
    mask = mask[..., :n_kv]
    in_place = mask.dtype == scores.dtype and torch.broadcast_shapes(mask.shape, scores.shape) == scores.shape
    added = scores.add_(mask) if in_place else scores + mask  # else broadcasting or type promotion as in HF
    return added if fill is None else added.masked_fill_(mask == torch.finfo(mask.dtype).min, fill)


def _causal_blocked(n_q: int, n_kv: int, device: torch.device) -> Tensor:
    """``[n_q, n_kv]``: True where query i (aligned to the end of the keys) may not see the key."""
    q_idx = torch.arange(n_q, device=device)[:, None] + (n_kv - n_q)
    return torch.arange(n_kv, device=device)[None, :] > q_idx


class _RouteSdpa(TorchFunctionMode):
    """Inside one attention module's forward: its SDPA call goes through `hooked_attention`."""

    def __init__(self, module: nn.Module, groups: list[AttentionPoints]) -> None:
        super().__init__()
        self.module, self.groups = module, groups

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return _sdpa_with_points(self.module, self.groups, func, *args, **kwargs)


def _sdpa_with_points(
    module: nn.Module,
    groups: list[AttentionPoints],
    sdpa: Callable,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **kwargs: object,
) -> Tensor:
    if attn_mask is None and not is_causal and query.shape[2] > 1:  # every query sees every key
        attn_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
    edited = hooked_attention(module, query, key, value, attn_mask, groups, scaling=scale, dropout=dropout_p)
    if edited is None:  # hooks that only read leave the output to the original kernel (bitwise HF)
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    **kwargs)  # fmt: skip
    return edited[0].transpose(1, 2)  # SDPA's layout: [b, head, q, d]


class SdpaSite(TorchHook):
    """A layer whose HF attention module calls torch's SDPA itself (Falcon): while one of its attention points
    is hooked, its forward runs inside a `TorchFunctionMode` that routes that SDPA call through
    `hooked_attention` (the mode is entered by a forward pre-hook and left by a forward hook that also runs
    when the forward raises)."""

    def __init__(self, module: nn.Module, points: AttentionPoints) -> None:
        self.module, self.points = module, points
        self.served: list[HookPoint] = []
        self.handle: RemovableHandle | None = None
        self.fired = False
        self._modes: list[_RouteSdpa] = []

    def _register(self) -> RemovableHandle:
        enter = self.module.register_forward_pre_hook(self._enter)
        leave = self.module.register_forward_hook(self._leave, always_call=True)
        return Handles(enter, leave)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.fired = True
        mode = _RouteSdpa(module, [self.points])
        mode.__enter__()
        self._modes.append(mode)

    def _leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._modes:
            self._modes.pop().__exit__(None, None, None)


class Handles(RemovableHandle):
    """Several torch hook handles removed as one."""

    def __init__(self, *handles: RemovableHandle) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
