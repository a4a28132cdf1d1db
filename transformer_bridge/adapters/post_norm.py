"""Blocks without pre-norms: ``x + norm(attn(x))``, then ``h + norm(mlp(h))`` (OLMo 2, OLMo 3, EXAONE 4).

The post-sublayer norms are the modules whose outputs are ``hook_attn_out`` / ``hook_mlp_out`` and get
``ln1_post`` / ``ln2_post`` points, as Gemma 2's sandwich norms; there are no ``ln1`` / ``ln2`` points.
OLMo's q/k norms span all heads of the projection (``flat``); EXAONE 4's are per head.
"""

from dataclasses import replace

from .llama import LLAMA

OLMO2 = replace(
    LLAMA,
    model_types=("olmo2", "olmo3"),
    ln1=None,
    ln2=None,
    attn_out="post_attention_layernorm",
    mlp_out="post_feedforward_layernorm",
    sandwich=True,
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    qk_norm_layout="flat",
)

EXAONE4 = replace(OLMO2, model_types=("exaone4",), qk_norm_layout="head_pos")
