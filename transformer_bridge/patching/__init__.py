"""Activation patching with TransformerLens' names and signatures, many patches per forward.

Port TransformerLens code by one import: ``from transformer_bridge import patching`` (or
``from transformer_bridge.patching import get_act_patch_resid_pre``) instead of ``transformer_lens.patching``.
Every ``get_act_patch_*`` function, `generic_activation_patch` (with ``index_axis_names`` or an ``index_df``),
the patch setters, the ``*_every`` helpers, ``reduce=`` / ``baseline=`` / a mapping of metrics and
`PatchingResult` behave as in TransformerLens 4.3. What differs is the cost: the corrupted batch is repeated
along the batch axis, one copy per patch, so a sweep of ``n`` patches takes ``n / patches_per_forward``
forwards (sized to ``memory_budget``) instead of ``n``, and the metric values stay on the device until the
end. Grouped-query models are patched per key-value head for ``k`` / ``v`` (see `named`).

Example:
    >>> from transformer_bridge import patching
    >>> _, clean_cache = model.run_with_cache(clean_tokens)
    >>> metric = lambda logits: logits[0, -1, paris] - logits[0, -1, rome]
    >>> scan = patching.get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric)   # [n_layers, pos]

It is a function package over the core bridge: it may import the core, `cache`, `sites` (to read which module serves
a point) and `utils`.
"""

from .engine import AXES, REDUCE, MetricFn, PatchSetter, chunk_size, generic_activation_patch
from .named import (
    get_act_patch_attn_head_all_pos_every,
    get_act_patch_attn_head_by_pos_every,
    get_act_patch_attn_head_k_all_pos,
    get_act_patch_attn_head_k_by_pos,
    get_act_patch_attn_head_out_all_pos,
    get_act_patch_attn_head_out_by_pos,
    get_act_patch_attn_head_pattern_all_pos,
    get_act_patch_attn_head_pattern_by_pos,
    get_act_patch_attn_head_pattern_dest_src_pos,
    get_act_patch_attn_head_q_all_pos,
    get_act_patch_attn_head_q_by_pos,
    get_act_patch_attn_head_v_all_pos,
    get_act_patch_attn_head_v_by_pos,
    get_act_patch_attn_out,
    get_act_patch_block_every,
    get_act_patch_mlp_out,
    get_act_patch_resid_mid,
    get_act_patch_resid_pre,
)
from .result import PatchingResult, make_df_from_ranges
from .setters import (
    layer_head_dest_src_pos_pattern_patch_setter,
    layer_head_pattern_patch_setter,
    layer_head_pos_pattern_patch_setter,
    layer_head_vector_patch_setter,
    layer_pos_head_vector_patch_setter,
    layer_pos_patch_setter,
)

__all__ = [
    "AXES",
    "REDUCE",
    "MetricFn",
    "PatchSetter",
    "PatchingResult",
    "chunk_size",
    "generic_activation_patch",
    "get_act_patch_attn_head_all_pos_every",
    "get_act_patch_attn_head_by_pos_every",
    "get_act_patch_attn_head_k_all_pos",
    "get_act_patch_attn_head_k_by_pos",
    "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_attn_head_pattern_all_pos",
    "get_act_patch_attn_head_pattern_by_pos",
    "get_act_patch_attn_head_pattern_dest_src_pos",
    "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_q_by_pos",
    "get_act_patch_attn_head_v_all_pos",
    "get_act_patch_attn_head_v_by_pos",
    "get_act_patch_attn_out",
    "get_act_patch_block_every",
    "get_act_patch_mlp_out",
    "get_act_patch_resid_mid",
    "get_act_patch_resid_pre",
    "layer_head_dest_src_pos_pattern_patch_setter",
    "layer_head_pattern_patch_setter",
    "layer_head_pos_pattern_patch_setter",
    "layer_head_vector_patch_setter",
    "layer_pos_head_vector_patch_setter",
    "layer_pos_patch_setter",
    "make_df_from_ranges",
]
