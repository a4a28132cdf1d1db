"""Parallel blocks where one norm feeds both attention and the MLP: ``x + attn(ln(x)) + mlp(ln(x))``.

Phi (phi-2: partial rotary, biases), Cohere (LayerNorm without bias; logits multiplied by
``logit_scale``), GPT-J (through HF's attention registry from transformers 5.24; before, the HF module
computed attention itself and ``hook_pattern`` came from the dropout after its softmax) and Falcon (fused
multi-query ``query_key_value``; the HF module calls SDPA itself, so the attention points come from that
call, see `attention.SdpaSite`; ``parallel_attn=False`` gives a sequential block with a second norm).
These blocks have no ``ln2`` and no ``hook_resid_mid``.
"""

from dataclasses import replace

from .base import Adapter
from .llama import LLAMA

PHI = Adapter(
    model_types=("phi",),
    embed="model.embed_tokens",
    blocks="model.layers",
    ln_final="model.final_layernorm",
    ln1="input_layernorm",
    ln2=None,
    attn="self_attn",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    o_proj="self_attn.dense",
    attn_out="self_attn",
    mlp_in="mlp.fc1",
    mlp_down="mlp.fc2",
    mlp_out="mlp",
    norm="layernorm",
    parallel_attn_mlp=True,
)

COHERE = replace(LLAMA, model_types=("cohere",), ln2=None, norm="layernorm", parallel_attn_mlp=True)

# From transformers 5.24 GPT-J calls attention through HF's registry: the full attention point set.
GPTJ = Adapter(
    model_types=("gptj",),
    embed="transformer.wte",
    blocks="transformer.h",
    ln_final="transformer.ln_f",
    ln1="ln_1",
    ln2=None,
    attn="attn",
    q="attn.q_proj",
    k="attn.k_proj",
    v="attn.v_proj",
    o_proj="attn.out_proj",
    attn_out="attn",
    mlp_in="mlp.fc_in",
    mlp_down="mlp.fc_out",
    mlp_out="mlp",
    norm="layernorm",
    parallel_attn_mlp=True,
    transformers=">=5.24",
)

# Before 5.24 the HF module computed attention itself: the pattern is the output of the dropout after its
# softmax; no rotated q/k or scores.
GPTJ_BEFORE_5_24 = replace(GPTJ, attn_registry=False, pattern_module="attn.attn_dropout", transformers="<5.24")

# Falcon-7B's layout (`multi_query=True`, `new_decoder_architecture=False`): [q heads | one k | one v].
FALCON = Adapter(
    model_types=("falcon",),
    embed="transformer.word_embeddings",
    blocks="transformer.h",
    ln_final="transformer.ln_f",
    ln1="input_layernorm",
    ln2="post_attention_layernorm",
    attn="self_attention",
    qkv="self_attention.query_key_value",
    qkv_layout="concat",
    o_proj="self_attention.dense",
    attn_out="self_attention",
    mlp_in="mlp.dense_h_to_4h",
    mlp_down="mlp.dense_4h_to_h",
    mlp_out="mlp",
    norm="layernorm",
    parallel_attn_mlp="parallel_attn",
    attn_registry=False,
    sdpa_call=True,
    mlp_out_mutated=True,
)
