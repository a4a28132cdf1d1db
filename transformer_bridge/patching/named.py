"""TransformerLens' named sweeps (``get_act_patch_*``) and the ``*_every`` helpers that stack several.

Each is `generic_activation_patch` with a setter, a point and the axes swept, and takes the same keyword
options (``reduce``, ``baseline``, ``patches_per_forward``, ``memory_budget``, ``attention_mask``, ``progress``).
Grouped-query attention: ``hook_k`` / ``hook_v`` have one head per key-value head, so the k and v sweeps return
``n_kv_heads`` heads (patching key-value head ``g`` changes the keys or values that all query heads of its
group read); the ``*_every`` helpers pad them with zeros to ``n_heads``, as TransformerLens does.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..cache.activation_cache import ActivationCache
from ..core import BridgeCore
from .engine import MetricFn, generic_activation_patch
from .result import PatchingResult, index_rows
from .setters import (
    layer_head_dest_src_pos_pattern_patch_setter,
    layer_head_pattern_patch_setter,
    layer_head_pos_pattern_patch_setter,
    layer_head_vector_patch_setter,
    layer_pos_head_vector_patch_setter,
    layer_pos_patch_setter,
)

Result = Tensor | PatchingResult


def _sweep(setter: Callable, point: str, axes: tuple[str, ...]) -> Callable[..., Result]:
    def run(
        model: BridgeCore,
        corrupted_tokens: Any,
        clean_cache: ActivationCache,
        patching_metric: MetricFn,
        **options: Any,
    ) -> Result:
        return generic_activation_patch(model, corrupted_tokens, clean_cache, patching_metric, setter, point,
                                        index_axis_names=axes, **options)  # fmt: skip

    return run


_resid_pre = _sweep(layer_pos_patch_setter, "resid_pre", ("layer", "pos"))
_resid_mid = _sweep(layer_pos_patch_setter, "resid_mid", ("layer", "pos"))
_attn_out = _sweep(layer_pos_patch_setter, "attn_out", ("layer", "pos"))
_mlp_out = _sweep(layer_pos_patch_setter, "mlp_out", ("layer", "pos"))
_by_pos = {p: _sweep(layer_pos_head_vector_patch_setter, p, ("layer", "pos", "head")) for p in "zqkv"}
_all_pos = {p: _sweep(layer_head_vector_patch_setter, p, ("layer", "head")) for p in "zqkv"}
_pattern_by_pos = _sweep(layer_head_pos_pattern_patch_setter, "pattern", ("layer", "head_index", "dest_pos"))
_pattern_all_pos = _sweep(layer_head_pattern_patch_setter, "pattern", ("layer", "head_index"))
_pattern_dest_src = _sweep(
    layer_head_dest_src_pos_pattern_patch_setter, "pattern", ("layer", "head_index", "dest_pos", "src_pos")
)


def get_act_patch_resid_pre(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer pos"] | PatchingResult:
    """Patch the residual stream entering each block, one position at a time: ``[n_layers, pos]``.

    Example:
        >>> scan = get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric)   # [n_layers, pos]
    """
    return _resid_pre(model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_resid_mid(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer pos"] | PatchingResult:
    """Patch the residual stream between each block's attention and MLP, by position: ``[n_layers, pos]``.

    Example:
        >>> scan = get_act_patch_resid_mid(model, corrupted_tokens, clean_cache, metric)
    """
    return _resid_mid(model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_out(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer pos"] | PatchingResult:
    """Patch each attention layer's output, by position: ``[n_layers, pos]``.

    Example:
        >>> scan = get_act_patch_attn_out(model, corrupted_tokens, clean_cache, metric)
    """
    return _attn_out(model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_mlp_out(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer pos"] | PatchingResult:
    """Patch each MLP's output, by position: ``[n_layers, pos]``.

    Example:
        >>> scan = get_act_patch_mlp_out(model, corrupted_tokens, clean_cache, metric)
    """
    return _mlp_out(model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_out_by_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer pos head"] | PatchingResult:
    """Patch each head's output (``hook_z``) at each position: ``[n_layers, pos, n_heads]``.

    Example:
        >>> scan = get_act_patch_attn_head_out_by_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _by_pos["z"](model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_q_by_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer pos head"] | PatchingResult:
    """Patch each head's queries (``hook_q``, before RoPE) at each position: ``[n_layers, pos, n_heads]``.

    Example:
        >>> scan = get_act_patch_attn_head_q_by_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _by_pos["q"](model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_k_by_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer pos kv_head"] | PatchingResult:
    """Patch each key head (``hook_k``) at each position: ``[n_layers, pos, n_kv_heads]`` (``n_heads`` without
    grouped-query attention; a key-value head feeds every query head of its group).

    Example:
        >>> scan = get_act_patch_attn_head_k_by_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _by_pos["k"](model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_v_by_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer pos kv_head"] | PatchingResult:
    """Patch each value head (``hook_v``) at each position: ``[n_layers, pos, n_kv_heads]``.

    Example:
        >>> scan = get_act_patch_attn_head_v_by_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _by_pos["v"](model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_pattern_by_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer head query_pos"] | PatchingResult:
    """Patch each head's attention pattern row at each destination position: ``[n_layers, n_heads, dest_pos]``.

    Example:
        >>> scan = get_act_patch_attn_head_pattern_by_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _pattern_by_pos(model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_pattern_dest_src_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer head query_pos key_pos"] | PatchingResult:
    """Patch each entry of each head's pattern: ``[n_layers, n_heads, dest_pos, src_pos]``.

    Example:
        >>> scan = get_act_patch_attn_head_pattern_dest_src_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _pattern_dest_src(model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_out_all_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer head"] | PatchingResult:
    """Patch each head's output (``hook_z``) at every position at once: ``[n_layers, n_heads]``.

    Example:
        >>> scan = get_act_patch_attn_head_out_all_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _all_pos["z"](model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_q_all_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer head"] | PatchingResult:
    """Patch each head's queries at every position: ``[n_layers, n_heads]``.

    Example:
        >>> scan = get_act_patch_attn_head_q_all_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _all_pos["q"](model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_k_all_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer kv_head"] | PatchingResult:
    """Patch each key head at every position: ``[n_layers, n_kv_heads]``.

    Example:
        >>> scan = get_act_patch_attn_head_k_all_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _all_pos["k"](model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_v_all_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer kv_head"] | PatchingResult:
    """Patch each value head at every position: ``[n_layers, n_kv_heads]``.

    Example:
        >>> scan = get_act_patch_attn_head_v_all_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _all_pos["v"](model, corrupted_tokens, clean_cache, patching_metric, **options)


def get_act_patch_attn_head_pattern_all_pos(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn, **options: Any
) -> Float[Tensor, "layer head"] | PatchingResult:
    """Patch each head's whole attention pattern: ``[n_layers, n_heads]``.

    Example:
        >>> scan = get_act_patch_attn_head_pattern_all_pos(model, corrupted_tokens, clean_cache, metric)
    """
    return _pattern_all_pos(model, corrupted_tokens, clean_cache, patching_metric, **options)


# -- several sweeps, stacked --------------------------------------------------------------------
HEAD_TYPES = ("out", "q", "k", "v", "pattern")
BLOCK_TYPES = ("resid_pre", "attn_out", "mlp_out")


def get_act_patch_attn_head_all_pos_every(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, metric: MetricFn, **options: Any
) -> Float[Tensor, "patch_type layer head"] | PatchingResult:
    """Every head's output, queries, keys, values and pattern, patched at all positions: ``[5, n_layers, n_heads]``
    (keys and values zero-padded to ``n_heads`` in grouped-query models).

    Example:
        >>> every = get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, metric)
    """
    sweeps = [_all_pos["z"], _all_pos["q"], _all_pos["k"], _all_pos["v"], _pattern_all_pos]
    results = _run(sweeps, model, corrupted_tokens, clean_cache, metric, options)
    return _stack(results, [("layer", "head")] * 4 + [("layer", "head_index")], ("layer", "head"), model.cfg.n_heads,
                  HEAD_TYPES)  # fmt: skip


def get_act_patch_attn_head_by_pos_every(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, metric: MetricFn, **options: Any
) -> Float[Tensor, "patch_type layer pos head"] | PatchingResult:
    """Every head's output, queries, keys, values and pattern, by position: ``[5, n_layers, pos, n_heads]`` (the
    pattern by destination position).

    Example:
        >>> every = get_act_patch_attn_head_by_pos_every(model, corrupted_tokens, clean_cache, metric)
    """
    sweeps = [_by_pos["z"], _by_pos["q"], _by_pos["k"], _by_pos["v"], _pattern_by_pos]
    results = _run(sweeps, model, corrupted_tokens, clean_cache, metric, options)
    axes = [("layer", "pos", "head")] * 4 + [("layer", "head_index", "dest_pos")]
    return _stack(results, axes, ("layer", "pos", "head"), model.cfg.n_heads, HEAD_TYPES)


def get_act_patch_block_every(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, metric: MetricFn, **options: Any
) -> Float[Tensor, "patch_type layer pos"] | PatchingResult:
    """The residual stream entering each block, each attention output and each MLP output, by position:
    ``[3, n_layers, pos]``.

    Example:
        >>> every = get_act_patch_block_every(model, corrupted_tokens, clean_cache, metric)
    """
    results = _run([_resid_pre, _attn_out, _mlp_out], model, corrupted_tokens, clean_cache, metric, options)
    return _stack(results, [("layer", "pos")] * 3, ("layer", "pos"), 0, BLOCK_TYPES)


def _run(
    sweeps: list[Callable],
    model: BridgeCore,
    tokens: Any,
    cache: ActivationCache,
    metric: MetricFn,
    options: dict[str, Any],
) -> list[Result]:
    """Run each sweep; a requested baseline is computed once (by the first)."""
    baseline = bool(options.pop("baseline", False))
    results = []
    for i, sweep in enumerate(sweeps):
        out = sweep(model, tokens, cache, metric, baseline=baseline and i == 0, **options)
        results.append(out)
    return results


def _stack(
    results: list[Result], axes: list[tuple[str, ...]], order: tuple[str, ...], n_heads: int, types: Sequence[str]
) -> Result:
    """Stack sweeps on a leading ``patch_type`` axis, each permuted to ``order`` (``head_index`` is ``head``,
    ``dest_pos`` is ``pos``) with its head axis zero-padded to ``n_heads``."""
    typed = [r if isinstance(r, PatchingResult) else None for r in results]
    first = next((r for r in typed if r is not None), None)
    values = []
    for r, names in zip(results, axes, strict=True):
        v, lead = (r.values, int(r.has_metric_axis)) if isinstance(r, PatchingResult) else (r, 0)
        renamed = [{"head_index": "head", "dest_pos": "pos"}.get(n, n) for n in names]
        perm = [*range(lead), *(lead + renamed.index(n) for n in order), *range(lead + len(names), v.dim())]
        v = v.permute(*perm)
        if "head" in order and v.shape[lead + order.index("head")] < n_heads:
            pad = list(v.shape)
            pad[lead + order.index("head")] = n_heads - v.shape[lead + order.index("head")]
            v = torch.cat([v, v.new_zeros(pad)], lead + order.index("head"))
        values.append(v)
    if first is None:
        return torch.stack(values)
    lead = int(first.has_metric_axis)
    stacked = torch.stack(values, dim=lead)
    cells = list(stacked.shape[lead : lead + 1 + len(order)])
    return PatchingResult(
        values=stacked, axis_names=["patch_type", *order], index=index_rows(cells),
        index_names=["patch_type", *order], metric_names=list(first.metric_names), reduced=first.reduced,
        baseline=first.baseline, has_metric_axis=first.has_metric_axis, patch_type_names=list(types),
    )  # fmt: skip
