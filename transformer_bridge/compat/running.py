"""TransformerLens' keywords of ``run_with_cache`` over the core's, and TL's name for the wrapped model.

TransformerLens' ``run_with_cache`` passes forward keywords through (``return_type="loss"``,
``loss_per_token``), can return a plain dict (``return_cache_object=False``) and can clear the hook
contexts of the points it cached (``clear_contexts=True``). The core's ``run_with_cache`` computes the
logits and the cache; this layer shapes what is returned, so the cache and the logits stay exactly the
core's.
"""

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..cache import ActivationCache, check_pos_slice
from ..caching import CacheWriter, next_token_loss, next_token_losses
from ..checks import check_bool, check_device
from ..core import BridgeCore

ReturnType = Literal["logits", "loss", "both"] | None


class RunCompat:
    """Mixin: TransformerLens' ``run_with_cache`` keywords and ``original_model``."""

    @property
    def original_model(self: BridgeCore) -> nn.Module:
        """TransformerLens' name for the wrapped HF model: the same object as ``model.hf_model``.

        Example:
            >>> model.original_model is model.hf_model
            True
        """
        return self.hf_model

    def set_use_attn_result(self: BridgeCore, use_attn_result: bool) -> None:
        """TransformerLens' switch for ``blocks.L.attn.hook_result``. Here the point is computed whenever it is
        hooked or cached (from ``hook_z`` and the output projection), so either value leaves the model as it is:
        ``True`` is what the bridge always does, and with ``False`` an unhooked, uncached point costs nothing.

        Example:
            >>> model.set_use_attn_result(True)
            >>> _, cache = model.run_with_cache("Hi")
            >>> cache["result", 0].shape   # [batch, pos, head, d_model]
        """
        check_bool("use_attn_result", use_attn_result)
        self.cfg.use_attn_result = use_attn_result  # TransformerLens' cfg field, which reads it back

    def run_with_cache(
        self,
        input: Any,
        *args: Any,
        return_type: ReturnType = "logits",
        loss_per_token: bool = False,
        return_cache_object: bool = True,
        clear_contexts: bool = False,
        **kwargs: Any,
    ) -> tuple[Any, Any]:
        """Forward and cache activations: ``(output, cache)``, TransformerLens' keywords included.

        ``return_type``: ``"logits"`` (default), ``"loss"`` (mean next-token loss over real tokens;
        ``loss_per_token=True``: ``[batch, pos - 1]``), ``"both"`` (``(logits, loss)``) or ``None``.
        ``return_cache_object=False`` returns the cache as a plain ``{name: tensor}`` dict.
        ``clear_contexts=True`` empties the ``hook.ctx`` of every point cached, afterwards. With
        ``stop_at_layer`` the output is the residual stream whatever ``return_type`` says. With
        ``start_at_layer=K``, ``input`` is the residual stream entering block ``K`` (``tokens=`` /
        ``attention_mask=`` as in `forward`) and only block ``K`` onwards is cached. The other
        keywords are `BridgeCore.run_with_cache`'s (``names_filter``, ``incl_bwd``, ``pos_slice`` …).

        Example:
            >>> loss, cache = model.run_with_cache("Hello world", return_type="loss")
            >>> loss.shape
            torch.Size([])
        """
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"`return_type` must be 'logits', 'loss', 'both' or None, got {return_type!r}.")
        check_bool("loss_per_token", loss_per_token)
        check_bool("return_cache_object", return_cache_object)
        check_bool("clear_contexts", clear_contexts)
        if kwargs.get("incl_bwd") and not torch.is_grad_enabled():
            raise ValueError(
                "`incl_bwd=True` backpropagates, but gradient tracking is off (inside torch.no_grad() or "
                "torch.set_grad_enabled(False)); call run_with_cache outside it."
            )
        if kwargs.get("reset_hooks_end", True) is not True:
            raise ValueError(
                f"`reset_hooks_end`={kwargs['reset_hooks_end']!r}: the cache is filled by this call only; "
                "for hooks that outlive the call use model.add_hook(name, fn)."
            )
        kwargs.pop("reset_hooks_end", None)
        start_at_layer = kwargs.pop("start_at_layer", None)
        if start_at_layer is not None:
            out, cache = self._cache_from_layer(input, start_at_layer, return_type, loss_per_token, **kwargs)
            return out, (cache if return_cache_object else dict(cache.cache_dict))
        out, cache = super().run_with_cache(input, *args, **kwargs)  # type: ignore[misc]
        if clear_contexts:
            for name in self.names_matching(kwargs.get("names_filter")):
                self.hook_dict[name].clear_context()
        if kwargs.get("stop_at_layer") is None:
            out = self._shape_output(out, input, return_type, loss_per_token, kwargs)
        return out, (cache if return_cache_object else dict(cache.cache_dict))

    def _cache_from_layer(
        self,
        residual: Tensor,
        start_at_layer: int,
        return_type: ReturnType,
        loss_per_token: bool,
        names_filter: Any = None,
        device: Any = None,
        pos_slice: Any = None,
        tokens: Tensor | None = None,
        attention_mask: Tensor | None = None,
        stop_at_layer: int | None = None,
        **rest: Any,
    ) -> tuple[Any, ActivationCache]:
        """``run_with_cache(residual, start_at_layer=K)``: `forward`'s resumed run with caching hooks; the
        blocks before ``K`` (run on a placeholder) and the embeddings fire no hook, so they are not cached."""
        if rest:
            raise TypeError(f"run_with_cache(start_at_layer=...) does not take {sorted(rest)}.")
        device = check_device(device)
        if pos_slice is not None:
            pos_slice = check_pos_slice(pos_slice, residual.shape[1])
        store = CacheWriter(device, pos_slice)
        caching = [(n, store.hook) for n in self.names_matching(names_filter)]
        resume = dict(start_at_layer=start_at_layer, stop_at_layer=stop_at_layer, tokens=tokens)
        with torch.no_grad(), self.hooks(fwd_hooks=caching, read_only=True):
            out = self(residual, attention_mask=attention_mask, return_type=return_type,
                       loss_per_token=loss_per_token, **resume)  # fmt: skip
        mask = attention_mask if attention_mask is not None else torch.ones(residual.shape[:2], dtype=torch.long)
        return out, ActivationCache(store.tensors, self, attention_mask=mask.to(device or mask.device))

    def _shape_output(
        self, logits: Tensor, input: Any, return_type: ReturnType, loss_per_token: bool, kwargs: dict[str, Any]
    ) -> Any:
        if return_type == "logits":
            return logits
        if return_type is None:
            return None
        tokens, mask = self.prepare_input(input, kwargs.get("attention_mask"), kwargs.get("prepend_bos"))
        loss_fn: Callable[..., Tensor] = next_token_losses if loss_per_token else next_token_loss
        loss = loss_fn(logits, tokens.to(logits.device), mask.to(logits.device))
        return loss if return_type == "loss" else (logits, loss)
