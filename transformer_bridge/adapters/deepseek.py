"""DeepSeek-V3: multi-head latent attention (`transformer_bridge.sites.mla`) and mixture-of-experts blocks.

The first ``first_k_dense_replace`` blocks have a dense Llama MLP; the others a router (sigmoid scores,
a bias-corrected group top-k: ``sigmoid_group_topk``), experts in the standard layout (so
``hook_expert_pre`` / ``hook_expert_post`` exist) and shared experts inside ``hook_mlp_out``.
"""

from dataclasses import replace

from .base import MoE
from .llama import LLAMA

DEEPSEEK_V3 = replace(
    LLAMA,
    model_types=("deepseek_v3",),
    q=None,
    k=None,
    v=None,
    mla=True,
    moe=MoE(router="mlp.gate", experts="mlp.experts", routing="sigmoid_group_topk", shared="mlp.shared_experts"),
    # HF's router holds `num_experts` (which the bridge reads) from transformers 5.13 on.
    transformers=">=5.13",
)
