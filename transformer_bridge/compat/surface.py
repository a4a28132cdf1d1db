# ruff: noqa: N802  (TransformerLens' names: W_Q, QK, OV ...)
"""`TransformerLensSurface`: TransformerLens' model attributes over the core, as one mixin of `TransformerBridge`.

Everything a TransformerLens user reaches on the model that the core does not have: stacked weights (``W_Q`` …
``b_U``), QK / OV circuits and composition scores, opt-in weight processing, the component tree
(``model.blocks[i].attn``), caching hooks, token helpers. The members are listed here in one class; their work is
done by the functions of the modules named in each section, next to what they serve.
"""

import warnings
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..cache import full
from ..checks import check_bool, warn_difference_once
from ..core import BridgeCore
from ..hooks.points import HookPoint
from .caching_hooks import HookPair, caching_hooks, hook_point
from .circuits import CompositionScores, composition_scores, get_params, per_query_head
from .components import Blocks, ComponentView, build_components
from .factored import FactoredMatrix
from .processing import WeightProcessing, process_weights
from .weights import ATTN_WEIGHTS, MLP_WEIGHTS, W_E, W_U, W_pos, W_U_raw, WeightNotAvailableError, b_U, b_U_raw, stacked


class TransformerLensSurface:
    """Mixin of `TransformerBridge`: TransformerLens' model surface (see the module docstring).

    Example:
        >>> model.W_Q.shape                      # [layer, head, d_model, d_head]
        >>> model.blocks[0].attn.hook_pattern    # the HookPoint
    """

    # -- TransformerLens' stacked weights, read from the HF modules on each access (compat/weights.py) ----------

    @property
    def W_Q(self) -> Float[Tensor, "layer head d_model d_head"]:
        """Query weights of every layer (a copy)."""
        return stacked(self, ATTN_WEIGHTS["W_Q"])

    @property
    def W_K(self) -> Float[Tensor, "layer kv_head d_model d_head"]:
        """Key weights over the kv heads (``n_heads`` of them without GQA; a copy)."""
        return stacked(self, ATTN_WEIGHTS["W_K"])

    @property
    def W_V(self) -> Float[Tensor, "layer kv_head d_model d_head"]:
        """Value weights over the kv heads (a copy)."""
        return stacked(self, ATTN_WEIGHTS["W_V"])

    @property
    def _W_K(self) -> Float[Tensor, "layer kv_head d_model d_head"]:
        """Key weights over kv heads (a copy)."""
        return stacked(self, ATTN_WEIGHTS["_W_K"])

    @property
    def _W_V(self) -> Float[Tensor, "layer kv_head d_model d_head"]:
        """Value weights over kv heads (a copy)."""
        return stacked(self, ATTN_WEIGHTS["_W_V"])

    @property
    def W_O(self) -> Float[Tensor, "layer head d_head d_model"]:
        """Attention output weights (a copy)."""
        return stacked(self, ATTN_WEIGHTS["W_O"])

    @property
    def b_Q(self) -> Float[Tensor, "layer head d_head"]:
        """Query biases, zeros where the family has none (a copy)."""
        return stacked(self, ATTN_WEIGHTS["b_Q"])

    @property
    def b_K(self) -> Float[Tensor, "layer kv_head d_head"]:
        """Key biases over the kv heads (a copy)."""
        return stacked(self, ATTN_WEIGHTS["b_K"])

    @property
    def b_V(self) -> Float[Tensor, "layer kv_head d_head"]:
        """Value biases over the kv heads (a copy)."""
        return stacked(self, ATTN_WEIGHTS["b_V"])

    @property
    def _b_K(self) -> Float[Tensor, "layer kv_head d_head"]:
        """Key biases over kv heads (a copy)."""
        return stacked(self, ATTN_WEIGHTS["_b_K"])

    @property
    def _b_V(self) -> Float[Tensor, "layer kv_head d_head"]:
        """Value biases over kv heads (a copy)."""
        return stacked(self, ATTN_WEIGHTS["_b_V"])

    @property
    def b_O(self) -> Float[Tensor, "layer d_model"]:
        """Attention output biases (a copy)."""
        return stacked(self, ATTN_WEIGHTS["b_O"])

    @property
    def W_in(self) -> Float[Tensor, "layer d_model d_mlp"]:
        """MLP input weights (gated MLPs: the up projection) (a copy)."""
        return stacked(self, MLP_WEIGHTS["W_in"])

    @property
    def W_gate(self) -> Float[Tensor, "layer d_model d_mlp"] | None:
        """MLP gate weights (a copy); None for ungated MLPs, as in TransformerLens."""
        return stacked(self, MLP_WEIGHTS["W_gate"]) if self.adapter.gated else None

    @property
    def W_out(self) -> Float[Tensor, "layer d_mlp d_model"]:
        """MLP output weights (a copy)."""
        return stacked(self, MLP_WEIGHTS["W_out"])

    @property
    def b_in(self) -> Float[Tensor, "layer d_mlp"]:
        """MLP input biases (a copy)."""
        return stacked(self, MLP_WEIGHTS["b_in"])

    @property
    def b_out(self) -> Float[Tensor, "layer d_model"]:
        """MLP output biases (a copy)."""
        return stacked(self, MLP_WEIGHTS["b_out"])

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        """Token embedding (a view; Gemma: scaled by √d_model, a copy). See `weights.W_E`."""
        return W_E(self)

    @property
    def W_pos(self) -> Float[Tensor, "pos d_model"]:
        """Learned position embedding (a view); raises `WeightNotAvailableError` for rotary models."""
        return W_pos(self)

    @property
    def W_E_pos(self) -> Float[Tensor, "d_vocab_plus_pos d_model"]:
        """TransformerLens' ``W_E_pos``: `W_E` and `W_pos` stacked along the first axis (a copy); raises
        `WeightNotAvailableError` for rotary models."""
        return torch.cat([W_E(self), W_pos(self)], dim=0)

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """Unembedding with the final norm's γ folded in (a copy); the HF matrix is `W_U_raw`."""
        return W_U(self)

    @property
    def b_U(self) -> Float[Tensor, "d_vocab"]:
        """Unembedding bias with the final norm's β folded in (a copy); the HF bias is `b_U_raw`."""
        return b_U(self)

    @property
    def W_U_raw(self) -> Float[Tensor, "d_model d_vocab"]:
        """The HF unembedding matrix as ``[d_model, d_vocab]`` (a view)."""
        return W_U_raw(self)

    @property
    def b_U_raw(self) -> Float[Tensor, "d_vocab"] | None:
        """The HF unembedding bias (a view), or None."""
        return b_U_raw(self)

    # -- QK / OV circuits, head labels, composition scores (compat/circuits.py) --------------------

    @property
    def QK(self) -> FactoredMatrix:
        """``W_Q @ W_Kᵀ`` per layer and head: ``[layer, head, d_model, d_model]``, kept factored.

        Example:
            >>> model.QK.shape[:2] == (model.cfg.n_layers, model.cfg.n_heads)
            True
        """
        return FactoredMatrix(self.W_Q, per_query_head(self, self.W_K).transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """``W_V @ W_O`` per layer and head: ``[layer, head, d_model, d_model]``, kept factored.

        Example:
            >>> model.OV.AB.shape[-2:] == (model.cfg.d_model, model.cfg.d_model)
            True
        """
        return FactoredMatrix(per_query_head(self, self.W_V), self.W_O)

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

    # -- opt-in weight processing (compat/processing.py) -------------------------------------------

    weight_processing: WeightProcessing | None = None

    @classmethod
    def from_pretrained_no_processing(cls, name_or_path: str, *args: Any, **kwargs: Any) -> Any:
        """TransformerLens' name for loading without processing: `from_pretrained` (the default here)."""
        return cls.from_pretrained(name_or_path, *args, **kwargs)

    def process_weights(
        self,
        fold_ln: bool = True,
        center_writing_weights: bool = True,
        center_unembed: bool = True,
        fold_value_biases: bool = True,
        refactor_factored_attn_matrices: bool = False,
    ) -> WeightProcessing:
        """Rewrite the HF model's weights in place into TransformerLens' processed form; returns and records
        (``model.weight_processing``) what was applied and what was skipped (see `compat.processing`).

        Example:
            >>> model.process_weights(fold_ln=True, center_writing_weights=False)
        """
        report = process_weights(self, fold_ln, center_writing_weights, center_unembed, fold_value_biases,  # type: ignore[arg-type]
                                 refactor_factored_attn_matrices)  # fmt: skip
        previous = self.weight_processing
        applied = tuple(dict.fromkeys([*(previous.applied if previous else ()), *report.applied]))
        self.weight_processing = WeightProcessing(applied, {**(previous.skipped if previous else {}), **report.skipped})
        return self.weight_processing

    def enable_compatibility_mode(
        self,
        disable_warnings: bool = False,
        no_processing: bool = False,
        fold_ln: bool = True,
        center_writing_weights: bool = True,
        center_unembed: bool = True,
        fold_value_biases: bool = True,
        refactor_factored_attn_matrices: bool = False,
    ) -> None:
        """TransformerLens 4's switch to HookedTransformer's processed weights: `process_weights` with these
        steps (``no_processing=True``: none). Hook names need no switch here (TransformerLens' names are the
        canonical ones).

        Example:
            >>> model.enable_compatibility_mode()
            >>> model.weight_processing.applied
        """
        if not isinstance(disable_warnings, bool):
            raise TypeError(f"`disable_warnings` must be True or False, got {disable_warnings!r}.")
        kernel = getattr(self.hf_model.config, "_attn_implementation", None)
        if not disable_warnings and kernel not in (None, "eager"):
            warn_difference_once(self, "_warned_attention_kernel", (
                f"attention runs on the model's own kernel ({kernel!r}), whose logits are HF's; TransformerLens 4's "
                "bridge forces HF's eager attention, so numbers differ by float summation order (about 1e-5 on "
                "logits). Load the model with attn_implementation='eager' for TransformerLens' numbers."
            ))  # fmt: skip
        if no_processing:
            return
        self.process_weights(fold_ln, center_writing_weights, center_unembed, fold_value_biases,
                             refactor_factored_attn_matrices)  # fmt: skip

    # -- the component tree (model.blocks[i].attn ...) (compat/components.py) ----------------------

    @property
    def blocks(self) -> Blocks:
        """``model.blocks[i]`` with ``.attn``, ``.mlp``, ``.ln1``, ``.ln2`` and hook points as attributes."""
        return self._component_tree()[0]

    @property
    def embed(self) -> ComponentView:
        return self._component_tree()[1]["embed"]

    @property
    def unembed(self) -> ComponentView:
        return self._component_tree()[1]["unembed"]

    @property
    def ln_final(self) -> ComponentView:
        return self._component_tree()[1]["ln_final"]

    @property
    def pos_embed(self) -> ComponentView:
        model_level = self._component_tree()[1]
        if "pos_embed" not in model_level:
            raise WeightNotAvailableError(
                f"This {self.cfg.model_type} model has no learned position embedding (positions are rotary)."
            )
        return model_level["pos_embed"]

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, "d_model"]:
        """TransformerLens' ``model.accumulated_bias``: the output biases (``b_O``, ``b_out``) of the blocks
        before ``layer`` (``mlp_input``: plus ``layer``'s ``b_O``), zeros where a family has none.

        Example:
            >>> model.accumulated_bias(2).shape    # [d_model]
        """
        return full.accumulated_bias(self, layer, mlp_input, include_mlp_biases)

    @property
    def mod_dict(self) -> dict[str, Any]:
        """TransformerLens' name → module map: every hook point, and the HF modules under ``hf_model.``."""
        return {**{f"hf_model.{n}": m for n, m in self.hf_model.named_modules() if n}, **self.hook_dict}

    def _component_tree(self) -> tuple[Blocks, dict[str, ComponentView]]:
        tree = self.__dict__.get("_components")
        if tree is None:
            tree = build_components(self)
            self.__dict__["_components"] = tree
        return tree

    # -- caching hooks (compat/caching_hooks.py) ---------------------------------------------------

    def get_caching_hooks(
        self: BridgeCore,
        names_filter: Any = None,
        incl_bwd: bool = False,
        device: Any = None,
        remove_batch_dim: bool = False,
        cache: dict | None = None,
        pos_slice: Any = None,
    ) -> tuple[dict, list[HookPair], list[HookPair]]:
        """``(cache, fwd_hooks, bwd_hooks)``: hooks that store each selected point's tensor into ``cache``
        (a new `CachingDict` unless given: one entry per point, under its canonical name, that TransformerLens 4's
        spellings such as ``blocks.0.hook_out`` also read); ``bwd_hooks`` is empty unless ``incl_bwd``.
        ``remove_batch_dim`` drops a leading axis of size 1 from each tensor and keeps a larger batch whole.

        Example:
            >>> cache, fwd, _ = model.get_caching_hooks("resid_post")
            >>> with model.hooks(fwd_hooks=fwd):
            ...     model("Hello")
            >>> cache["blocks.0.hook_resid_post"].shape
        """
        return caching_hooks(self, names_filter, incl_bwd, device, remove_batch_dim, cache, pos_slice)

    def get_hook_point(self: BridgeCore, hook_name: str) -> HookPoint | None:
        """The hook point called ``hook_name`` (a TransformerLens 4 spelling such as ``blocks.0.hook_out`` too);
        None if there is none, as in TransformerLens.

        Example:
            >>> model.get_hook_point("blocks.0.hook_out") is model.hook_dict["blocks.0.hook_resid_post"]
            True
        """
        return hook_point(self, hook_name)

    def add_caching_hooks(
        self: BridgeCore,
        names_filter: Any = None,
        incl_bwd: bool = False,
        device: Any = None,
        remove_batch_dim: bool = False,
        cache: dict | None = None,
    ) -> dict:
        """Attach caching hooks (until ``reset_hooks()``) and return the dict they fill on every forward.

        Example:
            >>> cache = model.add_caching_hooks("pattern")
            >>> _ = model("Hello"); model.reset_hooks()
        """
        cache, fwd, bwd = self.get_caching_hooks(names_filter, incl_bwd, device, remove_batch_dim, cache)
        for name, fn in fwd:
            self.add_hook(name, fn, read_only=True)
        for name, fn in bwd:
            self.add_hook(name, fn, dir="bwd", read_only=True)
        return cache

    def cache_all(
        self, cache: dict | None, incl_bwd: bool = False, device: Any = None, remove_batch_dim: bool = False
    ) -> dict:
        """Deprecated (TransformerLens): ``add_caching_hooks(cache=cache)`` for every point."""
        warnings.warn("cache_all is deprecated; use add_caching_hooks or run_with_cache.", DeprecationWarning, 2)
        return self.add_caching_hooks(None, incl_bwd, device, remove_batch_dim, cache)

    def cache_some(
        self,
        cache: dict | None,
        names: Any,
        incl_bwd: bool = False,
        device: Any = None,
        remove_batch_dim: bool = False,
    ) -> dict:
        """Deprecated (TransformerLens): ``add_caching_hooks(names, cache=cache)``."""
        warnings.warn("cache_some is deprecated; use add_caching_hooks or run_with_cache.", DeprecationWarning, 2)
        return self.add_caching_hooks(names, incl_bwd, device, remove_batch_dim, cache)

    # -- token helpers (the rest of TransformerLens' token helpers are the core's, tokens.py) -----------------

    def tokens_to_residual_directions(self, tokens: str | int | Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        """The residual direction each token is read along: its column of the folded `W_U` (TransformerLens).

        Example:
            >>> paris = model.tokens_to_residual_directions(" Paris")        # [d_model]
        """
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        index = torch.as_tensor(tokens, device=self.W_U.device)
        return self.W_U[:, index].movedim(0, -1)

    # -- the wrapped model under its TransformerLens name -------------------------------------------------

    @property
    def original_model(self: BridgeCore) -> nn.Module:
        """TransformerLens' name for the wrapped HF model: the same object as ``model.hf_model``.

        Example:
            >>> model.original_model is model.hf_model
            True
        """
        return self.hf_model

    def set_use_attn_result(self: BridgeCore, use_attn_result: bool) -> None:
        """TransformerLens' switch for ``blocks.L.attn.hook_result`` (``cfg.use_attn_result``). ``True``: the point
        is computed (from ``hook_z`` and the output projection) while hooked or cached, and caches of all points hold
        it. ``False`` (the default, as in TransformerLens): caches of all points leave it out, and naming it in a
        hook or ``names_filter`` computes it on demand. The logits are the model's either way; TransformerLens 4
        instead computes the attention output as the sum of the heads' results while it is on (its logits move by
        float summation order), which the first ``True`` says once per model.

        Example:
            >>> model.set_use_attn_result(True)
            >>> _, cache = model.run_with_cache("Hi")
            >>> cache["result", 0].shape   # [batch, pos, head, d_model]
        """
        check_bool("use_attn_result", use_attn_result)
        if use_attn_result:
            warn_difference_once(self, "_warned_attn_result", (
                "set_use_attn_result(True): TransformerLens 4 then computes each attention output as the sum of its "
                "heads' results, which moves its logits by float summation order (about 1e-5); here the model's own "
                "computation stays (HF's logits) and hook_result is derived from hook_z and W_O, so the two bridges' "
                "numbers differ at that level."
            ))  # fmt: skip
        self.cfg.use_attn_result = use_attn_result  # TransformerLens' cfg field, which reads it back

    def set_use_split_qkv_input(self: BridgeCore, use_split_qkv_input: bool) -> None:
        """TransformerLens' switch (``cfg.use_split_qkv_input``) for ``blocks.L.hook_q_input`` / ``hook_k_input`` /
        ``hook_v_input``: per-head copies of the residual that Q, K and V read (`split_inputs`); an edit of head
        ``h``'s copy changes head ``h``'s query (or key, value) only. Refused with `config.ConfigFieldError` while
        ``use_attn_in`` is on, or where the family cannot honour it exactly.

        Example:
            >>> model.set_use_split_qkv_input(True)
            >>> model.run_with_hooks("Hi", fwd_hooks=[("blocks.0.hook_q_input", lambda x, hook: x * 0.5)])
        """
        self.cfg.use_split_qkv_input = check_bool("use_split_qkv_input", use_split_qkv_input)

    def set_use_attn_in(self: BridgeCore, use_attn_in: bool) -> None:
        """TransformerLens' switch (``cfg.use_attn_in``) for ``blocks.L.hook_attn_in``: one copy of the residual
        per query head that feeds Q, K and V (kv head ``g`` reads copy ``g``). Exclusive with
        ``use_split_qkv_input``.

        Example:
            >>> model.set_use_attn_in(True)
        """
        self.cfg.use_attn_in = check_bool("use_attn_in", use_attn_in)

    def set_use_hook_mlp_in(self: BridgeCore, use_hook_mlp_in: bool) -> None:
        """TransformerLens' switch (``cfg.use_hook_mlp_in``) for ``blocks.L.hook_mlp_in``: a copy of the MLP
        branch's input that the MLP reads (the residual its output joins keeps the unedited tensor).

        Example:
            >>> model.set_use_hook_mlp_in(True)
        """
        self.cfg.use_hook_mlp_in = check_bool("use_hook_mlp_in", use_hook_mlp_in)
