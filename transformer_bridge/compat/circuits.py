# ruff: noqa: N802  (TransformerLens' names: QK, OV)
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
from ..sites import get_module
from . import weights
from .factored import FactoredMatrix

_ATTN = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")
_MLP = ("W_in", "W_gate", "b_in", "W_out", "b_out")


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


def get_params(core: BridgeCore) -> dict[str, Tensor]:
    """HookedTransformer's parameter names → the bridge's weights (``embed.W_E``, ``blocks.0.attn.W_Q`` …,
    ``unembed.W_U``). Shapes are TransformerLens'; the unembedding is the folded one (see `compat.weights`)."""
    n_blocks = len(get_module(core.hf_model, core.adapter.blocks))
    if core.cfg.n_layers != n_blocks:
        raise ValueError(
            f"Configuration mismatch: cfg.n_layers is {core.cfg.n_layers} but {n_blocks} blocks found in the model."
        )
    out: dict[str, Tensor] = {"embed.W_E": weights.W_E(core)}
    if core.adapter.pos_embed:
        out["pos_embed.W_pos"] = weights.W_pos(core)
    for layer in range(core.cfg.n_layers):
        for group, names in (("attn", _ATTN), ("mlp", _MLP)):
            table = weights.ATTN_WEIGHTS if group == "attn" else weights.MLP_WEIGHTS
            for name in names:
                if name not in table:
                    continue
                try:
                    value = table[name](core, layer)
                except weights.WeightNotAvailableError:
                    continue
                if value is not None:  # W_gate of an ungated MLP
                    out[f"blocks.{layer}.{group}.{name}"] = value
    out["unembed.W_U"] = weights.W_U(core)
    out["unembed.b_U"] = weights.b_U(core)
    return out


def _per_query_head(core: Any, kv: Float[Tensor, "layer kv_head ..."]) -> Float[Tensor, "layer head ..."]:
    """A GQA model's ``[layer, kv_head, ...]`` weights repeated so head ``h`` holds kv head ``h // group``."""
    return kv.repeat_interleave(core.cfg.n_heads // core.cfg.n_kv_heads, dim=1)


class Circuits:
    """Mixin: ``QK``, ``OV``, their ``*_for_attn_layers`` forms, head labels, composition scores, ``get_params``."""

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_Kᵀ`` per layer and head: ``[layer, head, d_model, d_model]``, kept factored.

        Example:
            >>> model.QK.shape[:2] == (model.cfg.n_layers, model.cfg.n_heads)
            True
        """
        return FactoredMatrix(self.W_Q, _per_query_head(self, self.W_K).transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` per layer and head: ``[layer, head, d_model, d_model]``, kept factored.

        Example:
            >>> model.OV.AB.shape[-2:] == (model.cfg.d_model, model.cfg.d_model)
            True
        """
        return FactoredMatrix(_per_query_head(self, self.W_V), self.W_O)

    def QK_for_attn_layers(self) -> tuple[list[int], FactoredMatrix]:
        """``(layer indices, QK)``: every layer here has attention, so the indices are all layers."""
        return list(range(self.cfg.n_layers)), self.QK

    def OV_for_attn_layers(self) -> tuple[list[int], FactoredMatrix]:
        """``(layer indices, OV)``, as `QK_for_attn_layers`."""
        return list(range(self.cfg.n_layers)), self.OV

    @property
    def all_head_labels(self) -> list[str]:
        """``["L0H0", "L0H1", …]``: layer-major labels of every attention head."""
        return [f"L{layer}H{head}" for layer in range(self.cfg.n_layers) for head in range(self.cfg.n_heads)]

    def all_composition_scores(self, mode: str) -> CompositionScores:
        """Composition of every head's output (OV) into every later head's query (``"Q"``: QK), key
        (``"K"``: QKᵀ) or value (``"V"``: OV): ``[layer, head, layer, head]``, zero where the second
        head's layer is not after the first's.

        Example:
            >>> scores = model.all_composition_scores("Q")
            >>> scores.shape == (model.cfg.n_layers, model.cfg.n_heads) * 2
            True
        """
        left = self.OV
        rights = {"Q": lambda: self.QK, "K": lambda: self.QK.T, "V": lambda: left}
        if mode not in rights:
            raise ValueError(f"`mode`={mode!r}: mode must be one of 'Q', 'K', 'V'.")
        scores = composition_scores(left, rights[mode]())
        n = self.cfg.n_layers
        later = torch.arange(n)[:, None, None, None] < torch.arange(n)[None, None, :, None]
        scores = torch.where(later.to(scores.device), scores, torch.zeros_like(scores))
        out = scores.as_subclass(CompositionScores)
        out.layer_indices, out.head_labels = list(range(n)), self.all_head_labels
        return out

    def get_params(self) -> dict[str, Any]:
        """The weights under HookedTransformer's state-dict names (``blocks.0.attn.W_Q`` …).

        Example:
            >>> model.get_params()["blocks.0.attn.W_Q"].shape == model.blocks[0].attn.W_Q.shape
            True
        """
        return get_params(self)
