"""`dla`: direct logit attribution of each head, MLP and the embedding, read from the cache.

What it computes: the final residual stream at the predicting position is a sum of components
(embedding, position embedding, each head's output, each layer's attention-output bias, each MLP's
output): `transformer_bridge.cache.decompose.components`, the decomposition the cache's TransformerLens
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
(``L0.mixer``).

Under hooks that edit the forward (a steering vector added at ``blocks.10.hook_resid_post``, an ablation of a
residual point), the edit is in no block's output. `dla` then lists it as its own component,
``edit:blocks.10.hook_resid_post`` (found between consecutive cached residual points; ``edit:unlocated`` when
those points are not cached), so the components still sum to the logit of the forward that was cached, and
``values`` is that logit, read from the cached final residual stream: the sum is checked, not assumed.
Edits inside a block (``hook_z``, ``hook_pattern``, ``hook_mlp_out`` …) are already in the outputs the components
read. Reads `dla_required` (+ `resid_points` and `expert_hooks` when cached; `dla_hooks` lists them all).
Cost: no forward, a few small matmuls.
"""

import torch
from torch import Tensor

from ..cache.decompose import (
    Activations,
    Component,
    components,
    edit_label,
    expert_result_name,
    has_experts,
    logit_attributions,
    logit_direction,
    post_norm_scale_name,
    readout_biases,
)
from ..core import BridgeCore
from .cache_access import require
from .protocol import Method, Request
from .result import MethodOutput


def dla_hooks(model: BridgeCore) -> list[str]:
    """The hook points `dla` reads from the cache: the components (`dla_required`), then the residual points that
    let it check the components against the forward and place a hook's edit of the stream (`resid_points`)."""
    required = dla_required(model)
    return [*required, *(n for n in resid_points(model) if n not in required)]


def dla_required(model: BridgeCore) -> list[str]:
    """The hook points without which `dla` cannot run: the embedding, each head (or mixer) and MLP output, the
    sandwich norms' scales and the final norm's scale."""
    names = ["blocks.0.hook_resid_pre"]
    if "hook_pos_embed" in model.hook_dict:
        names.append("hook_pos_embed")
    for layer in range(model.cfg.n_layers):
        # Per block, what it holds: a mixer's output (Mamba, a hybrid's mixer layers) or the heads', and the MLP's.
        # Heads from ``hook_z`` and the output projection, as TransformerLens (``hook_result`` is on demand).
        parts = ("hook_mixer_out", "attn.hook_z", "hook_mlp_out")
        names += [f"blocks.{layer}.{part}" for part in parts if f"blocks.{layer}.{part}" in model.hook_dict]
        if model.adapter.sandwich:
            names.append(post_norm_scale_name(layer, "attn"))
    return [*names, "ln_final.hook_scale"]


def resid_points(model: BridgeCore) -> list[str]:
    """Every residual-stream point (``hook_resid_pre`` / ``mid`` / ``post`` of each block), the final norm's output
    and ``hook_embed`` (which names the tokens of a cache that came without them), where the model has them."""
    names = ["hook_embed"]
    for layer in range(model.cfg.n_layers):
        names += [f"blocks.{layer}.hook_resid_{where}" for where in ("pre", "mid", "post")]
    names.append("ln_final.hook_normalized")
    return [n for n in names if n in model.hook_dict]


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

    When hooks edited the residual stream during the cached forward (steering, ablation), each edit is its
    own component (``edit:blocks.10.hook_resid_post``), so the components still sum to the logit that forward
    computed. ``values`` is that logit, read from the cached final residual stream (and the final norm's
    output, when cached); ``conservation_error`` is ``|Σ components − logit| / |logit|``. A cache without the
    final residual stream cannot be checked: ``values`` is then None and ``extras["checked"]`` False.

    Example:
        >>> out = dla(Request(model, tokens, mask, explained, Target("logit"), cache))
        >>> out.scores.sum(-1)   # == out.values, the logits, up to rounding
    """
    model, explained, target, cache = request.model, request.explained, request.target, request.cache
    if not target.is_linear_in_logits:
        raise ValueError(
            f"Method 'dla' attributes a linear read-out of the residual stream; `target`={str(target)!r} is not "
            "one. Use target='logit' or ('logit_diff', contrast_token)."
        )
    cached = require(cache, dla_required(model), "dla")
    split = expert_hooks(model)
    experts = bool(split) and all(name in cache for name in split)  # `require` found the cache
    names = (split if experts else []) + [n for n in resid_points(model) if n in cache]
    cached.update({name: cache[name] for name in names})
    rows = torch.tensor([e.batch_index for e in explained])
    cols = torch.tensor([e.logit_position for e in explained])

    def at(name: str) -> Tensor:
        t = cached[name]
        return t[rows.to(t.device), cols.to(t.device)].float()  # [explained, ...]

    acts = Activations(at, cached.__contains__)
    n = model.cfg.n_layers
    parts, comps = components(model, acts, n, heads=True, experts=experts, edits=True)
    ids = torch.tensor([e.token_id for e in explained], device=model.device)
    direction = logit_direction(model, ids, target.contrast).float()
    scale = at("ln_final.hook_scale")
    scores = logit_attributions(model, parts, direction, scale)
    bias_rows, bias_labels = readout_biases(model, ids, target.contrast)
    labels = [label(c) for c in comps] + bias_labels
    scores = torch.cat([scores, bias_rows.to(scores.device)])  # [component, explained]
    final = f"blocks.{n - 1}.hook_resid_post"
    values = None
    if acts.has(final):
        values = logit_attributions(model, acts.get(final)[None], direction, scale)[0] + bias_rows.sum(0).to(scores)
        if acts.has("ln_final.hook_normalized"):  # an edit of the final norm's output is one more component
            normalized = (acts.get("ln_final.hook_normalized") * direction).sum(-1) + bias_rows.sum(0).to(scores)
            scores, labels = _with_edit(scores, labels, normalized - values, "ln_final.hook_normalized", normalized)
            values = normalized
    scores = scores.T.contiguous()  # [explained, component]
    error = None if values is None else (scores.sum(-1) - values).abs() / values.abs().clamp_min(1e-12)
    extras = {"checked": values is not None}
    return MethodOutput(scores, values=values, conservation_error=error, kind="components", labels=labels,
                        extras=extras)  # fmt: skip


def _with_edit(scores: Tensor, labels: list[str], gap: Tensor, point: str, total: Tensor) -> tuple[Tensor, list[str]]:
    """``scores`` (``[component, explained]``) with ``gap`` as the component ``edit:<point>`` when it is larger than
    rounding (relative to ``total``)."""
    if not bool((gap.abs() > 1e-5 * total.abs().clamp_min(1.0)).any()):
        return scores, labels
    return torch.cat([scores, gap[None]]), [*labels, edit_label(point)]


def label(component: Component) -> str:
    """The label `dla` gives a component: ``embed``, ``pos_embed``, ``L0H3``, ``L0.attn_bias``, ``L0.mlp``,
    and for a mixture of experts split by expert ``L0E5`` (expert 5) and ``L0.mlp_rest`` (a shared expert);
    ``L0.mixer`` for a state-space block; ``edit:blocks.10.hook_resid_post`` for what a hook added to the stream."""
    kind, layer = component.kind, component.layer
    if kind == "edit":
        return edit_label(component.point)
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
