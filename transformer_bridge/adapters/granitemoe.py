"""GraniteMoE: Granite's multipliers (embedding, residual, attention, logits) with a mixture of experts.

The MoE block is ``block_sparse_moe`` (router ``router``: top-k logits, softmax over them; experts in the
standard layout, so ``hook_expert_pre`` / ``hook_expert_post`` exist). ``hook_mlp_out`` is the block's
output before the residual multiplier, as for Granite.
"""

from dataclasses import replace

from .base import MoE
from .llama import GRANITE

GRANITEMOE = replace(
    GRANITE,
    model_types=("granitemoe",),
    mlp_out="block_sparse_moe",
    moe=MoE(router="block_sparse_moe.router", experts="block_sparse_moe.experts", routing="topk_softmax"),
    # Before 5.21 HF's router returned (index, weights, logits); the bridge reads (logits, weights, index).
    transformers=">=5.21",
)
