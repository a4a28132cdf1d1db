"""GLM and GLM-4: separate q/k/v with biases, fused ``gate_up_proj`` ([gate | up]), partial rotary.

GLM-4 adds sandwich norms: ``post_self_attn_layernorm`` and ``post_mlp_layernorm`` norm the sublayer
outputs before the residual add (its ``post_attention_layernorm`` is the norm before the MLP).
"""

from dataclasses import replace

from .base import Adapter

GLM = Adapter(
    model_types=("glm",),
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
    mlp_in="mlp.gate_up_proj",
    fused_gate_up=True,
    mlp_down="mlp.down_proj",
    mlp_out="mlp",
)

GLM4 = replace(
    GLM, model_types=("glm4",), attn_out="post_self_attn_layernorm", mlp_out="post_mlp_layernorm", sandwich=True
)
