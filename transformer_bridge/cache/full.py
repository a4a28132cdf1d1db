"""The rest of `ActivationCache`'s TransformerLens analysis: the biases before a layer, the full residual
decomposition (every head, neuron, embedding, bias and edit), and the batch axis (its size, slicing, removal).
Functions of a cache whose model is a bridge, exposed as cache methods; the residual stacks are in `analysis`,
head and neuron results in `heads`.
"""

from collections import Counter
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..checks import ArgumentValueError, check_int
from .analysis import Cache, acts_of, labels_of, mlp_reads_attn, model_of, project, resolve_layer
from .decompose import Group, component_groups, o_weight, stack_groups, sublayer_bias


def accumulated_bias(
    model: Any, layer: int | None, mlp_input: bool = False, include_mlp_biases: bool = True
) -> Float[Tensor, "d_model"]:
    """Sum of ``b_O`` (and ``b_out``) of the blocks before ``layer``; see `ActivationCache.accumulated_bias`."""
    layer = resolve_layer(layer, model.cfg.n_layers)
    mid = mlp_reads_attn(model, layer, mlp_input)
    total = o_weight(model, 0).new_zeros(model.cfg.d_model)
    for i in range(layer + mid):
        biases = [sublayer_bias(model, i, "attn")]
        if include_mlp_biases and i < layer:
            biases.append(sublayer_bias(model, i, "mlp"))
        for bias in biases:
            if bias is not None:
                total = total + bias.detach()
    return total


def get_full_resid_decomposition(
    cache: Cache,
    layer: int | None = None,
    mlp_input: bool = False,
    expand_neurons: bool = True,
    apply_ln: bool = False,
    pos_slice: Any = None,
    return_labels: bool = False,
    project_output_onto: Any = None,
) -> Float[Tensor, "component ... pos d_model"] | tuple[Tensor, list[str]]:
    """Heads, neurons (or MLPs), embeddings and biases; see `ActivationCache.get_full_resid_decomposition`."""
    model = model_of(cache)
    layer = resolve_layer(layer, model.cfg.n_layers)
    mid = mlp_reads_attn(model, layer, mlp_input)
    acts = acts_of(cache, pos_slice, "get_full_resid_decomposition")
    groups = component_groups(model, acts, layer, mid, heads=True, neurons=expand_neurons, edits=True)
    # TransformerLens' order: heads, then neurons (or MLP outputs), then embeddings, then all biases as one row;
    # edits by hooks (steering), when the cached forward had any, after the embeddings.
    order = [("head",), ("neuron", "mlp_out"), ("embed", "pos_embed"), ("edit",)]
    picked = [g for kinds in order for g in groups if g.kind in kinds]
    bias = picked[-1].parts.new_zeros(picked[-1].parts.shape)
    for g in groups:
        if g.kind in ("attn_bias", "mlp_bias"):
            bias = bias + g.parts.to(bias.dtype)
    stack = stack_groups([*picked, Group(bias, "attn_bias")])
    labels = [*labels_of(picked), "bias"]
    if apply_ln:
        stack = cache.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
    return project((stack, labels) if return_labels else stack, project_output_onto)


def batch_size(cache: Cache) -> int:
    """The cache's number of rows: its attention mask's when it has one (a run's cache), else the most common
    leading size of its tensors (a cache built by hand, where broadcast ``[1, ...]`` or position-indexed entries
    may sit next to the batched ones: TransformerLens' rule)."""
    if cache.attention_mask is not None and cache.attention_mask.dim() == 2:
        return cache.attention_mask.shape[0]
    counts = Counter(t.shape[0] for t in cache.cache_dict.values() if t.dim() > 0)
    return counts.most_common(1)[0][0] if counts else 1


def remove_batch_dim(cache: Cache, rows: Any) -> Cache:
    """Drop the batch axis of a batch-1 cache in place; see `ActivationCache.remove_batch_dim`."""
    if not cache.has_batch_dim:
        return cache
    if rows is None:
        rows, source = cache._batch_size(), _source(cache)
    else:
        rows, source = check_int("batch_size", rows, minimum=1), "`batch_size`"
    if rows != 1:
        raise ArgumentValueError(
            f"remove_batch_dim needs a cache of batch size 1, but this cache has batch size {rows} ({source}); "
            "take one row first with `apply_slice_to_batch_dim(i)`."
        )
    squeezed: dict[int, Tensor] = {}  # aliases of one tensor stay one tensor
    out = {k: squeezed.setdefault(id(t), t[0] if t.dim() > 0 and t.shape[0] == 1 else t)
           for k, t in cache.cache_dict.items()}  # fmt: skip
    cache.cache_dict.clear()
    cache.cache_dict.update(out)
    cache.attention_mask = None if cache.attention_mask is None else cache.attention_mask[0]
    cache.has_batch_dim = False
    return cache


def _source(cache: Cache) -> str:
    if cache.attention_mask is not None:
        return "the rows of its attention mask"
    return "the most common leading size of its tensors; pass `batch_size=` when that is not the batch"


def apply_slice_to_batch_dim(cache: Cache, batch_slice: Any) -> Cache:
    """The cache with ``batch_slice`` applied to every tensor's batch axis (an int drops the axis: the result has
    no batch dimension); see `ActivationCache.apply_slice_to_batch_dim`. A tensor whose leading size is not the
    batch size (a broadcast ``[1, ...]`` entry in a larger batch) is kept as it is."""
    if not cache.has_batch_dim:
        if batch_slice is None:
            return cache
        raise ValueError("`batch_slice` needs a cache with a batch axis; this one has none (remove_batch_dim).")
    size = cache._batch_size()
    rows = cache._select(torch.arange(size), batch_slice, 0, "batch_slice")
    taken: dict[int, Tensor] = {}  # aliases of one tensor stay one tensor
    for t in cache.cache_dict.values():
        if id(t) not in taken:
            batched = t.dim() > 0 and t.shape[0] == size
            taken[id(t)] = cache._select(t, batch_slice, 0, "batch_slice") if batched else t
    out = {k: taken[id(t)] for k, t in cache.cache_dict.items()}
    mask, lengths = cache.attention_mask, cache.prompt_lengths
    return cache._derive(
        out,
        attention_mask=None if mask is None else cache._select(mask, batch_slice, 0, "batch_slice"),
        prompt_lengths=None if lengths is None else cache._select(lengths, batch_slice, 0, "batch_slice"),
        has_batch_dim=rows.dim() > 0,
    )
