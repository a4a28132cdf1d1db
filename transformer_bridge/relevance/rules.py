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
- Gemma 2's final logit soft-cap: identity rule (see `softcap_identity`);
- mixture-of-experts blocks: the router's weights ``hook_expert_weights`` constant (like a norm's scale,
  so relevance flows only through the experts a token was routed to, in proportion to their weighted
  outputs), and each expert's ``act(gate) * up`` (``hook_expert_pre`` / ``hook_expert_post``) under the
  gated-MLP rule above | same; a shared expert's ``act(gate) * up`` (``hook_shared_pre`` /
  ``hook_shared_post``) under the gated-MLP rule and its sigmoid gate ``hook_shared_gate`` constant, like
  the router weights | same;
- latent attention (DeepSeek-V3, no ``hook_k``): the norm scales of the query and key/value latents
  (``attn.q_a_layernorm`` / ``attn.kv_a_layernorm.hook_scale``) constant by the norm rule; uniform rule on
  ``hook_q`` and ``hook_rot_k`` (the values have no point, so no ÷ 2) | ``hook_pattern`` constant.
"""

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from ..core import BridgeCore
from ..hooks.points import HookPoint
from .backprop import safe_ratio, scale_gradient

Variant = Literal["attnlrp", "cp_lrp"]
HookList = list[tuple[str, Callable]]
# A rule: the forward hooks that set one kind of relevance flow, on the hook points of ``model`` it applies to.
Rule = Callable[[BridgeCore], HookList]


def points(model: BridgeCore, suffix: str) -> list[str]:
    """The model's hook points whose name ends with ``suffix`` (e.g. ``attn.hook_q`` in every block).

    A rule built on it applies wherever the family has the point and is a no-op where it has none, so a
    new family needs no rule code unless it adds a new kind of computation.
    """
    return [name for name in model.hook_dict if name.endswith(suffix)]


def norm_scales_constant(model: BridgeCore) -> HookList:
    """Every norm's ``1/rms`` (``1/std``) is a constant: block, final, sandwich and per-head q/k norms."""
    return [(name, _constant_scale) for name in points(model, ".hook_scale")]


def attention_uniform(model: BridgeCore) -> HookList:
    """Uniform rule on ``q @ kᵀ`` and ``pattern @ v``: gradient ÷ 4 on q and k, ÷ 2 on v.

    Latent attention (no ``hook_k``) takes the key at ``hook_rot_k``; its values have no point (no ÷ 2).
    """
    keys = points(model, "attn.hook_k") + _latent(model, "attn.hook_rot_k")
    return [
        *[(name, _gradient_times(0.25)) for name in points(model, "attn.hook_q") + keys],
        *[(name, _gradient_times(0.5)) for name in points(model, "attn.hook_v")],
    ]


def attention_constant(model: BridgeCore) -> HookList:
    """q and k detached: the pattern is a constant and v gets the whole gradient (latent attention, no
    ``hook_k``: the pattern itself is detached)."""
    names = points(model, "attn.hook_q") + points(model, "attn.hook_k") + _latent(model, "attn.hook_pattern")
    return [(name, _constant) for name in names]


def _latent(model: BridgeCore, suffix: str) -> list[str]:
    """``suffix`` points of the attention layers without ``hook_k`` (latent attention)."""
    return [n for n in points(model, suffix) if n.removesuffix(suffix) + "attn.hook_k" not in model.hook_dict]


def router_constant(model: BridgeCore) -> HookList:
    """Mixture-of-experts router weights (and a shared expert's gate) held constant, as a norm's scale: no
    relevance reaches the router."""
    return [
        (name, _constant) for name in points(model, "mlp.hook_expert_weights") + points(model, "mlp.hook_shared_gate")
    ]


def mlp_attnlrp(model: BridgeCore) -> HookList:
    """Identity rule on the activation; uniform rule on ``act(gate) × up`` (gradient ÷ 2 on each factor)."""
    return _mlp_hooks(model, gate_share=0.5 if model.cfg.gated_mlp else 1.0)


def mlp_cp_lrp(model: BridgeCore) -> HookList:
    """Identity rule on plain activations; ``act(gate)`` constant in gated MLPs (``post`` linear in ``up``)."""
    return _mlp_hooks(model, gate_share=0.0 if model.cfg.gated_mlp else 1.0)


# The rules of each variant. A new kind of computation (e.g. a mixture-of-experts router) gets one `Rule`
# function over its hook points, added to the variants it belongs to.
RULES: dict[Variant, tuple[Rule, ...]] = {
    "attnlrp": (norm_scales_constant, attention_uniform, mlp_attnlrp, router_constant),
    "cp_lrp": (norm_scales_constant, attention_constant, mlp_cp_lrp, router_constant),
}


def lrp_hooks(model: BridgeCore, variant: Variant) -> HookList:
    """The forward hooks that turn the model's gradient into ``variant``'s relevance flow (`RULES`)."""
    return [hook for rule in RULES[variant] for hook in rule(model)]


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


def _mlp_hooks(model: BridgeCore, gate_share: float) -> HookList:
    """Identity rule on the activation, and ``gate_share`` of a gated product's gradient to the gate.

    ``hook_pre`` returns the pre-activation detached, so the model's own activation derivative never
    enters the graph; ``hook_post`` (the down projection's input) re-attaches the gradient with the
    rule's constant factors. For gated MLPs ``post = act(gate) * up``, so ``post / gate`` is
    ``(act(gate) / gate) * up``: the identity rule times the other factor, and ``up`` gets the rest
    (``1 - gate_share``). Plain MLPs give the whole share to the activation. Mixture-of-experts blocks get
    the same rule on every expert's ``hook_expert_pre`` / ``hook_expert_post`` and on the shared expert's
    ``hook_shared_pre`` / ``hook_shared_post`` (always gated).
    """
    hooks: HookList = []
    up_share = 1.0 - gate_share if model.cfg.gated_mlp else 0.0
    for post_name in points(model, "mlp.hook_post"):
        pre_name = post_name.removesuffix("hook_post") + "hook_pre"
        if pre_name in model.hook_dict:
            hooks += _identity_pair(pre_name, post_name, gate_share, up_share)
    for kind in ("expert", "shared"):
        for post_name in points(model, f"mlp.hook_{kind}_post"):
            pre_name = post_name.removesuffix(f"hook_{kind}_post") + f"hook_{kind}_pre"
            hooks += _identity_pair(pre_name, post_name, gate_share, 1.0 - gate_share)
    return hooks


def _identity_pair(pre_name: str, post_name: str, gate_share: float, up_share: float) -> HookList:
    stash: dict[str, Tensor] = {}

    def pre(x: Tensor, hook: HookPoint) -> Tensor:
        stash["pre"] = x
        return x.detach()

    def post(x: Tensor, hook: HookPoint) -> Tensor:
        a = stash.pop("pre")
        out = x.detach() + (a - a.detach()) * (gate_share * safe_ratio(x, a))
        if up_share:
            out = out + (x - x.detach()) * up_share
        return out

    return [(pre_name, pre), (post_name, post)]
