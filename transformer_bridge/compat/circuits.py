"""TransformerLens' weight-circuit surface: ``model.QK`` / ``model.OV`` (factored), ``all_head_labels``,
``all_composition_scores`` and ``get_params`` (the weights under HookedTransformer's state-dict names).

Everything is built from the weight properties of `compat.weights`, so it shows the model's own
(unprocessed) weights: ``QK = W_Q @ W_Kᵀ`` and ``OV = W_V @ W_O`` per layer and head, with a GQA model's
``W_K`` / ``W_V`` (over its kv heads) repeated explicitly so query head ``h`` pairs with kv head
``h // (n_heads // n_kv_heads)``. Composition scores follow the transformer-circuits
definition, ``‖L @ R‖_F / (‖L‖_F ‖R‖_F)`` of an earlier head's ``OV`` (L) and a later head's QK, QKᵀ or
OV (R), zero unless the first head's layer comes before the second's.
"""

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..core import BridgeCore
from ..sites.module_paths import get_module, optional_module
from . import weights
from .factored import FactoredMatrix

_ATTN = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")
_MLP = ("W_in", "W_out", "b_in", "b_out", "W_gate")  # TransformerLens 4's order
_KV = ("W_K", "W_V", "b_K", "b_V")


class CompositionScores(Tensor):
    """``[layer, head, layer, head]`` scores (a tensor) that also carry ``.scores``, ``.layer_indices``
    and ``.head_labels`` (TransformerLens 4's result object)."""

    layer_indices: list[int]
    head_labels: list[str]

    @property
    def scores(self) -> Tensor:
        """The scores as a plain tensor."""
        return self.as_subclass(Tensor)


def composition_scores(left: FactoredMatrix, right: FactoredMatrix) -> Float[Tensor, "... "]:
    """``‖left @ right‖_F / (‖left‖_F ‖right‖_F)``, every leading index of ``left`` against every one of
    ``right`` (``left``'s leading dimensions first)."""
    n_left, n_right = len(left.shape) - 2, len(right.shape) - 2
    for i in range(n_left):
        right = right.unsqueeze(i)
    for i in range(n_right):
        left = left.unsqueeze(n_left + i)
    return (left @ right).norm() / left.norm() / right.norm()


def _norm_params(core: BridgeCore, prefix: str, path: str | None, root: torch.nn.Module) -> dict[str, Tensor]:
    """A norm's ``w`` (and ``b``) as ``model.<prefix>w`` gives them (the HF module's parameters), for the norms
    the bridge exposes (those with hook points)."""
    module = optional_module(root, path, may_be_absent=True) if path is not None else None
    if module is None or not any(n.startswith(prefix) for n in core.hook_dict):
        return {}
    found = {"w": getattr(module, "weight", None), "b": getattr(module, "bias", None)}
    return {prefix + k: v for k, v in found.items() if isinstance(v, Tensor)}


def get_params(core: BridgeCore) -> dict[str, Tensor]:
    """HookedTransformer's parameter names → the bridge's weights (``embed.W_E``, ``blocks.0.attn.W_Q`` …,
    ``unembed.W_U``). Shapes are TransformerLens': a GQA model's ``W_K`` / ``W_V`` / ``b_K`` / ``b_V`` have its kv
    heads repeated to ``n_heads`` (row ``h`` is query head ``h``'s, as HookedTransformer's and TransformerLens 4's
    ``get_params``; ``blocks[l].attn.W_K`` keeps the kv heads); the unembedding is the folded one (see
    `compat.weights`). In TransformerLens 4's order: per block the attention's, then the MLP's (``W_in``, ``W_out``,
    ``b_in``, ``b_out``, ``W_gate``), then its norms' ``ln1.w`` / ``ln1.b`` / ``ln2.w`` / ``ln2.b`` where it has
    them; then ``ln_final.w`` / ``.b`` and the unembedding. A norm's ``w`` is the HF module's weight, as
    ``model.blocks[L].ln1.w`` gives it (note ``unembed.W_U`` already holds ``ln_final.w`` folded in)."""
    n_blocks = len(get_module(core.hf_model, core.adapter.blocks))
    if core.cfg.n_layers != n_blocks:
        raise ValueError(
            f"Configuration mismatch: cfg.n_layers is {core.cfg.n_layers} but {n_blocks} blocks found in the model."
        )
    out: dict[str, Tensor] = {"embed.W_E": weights.W_E(core)}
    if core.adapter.pos_embed:
        out["pos_embed.W_pos"] = weights.W_pos(core)
    blocks = get_module(core.hf_model, core.adapter.blocks)
    for layer in range(core.cfg.n_layers):
        for group, names in (("attn", _ATTN), ("mlp", _MLP)):
            table = weights.ATTN_WEIGHTS if group == "attn" else weights.MLP_WEIGHTS
            for name in names:
                if name not in table:
                    continue
                try:  # a GQA model's kv heads repeated to n_heads, as HookedTransformer's W_K / W_V read
                    value = table[name](core, layer, kv_heads=False) if name in _KV else table[name](core, layer)
                except weights.WeightNotAvailableError:
                    continue
                if value is not None:  # W_gate of an ungated MLP
                    out[f"blocks.{layer}.{group}.{name}"] = value
        for key in ("ln1", "ln2"):
            out.update(_norm_params(core, f"blocks.{layer}.{key}.", getattr(core.adapter, key), blocks[layer]))
    out.update(_norm_params(core, "ln_final.", core.adapter.ln_final, core.hf_model))
    out["unembed.W_U"] = weights.W_U(core)
    out["unembed.b_U"] = weights.b_U(core)
    return out


def per_query_head(core: Any, kv: Float[Tensor, "layer kv_head ..."]) -> Float[Tensor, "layer head ..."]:
    """A GQA model's ``[layer, kv_head, ...]`` weights repeated so head ``h`` holds kv head ``h // group``."""
    return kv.repeat_interleave(core.cfg.n_heads // core.cfg.n_kv_heads, dim=1)
