"""GPT-NeoX / Pythia (fused per-head QKV, partial rotary, parallel attention and MLP by default) and Persimmon."""

from .base import Adapter

GPT_NEOX = Adapter(
    model_types=("gpt_neox",),
    embed="gpt_neox.embed_in",
    blocks="gpt_neox.layers",
    ln_final="gpt_neox.final_layer_norm",
    unembed="embed_out",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn="attention",
    qkv="attention.query_key_value",
    qkv_layout="per_head",
    o_proj="attention.dense",
    attn_out="attention",
    mlp_in="mlp.dense_h_to_4h",
    mlp_down="mlp.dense_4h_to_h",
    mlp_out="mlp",
    norm="layernorm",
    parallel_attn_mlp="use_parallel_residual",
)

# Persimmon: the same fused per-head QKV, per-head q/k LayerNorms (``qk_layernorm``), a sequential block,
# a plain ``dense_h_to_4h → relu² → dense_4h_to_h`` MLP, partial rotary.
PERSIMMON = Adapter(
    model_types=("persimmon",),
    embed="model.embed_tokens",
    blocks="model.layers",
    ln_final="model.final_layernorm",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn="self_attn",
    qkv="self_attn.query_key_value",
    qkv_layout="per_head",
    o_proj="self_attn.dense",
    attn_out="self_attn",
    mlp_in="mlp.dense_h_to_4h",
    mlp_down="mlp.dense_4h_to_h",
    mlp_out="mlp",
    norm="layernorm",
    q_norm="self_attn.q_layernorm",
    k_norm="self_attn.k_layernorm",
)
