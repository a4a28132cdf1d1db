"""`ActivationCache`: hook name → tensor, TransformerLens shorthand keys, analysis helpers, safetensors I/O."""

import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..convertible import LabelledStack
from ..hooks.names import HookNames, HookOffError, NotCachedError, tl4_spelling
from ..utils import get_act_name
from . import analysis, full, heads, storage
from .pos_slice import PosSlice, check_pos_slice
from .storage import CacheFileError


class CacheModel(Protocol):
    """What a cache needs of its model (a `BridgeCore`): sizes, hook points, unembedding directions."""

    cfg: Any
    hook_dict: Mapping[str, Any]

    def unembed_directions(self, tokens: Any) -> Tensor: ...


__all__ = ["ActivationCache", "CacheFileError", "PosSlice", "check_pos_slice", "get_act_name"]


class ActivationCache(Mapping[str, Tensor]):
    """Cached activations by canonical hook name, with TransformerLens shorthand and helpers.

    ``cache["resid_post", 3]`` is ``cache["blocks.3.hook_resid_post"]``; negative layers count
    from the end. ``attention_mask`` ([batch, pos], 1 for real tokens) and ``prompt_lengths``
    (when the cache comes from `generate`) tell which positions are real.

    Example:
        >>> logits, cache = model.run_with_cache("Hello world")
        >>> cache["pattern", 0].shape          # [batch, head, query_pos, key_pos]
        >>> parts, labels = cache.decompose_resid(return_labels=True)
    """

    def __init__(
        self,
        tensors: dict[str, Tensor],
        model: CacheModel | None = None,
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        prompt_lengths: Int[Tensor, "batch"] | None = None,
        has_batch_dim: bool = True,
    ) -> None:
        self._tensors = tensors
        self.model = model
        self.attention_mask = attention_mask
        self.prompt_lengths = prompt_lengths
        self.has_batch_dim = has_batch_dim

    # -- mapping --------------------------------------------------------------------------------
    def _key(self, key: Any) -> str:
        known = self.model.hook_dict if getattr(self.model, "hook_dict", None) is not None else self._tensors
        if isinstance(key, str) and (key in self._tensors or tl4_spelling(key, known) in self._tensors):
            return key if key in self._tensors else tl4_spelling(key, known)
        compact = _tl_compact_name(key)  # TransformerLens' compact strings: "scale5ln1", "k6"
        if compact is not None and compact in self._tensors:
            return compact
        valid = list(self.model.hook_dict) if self.model is not None else list(self._tensors)
        n_layers = getattr(getattr(self.model, "cfg", None), "n_layers", None)
        if n_layers is None:  # no model, or one without a cfg (a HookedRootModule): count the named blocks
            n_layers = _layers_in(valid)
        off = getattr(self.model, "_points_off", None)  # a switched-off point is named as such, not as unknown
        names = HookNames([*valid, *off()] if callable(off) else valid, n_layers)
        if callable(off):
            names.off = off
        try:
            name = names.key(key, "key")
        except HookOffError as e:
            raise NotCachedError(f"Not in this cache: {e}") from None
        if name not in self._tensors:
            hint = (
                " (`cfg.use_attn_result` is False, TransformerLens' default: caches of all points leave head "
                "results out; or call `cache.compute_head_results()`)"
                if name.endswith("attn.hook_result")
                else ""
            )
            raise NotCachedError(
                f"{name!r} is a valid hook point but is not in this cache; add it to `names_filter` (or use "
                f"names_filter=None for everything){hint}. This cache holds {len(self._tensors)} names."
            )
        return name

    def __getitem__(self, key: Any) -> Tensor:
        return self._tensors[self._key(key)]

    def __contains__(self, key: object) -> bool:
        try:
            self._key(key)
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} tensors, {self.nbytes() / 2**20:.2f} MiB)"

    def nbytes(self) -> int:
        """Bytes held, counting shared storage once."""
        seen: dict[tuple, int] = {}
        for t in self._tensors.values():
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), t.device)] = storage.nbytes()
        return sum(seen.values())

    def _derive(self, tensors: dict[str, Tensor], **changes: Any) -> "ActivationCache":
        fields = dict(
            model=self.model,
            attention_mask=self.attention_mask,
            prompt_lengths=self.prompt_lengths,
            has_batch_dim=self.has_batch_dim,
        )
        fields.update(changes)
        return ActivationCache(tensors, **fields)

    def to(self, device: str | torch.device) -> "ActivationCache":
        """A cache with every tensor on ``device`` (shared tensors stay shared)."""
        moved: dict[int, Tensor] = {}
        out = {k: moved.setdefault(id(t), t.to(device)) for k, t in self._tensors.items()}
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        lengths = None if self.prompt_lengths is None else self.prompt_lengths.to(device)
        return self._derive(out, attention_mask=mask, prompt_lengths=lengths)

    def apply_slice_to_batch_dim(self, batch_slice: PosSlice | None) -> "ActivationCache":
        """The cache at the rows ``batch_slice`` selects (TransformerLens' `Slice` rules: an int drops the
        batch axis, leaving a cache without one).

        Example:
            >>> cache.apply_slice_to_batch_dim(0)["resid_post", 0].shape   # [pos, d_model]
        """
        return full.apply_slice_to_batch_dim(self, batch_slice)

    def remove_batch_dim(self, batch_size: int | None = None) -> "ActivationCache":
        """Drop the batch dimension of a batch-1 cache, in place as TransformerLens does; returns the cache.

        The batch size is ``batch_size`` when given, else the rows of the cache's attention mask (a run's
        cache), else the most common leading size of its tensors; anything but 1 raises. Entries whose
        leading size is not 1 (position-indexed or flattened ``[batch * pos, ...]`` ones) are kept as they are.

        Example:
            >>> _, cache = model.run_with_cache("Hi")
            >>> cache.remove_batch_dim()["resid_post", 0].shape   # [pos, d_model]; cache.has_batch_dim is False
        """
        return full.remove_batch_dim(self, batch_size)

    def _batch_size(self) -> int:
        """The number of rows (see `full.batch_size`)."""
        return full.batch_size(self)

    # -- analysis -----------------------------------------------------------------------------
    def _need_model(self) -> CacheModel:
        if self.model is None:
            raise ValueError("This cache has no model attached; pass `model=` to ActivationCache.load.")
        return self.model

    def _get(self, name: str, why: str) -> Tensor:
        if name not in self._tensors:
            raise KeyError(
                f"{why} needs {name!r}, which is not in the cache. Re-run with a `names_filter` that "
                f"includes it (or names_filter=None for everything)."
            )
        return self._tensors[name]

    def _select(self, t: Tensor, selection: Any, dim: int, param: str) -> Tensor:
        """``t`` along ``dim`` at an int (the axis dropped, as TransformerLens), a slice or a list of indices;
        None keeps all."""
        if selection is None:
            return t
        selection = check_pos_slice(selection, t.shape[dim], param)
        if isinstance(selection, int):
            return t.select(dim, selection)
        if isinstance(selection, list):
            return t.index_select(dim, torch.as_tensor(selection, device=t.device))
        return t[(slice(None),) * dim + (selection,)]

    def _at_pos(self, t: Tensor, pos_slice: Any) -> Tensor:
        """A cached ``[(batch,) pos, ...]`` tensor at the positions ``pos_slice`` selects."""
        return self._select(t, pos_slice, int(self.has_batch_dim), "pos_slice")

    @property
    def cache_dict(self) -> dict[str, Tensor]:
        """The underlying name → tensor dict (TransformerLens' attribute; edits change the cache)."""
        return self._tensors

    def toggle_autodiff(self, mode: bool = False) -> None:
        """Switch torch's autograd on or off globally (TransformerLens' helper; prefer ``torch.no_grad()``)."""
        warnings.warn(f"toggle_autodiff changed torch's global state: grad enabled = {mode}.", stacklevel=2)
        torch.set_grad_enabled(mode)

    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: PosSlice | None = None,
        mlp_input: bool = False,
        return_labels: bool = False,
    ) -> Float[Tensor, "layer *batch pos d_model"] | tuple[Tensor, list[str]]:
        """The residual stream entering each layer, up to and including the input of ``layer``.

        ``layer`` counts layer inputs, ``0..n_layers``: ``n_layers`` (also None and -1) is the stream
        after the last block, labelled ``"final_post"``; the others are ``resid_pre``, labelled
        ``"{l}_pre"``. ``incl_mid`` adds ``resid_mid`` of the layers before ``layer`` (``"{l}_mid"``);
        ``mlp_input`` ends at the input of ``layer``'s MLP (its ``resid_mid``; parallel attention/MLP
        blocks feed the MLP ``resid_pre``, so nothing is added there). ``apply_ln`` applies the norm that
        reads ``layer`` to each entry with that entry's own statistics (the logit lens; `apply_ln_to_stack`
        with ``recompute_ln=True``, TransformerLens 4.3's rule); the last entry's are the cached ones.

        Example:
            >>> resids, labels = cache.accumulated_resid(return_labels=True)   # logit lens input
            >>> labels[0], labels[-1]
            ('0_pre', 'final_post')
        """
        return _labelled(
            analysis.accumulated_resid(self, layer, incl_mid, apply_ln, pos_slice, mlp_input, return_labels)
        )

    def decompose_resid(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        mode: Literal["all", "mlp", "attn"] = "all",
        apply_ln: bool = False,
        pos_slice: PosSlice | None = None,
        incl_embeds: bool = True,
        return_labels: bool = False,
    ) -> Float[Tensor, "component *batch pos d_model"] | tuple[Tensor, list[str]]:
        """Split the residual stream entering ``layer`` into the embeddings and each block's outputs.

        Parts: ``embed`` (the token embedding as it enters the stream, Gemma's √d scaling included),
        ``pos_embed`` (absolute-position families), then ``{l}_attn_out`` and ``{l}_mlp_out`` for the
        layers before ``layer`` (``mode`` ``"attn"`` / ``"mlp"`` keeps one kind). ``layer`` is
        ``0..n_layers`` as in `accumulated_resid`; ``mlp_input`` adds ``layer``'s own attention output
        (not in parallel attention/MLP blocks). When hooks edited the residual stream during the forward that
        filled the cache (steering, ablation), each edit is a part of its own, ``edit:blocks.L.hook_resid_post``
        (``edit:unlocated`` when the cache lacks the points around it). The parts sum to that residual up to
        float rounding.

        Example:
            >>> parts, labels = cache.decompose_resid(return_labels=True)
            >>> torch.allclose(parts.sum(0), cache["resid_post", -1], atol=1e-5)
            True
        """
        out = analysis.decompose_resid(self, layer, mlp_input, mode, apply_ln, pos_slice, incl_embeds, return_labels)
        return _labelled(out)

    def compute_head_results(self) -> None:
        """Store each layer's ``blocks.L.attn.hook_result`` computed from the cached ``hook_z``.

        Each head's ``z`` through its slice of the output projection, bias excluded: what the hook
        point computes during a forward. Layers whose result is cached are left as they are.

        Example:
            >>> _, cache = model.run_with_cache("Hi", names_filter=lambda n: "hook_z" in n)
            >>> cache.compute_head_results(); cache["result", 0].shape   # [batch, pos, head, d_model]
        """
        heads.compute_head_results(self)

    def stack_head_results(
        self,
        layer: int | None = -1,
        return_labels: bool = False,
        incl_remainder: bool = False,
        pos_slice: PosSlice | None = None,
        apply_ln: bool = False,
    ) -> Float[Tensor, "component *batch pos d_model"] | tuple[Tensor, list[str]]:
        """Each head's contribution to the residual stream in the layers before ``layer``, stacked.

        Rows are labelled ``L{layer}H{head}``; ``incl_remainder`` adds ``"remainder"``, the residual
        entering ``layer`` minus the heads. As in TransformerLens 4.3, ``layer=0`` with the remainder is the
        whole model (the final residual stream, one row), and a ``layer`` below -1 with it is refused;
        without it, negative layers count from the end (-1, None: ``n_layers``). Read from ``hook_result``,
        or computed from ``hook_z`` when the result is not cached. For Gemma 2 the rows are the heads' outputs
        through the post-attention norm at its cached scale (see ``cache.heads``), so they sum to ``attn_out``.

        Example:
            >>> heads, labels = cache.stack_head_results(return_labels=True)   # labels "L0H0", …
        """
        return _labelled(heads.stack_head_results(self, layer, return_labels, incl_remainder, pos_slice, apply_ln))

    def get_neuron_results(
        self,
        layer: int,
        neuron_slice: PosSlice | None = None,
        pos_slice: PosSlice | None = None,
        project_output_onto: Tensor | None = None,
    ) -> Float[Tensor, "*batch pos neuron d_model"]:
        """Each neuron's contribution to the residual stream in block ``layer``: ``hook_post[n] * W_out[n]``.

        The down projection's bias is not included (see `accumulated_bias`); Gemma 2's go through the
        post-feedforward norm at its cached scale. Not stored: it is large and cheap to recompute.
        ``project_output_onto`` (``[d_model]`` or ``[d_model, k]``) contracts the ``d_model`` axis with it.

        Example:
            >>> cache.get_neuron_results(0, neuron_slice=[3, 7]).shape   # [batch, pos, 2, d_model]
        """
        return heads.get_neuron_results(self, layer, neuron_slice, pos_slice, project_output_onto)

    def stack_neuron_results(
        self,
        layer: int | None,
        pos_slice: PosSlice | None = None,
        neuron_slice: PosSlice | None = None,
        return_labels: bool = False,
        incl_remainder: bool = False,
        apply_ln: bool = False,
        mlp_input: bool = False,
        project_output_onto: Tensor | None = None,
    ) -> Float[Tensor, "component *batch pos d_model"] | tuple[Tensor, list[str]]:
        """Each neuron's contribution (`get_neuron_results`) in the layers before ``layer``, stacked.

        Rows are labelled ``L{layer}N{neuron}``; ``incl_remainder`` adds ``"remainder"``, the residual
        entering ``layer`` (its MLP with ``mlp_input``) minus the neurons; ``layer`` counts as in
        `stack_head_results` (at 0 the remainder is the whole model, or ``resid_mid[0]`` with ``mlp_input``).
        Large: ``layer * d_mlp`` rows; ``project_output_onto`` (``[d_model]`` or ``[d_model, k]``) contracts the
        ``d_model`` axis with it.

        Example:
            >>> neurons, labels = cache.stack_neuron_results(1, return_labels=True)   # labels "L0N0", …
        """
        out = heads.stack_neuron_results(
            self, layer, pos_slice, neuron_slice, return_labels, incl_remainder, apply_ln, mlp_input,
            project_output_onto,
        )  # fmt: skip
        return _labelled(out)

    def accumulated_bias(
        self, layer: int | None, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, "d_model"]:
        """Sum of the attention output biases ``b_O`` and MLP output biases ``b_out`` of the blocks before ``layer``.

        ``mlp_input`` adds ``layer``'s own ``b_O``; families without those biases contribute zeros.
        These are the biases as stored: behind Gemma 2's sandwich norms they enter the residual
        through the norm (`get_full_resid_decomposition`'s ``"bias"`` row accounts for that).

        Example:
            >>> cache.accumulated_bias(2).shape   # [d_model]
        """
        return full.accumulated_bias(self._need_model(), layer, mlp_input, include_mlp_biases)

    def get_full_resid_decomposition(
        self,
        layer: int | None = None,
        mlp_input: bool = False,
        expand_neurons: bool = True,
        apply_ln: bool = False,
        pos_slice: PosSlice | None = None,
        return_labels: bool = False,
        project_output_onto: Tensor | None = None,
    ) -> Float[Tensor, "component *batch pos d_model"] | tuple[Tensor, list[str]]:
        """The residual entering ``layer`` as every head, every neuron (or MLP), the embeddings and the biases.

        Rows, in TransformerLens' order: ``L{l}H{h}`` heads, ``L{l}N{n}`` neurons (``{l}_mlp_out``
        without ``expand_neurons``), ``embed``, ``pos_embed`` (absolute-position families), ``bias``
        (every ``b_O``, and ``b_out`` with ``expand_neurons``), and an ``edit:…`` row for each edit hooks made to
        the residual stream (see `decompose_resid`). They sum to ``resid_pre[layer]``
        (``resid_mid`` with ``mlp_input``; the final residual for ``layer`` None) up to rounding, on
        every family; for Gemma 2 through the sandwich norms at their cached scales.
        ``project_output_onto`` (``[d_model]`` or ``[d_model, k]``) contracts the ``d_model`` axis with it.

        Example:
            >>> parts, labels = cache.get_full_resid_decomposition(return_labels=True)
            >>> attrs = cache.logit_attrs(parts, tokens=model.to_single_token(" Paris"))
        """
        out = full.get_full_resid_decomposition(
            self, layer, mlp_input, expand_neurons, apply_ln, pos_slice, return_labels, project_output_onto
        )
        return _labelled(out)

    def stack_activation(
        self, activation_name: str, layer: int | None = -1, sublayer_type: str | None = None
    ) -> Float[Tensor, "layer ..."]:
        """``cache[activation_name, l]`` for the layers before ``layer`` (-1 / None: all), stacked.

        Example:
            >>> cache.stack_activation("pattern").shape   # [layer, batch, head, query_pos, key_pos]
        """
        layer = analysis.resolve_layer(layer, self._need_model().cfg.n_layers)
        return torch.stack([self[activation_name, i, sublayer_type] for i in range(layer)])

    def apply_ln_to_stack(
        self,
        residual_stack: Float[Tensor, "component *batch pos d_model"],
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: PosSlice | None = None,
        batch_slice: PosSlice | None = None,
        has_batch_dim: bool = True,
        recompute_ln: bool = False,
    ) -> Float[Tensor, "component *batch pos d_model"]:
        """Apply the cached norm scale to each component, as the whole stream was normed.

        Centres each component (LayerNorm families) and divides by the cached scale of the norm that
        reads ``layer``: ``ln1`` (``ln2`` with ``mlp_input``) of that layer, or the final norm for
        ``layer`` n_layers / -1 / None. The norm's weight and bias are not applied (see `logit_attrs`).
        ``pos_slice``: the positions the stack already holds (it selects the cached scale);
        ``batch_slice``: the rows to take, of the stack and the scale; ``has_batch_dim=False``: the
        stack has no batch axis. Components then sum to ``hook_normalized`` up to rounding.
        ``recompute_ln=True`` with the final norm (``layer`` None / -1 / n_layers): each component is
        normalised by its own statistics instead (TransformerLens 4's logit-lens option).

        Example:
            >>> normed = cache.apply_ln_to_stack(cache.decompose_resid(pos_slice=-1), layer=-1, pos_slice=-1)
        """
        return analysis.apply_ln_to_stack(
            self, residual_stack, layer, mlp_input, pos_slice, batch_slice, has_batch_dim, recompute_ln
        )

    def logit_attrs(
        self,
        residual_stack: Float[Tensor, "component *batch pos d_model"],
        tokens: Int[Tensor, "..."] | int | str,
        incorrect_tokens: Int[Tensor, "..."] | int | str | None = None,
        pos_slice: PosSlice | None = None,
        batch_slice: PosSlice | None = None,
        has_batch_dim: bool = True,
        has_applied_ln: bool = False,
    ) -> Float[Tensor, "component *batch pos"]:
        """Direct logit attribution of each residual component to ``tokens`` (minus ``incorrect_tokens``).

        Each component is normed with the cached final-norm scale (`apply_ln_to_stack`, with
        ``pos_slice`` / ``batch_slice`` / ``has_batch_dim``; skipped if ``has_applied_ln``) and projected
        on ``γ ⊙ W_U_raw[:, token]`` (``model.W_U[:, token]``, γ folded in). ``tokens``: an id or a
        one-token string (every row and position), a ``[batch]`` tensor (one per row, when its length is
        the stack's batch size), ``[pos]`` (one per position) or ``[batch, pos]``. The attributions sum
        to the logit minus ``model.b_U[token]`` (the bias terms ``β · W_U_raw[:, token] + b_U_raw[token]``:
        LayerNorm families, models with an unembedding bias), and before Gemma 2's final logit soft-capping.

        Example:
            >>> stack = cache.decompose_resid(pos_slice=-1)
            >>> attrs = cache.logit_attrs(stack, tokens=" Paris", pos_slice=-1)   # [component, batch, 1]
        """
        return analysis.logit_attrs(
            self, residual_stack, tokens, incorrect_tokens, pos_slice, batch_slice, has_batch_dim, has_applied_ln
        )

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Save to a safetensors file (no pickle). Tensors shared under several names are written once.

        Example:
            >>> cache.save("acts.safetensors")
        """
        storage.save(self, path)

    @classmethod
    def load(
        cls, path: str | Path, model: CacheModel | None = None, device: str | torch.device = "cpu"
    ) -> "ActivationCache":
        """Load a cache written by `save`; attach ``model`` for the analysis helpers.

        Example:
            >>> cache = ActivationCache.load("acts.safetensors", model)
        """
        return cls(model=model, **storage.load(path, device))


def _labelled(out: Any) -> Any:
    """A ``(stack, labels)`` pair as a `LabelledStack`, which ``torch.as_tensor`` / ``np.asarray`` read as the stack;
    a bare stack as it is."""
    return LabelledStack(*out) if isinstance(out, tuple) else out


def _layers_in(names: Iterable[str]) -> int:
    return 1 + max((int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n))), default=-1)


def _tl_compact_name(key: Any) -> str | None:
    """The hook name of one of TransformerLens' compact strings (``"scale5ln1"``), None if ``key`` is not one."""
    if not isinstance(key, str) or "." in key or key.startswith("hook_"):
        return None
    try:
        return get_act_name(key)
    except (ValueError, TypeError, KeyError):
        return None
