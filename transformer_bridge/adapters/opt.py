"""OPT: learned positions (offset 2), MLP as ``fc1``/``fc2`` directly in the block, on flattened tokens."""

from .base import Adapter

OPT = Adapter(
    model_types=("opt",),
    embed="model.decoder.embed_tokens",
    pos_embed="model.decoder.embed_positions",
    blocks="model.decoder.layers",
    ln_final="model.decoder.final_layer_norm",
    ln1="self_attn_layer_norm",
    ln2="final_layer_norm",
    attn="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o_proj="self_attn.out_proj",
    attn_out="self_attn",
    mlp_in="fc1",
    mlp_down="fc2",
    mlp_out="fc2",
    norm="layernorm",
    rotary=False,
    positions_from_mask=True,
)
