"""LRP rules as forward hooks: values stay those of the model, only gradients change.

Every rule here is written as ``value.detach() + (graph - graph.detach()) * constant``: the sum is
numerically the original activation, and its gradient is the rule's. With gradient × input at the
embedding this gives LRP relevances from one ordinary backward pass (the "efficient" form of
AttnLRP, Achtibat et al. 2024). No model code is touched; only the bridge's hook points are used.

Rules (``attnlrp`` | ``cp_lrp``):

- linear maps: plain gradient (the ε-rule with ε → 0) | same;
- norms: ``1/rms`` (or ``1/std``) treated as a constant via every ``hook_scale`` (the block norms, the
  final norm, Gemma 2's sandwich norms ``ln1_post``/``ln2_post`` and Qwen 3's per-head
  ``attn.q_norm``/``attn.k_norm``) | same;
- ``q @ kᵀ`` and ``pattern @ v``: uniform rule, gradient ÷ 4 on q and k, ÷ 2 on v (the softmax
  gradient itself as is) | q and k constant, so the pattern is constant and v gets the gradient;
- activation ``act(x)``: identity rule, gradient replaced by ``act(x) / x`` | same for plain MLPs;
- gated MLP ``act(gate) * up``: identity rule on ``act`` and uniform rule on the product (gradient ÷ 2
  on each factor) | ``act(gate)`` constant, the product is linear in ``up``;
- Gemma 2's final logit soft-cap: identity rule (see `softcap_identity`).
"""

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from ..core import BridgeCore
from ..hook_points import HookPoint
from .backprop import safe_ratio, scale_gradient

Variant = Literal["attnlrp", "cp_lrp"]
HookList = list[tuple[str, Callable]]


def lrp_hooks(model: BridgeCore, variant: Variant) -> HookList:
    """The forward hooks that turn the model's gradient into ``variant``'s relevance flow."""
    hooks: HookList = [(name, _constant_scale) for name in model.hook_dict if name.endswith(".hook_scale")]
    for layer in range(model.cfg.n_layers):
        p = f"blocks.{layer}."
        if variant == "attnlrp":
            hooks += [
                (p + "attn.hook_q", _gradient_times(0.25)),
                (p + "attn.hook_k", _gradient_times(0.25)),
                (p + "attn.hook_v", _gradient_times(0.5)),
            ]
        else:
            hooks += [(p + "attn.hook_q", _constant), (p + "attn.hook_k", _constant)]
        hooks += _mlp_hooks(model, p, variant)
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


def _mlp_hooks(model: BridgeCore, p: str, variant: Variant) -> HookList:
    """Identity rule on the activation; for gated MLPs the product rule of ``variant``.

    ``hook_pre`` returns the pre-activation detached, so the model's own activation derivative never
    enters the graph; ``hook_post`` (the down projection's input) re-attaches the gradient with the
    rule's constant factors. For gated MLPs ``post = act(gate) * up``, so ``post / gate`` is
    ``(act(gate) / gate) * up``: the identity rule times the other factor. ``cp_lrp`` gives the gate
    no gradient at all (share 0): ``act(gate)`` is a constant and ``post`` is linear in ``up``.
    """
    stash: dict[str, Tensor] = {}
    if model.cfg.gated_mlp:
        gate_share, up_share = (0.5, 0.5) if variant == "attnlrp" else (0.0, 1.0)
    else:
        gate_share, up_share = 1.0, 0.0

    def pre(x: Tensor, hook: HookPoint) -> Tensor:
        stash["pre"] = x
        return x.detach()

    def post(x: Tensor, hook: HookPoint) -> Tensor:
        a = stash.pop("pre")
        out = x.detach() + (a - a.detach()) * (gate_share * safe_ratio(x, a))
        if up_share:
            out = out + (x - x.detach()) * up_share
        return out

    return [(p + "mlp.hook_pre", pre), (p + "mlp.hook_post", post)]
