"""Gemma (1), VaultGemma, Gemma 2 and Gemma 3 (text): RMS norms stored as ``w - 1``, embeddings scaled by
sqrt(d_model).

Gemma 2 and 3 add sandwich norms (the attention and MLP outputs are normed before the residual add);
Gemma 3 adds per-head q/k norms (also ``1 + w``) and alternates sliding-window and global layers.
"""

from dataclasses import replace

from .base import Adapter
from .llama import LLAMA

GEMMA = replace(LLAMA, model_types=("gemma",), norm="rms_one_plus")
# VaultGemma: Gemma 2 without the post-sublayer norms (soft-capping and sliding windows kept).
VAULTGEMMA = replace(GEMMA, model_types=("vaultgemma",), ln2="pre_feedforward_layernorm")

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

GEMMA3 = replace(
    GEMMA2,
    model_types=("gemma3_text",),
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    qk_norm_layout="head_pos",
)
