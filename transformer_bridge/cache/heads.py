"""Per-head and per-neuron results from a cache: TransformerLens' ``compute_head_results``, ``stack_head_results``,
``get_neuron_results`` and ``stack_neuron_results``, as functions of a cache whose model is a bridge (the cache
exposes them as methods). A head's result is its ``hook_z`` through its slice of ``W_O`` and a neuron's is its
activation times its output weight, each read into the residual stream as `analysis` reads whole sublayers
(through a post-sublayer norm at its cached scale where the family has one).
"""

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from .analysis import (
    Cache,
    Sublayer,
    _is_bridge,
    _scale_name,
    acts_of,
    logger,
    mlp_reads_attn,
    model_of,
    project,
    resid_at,
    resolve_layer,
    stack_layer,
)
from .decompose import (
    head_outputs,
    out_weight,
    to_resid,
    z_to_result,
)


def _to_resid(
    cache: Cache, model: Any, layer: int, which: Sublayer, x: Tensor, pos_slice: Any, per_part: bool
) -> Tensor:
    """What ``x``, a part of ``layer``'s attention or MLP output, adds to the residual stream (`decompose.to_resid`)."""
    return to_resid(model, acts_of(cache, pos_slice, f"The {which} decomposition"), layer, which, x, per_part)


def _matched(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(x.dtype, weight.dtype)
    return x.to(dtype), weight.detach().to(x.device, dtype)


# -- heads ------------------------------------------------------------------------------------
def compute_head_results(cache: Cache) -> None:
    """Store ``blocks.L.attn.hook_result`` for every layer whose ``hook_z`` is cached and result is not.

    A cached result with the wrong rank or head count (left by an edit of the cache) is recomputed; if every
    layer's result is already cached and well formed, nothing is computed and TransformerLens' warning is logged.
    The model is duck-typed like TransformerLens': a bridge, or anything with ``cfg.n_layers``, ``cfg.n_heads``
    and ``blocks[L].attn.W_O`` (``[head, d_head, d_model]``, used as given, so gradients reach it).
    """
    if not _fill_head_results(cache, cache._need_model()):
        logger.warning("Tried to compute head results when they were already cached")


def _fill_head_results(cache: Cache, model: Any) -> bool:
    """Compute the missing or malformed ``hook_result`` of each layer; False if there was none to compute."""
    n_heads = model.cfg.n_heads
    rank = 4 if cache.has_batch_dim else 3
    todo = []
    for layer in range(model.cfg.n_layers):
        old = cache.cache_dict.get(f"blocks.{layer}.attn.hook_result")
        if old is None or old.dim() != rank or old.shape[-2] != n_heads:
            todo.append(layer)
    if not todo:
        return False
    for layer in todo:
        z = cache._get(f"blocks.{layer}.attn.hook_z", "compute_head_results")
        if _is_bridge(model):
            result = z_to_result(model, layer, z)
        else:  # TransformerLens' duck-typed model: W_O [head, d_head, d_model] as the model gives it
            weight = model.blocks[layer].attn.W_O
            dtype = torch.promote_types(z.dtype, weight.dtype)
            result = torch.einsum("...hd,hdm->...hm", z.to(dtype), weight.to(z.device, dtype))
        cache.cache_dict[f"blocks.{layer}.attn.hook_result"] = result
    return True


def head_results(cache: Cache, layer: int, pos_slice: Any = None) -> Float[Tensor, "... pos head d_model"]:
    """Each head's contribution to the residual stream in ``layer`` (``hook_result``, or computed from ``hook_z``)."""
    return head_outputs(model_of(cache), acts_of(cache, pos_slice, "Head results (hook_result is not cached)"), layer)


def stack_head_results(
    cache: Cache,
    layer: int | None = -1,
    return_labels: bool = False,
    incl_remainder: bool = False,
    pos_slice: Any = None,
    apply_ln: bool = False,
) -> Float[Tensor, "component ... pos d_model"] | tuple[Tensor, list[str]]:
    """Every head's contribution before ``layer``; see `ActivationCache.stack_head_results`."""
    model = model_of(cache)
    layer = stack_layer(layer, model.cfg.n_layers, incl_remainder)
    if all(f"blocks.{i}.attn.hook_z" in cache.cache_dict for i in range(model.cfg.n_layers)):
        _fill_head_results(cache, model)  # stored like TransformerLens does, so later calls reuse them
    parts = [head_results(cache, i, pos_slice).movedim(-2, 0) for i in range(layer)]
    labels = [f"L{i}H{h}" for i in range(layer) for h in range(model.cfg.n_heads)]
    return _finish(cache, parts, labels, layer, False, incl_remainder, pos_slice, apply_ln, return_labels)


# -- neurons ----------------------------------------------------------------------------------
def get_neuron_results(
    cache: Cache, layer: int, neuron_slice: Any = None, pos_slice: Any = None, project_output_onto: Any = None
) -> Float[Tensor, "... pos neuron d_model"]:
    """Each neuron's contribution ``hook_post[n] * W_out[n]`` in block ``layer``; see the cache method."""
    model = model_of(cache)
    layer = resolve_layer(layer, model.cfg.n_layers, final=False)
    post = cache._at_pos(cache._get(f"blocks.{layer}.mlp.hook_post", "get_neuron_results"), pos_slice)
    post, weight = _matched(post, out_weight(model, layer))
    one = False
    if neuron_slice is not None:  # an int drops the neuron axis (TL), computed as a one-neuron list
        chosen = cache._select(torch.arange(post.shape[-1]), neuron_slice, 0, "neuron_slice")
        one, chosen = chosen.dim() == 0, chosen.reshape(-1)
        post, weight = post.index_select(-1, chosen.to(post.device)), weight.index_select(0, chosen.to(weight.device))
    out = _to_resid(cache, model, layer, "mlp", post[..., None] * weight, pos_slice, per_part=True)
    return project(out.squeeze(-2) if one else out, project_output_onto)


def stack_neuron_results(
    cache: Cache,
    layer: int | None,
    pos_slice: Any = None,
    neuron_slice: Any = None,
    return_labels: bool = False,
    incl_remainder: bool = False,
    apply_ln: bool = False,
    mlp_input: bool = False,
    project_output_onto: Any = None,
) -> Float[Tensor, "component ... pos d_model"] | tuple[Tensor, list[str]]:
    """Every neuron's contribution before ``layer``; see `ActivationCache.stack_neuron_results`."""
    model = model_of(cache)
    layer = stack_layer(layer, model.cfg.n_layers, incl_remainder)
    neurons = torch.arange(model.cfg.d_mlp)
    if neuron_slice is not None:
        neurons = cache._select(neurons, neuron_slice, 0, "neuron_slice").reshape(-1)
        neuron_slice = neurons.tolist()  # one neuron per layer is still a component axis here
    labels = [f"L{i}N{n}" for i in range(layer) for n in neurons.tolist()]
    if project_output_onto is not None and not incl_remainder and not model.adapter.sandwich:
        return _projected_neurons(cache, model, layer, neuron_slice, pos_slice, apply_ln, mlp_input,
                                  project_output_onto, labels, return_labels)  # fmt: skip
    parts = [get_neuron_results(cache, i, neuron_slice, pos_slice).movedim(-2, 0) for i in range(layer)]
    out = _finish(cache, parts, labels, layer, mlp_input, incl_remainder, pos_slice, apply_ln, return_labels)
    return project(out, project_output_onto)


def _projected_neurons(
    cache: Cache, model: Any, layer: int, neuron_slice: Any, pos_slice: Any, apply_ln: bool, mlp_input: bool,
    direction: Any, labels: list[str], return_labels: bool,
) -> Tensor | tuple[Tensor, list[str]]:  # fmt: skip
    """`stack_neuron_results(..., project_output_onto=direction)` without the ``[neuron, ..., d_model]`` stack:
    neuron ``n`` adds ``post_n * W_out[n]``, so its projection is ``post_n * (W_out[n] @ direction)``; with
    ``apply_ln`` the frozen norm is linear too: ``(x @ d - mean(x) * sum(d)) / scale`` (the mean for LayerNorm)."""
    if not isinstance(direction, Tensor) or direction.dim() not in (1, 2) or direction.shape[0] != model.cfg.d_model:
        return project(torch.zeros(0, model.cfg.d_model), direction)  # raises the projection's error
    mlp_reads_attn(model, layer, mlp_input)
    multiplier = model.adapter.residual_scale(model.hf_model.config)  # Granite's residual_multiplier
    parts = []
    for i in range(layer):
        post = cache._at_pos(cache._get(f"blocks.{i}.mlp.hook_post", "stack_neuron_results"), pos_slice)
        post, weight = _matched(post, out_weight(model, i))
        if neuron_slice is not None:
            chosen = torch.as_tensor(neuron_slice, device=post.device)
            post, weight = post.index_select(-1, chosen), weight.index_select(0, chosen.to(weight.device))
        d = direction.to(weight.device, weight.dtype)
        per_neuron = weight @ d  # [neuron] or [neuron, k]
        if apply_ln and model.cfg.normalization == "layernorm":
            mean = weight.mean(-1)
            per_neuron = per_neuron - (mean * d.sum() if d.dim() == 1 else mean[:, None] * d.sum(0))
        per_neuron = (per_neuron * multiplier if multiplier != 1.0 else per_neuron).to(post.device)
        parts.append(
            (post * per_neuron).movedim(-1, 0) if d.dim() == 1 else (post[..., None] * per_neuron).movedim(-2, 0)
        )
    name = _scale_name(model, layer, mlp_input) if apply_ln else None
    if parts:
        stack = torch.cat(parts)
    else:  # layer 0: no neurons, in the dtype a later layer's stack has (the weights' and scale's promotion)
        target = resid_at(cache, layer, mlp_reads_attn(model, layer, mlp_input), pos_slice, "An empty stack")
        try:
            dtype = torch.promote_types(target.dtype, out_weight(model, 0).dtype)
        except ValueError:  # a mixture of experts has no W_out (nor neurons to stack)
            dtype = target.dtype
        stack = target.new_zeros((0, *target.shape[:-1], *direction.shape[1:]), dtype=dtype)
    if name is not None:
        scale = cache._at_pos(cache._get(name, "apply_ln"), pos_slice).to(stack.device)
        stack = stack / (scale[..., 0] if direction.dim() == 1 else scale)
    return (stack, labels) if return_labels else stack


def _finish(
    cache: Cache,
    parts: list[Tensor],
    labels: list[str],
    layer: int,
    mlp_input: bool,
    incl_remainder: bool,
    pos_slice: Any,
    apply_ln: bool,
    return_labels: bool,
) -> Tensor | tuple[Tensor, list[str]]:
    """Stack ``parts``, add the remainder up to the residual that ``layer`` reads, apply the norm's scale.

    With no parts at ``layer=0``, the remainder is the whole model (TransformerLens 4.3's contract): the final
    residual stream, read by the final norm (the MLP input ``resid_mid[0]`` with ``mlp_input``)."""
    if incl_remainder and layer == 0 and not mlp_input:
        layer = cache.model.cfg.n_layers
    target = None
    if incl_remainder or not parts:
        mid = mlp_reads_attn(cache.model, layer, mlp_input)
        target = resid_at(cache, layer, mid, pos_slice, "The remainder" if incl_remainder else "An empty stack")
    stack = torch.cat(parts) if parts else target.new_zeros((0, *target.shape))
    if incl_remainder:
        stack = torch.cat([stack, (target - stack.sum(0))[None]])
        labels = [*labels, "remainder"]
    if apply_ln:
        stack = cache.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
    return (stack, labels) if return_labels else stack
