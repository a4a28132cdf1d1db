"""GPT-OSS: Llama layout with attention sinks and biased projections; every block a mixture of experts.

The router (``mlp.router``, with a bias) keeps the top-k logits and softmaxes over them. Attention
sinks (one learned logit per head) take part in the softmax and are dropped, so a row of
``hook_pattern`` sums to less than 1. Layers alternate sliding-window and full attention.
"""

from dataclasses import replace

from .base import MoE
from .llama import LLAMA

GPT_OSS = replace(
    LLAMA,
    model_types=("gpt_oss",),
    moe=MoE(router="mlp.router", experts="mlp.experts", routing="topk_softmax"),
)
