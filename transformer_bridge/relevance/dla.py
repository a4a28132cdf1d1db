"""`dla`: direct logit attribution of each head, MLP and the embedding, read from the cache.

What it computes: the final residual stream at the predicting position is a sum of components
(embedding, position embedding, each head's output, each layer's attention-output bias, each MLP's
output). The final norm is linear once its scale is fixed, so each component is (centred for
LayerNorm and) divided by the *cached* ``ln_final`` scale, then projected on ``γ ⊙ W_U_raw[:, t]``
(minus the contrast token's direction for ``("logit_diff", c)``). Two bias terms complete the sum:
``bias:ln_final`` = ``β · W_U_raw[:, t]`` (LayerNorm families) and ``bias:unembed`` = ``b_U_raw[t]``. The
components then sum to the token's logit up to float rounding; for Gemma 2 to the logit before the
final soft-cap, with each head's output passed through the post-attention norm at its cached scale
(``blocks.L.ln1_post.hook_scale``: the norm is linear once its scale is fixed, like the final one).

Reads ``blocks.0.hook_resid_pre`` (+ ``hook_pos_embed``), ``blocks.L.attn.hook_result``,
``blocks.L.hook_mlp_out``, ``ln_final.hook_scale`` (+ ``blocks.L.ln1_post.hook_scale`` for Gemma 2).
Cost: no forward, a few small matmuls.
"""

from collections.abc import Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from ..cache import ActivationCache
from ..core import BridgeCore
from ..sites import get_module
from .cache_access import require
from .result import MethodOutput
from .targets import ExplainedToken, Target


def dla_hooks(model: BridgeCore) -> list[str]:
    """The hook points `dla` reads from the cache."""
    names = ["blocks.0.hook_resid_pre"]
    if "hook_pos_embed" in model.hook_dict:
        names.append("hook_pos_embed")
    for layer in range(model.cfg.n_layers):
        names += [f"blocks.{layer}.attn.hook_result", f"blocks.{layer}.hook_mlp_out"]
        if model.adapter.sandwich:
            names.append(f"blocks.{layer}.ln1_post.hook_scale")
    return [*names, "ln_final.hook_scale"]


def dla(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"],
    explained: Sequence[ExplainedToken],
    target: Target,
    cache: ActivationCache | None = None,
) -> MethodOutput:
    """Per-component contributions to each explained token's logit (or logit difference).

    Example:
        >>> out = dla(model, tokens, mask, explained, Target("logit"), cache)
        >>> out.scores.sum(-1)   # == the logits, up to rounding
    """
    if not target.is_linear_in_logits:
        raise ValueError(
            f"Method 'dla' attributes a linear read-out of the residual stream; `target`={str(target)!r} is not "
            "one. Use target='logit' or ('logit_diff', contrast_token)."
        )
    acts = require(cache, dla_hooks(model), "dla")
    rows = torch.tensor([e.batch_index for e in explained])
    cols = torch.tensor([e.logit_position for e in explained])

    def at(name: str) -> Tensor:
        t = acts[name]
        return t[rows.to(t.device), cols.to(t.device)].float()  # [explained, ...]

    parts, labels = _components(model, at)
    stack = torch.stack(parts)  # [component, explained, d_model]
    if model.cfg.normalization == "layernorm":
        stack = stack - stack.mean(-1, keepdim=True)
    stack = stack / at("ln_final.hook_scale")
    ids = torch.tensor([e.token_id for e in explained], device=model.device)
    direction = _direction(model, ids, target).to(stack.device)
    scores = (stack * direction).sum(-1)  # [component, explained]
    bias_rows, bias_labels = _bias_terms(model, ids, target)
    scores = torch.cat([scores, bias_rows.to(scores.device)]).T.contiguous()
    return MethodOutput(scores, values=scores.sum(-1), kind="components", labels=labels + bias_labels)


def _components(model: BridgeCore, at) -> tuple[list[Tensor], list[str]]:
    resid0 = at("blocks.0.hook_resid_pre")
    if "hook_pos_embed" in model.hook_dict:
        pos = at("hook_pos_embed").expand_as(resid0)
        parts, labels = [resid0 - pos, pos], ["embed", "pos_embed"]
    else:
        parts, labels = [resid0], ["embed"]
    blocks = get_module(model.hf_model, model.adapter.blocks)
    for layer, block in enumerate(blocks):
        heads = at(f"blocks.{layer}.attn.hook_result")  # [explained, head, d_model]
        if model.adapter.sandwich:
            gamma = 1.0 + get_module(block, model.adapter.attn_out).weight.detach().float().to(heads.device)
            heads = heads / at(f"blocks.{layer}.ln1_post.hook_scale")[:, None] * gamma
        parts += list(heads.unbind(1))
        labels += [f"L{layer}H{h}" for h in range(heads.shape[1])]
        bias = getattr(get_module(block, model.adapter.o_proj), "bias", None)
        if bias is not None:
            parts.append(bias.detach().float().to(heads.device).expand(heads.shape[0], -1))
            labels.append(f"L{layer}.attn_bias")
        parts.append(at(f"blocks.{layer}.hook_mlp_out"))
        labels.append(f"L{layer}.mlp")
    return parts, labels


def _direction(model: BridgeCore, ids: Tensor, target: Target) -> Tensor:
    direction = model.unembed_directions(ids).float()
    if target.kind == "logit_diff":
        direction = direction - model.unembed_directions(target.contrast).float()
    return direction


def _bias_terms(model: BridgeCore, ids: Tensor, target: Target) -> tuple[Tensor, list[str]]:
    rows, labels = [], []
    w = model.hf_model.get_output_embeddings().weight.detach().float()
    beta = getattr(get_module(model.hf_model, model.adapter.ln_final), "bias", None)
    if beta is not None:
        read = w[ids] - (w[target.contrast] if target.kind == "logit_diff" else 0.0)
        rows.append(read @ beta.detach().float())
        labels.append("bias:ln_final")
    b_u = getattr(model.hf_model.get_output_embeddings(), "bias", None)  # the raw bias, `b_U_raw`
    if b_u is not None:
        b = b_u.detach().float()
        rows.append(b[ids] - (b[target.contrast] if target.kind == "logit_diff" else 0.0))
        labels.append("bias:unembed")
    if not rows:
        return torch.zeros(0, len(ids)), []
    return torch.stack(rows).cpu(), labels
