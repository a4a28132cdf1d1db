"""TransformerLens' caching-hook API (``HookedRootModule``): ``get_caching_hooks``, ``add_caching_hooks``
and the deprecated ``cache_all`` / ``cache_some``.

They fill a ``{name: tensor}`` dict while the model runs, for code that drives the forward itself
(``with model.hooks(fwd_hooks=hooks): model(tokens)``). `run_with_cache` is the one-call form and returns
an `ActivationCache`. Tensors are stored detached, once, under the canonical hook name (``<name>_grad`` for
gradients), optionally moved to ``device``, trimmed to ``pos_slice`` and without a leading axis of size 1
(``remove_batch_dim``). The dict is a `CachingDict`: TransformerLens 4's spellings of a point
(``blocks.0.hook_in`` for ``blocks.0.hook_resid_pre``) look up its one entry instead of being stored again.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..cache.activation_cache import check_pos_slice
from ..cache.caching import CachingDict
from ..checks import ArgumentTypeError, check_bool, check_device, describe
from ..hooks.names import tl4_spelling
from ..hooks.points import HookPoint

HookPair = tuple[str, Callable[[Tensor, HookPoint], None]]


def caching_hooks(
    model: Any,
    names_filter: Any = None,
    incl_bwd: bool = False,
    device: Any = None,
    remove_batch_dim: bool = False,
    cache: dict | None = None,
    pos_slice: Any = None,
) -> tuple[dict, list[HookPair], list[HookPair]]:
    """``(cache, fwd_hooks, bwd_hooks)`` over ``model``'s points ``names_filter`` selects; see
    `TransformerBridge.get_caching_hooks`.

    Example:
        >>> cache, fwd, _ = caching_hooks(model, "resid_post")
    """
    for name, value in (("incl_bwd", incl_bwd), ("remove_batch_dim", remove_batch_dim)):
        check_bool(name, value)
    device = check_device(device)
    if cache is None:
        cache = CachingDict()
        cache.known = model.hook_dict
    if not isinstance(cache, dict):
        raise ArgumentTypeError(f"`cache` must be a dict (or None for a new one), got {describe(cache)}.")
    names = model.names_matching(names_filter)

    def store(key: str, tensor: Tensor) -> None:
        t = tensor.detach()
        if pos_slice is not None:
            t = at_positions(key, t, pos_slice)
        # Per tensor: a hook cannot tell a batch axis from a flattened [batch * pos, ...] one, so only a
        # leading 1 goes; a larger batch keeps every row (`run_with_cache` refuses it instead).
        if remove_batch_dim and t.dim() > 0 and t.shape[0] == 1:
            t = t[0]
        cache[key] = t.to(device) if device is not None else t

    fwd = [(n, lambda t, hook: store(hook.name, t)) for n in names]
    bwd = [(n, lambda g, hook: store(hook.name + "_grad", g)) for n in names] if incl_bwd else []
    return cache, fwd, bwd


def hook_point(model: Any, hook_name: Any) -> HookPoint | None:
    """``model``'s hook point called ``hook_name`` (canonical, a TransformerLens 4 spelling or a shorthand key),
    None if it has none; see `TransformerBridge.get_hook_point`."""
    if not isinstance(hook_name, (str, tuple)):
        raise ArgumentTypeError(f"`hook_name` must be a hook name (a str), got {describe(hook_name)}.")
    try:
        name = tl4_spelling(hook_name, model.hook_dict) if isinstance(hook_name, str) else hook_name
        return model.hook_dict[model.names.key(name)]
    except KeyError:
        return None


def at_positions(name: str, t: Tensor, pos_slice: Any) -> Tensor:
    """``t`` at ``pos_slice`` along its position axis (the query axis of attention maps); an int keeps a
    length-1 axis, as `run_with_cache` does."""
    dim = 2 if name.endswith(("hook_pattern", "hook_attn_scores", "hook_pattern_grad", "hook_attn_scores_grad")) else 1
    sel = check_pos_slice(pos_slice, t.shape[dim])
    if isinstance(sel, int):
        return t.narrow(dim, sel, 1)
    if isinstance(sel, list):
        return t.index_select(dim, torch.as_tensor(sel, device=t.device))
    return t[(slice(None),) * dim + (sel,)]
