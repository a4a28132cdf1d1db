"""GraniteMoE: Granite's multipliers (embedding, residual, attention, logits) with a mixture of experts.

The MoE block is ``block_sparse_moe`` (router ``router``: top-k logits, softmax over them; experts in the
standard layout, so ``hook_expert_pre`` / ``hook_expert_post`` exist). ``hook_mlp_out`` is the block's
output before the residual multiplier, as for Granite. Before transformers 5.21 the router returned its three
tensors in another order (`GRANITEMOE_BEFORE_5_21`).
"""

from dataclasses import replace

from .base import MoE
from .llama import GRANITE

GRANITEMOE = replace(
    GRANITE,
    model_types=("granitemoe",),
    mlp_out="block_sparse_moe",
    moe=MoE(router="block_sparse_moe.router", experts="block_sparse_moe.experts", routing="topk_softmax"),
    transformers=">=5.21",
)

# Before 5.21 HF's router returned the same three tensors in the other order: (index, weights, logits). Measured from
# 5.15 (the router module is there from 5.13; 5.10 and before route inside the MoE block).
GRANITEMOE_BEFORE_5_21 = replace(
    GRANITEMOE,
    moe=replace(GRANITEMOE.moe, router_output=("indices", "weights", "logits")),
    transformers=">=5.15,<5.21",
)
