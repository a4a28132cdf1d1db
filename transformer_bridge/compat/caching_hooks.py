"""TransformerLens' caching-hook API (``HookedRootModule``): ``get_caching_hooks``, ``add_caching_hooks``
and the deprecated ``cache_all`` / ``cache_some``.

They fill a plain ``{name: tensor}`` dict while the model runs, for code that drives the forward itself
(``with model.hooks(fwd_hooks=hooks): model(tokens)``). `run_with_cache` is the one-call form and returns
an `ActivationCache`. Tensors are stored detached, under the canonical hook name (``<name>_grad`` for
gradients), optionally moved to ``device``, trimmed to ``pos_slice`` and without a batch axis of size 1
(``remove_batch_dim``).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..cache import check_pos_slice
from ..hook_points import HookPoint

HookPair = tuple[str, Callable[[Tensor, HookPoint], None]]


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
