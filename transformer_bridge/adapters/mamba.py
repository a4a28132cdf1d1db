"""Mamba: a state-space family. Each block is ``norm → mixer → + residual``; no attention, no MLP.

The hook points are those of `transformer_bridge.ssm` (no ``hook_pattern``, no q/k/v, no MLP points).
The attention / MLP paths below are placeholders the state-space sites never read, except ``mlp_down``
(the mixer's output projection), whose input width is reported as ``cfg.d_mlp`` (the mixer's width).
"""

from .base import SSM, Adapter

MAMBA = Adapter(
    model_types=("mamba",),
    embed="backbone.embeddings",
    blocks="backbone.layers",
    ln_final="backbone.norm_f",
    ln1="norm",
    ln2="norm",
    attn="mixer",
    o_proj="mixer.out_proj",
    attn_out="mixer",
    mlp_out="mixer",
    mlp_in="mixer.in_proj",
    mlp_down="mixer.out_proj",
    rotary=False,
    attn_registry=False,
    ssm=SSM(),
)
