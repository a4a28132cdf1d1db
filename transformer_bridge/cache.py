"""`ActivationCache`: hook name → tensor, TransformerLens shorthand keys, analysis helpers, safetensors I/O."""

import json
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from jaxtyping import Float, Int
from safetensors.torch import load_file, save_file
from torch import Tensor

from .checks import check_device
from .names import HookNames, NotCachedError, get_act_name


class CacheModel(Protocol):
    """What a cache needs of its model (a `BridgeCore`): sizes, hook points, unembedding directions."""

    cfg: Any
    hook_dict: Mapping[str, Any]

    def unembed_directions(self, tokens: Any) -> Tensor: ...


__all__ = ["ActivationCache", "check_pos_slice", "get_act_name"]

PosSlice = int | slice | Sequence[int] | Tensor


def check_pos_slice(pos_slice: Any, n_pos: int, param: str = "pos_slice") -> int | slice | list[int]:
    """Validate a position selection over ``n_pos`` positions; returns it normalised.

    An int selects one position (negative counts from the end) and keeps the axis; a slice needs a
    positive step and must select something; a list / 1-d integer tensor selects those positions.

    Example:
        >>> check_pos_slice(-1, 5)
        4
    """
    if isinstance(pos_slice, bool):
        raise TypeError(f"`{param}` must be an int, a slice or a list of ints, got bool {pos_slice!r}.")
    if isinstance(pos_slice, Tensor) and pos_slice.dim() == 0:
        pos_slice = pos_slice.item()
    if not isinstance(pos_slice, (slice, list, tuple, range, Tensor)) and hasattr(pos_slice, "__index__"):
        index = operator.index(pos_slice)
        if not -n_pos <= index < n_pos:
            raise IndexError(f"`{param}`={index} is out of range for {n_pos} positions; use -{n_pos}..{n_pos - 1}.")
        return index % n_pos
    if isinstance(pos_slice, slice):
        for part in ("start", "stop", "step"):
            value = getattr(pos_slice, part)
            if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__")):
                raise TypeError(f"`{param}`={pos_slice!r}: the slice's {part} must be an int or None.")
        if pos_slice.step is not None and pos_slice.step <= 0:
            raise ValueError(f"`{param}`={pos_slice!r}: the step must be positive, got {pos_slice.step}.")
        if not range(n_pos)[pos_slice]:
            raise IndexError(f"`{param}`={pos_slice!r} selects no position out of {n_pos}.")
        return pos_slice
    if isinstance(pos_slice, Tensor):
        if pos_slice.dim() != 1 or pos_slice.dtype.is_floating_point or pos_slice.dtype == torch.bool:
            raise TypeError(
                f"`{param}` as a tensor must be 1-d integer positions, got dtype {pos_slice.dtype} shape "
                f"{tuple(pos_slice.shape)}."
            )
        pos_slice = pos_slice.tolist()
    if isinstance(pos_slice, (list, tuple, range)):
        items = list(pos_slice)
        if not items:
            raise ValueError(f"`{param}` is an empty list; give at least one position.")
        bad = [p for p in items if isinstance(p, bool) or not hasattr(p, "__index__")]
        if bad:
            raise TypeError(f"`{param}` must hold ints, got {bad[0]!r} ({type(bad[0]).__name__}).")
        out = [p.__index__() for p in items]
        outside = [p for p in out if not -n_pos <= p < n_pos]
        if outside:
            raise IndexError(f"`{param}` holds position {outside[0]}, out of range for {n_pos} positions.")
        return [p % n_pos for p in out]
    raise TypeError(
        f"`{param}` must be an int, a slice, a list of ints or None, got {type(pos_slice).__name__} {pos_slice!r}."
    )


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
        if isinstance(key, str) and key in self._tensors:
            return key
        valid = list(self.model.hook_dict) if self.model is not None else list(self._tensors)
        n_layers = self.model.cfg.n_layers if self.model is not None else _layers_in(self._tensors)
        name = HookNames(valid, n_layers).key(key, "key")
        if name not in self._tensors:
            raise NotCachedError(
                f"{name!r} is a valid hook point but is not in this cache; add it to `names_filter` (or use "
                f"names_filter=None for everything). This cache holds {len(self._tensors)} names."
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

    def remove_batch_dim(self) -> "ActivationCache":
        """Drop the batch dimension of a batch-1 cache."""
        if not self.has_batch_dim:
            return self
        for name, t in self._tensors.items():
            if t.shape[0] != 1:
                raise ValueError(f"remove_batch_dim needs batch 1, but {name!r} has batch {t.shape[0]}.")
        squeezed: dict[int, Tensor] = {}
        out = {k: squeezed.setdefault(id(t), t[0]) for k, t in self._tensors.items()}
        mask = None if self.attention_mask is None else self.attention_mask[0]
        return self._derive(out, attention_mask=mask, has_batch_dim=False)

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

    def accumulated_resid(
        self,
        layer: int | None = None,
        incl_mid: bool = False,
        apply_ln: bool = False,
        pos_slice: int | slice | None = None,
        return_labels: bool = False,
    ) -> Float[Tensor, "layer batch pos d_model"] | tuple[Tensor, list[str]]:
        """The residual stream before each layer up to ``layer`` (all layers and the final one if None).

        Example:
            >>> resids, labels = cache.accumulated_resid(return_labels=True)  # labels "0_pre", …, "final_post"
        """
        n = self._need_model().cfg.n_layers
        layer = n if layer is None else (layer + n + 1 if layer < 0 else layer)
        parts, labels = [], []
        for i in range(min(layer, n) + (1 if layer > n else 0)):
            parts.append(self._get(f"blocks.{i}.hook_resid_pre", "accumulated_resid"))
            labels.append(f"{i}_pre")
            if incl_mid and f"blocks.{i}.hook_resid_mid" in self.model.hook_dict:
                parts.append(self._get(f"blocks.{i}.hook_resid_mid", "accumulated_resid(incl_mid=True)"))
                labels.append(f"{i}_mid")
        if layer == n:
            parts.append(self._get(f"blocks.{n - 1}.hook_resid_post", "accumulated_resid"))
            labels.append("final_post")
        stack = _pos(torch.stack(parts), pos_slice, self.has_batch_dim)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer=None if layer == n else layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def decompose_resid(
        self,
        layer: int | None = None,
        mode: str = "all",
        apply_ln: bool = False,
        pos_slice: int | slice | None = None,
        return_labels: bool = False,
    ) -> Float[Tensor, "component batch pos d_model"] | tuple[Tensor, list[str]]:
        """Split the residual stream before ``layer`` (after the last layer if None) into its parts.

        Parts: ``embed`` (token embedding as it enters the stream, Gemma's √d scaling included),
        ``pos_embed`` (absolute-position families), then ``{l}_attn_out`` and ``{l}_mlp_out``. They
        sum to ``resid_pre[layer]`` (``resid_post[-1]`` for None) up to float rounding.
        ``mode`` is ``"all"``, ``"attn"`` or ``"mlp"`` (which block outputs to include).
        """
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"`mode` must be 'all', 'attn' or 'mlp', got {mode!r}.")
        model = self._need_model()
        n = model.cfg.n_layers
        layer = n if layer is None else (layer + n + 1 if layer < 0 else layer)
        resid0 = self._get("blocks.0.hook_resid_pre", "decompose_resid")
        parts, labels = [], []
        if "hook_pos_embed" in model.hook_dict:
            pos = self._get("hook_pos_embed", "decompose_resid").expand_as(resid0)
            parts += [resid0 - pos, pos]
            labels += ["embed", "pos_embed"]
        else:
            parts.append(resid0)
            labels.append("embed")
        for i in range(layer):
            if mode in ("all", "attn"):
                parts.append(self._get(f"blocks.{i}.hook_attn_out", "decompose_resid"))
                labels.append(f"{i}_attn_out")
            if mode in ("all", "mlp"):
                parts.append(self._get(f"blocks.{i}.hook_mlp_out", "decompose_resid"))
                labels.append(f"{i}_mlp_out")
        stack = _pos(torch.stack(parts), pos_slice, self.has_batch_dim)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer=None if layer == n else layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def stack_head_results(
        self,
        layer: int | None = None,
        pos_slice: int | slice | None = None,
        apply_ln: bool = False,
        return_labels: bool = False,
    ) -> Float[Tensor, "component batch pos d_model"] | tuple[Tensor, list[str]]:
        """Each head's output (``hook_result``, bias excluded) for layers before ``layer``, stacked.

        Labels are ``L{layer}H{head}``. Needs ``hook_result`` cached (computed only when asked for).
        """
        model = self._need_model()
        n = model.cfg.n_layers
        layer = n if layer is None else (layer + n + 1 if layer < 0 else layer)
        parts, labels = [], []
        for i in range(layer):
            result = self._get(f"blocks.{i}.attn.hook_result", "stack_head_results")
            per_head = result.movedim(-2, 0)  # [head, (batch,) pos, d_model]
            parts.append(per_head)
            labels += [f"L{i}H{h}" for h in range(per_head.shape[0])]
        stack = _pos(torch.cat(parts), pos_slice, self.has_batch_dim)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer=None if layer == n else layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(
        self,
        stack: Float[Tensor, "component ... d_model"],
        layer: int | None = None,
        mlp_input: bool = False,
        pos_slice: int | slice | None = None,
    ) -> Float[Tensor, "component ... d_model"]:
        """Apply the cached norm to each component as the whole stream was normed.

        Centres each component (LayerNorm families) and divides by the cached scale of the final
        norm (``layer=None``) or of ``ln1`` / ``ln2`` (``mlp_input=True``) of ``layer``; the norm's
        weight and bias are not applied (see `logit_attrs`). Components then sum to
        ``hook_normalized`` up to rounding.
        """
        model = self._need_model()
        if layer is None or layer == model.cfg.n_layers:
            name = "ln_final.hook_scale"
        else:
            name = f"blocks.{layer}.{'ln2' if mlp_input else 'ln1'}.hook_scale"
        scale = _pos(self._get(name, "apply_ln_to_stack"), pos_slice, self.has_batch_dim, component_axis=False)
        if model.cfg.normalization == "layernorm":
            stack = stack - stack.mean(-1, keepdim=True)
        return stack / scale

    def logit_attrs(
        self,
        stack: Float[Tensor, "component ... d_model"],
        tokens: Int[Tensor, "..."] | int,
        incorrect_tokens: Int[Tensor, "..."] | int | None = None,
        pos_slice: int | slice | None = None,
        has_applied_ln: bool = False,
    ) -> Float[Tensor, "component ..."]:
        """Direct logit attribution of each residual component to ``tokens`` (minus ``incorrect_tokens``).

        Each component is normed with the cached final-norm scale (unless ``has_applied_ln``) and
        projected on ``γ ⊙ W_U[:, token]``. The attributions sum to the logit minus the bias terms
        ``β · W_U[:, token] + b_U[token]`` (LayerNorm families, models with an unembedding bias),
        and before Gemma 2's final logit soft-capping.

        Example:
            >>> stack = cache.decompose_resid(pos_slice=-1)
            >>> attrs = cache.logit_attrs(stack, tokens=model.to_single_token(" Paris"))
        """
        model = self._need_model()
        if not has_applied_ln:
            stack = self.apply_ln_to_stack(stack, None, pos_slice=pos_slice)
        direction = model.unembed_directions(tokens)
        if incorrect_tokens is not None:
            direction = direction - model.unembed_directions(incorrect_tokens)
        direction = direction.to(stack.device, stack.dtype)
        if direction.dim() == 2:  # one token per batch row: broadcast over positions
            direction = direction[:, None, :]
        return (stack * direction).sum(-1)

    # -- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Save to a safetensors file (no pickle). Tensors shared under several names are written once."""
        unique: dict[tuple, str] = {}
        tensors: dict[str, Tensor] = {}
        aliases: dict[str, str] = {}
        for name, t in self._tensors.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.device)
            if key in unique:
                aliases[name] = unique[key]
            else:
                unique[key] = name
                tensors[name] = t.detach().contiguous().clone() if not t.is_contiguous() else t.detach().clone()
        for extra in ("attention_mask", "prompt_lengths"):
            value = getattr(self, extra)
            if value is not None:
                tensors[f"__{extra}__"] = value.detach().contiguous().clone()
        meta = {"aliases": json.dumps(aliases), "has_batch_dim": json.dumps(self.has_batch_dim)}
        save_file({k: v.cpu() for k, v in tensors.items()}, str(path), metadata=meta)

    @classmethod
    def load(
        cls, path: str | Path, model: CacheModel | None = None, device: str | torch.device = "cpu"
    ) -> "ActivationCache":
        """Load a cache written by `save`; attach ``model`` for the analysis helpers."""
        from safetensors import SafetensorError, safe_open

        path = Path(path) if isinstance(path, (str, Path)) else path
        if not isinstance(path, Path):
            raise TypeError(f"`path` must be a str or Path, got {type(path).__name__} {path!r}.")
        if path.is_dir():
            raise CacheFileError(f"`path`={str(path)!r} is a directory; give the .safetensors file written by `save`.")
        if not path.exists():
            raise FileNotFoundError(f"`path`={str(path)!r} does not exist.")
        device = check_device(device) or torch.device("cpu")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path), device=str(device))
        except (SafetensorError, OSError, ValueError) as e:
            raise CacheFileError(f"`path`={str(path)!r} is not a safetensors cache file written by `save`: {e}") from e
        mask = tensors.pop("__attention_mask__", None)
        lengths = tensors.pop("__prompt_lengths__", None)
        aliases = _read_meta(meta, "aliases", "{}", path)
        if not isinstance(aliases, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
        ):
            raise CacheFileError(f"{str(path)!r}: metadata `aliases` must map names to names, got {aliases!r}.")
        for name, target in aliases.items():
            if target not in tensors:
                raise CacheFileError(f"{str(path)!r}: metadata alias {name!r} -> {target!r} names no stored tensor.")
            tensors[name] = tensors[target]
        has_batch_dim = _read_meta(meta, "has_batch_dim", "true", path)
        if not isinstance(has_batch_dim, bool):
            raise CacheFileError(
                f"{str(path)!r}: metadata `has_batch_dim` must be true or false, got {has_batch_dim!r}."
            )
        return cls(tensors, model, mask, lengths, has_batch_dim)


class CacheFileError(ValueError):
    """A file that is not a cache written by `ActivationCache.save` (or is damaged)."""


def _read_meta(meta: dict[str, str], key: str, default: str, path: Path) -> Any:
    try:
        return json.loads(meta.get(key, default))
    except json.JSONDecodeError as e:
        raise CacheFileError(f"{str(path)!r}: metadata `{key}` is not valid JSON ({e}).") from e


def _layers_in(names: Iterable[str]) -> int:
    return 1 + max((int(n.split(".")[1]) for n in names if n.startswith("blocks.")), default=-1)


def _pos(t: Tensor, pos_slice: Any, has_batch_dim: bool, component_axis: bool = True) -> Tensor:
    """Slice the position axis of ``[(component,) (batch,) pos, ...]``, keeping it as an axis."""
    if pos_slice is None:
        return t
    dim = int(has_batch_dim) + int(component_axis)
    pos_slice = check_pos_slice(pos_slice, t.shape[dim])
    if isinstance(pos_slice, int):
        return t.narrow(dim, pos_slice, 1)
    if isinstance(pos_slice, list):
        return t.index_select(dim, torch.as_tensor(pos_slice, device=t.device))
    index = [slice(None)] * t.dim()
    index[dim] = pos_slice
    return t[tuple(index)]
