"""Mixture-of-experts families with the Llama layout: Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE, OLMoE.

The MLP is a router (``mlp.gate``) and an experts module (``mlp.experts``); see `transformer_bridge.sites.moe`
for the hook points. Qwen2-MoE's dense blocks (``mlp_only_layers``) keep the Llama MLP points.
"""

from dataclasses import replace

from .base import MoE
from .llama import LLAMA, QWEN3

_ROUTED = MoE(router="mlp.gate", experts="mlp.experts", routing="softmax_topk")

MIXTRAL = replace(LLAMA, model_types=("mixtral",), moe=_ROUTED)
QWEN2_MOE = replace(
    LLAMA,
    model_types=("qwen2_moe",),
    moe=replace(_ROUTED, shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate"),
)
QWEN3_MOE = replace(QWEN3, model_types=("qwen3_moe",), moe=_ROUTED)
# OLMoE's q/k norms span all heads at once ([pos, head * d_head]), so they get no per-head norm points;
# hook_q / hook_k are the projections' outputs before that norm.
OLMOE = replace(LLAMA, model_types=("olmoe",), moe=_ROUTED)
