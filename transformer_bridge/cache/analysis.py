"""The analysis behind `ActivationCache`'s TransformerLens methods: residual stacks and decompositions.

`accumulated_resid`, `decompose_resid`, per-head and per-neuron results, biases, the full residual
decomposition, `apply_ln_to_stack` and `logit_attrs`, as functions of a cache whose model is a
bridge; the cache exposes them as methods (``cache.stack_head_results(...)``). ``activation_cache.py`` imports
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
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from ..checks import ArgumentIndexError, ArgumentTypeError, as_index, describe
from ..sites.module_paths import get_module
from .decompose import (
    Activations,
    Group,
    component_groups,
    edit_label,
    logit_attributions,
    logit_direction,
    stack_groups,
)

Cache = Any  # an `ActivationCache`; not imported, since activation_cache.py imports this module
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
    index = as_index(layer)
    if index is None:
        raise ArgumentTypeError(f"`{param}` must be an int or None, got {describe(layer)}.")
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
    index = as_index(layer)
    if incl_remainder and index is not None and index < -1:
        raise ArgumentIndexError(
            f"`layer`={index} with incl_remainder=True: the layer must be 0..{n_layers} (or -1 / "
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
