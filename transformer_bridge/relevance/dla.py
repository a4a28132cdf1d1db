"""`dla`: direct logit attribution of each head, MLP and the embedding, read from the cache.

What it computes: the final residual stream at the predicting position is a sum of components
(embedding, position embedding, each head's output, each layer's attention-output bias, each MLP's
output): `transformer_bridge.decompose.components`, the decomposition the cache's TransformerLens
methods also use. The final norm is linear once its scale is fixed, so each component is (centred for
LayerNorm and) divided by the *cached* ``ln_final`` scale, then projected on ``γ ⊙ W_U_raw[:, t]``
(minus the contrast token's direction for ``("logit_diff", c)``; times Cohere's logit scale). Two bias
terms complete the sum: ``bias:ln_final`` = ``β · W_U_raw[:, t]`` (a final norm with a bias) and
``bias:unembed`` = ``b_U_raw[t]``. The components then sum to the token's logit up to float rounding;
for Gemma 2 to the logit before the final soft-cap. Behind a sandwich norm (Gemma 2 and 3, OLMo 2,
GLM-4) each head's output and bias pass through the post-attention norm at its cached scale
(``blocks.L.ln1_post.hook_scale``). A mixture-of-experts MLP is one component (``L0.mlp``); when the cache
also holds each expert's output (``blocks.L.mlp.hook_expert_result``, e.g. ``names_filter=None``) it is
split into ``L0E0`` … (one per expert; 0 where the token was not routed there) and ``L0.mlp_rest`` (a
shared expert). A state-space (Mamba) block is one component, its mixer's output ``hook_mixer_out``
(``L0.mixer``). Reads `dla_hooks` (+ `expert_hooks` when cached). Cost: no forward, a few small matmuls.
"""

import torch
from torch import Tensor

from ..core import BridgeCore
from ..decompose import (
    Activations,
    Component,
    components,
    expert_result_name,
    has_experts,
    logit_attributions,
    logit_direction,
    post_norm_scale_name,
    readout_biases,
)
from .cache_access import require
from .protocol import Method, Request
from .result import MethodOutput


def dla_hooks(model: BridgeCore) -> list[str]:
    """The hook points `dla` needs from the cache."""
    names = ["blocks.0.hook_resid_pre"]
    if "hook_pos_embed" in model.hook_dict:
        names.append("hook_pos_embed")
    for layer in range(model.cfg.n_layers):
        if model.adapter.ssm is not None:  # Mamba: each block adds its mixer's output
            names.append(f"blocks.{layer}.hook_mixer_out")
            continue
        names += [f"blocks.{layer}.attn.hook_result", f"blocks.{layer}.hook_mlp_out"]
        if model.adapter.sandwich:
            names.append(post_norm_scale_name(layer, "attn"))
    return [*names, "ln_final.hook_scale"]


def expert_hooks(model: BridgeCore) -> list[str]:
    """The hook points that, when cached too, make `dla` split each mixture-of-experts MLP by expert."""
    names = []
    for layer in range(model.cfg.n_layers):
        if has_experts(model, layer) and expert_result_name(layer) in model.hook_dict:
            names.append(expert_result_name(layer))
            if model.adapter.sandwich:
                names.append(post_norm_scale_name(layer, "mlp"))
    return names


def dla(request: Request) -> MethodOutput:
    """Per-component contributions to each explained token's logit (or logit difference).

    Example:
        >>> out = dla(Request(model, tokens, mask, explained, Target("logit"), cache))
        >>> out.scores.sum(-1)   # == the logits, up to rounding
    """
    model, explained, target = request.model, request.explained, request.target
    if not target.is_linear_in_logits:
        raise ValueError(
            f"Method 'dla' attributes a linear read-out of the residual stream; `target`={str(target)!r} is not "
            "one. Use target='logit' or ('logit_diff', contrast_token)."
        )
    cached = require(request.cache, dla_hooks(model), "dla")
    split = expert_hooks(model)
    experts = bool(split) and all(name in request.cache for name in split)  # `require` found the cache
    cached.update({name: request.cache[name] for name in split} if experts else {})
    rows = torch.tensor([e.batch_index for e in explained])
    cols = torch.tensor([e.logit_position for e in explained])

    def at(name: str) -> Tensor:
        t = cached[name]
        return t[rows.to(t.device), cols.to(t.device)].float()  # [explained, ...]

    acts = Activations(at, cached.__contains__)
    parts, comps = components(model, acts, model.cfg.n_layers, heads=True, experts=experts)
    ids = torch.tensor([e.token_id for e in explained], device=model.device)
    direction = logit_direction(model, ids, target.contrast).float()
    scores = logit_attributions(model, parts, direction, at("ln_final.hook_scale"))
    bias_rows, bias_labels = readout_biases(model, ids, target.contrast)
    scores = torch.cat([scores, bias_rows.to(scores.device)]).T.contiguous()  # [explained, component]
    labels = [label(c) for c in comps] + bias_labels
    return MethodOutput(scores, values=scores.sum(-1), kind="components", labels=labels)


def label(component: Component) -> str:
    """The label `dla` gives a component: ``embed``, ``pos_embed``, ``L0H3``, ``L0.attn_bias``, ``L0.mlp``,
    and for a mixture of experts split by expert ``L0E5`` (expert 5) and ``L0.mlp_rest`` (a shared expert);
    ``L0.mixer`` for a state-space block."""
    kind, layer = component.kind, component.layer
    if kind in ("embed", "pos_embed"):
        return kind
    if kind == "mixer_out":
        return f"L{layer}.mixer"
    if kind in ("head", "expert"):
        return f"L{layer}{'H' if kind == 'head' else 'E'}{component.index}"
    return f"L{layer}.{'mlp' if kind == 'mlp_out' else kind}"


DLA = Method(
    "dla",
    dla,
    "direct logit attribution per head, MLP and embedding",
    reads=lambda model, options: dla_hooks(model),
)
