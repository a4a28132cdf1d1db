"""Phi-3: fused ``qkv_proj`` ([q | k | v]) and fused ``gate_up_proj`` ([gate | up])."""

from .base import Adapter

PHI3 = Adapter(
    model_types=("phi3",),
    embed="model.embed_tokens",
    blocks="model.layers",
    ln_final="model.norm",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn="self_attn",
    qkv="self_attn.qkv_proj",
    qkv_layout="concat",
    o_proj="self_attn.o_proj",
    attn_out="self_attn",
    mlp_in="mlp.gate_up_proj",
    fused_gate_up=True,
    mlp_down="mlp.down_proj",
    mlp_out="mlp",
)
