"""Learned positions: GPT-2 (fused ``c_attn`` ([q | k | v]), Conv1D weights stored [in, out]), GPTBigCode
(the same with ``nn.Linear`` and one kv head) and GPT-Neo (local attention in alternate layers; the HF
module computes attention itself, so ``hook_pattern`` comes from the dropout after its softmax and
there are no ``hook_attn_scores``)."""

from dataclasses import replace

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

GPT_BIGCODE = replace(GPT2, model_types=("gpt_bigcode",), conv1d=False)

GPT_NEO = replace(
    GPT2,
    model_types=("gpt_neo",),
    qkv=None,
    q="attn.attention.q_proj",
    k="attn.attention.k_proj",
    v="attn.attention.v_proj",
    o_proj="attn.attention.out_proj",
    attn="attn.attention",
    conv1d=False,
    attn_registry=False,
    pattern_module="attn.attention.attn_dropout",
)
