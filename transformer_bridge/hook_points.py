"""TransformerLens' ``hook_points`` module: the hook-point classes a hooked model of your own is built from.

``from transformer_lens.hook_points import HookPoint, HookedRootModule`` keeps working when
``transformer_lens`` becomes ``transformer_bridge``. The names are TransformerLens':

- `HookPoint`: a named point; called on a tensor it runs its hooks (the identity without hooks);
- `HookedRootModule`: the base class of a hooked model (``self.setup()``, ``run_with_hooks``, ``run_with_cache``);
- `LensHandle`: what ``hook_point.fwd_hooks`` / ``bwd_hooks`` list (``.hook.remove()``, ``.is_permanent``,
  ``.context_level``);
- `NamesFilter`: what a ``names_filter`` may be; `HookFunction`: ``fn(tensor, hook) -> tensor | None``;
  `DeviceType`.

Example:
    >>> import torch
    >>> from transformer_bridge.hook_points import HookedRootModule, HookPoint
    >>> class Toy(HookedRootModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.hook_x = HookPoint()
    ...         self.setup()
    ...     def forward(self, x):
    ...         return self.hook_x(x) * 2
    >>> _, cache = Toy().run_with_cache(torch.ones(2))
    >>> cache["hook_x"].tolist()
    [1.0, 1.0]
"""

import torch

from .compat.hooked_root import HookedRootModule
from .hooks.entries import HookEntry, HookFn, TensorConversion
from .hooks.names import NameFilter
from .hooks.points import HookPoint

LensHandle = HookEntry
NamesFilter = NameFilter
HookFunction = HookFn
DeviceType = str | torch.device | None
BaseTensorConversion = TensorConversion

__all__ = [
    "BaseTensorConversion",
    "DeviceType",
    "HookFunction",
    "HookPoint",
    "HookedRootModule",
    "LensHandle",
    "NamesFilter",
]
