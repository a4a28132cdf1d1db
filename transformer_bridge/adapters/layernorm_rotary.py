"""Rotary families with mean-centred LayerNorms in the Llama module layout.

StableLM (partial rotary, gated MLP; ``use_parallel_residual`` makes the block parallel), Starcoder2
(biases everywhere, a plain ``c_fc → act → c_proj`` MLP, sliding windows), OLMo (LayerNorms
without weight or bias) and Nemotron (``LayerNorm1P``: the weight stored as ``w - 1``; a plain
``up → relu² → down`` MLP; partial rotary; from transformers 5.13, where its attention moved onto HF's
attention interface).
"""

from dataclasses import replace

from .llama import LLAMA

STABLELM = replace(LLAMA, model_types=("stablelm",), norm="layernorm", parallel_attn_mlp="use_parallel_residual")
STARCODER2 = replace(
    LLAMA, model_types=("starcoder2",), norm="layernorm", mlp_in="mlp.c_fc", mlp_up=None, mlp_down="mlp.c_proj"
)
OLMO = replace(LLAMA, model_types=("olmo",), norm="layernorm")
NEMOTRON = replace(
    LLAMA,
    model_types=("nemotron",),
    norm="layernorm_one_plus",
    mlp_in="mlp.up_proj",
    mlp_up=None,
    transformers=">=5.13",
)
# Before 5.13 Nemotron's attention module called SDPA itself on key/value heads repeated per query head (so an
# edit of the rotated keys could not reach the KV cache): the adapter covers 5.13 on, older releases refuse it.
