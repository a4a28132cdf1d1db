"""The analysis behind `ActivationCache`'s TransformerLens methods: residual stacks and decompositions.

`accumulated_resid`, `decompose_resid`, per-head and per-neuron results, biases, the full residual
decomposition, `apply_ln_to_stack` and `logit_attrs`, as functions of a cache whose model is a
bridge; the cache exposes them as methods (``cache.stack_head_results(...)``). ``cache.py`` imports
this module, so this one reaches the cache only through the object it is given; weights come from
the HF modules the adapter names. The parts themselves (embeddings, heads, neurons, MLP outputs, biases)
come from `decompose.components`, the decomposition the ``dla`` relevance method also reads.

Every component is what a block adds to the residual stream, so a decomposition sums to the
residual it decomposes up to float rounding, on every family. Gemma 2 normalises the attention and
MLP outputs before the residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``).
A norm is linear once its scale is fixed, so there a head's or a neuron's contribution is its output
divided by the cached scale (``blocks.L.ln1_post.hook_scale`` / ``ln2_post.hook_scale``) times the
norm's weight: the frozen-scale reading `apply_ln_to_stack` and the ``dla`` relevance method use.
``hook_result`` itself stays what the hook point shows: the head's output before that norm.
"""

import logging
import operator
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from .checks import ArgumentIndexError, ArgumentTypeError, describe
from .decompose import (
    Activations,
    Group,
    component_groups,
    edit_label,
    head_outputs,
    logit_attributions,
    logit_direction,
    out_weight,
    stack_groups,
    to_resid,
    z_to_result,
)
from .sites import get_module

Cache = Any  # an `ActivationCache`; not imported, since cache.py imports this module
Sublayer = Literal["attn", "mlp"]
logger = logging.getLogger(__name__)


def resolve_layer(layer: Any, n_layers: int, param: str = "layer", final: bool = True) -> int:
    """``layer`` as an index in ``0..n_layers`` (``final``) or ``0..n_layers - 1``; None is the last one.

    With ``final``, ``n_layers`` (and -1) is the stream after the last block, read by the final norm,
    as in TransformerLens. Negative values count from the end.

    Example:
        >>> resolve_layer(-1, 12), resolve_layer(-1, 12, final=False)
        (12, 11)
    """
    top = n_layers if final else n_layers - 1
    if layer is None:
        return top
    if isinstance(layer, bool) or not hasattr(layer, "__index__"):
        raise ArgumentTypeError(f"`{param}` must be an int or None, got {describe(layer)}.")
    index = operator.index(layer)
    if not -(top + 1) <= index <= top:
        what = " (n_layers, -1 or None: the input of the final norm)" if final else ""
        raise ArgumentIndexError(
            f"`{param}`={index} is out of range: this model has {n_layers} layers, so `{param}` must be in "
            f"0..{top} or -{top + 1}..-1{what}."
        )
    return index % (top + 1)


def stack_layer(layer: Any, n_layers: int, incl_remainder: bool) -> int:
    """A stack's ``layer`` (TransformerLens 4.3): -1 / None is ``n_layers``, other negatives count from the end,
    but are refused with ``incl_remainder`` (whose ``layer=0`` is the whole model, see `stack_head_results`)."""
    if incl_remainder and not isinstance(layer, bool) and hasattr(layer, "__index__") and operator.index(layer) < -1:
        raise ArgumentIndexError(
            f"`layer`={operator.index(layer)} with incl_remainder=True: the layer must be 0..{n_layers} (or -1 / "
            f"None for {n_layers}, the final residual stream); layer 0's remainder is the whole model."
        )
    return resolve_layer(layer, n_layers)


def mlp_reads_attn(model: Any, layer: int, mlp_input: bool) -> bool:
    """Whether ``mlp_input`` adds ``layer``'s attention output (False in parallel attention/MLP blocks)."""
    if not mlp_input:
        return False
    if layer == model.cfg.n_layers:
        raise ValueError(
            f"`mlp_input=True` needs `layer` < n_layers={layer}: layer {layer} is the final norm's input, which "
            "has no MLP. Give the layer whose MLP input you want, or mlp_input=False."
        )
    return not model.cfg.parallel_attn_mlp


def resid_at(cache: Cache, layer: int, mid: bool, pos_slice: Any, why: str) -> Float[Tensor, "... pos d_model"]:
    """The residual stream read by ``layer``'s attention (its MLP if ``mid``); ``n_layers``: the final one."""
    n = cache.model.cfg.n_layers
    name = f"blocks.{n - 1}.hook_resid_post" if layer == n else f"blocks.{layer}.hook_resid_{'mid' if mid else 'pre'}"
    return cache._at_pos(cache._get(name, why), pos_slice)


# -- the residual stream, block by block ------------------------------------------------------
def _out(
    cache: Cache,
    stack: Tensor,
    labels: list[str],
    layer: int,
    mlp_input: bool,
    apply_ln: bool,
    pos_slice: Any,
    ret: bool,
    recompute_ln: bool = False,
) -> Tensor | tuple[Tensor, list[str]]:
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input, pos_slice, recompute_ln=recompute_ln)
    return (stack, labels) if ret else stack


def accumulated_resid(
    cache: Cache,
    layer: int | None = None,
    incl_mid: bool = False,
    apply_ln: bool = False,
    pos_slice: Any = None,
    mlp_input: bool = False,
    return_labels: bool = False,
) -> Float[Tensor, "layer ... pos d_model"] | tuple[Tensor, list[str]]:
    """The residual stream entering each layer up to ``layer``; see `ActivationCache.accumulated_resid`."""
    model = cache._need_model()
    n = model.cfg.n_layers
    layer = resolve_layer(layer, n)
    mid_last = mlp_reads_attn(model, layer, mlp_input)
    names, labels = [], []
    for i in range(layer + 1):
        if i == n:
            names.append(f"blocks.{n - 1}.hook_resid_post")
            labels.append("final_post")
            continue
        names.append(f"blocks.{i}.hook_resid_pre")
        labels.append(f"{i}_pre")
        if (incl_mid and i < layer and not model.cfg.parallel_attn_mlp) or (mid_last and i == layer):
            names.append(f"blocks.{i}.hook_resid_mid")
            labels.append(f"{i}_mid")
    stack = torch.stack([cache._at_pos(cache._get(name, "accumulated_resid"), pos_slice) for name in names])
    # Each entry is a whole residual stream: the norm reads it with its own statistics (the logit lens).
    return _out(cache, stack, labels, layer, mlp_input, apply_ln, pos_slice, return_labels, recompute_ln=True)


def decompose_resid(
    cache: Cache,
    layer: int | None = None,
    mlp_input: bool = False,
    mode: str = "all",
    apply_ln: bool = False,
    pos_slice: Any = None,
    incl_embeds: bool = True,
    return_labels: bool = False,
) -> Float[Tensor, "component ... pos d_model"] | tuple[Tensor, list[str]]:
    """Embeddings and each block's outputs before ``layer``; see `ActivationCache.decompose_resid`."""
    if mode not in ("all", "attn", "mlp"):
        raise ValueError(f"`mode` must be 'all', 'attn' or 'mlp', got {mode!r}.")
    model = cache._need_model()
    layer = resolve_layer(layer, model.cfg.n_layers)
    mid = mlp_reads_attn(model, layer, mlp_input)
    kinds = ("attn", "mlp") if mode == "all" else (mode,)
    acts = acts_of(cache, pos_slice, "decompose_resid")
    groups = component_groups(model, acts, layer, mid, embeds=incl_embeds, kinds=kinds, edits=True)
    if not groups:
        raise ValueError(f"Nothing to decompose: layer={layer}, mode={mode!r} and incl_embeds=False select no part.")
    return _out(cache, stack_groups(groups), labels_of(groups), layer, mlp_input, apply_ln, pos_slice, return_labels)


def apply_ln_to_stack(
    cache: Cache,
    residual_stack: Float[Tensor, "component ... pos d_model"],
    layer: int | None = None,
    mlp_input: bool = False,
    pos_slice: Any = None,
    batch_slice: Any = None,
    has_batch_dim: bool = True,
    recompute_ln: bool = False,
) -> Float[Tensor, "component ... pos d_model"]:
    """Centre (LayerNorm) and divide by the cached scale; see `ActivationCache.apply_ln_to_stack`."""
    model = cache._need_model()
    n = model.cfg.n_layers
    layer = resolve_layer(layer, n)
    mlp_reads_attn(model, layer, mlp_input)
    if recompute_ln and layer == n:
        return _own_norm(model, cache._select(residual_stack, batch_slice, 1, "batch_slice") if has_batch_dim
                         and cache.has_batch_dim else residual_stack)  # fmt: skip
    name = _scale_name(model, layer, mlp_input)
    if name is None:
        return residual_stack  # the sublayer reads the residual stream as it is
    scale = cache._at_pos(cache._get(name, "apply_ln_to_stack"), pos_slice)
    if cache.has_batch_dim:
        rank = scale.dim()
        scale = cache._select(scale, batch_slice, 0, "batch_slice")
        one_row = scale.dim() < rank  # an int batch_slice dropped the batch axis
        if has_batch_dim:
            residual_stack = cache._select(residual_stack, batch_slice, 1, "batch_slice")
        elif one_row:
            pass
        elif scale.shape[0] == 1:
            scale = scale[0]
        else:
            raise ValueError(
                f"`has_batch_dim=False`, but this cache holds {scale.shape[0]} rows: pick the stack's row with "
                "`batch_slice` (an int)."
            )
    elif batch_slice is not None:
        raise ValueError("`batch_slice` needs a cache with a batch axis; this one has none (remove_batch_dim).")
    if model.cfg.normalization == "layernorm":
        residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
    return residual_stack / scale.to(residual_stack.device)


def _scale_name(model: Any, layer: int, mlp_input: bool) -> str | None:
    """The cached scale of the norm that reads the residual at ``layer``; None where no norm does (OLMo 2)."""
    if layer == model.cfg.n_layers:
        return "ln_final.hook_scale"
    name = f"blocks.{layer}.{'ln2' if mlp_input else 'ln1'}.hook_scale"
    if name not in model.hook_dict:  # no such norm: one norm feeds both (Phi, GPT-J) or none (OLMo 2)
        name = f"blocks.{layer}.ln1.hook_scale"
    return name if name in model.hook_dict else None


def logit_attrs(
    cache: Cache,
    residual_stack: Float[Tensor, "component ... d_model"],
    tokens: Any,
    incorrect_tokens: Any = None,
    pos_slice: Any = None,
    batch_slice: Any = None,
    has_batch_dim: bool = True,
    has_applied_ln: bool = False,
) -> Float[Tensor, "component ..."]:
    """Direct logit attribution of each component; see `ActivationCache.logit_attrs`."""
    model = cache._need_model()
    ids = [_token_ids(model, t, p) for t, p in ((tokens, "tokens"), (incorrect_tokens, "incorrect_tokens"))]
    if ids[1] is not None and ids[0].shape != ids[1].shape:
        raise ValueError(
            f"`tokens` and `incorrect_tokens` must have the same shape, got {tuple(ids[0].shape)} and "
            f"{tuple(ids[1].shape)}."
        )
    if not has_applied_ln:
        residual_stack = apply_ln_to_stack(cache, residual_stack, None, False, pos_slice, batch_slice, has_batch_dim)
    direction = logit_direction(model, ids[0], ids[1])
    per_row = has_batch_dim and cache.has_batch_dim and residual_stack.dim() == 4
    if direction.dim() == 2 and per_row and direction.shape[0] == residual_stack.shape[1]:
        direction = direction[:, None, :]  # one token per batch row: broadcast over positions
    return logit_attributions(model, residual_stack, direction)


def _token_ids(model: Any, tokens: Any, param: str) -> Tensor | None:
    if tokens is None or isinstance(tokens, Tensor):
        return tokens
    if isinstance(tokens, str):
        if getattr(model, "tokenizer", None) is None:
            raise TypeError(f"`{param}`={tokens!r}: a string needs a model with a tokenizer; give token ids.")
        tokens = model.to_single_token(tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, (int, list, tuple)):
        raise TypeError(f"`{param}` must be a token id, a one-token string or an id tensor, got {describe(tokens)}.")
    return torch.as_tensor(tokens)


# -- weights ----------------------------------------------------------------------------------
def model_of(cache: Cache) -> Any:
    model = cache._need_model()
    if not _is_bridge(model):
        raise TypeError(
            f"This helper reads the model's weights, so the cache's model must be a TransformerBridge; got "
            f"{type(model).__name__}. Attach one with `ActivationCache.load(path, model=bridge)`."
        )
    return model


def _is_bridge(model: Any) -> bool:
    return hasattr(model, "hf_model") and hasattr(model, "adapter")


def acts_of(cache: Cache, pos_slice: Any, why: str) -> Activations:
    """The cache's activations at ``pos_slice``, for `decompose`; a missing one raises saying ``why`` it is read."""
    return Activations(lambda name: cache._at_pos(cache._get(name, why), pos_slice), cache.cache_dict.__contains__)


def labels_of(groups: list[Group]) -> list[str]:
    """TransformerLens' labels of `decompose` groups: ``embed``, ``L0H3``, ``L0N5``, ``0_attn_out``, ``0_mlp_out``;
    and ``edit:blocks.10.hook_resid_post`` for what a hook added to the stream there (`edit_label`)."""
    labels: list[str] = []
    for g in groups:
        if g.kind == "edit":
            labels.append(edit_label(g.point))
        elif g.indexed:
            letter = {"head": "H", "neuron": "N", "expert": "E"}[g.kind]
            labels += [f"L{g.layer}{letter}{i}" for i in range(g.parts.shape[0])]
        else:
            labels.append(g.kind if g.layer is None else f"{g.layer}_{g.kind}")
    return labels


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


def project(result: Any, direction: Any) -> Any:
    """``result`` (a stack, or ``(stack, labels)``) with its ``d_model`` axis contracted with ``direction``:
    ``[d_model]`` drops the axis, ``[d_model, k]`` replaces it by ``k``. None leaves it as it is."""
    if direction is None:
        return result
    stack, labels = result if isinstance(result, tuple) else (result, None)
    if not isinstance(direction, Tensor) or direction.dim() not in (1, 2) or direction.shape[0] != stack.shape[-1]:
        raise ArgumentTypeError(
            f"`project_output_onto` must be a tensor [d_model] or [d_model, k] with d_model {stack.shape[-1]}, got "
            f"{describe(direction)}"
            + (f" of shape {tuple(direction.shape)}." if isinstance(direction, Tensor) else ".")
        )
    out = stack @ direction.to(stack.device, stack.dtype)
    return out if labels is None else (out, labels)


def _own_norm(model: Any, stack: Tensor) -> Tensor:
    """Each component normalised by its own statistics with the final norm's epsilon (centred for
    LayerNorm), weight and bias not applied: TransformerLens' ``recompute_ln``."""
    norm = get_module(model.hf_model, model.adapter.ln_final)
    eps = next((getattr(norm, a) for a in ("eps", "variance_epsilon", "epsilon") if hasattr(norm, a)), 1e-5)
    x = stack.float()
    if model.cfg.normalization == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(stack.dtype)
