"""Families whose HF code is a layout the bridge already knows, under another name or with one difference.

- EXAONE 3 (``exaone``), InternLM 3 (``internlm3``) and IQuest-Coder (``iquestcoder``) are model types that
  transformers builds as ``LlamaForCausalLM``; Sarvam-MLA (``sarvam_mla``) as ``DeepseekV3ForCausalLM``;
  Sarvam-MoE (``sarvam_moe``) as ``Glm4MoeForCausalLM``.
- Ministral 3 (``ministral3``): Llama's layout; its queries are scaled by a position-dependent factor (Llama 4's
  attention scale) after RoPE, so ``hook_rot_q`` includes it.
- Cohere 2 (``cohere2``): Cohere's parallel block; sliding-window layers with RoPE, global layers without
  positions (there ``hook_rot_q/k`` equal ``hook_q/k``).
- Jais 2 (``jais2``): Llama's attention with biases, LayerNorm, a plain ``up → relu² → down`` MLP.
- FlexOLMo (``flex_olmo``): OLMo 2's post-norm blocks with OLMoE's mixture of experts.
- NanoChat (``nanochat``): Llama's attention with weightless RMS norms, per-head q/k norms applied after RoPE
  (so ``hook_rot_q/k`` are the normalised rotated q/k, ``attn.q_norm.*`` sees the rotated ones), a plain
  ``fc1 → relu² → fc2`` MLP, a final logit soft-cap, and one norm module (``model.norm``) applied twice: to the
  embedding (``ln_embed.*``) and before the unembedding (``ln_final.*``).
- GLM-4 MoE (``glm4_moe``): Llama's attention (partial rotary; per-head q/k norms when ``use_qk_norm``) and
  DeepSeek-V3's mixture of experts (group routing, shared experts) after ``first_k_dense_replace`` dense blocks.
"""

from dataclasses import replace

from .base import MoE
from .deepseek import DEEPSEEK_V3
from .llama import ARCEE, LLAMA
from .parallel import COHERE
from .post_norm import OLMO2

LLAMA_NAMED = replace(LLAMA, model_types=("exaone", "internlm3", "iquestcoder", "ministral3"))
SARVAM_MLA = replace(DEEPSEEK_V3, model_types=("sarvam_mla",))
COHERE2 = replace(COHERE, model_types=("cohere2",))
NANOCHAT = replace(
    LLAMA,
    model_types=("nanochat",),
    mlp_in="mlp.fc1",
    mlp_up=None,
    mlp_down="mlp.fc2",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    qk_norm_layout="head_pos",
    embed_norm=True,
)
JAIS2 = replace(ARCEE, model_types=("jais2",), norm="layernorm")
FLEX_OLMO = replace(OLMO2, model_types=("flex_olmo",), moe=MoE(router="mlp.gate", experts="mlp.experts"))
# GLM-4 MoE's router returns (logits, weights, indices) from transformers 5.13 on (logits only before).
GLM4_MOE = replace(
    LLAMA,
    model_types=("glm4_moe", "sarvam_moe"),
    transformers=">=5.13",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    moe=DEEPSEEK_V3.moe,
)
# Youtu-LLM: DeepSeek-V3's latent attention with a dense MLP in every block.
YOUTU = replace(DEEPSEEK_V3, model_types=("youtu",), moe=None)
