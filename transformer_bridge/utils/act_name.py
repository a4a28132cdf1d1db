"""`get_act_name`: TransformerLens' shorthand for hook names, resolved by the bridge's one name grammar."""

import re

from ..checks import ArgumentTypeError, as_index, describe
from ..hooks import names

_COMPACT = re.compile(r"([a-z]+)(\d+)([a-z]?.*)")


def get_act_name(name: str, layer: int | str | None = None, layer_type: str | None = None) -> str:
    """Canonical hook name from TransformerLens shorthand, as ``transformer_lens.utils.get_act_name``.

    Accepts full names (returned as they are), shorthand with a layer, TransformerLens' aliases
    (``"key"``, ``"query"``, ``"value"``, ``"attn_logits"``, ``"mlp_pre"``, ``"mlp_post"``; ``layer_type``
    ``"a"`` / ``"m"`` / ``"b"``) and compact forms (``"k6"``, ``"scale4ln1"``). A name it does not know gets
    TransformerLens' construction, ``blocks.{layer}.[{layer_type}.]hook_{name}`` (``"in"`` with layer 3:
    ``blocks.3.hook_in``, which the bridge reads as ``blocks.3.hook_resid_pre``); a model or a cache then says
    whether it is a point, with close matches. The layer is not checked against a model here (no model is known):
    negative layers raise, since only a model can resolve them; use ``cache["resid_pre", -1]``. A layer may be
    given as a string of digits (``"6"``), as TransformerLens allows, or a 0-d integer tensor (what ``topk`` returns).

    Example:
        >>> get_act_name("k", 6, "a"), get_act_name("scale4ln1"), get_act_name("normalized")
        ('blocks.6.attn.hook_k', 'blocks.4.ln1.hook_scale', 'ln_final.hook_normalized')
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(f"`name` must be a str such as 'resid_post', got {describe(name)}.")
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    match = _COMPACT.fullmatch(name) if layer is None and layer_type is None else None
    if match is not None:
        name, layer, layer_type = match.group(1), int(match.group(2)), match.group(3) or None
    if isinstance(layer, str) and layer.isdigit():
        layer = int(layer)
    if layer is not None and as_index(layer) is None:
        raise ArgumentTypeError(f"`layer` must be an int, a string of digits or None, got {describe(layer)}.")
    layer = None if layer is None else as_index(layer)
    if layer is not None and layer < 0:
        raise ValueError(
            f"`layer`={layer}: get_act_name knows no model, so it cannot count layers from the end. Give "
            f"model.cfg.n_layers + {layer}, or index the cache: cache[{name!r}, {layer}]."
        )
    return names.tl_act_name(name, layer, layer_type)
