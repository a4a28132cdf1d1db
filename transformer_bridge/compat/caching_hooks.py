"""TransformerLens' caching-hook API (``HookedRootModule``): ``get_caching_hooks``, ``add_caching_hooks``
and the deprecated ``cache_all`` / ``cache_some``.

They fill a plain ``{name: tensor}`` dict while the model runs, for code that drives the forward itself
(``with model.hooks(fwd_hooks=hooks): model(tokens)``). `run_with_cache` is the one-call form and returns
an `ActivationCache`. Tensors are stored detached, under the canonical hook name (``<name>_grad`` for
gradients), optionally moved to ``device``, trimmed to ``pos_slice`` and without a batch axis of size 1
(``remove_batch_dim``).
"""

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..cache import check_pos_slice
from ..checks import check_bool, check_device
from ..core import BridgeCore
from ..hook_points import HookPoint

HookPair = tuple[str, Callable[[Tensor, HookPoint], None]]


def _at_positions(name: str, t: Tensor, pos_slice: Any) -> Tensor:
    """``t`` at ``pos_slice`` along its position axis (the query axis of attention maps); an int keeps a
    length-1 axis, as `run_with_cache` does."""
    dim = 2 if name.endswith(("hook_pattern", "hook_attn_scores", "hook_pattern_grad", "hook_attn_scores_grad")) else 1
    sel = check_pos_slice(pos_slice, t.shape[dim])
    if isinstance(sel, int):
        return t.narrow(dim, sel, 1)
    if isinstance(sel, list):
        return t.index_select(dim, torch.as_tensor(sel, device=t.device))
    return t[(slice(None),) * dim + (sel,)]


class CachingHooks:
    """Mixin: TransformerLens' caching hooks."""

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
        (a new dict unless given); ``bwd_hooks`` is empty unless ``incl_bwd``.

        Example:
            >>> cache, fwd, _ = model.get_caching_hooks("resid_post")
            >>> with model.hooks(fwd_hooks=fwd):
            ...     model("Hello")
            >>> cache["blocks.0.hook_resid_post"].shape
        """
        for name, value in (("incl_bwd", incl_bwd), ("remove_batch_dim", remove_batch_dim)):
            check_bool(name, value)
        device = check_device(device)
        cache = {} if cache is None else cache
        if not isinstance(cache, dict):
            raise TypeError(f"`cache` must be a dict (or None for a new one), got {type(cache).__name__}.")
        names = self.names_matching(names_filter)

        def store(key: str, tensor: Tensor) -> None:
            t = tensor.detach()
            if pos_slice is not None:
                t = _at_positions(key, t, pos_slice)
            if remove_batch_dim and t.shape[0] == 1:
                t = t[0]
            cache[key] = t.to(device) if device is not None else t

        fwd = [(n, lambda t, hook: store(hook.name, t)) for n in names]
        bwd = [(n, lambda g, hook: store(hook.name + "_grad", g)) for n in names] if incl_bwd else []
        return cache, fwd, bwd

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
