"""GPT-2: learned positions, fused ``c_attn`` ([q | k | v]), Conv1D weights stored [in, out]."""

from .base import Adapter

GPT2 = Adapter(
    model_types=("gpt2",),
    embed="transformer.wte",
    pos_embed="transformer.wpe",
    blocks="transformer.h",
    ln_final="transformer.ln_f",
    ln1="ln_1",
    ln2="ln_2",
    attn="attn",
    qkv="attn.c_attn",
    qkv_layout="concat",
    o_proj="attn.c_proj",
    attn_out="attn",
    mlp_in="mlp.c_fc",
    mlp_down="mlp.c_proj",
    mlp_out="mlp",
    norm="layernorm",
    conv1d=True,
    rotary=False,
)
