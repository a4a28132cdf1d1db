"""Llama layout: pre-norm RMS blocks with separate q/k/v and a gated MLP.

Shared unchanged by Llama (SmolLM2), Mistral, Qwen2, SmolLM3 (some layers without rotary), Helium,
Ministral and CWM (sliding windows), Seed-OSS and ERNIE 4.5 (biases where the config asks); with per-head
q/k norms by Qwen3 and Hunyuan (norms after rotary there); with a plain ``up → act → down`` MLP by
Arcee and Apertus (Apertus: its own norm names and q/k norms); with constant multipliers by Granite.
"""

from dataclasses import replace

from .base import Adapter

LLAMA = Adapter(
    model_types=("llama", "mistral", "qwen2", "smollm3", "helium", "ministral", "seed_oss", "ernie4_5", "cwm"),
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
HUNYUAN = replace(
    LLAMA,
    model_types=("hunyuan_v1_dense",),
    q_norm="self_attn.query_layernorm",
    k_norm="self_attn.key_layernorm",
    qk_norm_layout="head_pos",
)
ARCEE = replace(LLAMA, model_types=("arcee",), mlp_in="mlp.up_proj", mlp_up=None)
APERTUS = replace(
    ARCEE,
    model_types=("apertus",),
    ln1="attention_layernorm",
    ln2="feedforward_layernorm",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    qk_norm_layout="head_pos",
)
# Granite multiplies the embeddings, each sublayer output before the residual add, the attention scores and
# the logits by config constants. The embedding multiplier sits between `hook_embed` and the first
# `hook_resid_pre`; the attention one is HF's `scaling`; the logit one is folded into W_U / b_U.
GRANITE = replace(LLAMA, model_types=("granite",), residual_multiplier="residual_multiplier")
