"""`get_act_name`: TransformerLens' shorthand for hook names, resolved by the bridge's one name grammar."""

import re

import numpy as np

from ..checks import ArgumentTypeError, describe
from ..hooks import names

_NAME_ALIAS = {
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_post": "post",
}
_TYPE_ALIAS = {
    "a": "attn",
    "attention": "attn",
    "attn": "attn",
    "m": "mlp",
    "mlp": "mlp",
    "b": "",
    "block": "",
    "blocks": "",
}
_COMPACT = re.compile(r"([a-z]+)(\d+)([a-z]?.*)")


def get_act_name(name: str, layer: int | str | None = None, layer_type: str | None = None) -> str:
    """Canonical hook name from TransformerLens shorthand, as ``transformer_lens.utils.get_act_name``.

    Accepts full names (returned as they are), shorthand with a layer, TransformerLens' aliases
    (``"key"``, ``"query"``, ``"value"``, ``"attn_logits"``, ``"mlp_pre"``, ``"mlp_post"``; ``layer_type``
    ``"a"`` / ``"m"`` / ``"b"``) and compact forms (``"k6"``, ``"scale4ln1"``). Unknown shorthand raises
    `KeyError` with close matches. The layer is not checked against a model here (no model is known):
    negative layers raise, since only a model can resolve them; use ``cache["resid_pre", -1]``. A layer may be
    given as a string of digits (``"6"``), as TransformerLens allows.

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
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, (int, np.integer))):
        raise ArgumentTypeError(f"`layer` must be an int, a string of digits or None, got {describe(layer)}.")
    if layer is not None and layer < 0:
        raise ValueError(
            f"`layer`={layer}: get_act_name knows no model, so it cannot count layers from the end. Give "
            f"model.cfg.n_layers + {layer}, or index the cache: cache[{name!r}, {layer}]."
        )
    name = _NAME_ALIAS.get(name, name)
    kind = _TYPE_ALIAS.get(layer_type, layer_type) if layer_type is not None else None
    norm = kind if kind not in ("", "attn", "mlp") else None
    full = names.canonical_name(name, None if layer is None else int(layer), norm)
    if kind in ("attn", "mlp") and f".{kind}." not in full:
        raise ValueError(f"`layer_type`={layer_type!r} does not fit {name!r}, which is {full!r}; leave it out.")
    return full
