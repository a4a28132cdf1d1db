"""Mamba, Falcon-Mamba and Mamba 2: state-space families. Each block is ``norm → mixer → + residual``; no
attention, no MLP.

The hook points are those of `transformer_bridge.sites.ssm`, with the mixer points of each kind
(`transformer_bridge.sites.mixers`): no ``hook_pattern``, no q/k/v, no MLP points. The attention / MLP paths below
are placeholders the state-space sites never read, except ``mlp_down`` (the mixer's output projection), whose
input width is reported as ``cfg.d_mlp`` (the mixer's width).
"""

from dataclasses import replace

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

# Mamba 1 with weightless RMS norms on dt, B and C after the selection projection (modules from transformers 5.15 on;
# a function before, with no boundary to hook).
FALCON_MAMBA = replace(MAMBA, model_types=("falcon_mamba",), ssm=SSM(selection_norms=True), transformers=">=5.15")

# Mamba 2: one input projection [gate | x B C | dt], multi-head scan, gated RMS norm before the output projection.
MAMBA2 = replace(MAMBA, model_types=("mamba2",), ssm=SSM(kind="mamba2", gated_norm="mixer.norm"))
