"""Llama layout, shared by Llama (SmolLM2), Mistral, Qwen2 and (with per-head q/k norms) Qwen3."""

from dataclasses import replace

from .base import Adapter

LLAMA = Adapter(
    model_types=("llama", "mistral", "qwen2"),
    embed="model.embed_tokens",
    blocks="model.layers",
    ln_final="model.norm",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o_proj="self_attn.o_proj",
    attn_out="self_attn",
    mlp_in="mlp.gate_proj",
    mlp_up="mlp.up_proj",
    mlp_down="mlp.down_proj",
    mlp_out="mlp",
)

QWEN3 = replace(LLAMA, model_types=("qwen3",), q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
