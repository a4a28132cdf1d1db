"""Llama 4 (text): chunked attention, layers without rotary (NoPE), and mixture-of-experts blocks.

The MoE block (``feed_forward``) has a router whose dense scores are the sigmoid of the top-k logits
(the other experts get 0), experts that run on the input already scaled by those scores, and a
shared expert added to their sum. Dense blocks (``moe_layers``) keep the Llama MLP points. Its q/k
L2 norm has no weight and gets no hook points: ``hook_q`` / ``hook_k`` are the projections' outputs.
"""

from dataclasses import replace

from .base import MoE
from .llama import LLAMA

LLAMA4 = replace(
    LLAMA,
    model_types=("llama4_text",),
    mlp_in="feed_forward.gate_proj",
    mlp_up="feed_forward.up_proj",
    mlp_down="feed_forward.down_proj",
    mlp_out="feed_forward",
    moe=MoE(
        router="feed_forward.router",
        experts="feed_forward.experts",
        routing="topk_sigmoid",
        dense=True,
        shared="feed_forward.shared_expert",
    ),
)
