"""LRP rules as forward hooks: values stay those of the model, only gradients change.

Every rule here is written as ``value.detach() + (graph - graph.detach()) * constant``: the sum is
numerically the original activation, and its gradient is the rule's. With gradient × input at the
embedding this gives LRP relevances from one ordinary backward pass (the "efficient" form of
AttnLRP, Achtibat et al. 2024). No model code is touched; only the bridge's hook points are used.

Rules (``attnlrp`` | ``cp_lrp``):

- linear maps: plain gradient (the ε-rule with ε → 0) | same;
- norms: ``1/rms`` (or ``1/std``) treated as a constant via ``hook_scale`` | same;
- ``q @ kᵀ`` and ``pattern @ v``: uniform rule, gradient ÷ 4 on q and k, ÷ 2 on v (the softmax
  gradient itself as is) | q and k constant, so the pattern is constant and v gets the gradient;
- activation ``act(x)``: identity rule, gradient replaced by ``act(x) / x`` | same for plain MLPs;
- gated MLP ``act(gate) * up``: identity rule on ``act`` and uniform rule on the product (gradient ÷ 2
  on each factor) | ``act(gate)`` constant, the product is linear in ``up``;
- Gemma 2's sandwich norms (after attention and MLP) have no ``hook_scale``: their ``γ / rms`` is
  applied as an elementwise constant ratio of output to input;
- Gemma 2's final logit soft-cap: identity rule (see `softcap_identity`).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from ..hook_points import HookPoint
from ..sites import get_module
from .backprop import safe_ratio, scale_gradient

if TYPE_CHECKING:
    from ..bridge import TransformerBridge

Variant = Literal["attnlrp", "cp_lrp"]
HookList = list[tuple[str, Callable]]


def lrp_hooks(model: "TransformerBridge", variant: Variant) -> HookList:
    """The forward hooks that turn the model's gradient into ``variant``'s relevance flow."""
    hooks: HookList = [(name, _constant_scale) for name in model.hook_dict if name.endswith(".hook_scale")]
    blocks = get_module(model.hf_model, model.adapter.blocks)
    for layer, block in enumerate(blocks):
        p = f"blocks.{layer}."
        if variant == "attnlrp":
            hooks += [
                (p + "attn.hook_q", _gradient_times(0.25)),
                (p + "attn.hook_k", _gradient_times(0.25)),
                (p + "attn.hook_v", _gradient_times(0.5)),
            ]
        else:
            hooks += [(p + "attn.hook_q", _constant), (p + "attn.hook_k", _constant)]
        hooks += _mlp_hooks(model, block, p, variant)
        if _is_norm(get_module(block, model.adapter.attn_out)):
            hooks += _sandwich_attn_hooks(p)
    return hooks


def softcap_identity(cap: float) -> Callable[[Tensor], Tensor]:
    """Identity rule for ``cap * tanh(x / cap)`` applied to already soft-capped logits.

    The pre-cap logit is recovered as ``cap * atanh(y / cap)`` (a differentiable function of ``y``),
    so the gradient reaching the network is ``y / x`` times the gradient of the target.
    """

    def fn(capped: Tensor) -> Tensor:
        inner = (capped.float() / cap).clamp(-1 + 1e-7, 1 - 1e-7)
        pre = torch.atanh(inner) * cap
        out = capped.detach().float() + (pre - pre.detach()) * safe_ratio(capped.float(), pre)
        return out.to(capped.dtype)

    return fn


def _constant_scale(scale: Tensor, hook: HookPoint) -> Tensor:
    return scale.detach()


def _constant(x: Tensor, hook: HookPoint) -> Tensor:
    return x.detach()


def _gradient_times(factor: float) -> Callable:
    def fn(x: Tensor, hook: HookPoint) -> Tensor:
        return scale_gradient(x, factor)

    return fn


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _mlp_hooks(model: "TransformerBridge", block: nn.Module, p: str, variant: Variant) -> HookList:
    """Identity rule on the activation; for gated MLPs the product rule of ``variant``.

    ``hook_pre`` returns the pre-activation detached, so the model's own activation derivative never
    enters the graph; ``hook_post`` (the down projection's input) re-attaches the gradient with the
    rule's constant factors. For gated MLPs ``post = act(gate) * up``, so ``post / gate`` is
    ``(act(gate) / gate) * up``: the identity rule times the other factor. ``cp_lrp`` gives the gate
    no gradient at all (share 0): ``act(gate)`` is a constant and ``post`` is linear in ``up``.
    """
    gated = model.cfg.gated_mlp
    stash: dict[str, Tensor] = {}
    if gated:
        gate_share, up_share = (0.5, 0.5) if variant == "attnlrp" else (0.0, 1.0)
    else:
        gate_share, up_share = 1.0, 0.0
    down = get_module(block, model.adapter.mlp_down)
    sandwich = _is_norm(get_module(block, model.adapter.mlp_out))

    def pre(x: Tensor, hook: HookPoint) -> Tensor:
        stash["pre"] = x
        return x.detach()

    def post(x: Tensor, hook: HookPoint) -> Tensor:
        a = stash.pop("pre")
        out = x.detach() + (a - a.detach()) * (gate_share * safe_ratio(x, a))
        if up_share:
            out = out + (x - x.detach()) * up_share
        if sandwich:
            stash["down"] = _linear(down, out, model.adapter.conv1d)
        return out

    hooks: HookList = [(p + "mlp.hook_pre", pre), (p + "mlp.hook_post", post)]
    if sandwich:
        hooks.append((p + "hook_mlp_out", _sandwich_from(stash, "down")))
    return hooks


def _sandwich_attn_hooks(p: str) -> HookList:
    """Gemma 2 norms the attention output before the residual add; make that norm linear."""
    stash: dict[str, Tensor] = {}

    def result(r: Tensor, hook: HookPoint) -> None:
        # Per-head results summed are the output projection's output (Gemma 2 has no o_proj bias).
        stash["attn"] = r.sum(-2)

    return [(p + "attn.hook_result", result), (p + "hook_attn_out", _sandwich_from(stash, "attn"))]


def _sandwich_from(stash: dict[str, Tensor], key: str) -> Callable:
    def fn(y: Tensor, hook: HookPoint) -> Tensor:
        x = stash.pop(key)
        return y.detach() + (x - x.detach()) * safe_ratio(y, x)

    return fn


def _linear(module: nn.Module, x: Tensor, conv1d: bool) -> Tensor:
    weight = module.weight.T if conv1d else module.weight
    return torch.nn.functional.linear(x, weight, getattr(module, "bias", None))
