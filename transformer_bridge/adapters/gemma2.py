"""Gemma 2: sandwich norms (the attention and MLP outputs are normed before the residual add)."""

from .base import Adapter

GEMMA2 = Adapter(
    model_types=("gemma2",),
    embed="model.embed_tokens",
    blocks="model.layers",
    ln_final="model.norm",
    ln1="input_layernorm",
    ln2="pre_feedforward_layernorm",
    attn="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o_proj="self_attn.o_proj",
    attn_out="post_attention_layernorm",
    mlp_in="mlp.gate_proj",
    mlp_up="mlp.up_proj",
    mlp_down="mlp.down_proj",
    mlp_out="post_feedforward_layernorm",
    norm="rms_one_plus",
    sandwich=True,
)
