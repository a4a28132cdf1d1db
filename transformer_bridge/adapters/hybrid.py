"""Hybrid families: layers of attention and layers of a state-space or convolution mixer in one stack.

A block that holds the mixer (``hybrid.out_proj`` exists there) gets the mixer points of its kind
(`transformer_bridge.sites.mixers`) and ``hook_mixer_out``; one that holds the attention's output projection gets
the attention points, through HF's attention registry as in every family; the MLP (or mixture of experts)
points and ``hook_resid_mid`` exist where the block has an MLP. ``hook_resid_pre`` / ``hook_resid_post`` and
the norms are on every block.

- Bamba: Mamba 2 layers (``mamba``) and attention layers, every block with a gated MLP (``feed_forward``).
- Jamba: Mamba 1 layers with RMS norms on dt / B / C, attention layers without positions (no rotary), the MLP of
  every other block a mixture of experts (softmax, top-k, not renormalised; before transformers 5.21 its router is a
  plain linear map, `JAMBA_BEFORE_5_21`).
- LFM2: gated short-convolution layers (``conv``) and attention layers with per-head q/k RMS norms, a SwiGLU MLP
  (``w1`` gate, ``w3`` up, ``w2`` down) in every block.
- Nemotron-H: each block is one norm and one sublayer (``mixer``): Mamba 2, attention, a plain relu² MLP, or a
  mixture of experts (DeepSeek-style routing, non-gated experts, a shared expert inside ``hook_mlp_out``).
"""

from dataclasses import replace

from .base import LINEAR_ROUTER, SSM, MoE
from .llama import LLAMA

BAMBA = replace(
    LLAMA,
    model_types=("bamba",),
    ln_final="model.final_layernorm",
    ln2="pre_ff_layernorm",
    mlp_in="feed_forward.gate_proj",
    mlp_up="feed_forward.up_proj",
    mlp_down="feed_forward.down_proj",
    mlp_out="feed_forward",
    hybrid=SSM(
        mixer="mamba", in_proj="mamba.in_proj", out_proj="mamba.out_proj", kind="mamba2", gated_norm="mamba.norm"
    ),
)

# Jamba's router returns (logits, top-k weights, top-k indices) from transformers 5.21 on.
JAMBA = replace(
    BAMBA,
    model_types=("jamba",),
    transformers=">=5.21",
    rotary=False,
    moe=MoE(router="feed_forward.router", experts="feed_forward.experts", routing="softmax_topk_unnormalized"),
    hybrid=SSM(mixer="mamba", in_proj="mamba.in_proj", x_proj="mamba.x_proj", out_proj="mamba.out_proj",
               selection_norms=True),
)  # fmt: skip

# Before 5.21 the router was a bare linear map and the MoE block routed its logits itself (measured from 5.15).
JAMBA_BEFORE_5_21 = replace(JAMBA, moe=replace(JAMBA.moe, router_output=LINEAR_ROUTER), transformers=">=5.15,<5.21")

LFM2 = replace(
    LLAMA,
    model_types=("lfm2",),
    ln_final="model.embedding_norm",
    ln1="operator_norm",
    ln2="ffn_norm",
    o_proj="self_attn.out_proj",
    q_norm="self_attn.q_layernorm",
    k_norm="self_attn.k_layernorm",
    mlp_in="feed_forward.w1",
    mlp_up="feed_forward.w3",
    mlp_down="feed_forward.w2",
    mlp_out="feed_forward",
    hybrid=SSM(mixer="conv", in_proj="conv.in_proj", out_proj="conv.out_proj", kind="short_conv"),
)

# Nemotron-H's router returns (logits, weights, indices) from transformers 5.13 on.
NEMOTRON_H = replace(
    LLAMA,
    model_types=("nemotron_h",),
    transformers=">=5.13",
    embed="model.embeddings",
    ln_final="model.norm_f",
    ln1="norm",
    ln2=None,
    attn="mixer",
    q="mixer.q_proj",
    k="mixer.k_proj",
    v="mixer.v_proj",
    o_proj="mixer.o_proj",
    attn_out="mixer",
    mlp_in="mixer.up_proj",
    mlp_up=None,
    mlp_down="mixer.down_proj",
    mlp_out="mixer",
    rotary=False,
    moe=MoE(router="mixer.gate", experts="mixer.experts", routing="sigmoid_group_topk"),
    hybrid=SSM(
        mixer="mixer", in_proj="mixer.in_proj", out_proj="mixer.out_proj", kind="mamba2", gated_norm="mixer.norm"
    ),
)
