"""What a hook point holds: one `HookEntry` per registered function (TransformerLens' ``LensHandle``), the
`HookHandle` a registration returns, and the view a function registered under alias names is called with.

An entry knows its point only as an object with ``name``, ``fwd_hooks``, ``bwd_hooks`` and ``_owner`` (the
registry that removes entries), so this module sits below `points`.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from .checks import check_direction

Direction = Literal["fwd", "bwd"]
HookFn = Callable[[Tensor, Any], Tensor | None]


def layer_of(name: str | None) -> int:
    """The block index in ``blocks.{layer}.…``; `ValueError` for a name outside the blocks."""
    parts = (name or "").split(".")
    if parts[0] != "blocks":
        raise ValueError(f"Hook point {name!r} is not inside a block, so it has no layer index.")
    return int(parts[1])


class TensorConversion:
    """A base for `HookPoint.enable_reshape` conversions (TransformerLens' ``BaseTensorConversion``): subclass it
    with ``handle_conversion(x)`` (the layout hooks see) and ``revert(x)`` (back to the point's layout).

    Example:
        >>> class Heads(TensorConversion):
        ...     def handle_conversion(self, x): return x.unflatten(-1, (4, -1))
        ...     def revert(self, x): return x.flatten(-2)
        >>> point.enable_reshape(Heads())
    """

    def convert(self, input_value: Tensor, *full_context: Any) -> Tensor:
        """What the point's functions see: ``handle_conversion(input_value)``."""
        return self.handle_conversion(input_value, *full_context)

    def handle_conversion(self, input_value: Tensor, *full_context: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define handle_conversion(x).")

    def revert(self, input_value: Tensor, *full_context: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define revert(x).")


def batch_free(fn: HookFn) -> HookFn:
    """``fn`` as TransformerLens' ``run_with_hooks(remove_batch_dim=True)`` calls it: a tensor whose leading
    (batch) axis has size 1 reaches ``fn`` without it (a view, so an in-place edit is an edit), and a tensor it
    returns gets the axis back; any other tensor reaches ``fn`` unchanged. Backward functions too (a returned
    ``(grad,)`` keeps its form).

    Example:
        >>> shapes = []
        >>> hook = batch_free(lambda x, hook: shapes.append(x.shape))
        >>> hook(torch.zeros(1, 5, 8), None); shapes
        [torch.Size([5, 8])]
    """

    def restore(out: Any) -> Any:
        if isinstance(out, Tensor):
            return out.unsqueeze(0)
        if isinstance(out, tuple):
            return tuple(restore(o) for o in out)
        return out

    @functools.wraps(fn)
    def wrapped(tensor: Tensor, hook: Any) -> Any:
        if not isinstance(tensor, Tensor) or tensor.dim() == 0 or tensor.shape[0] != 1:
            return fn(tensor, hook)
        return restore(fn(tensor[0], hook))

    return wrapped


class AliasView:
    """What a function registered with ``alias_names`` receives as ``hook``: its point under one alias name
    (``hook.name``, ``hook.layer()`` read the alias; everything else is the point's own)."""

    def __init__(self, name: str, point: Any) -> None:
        self.name = name
        self._point = point

    def layer(self) -> int:
        return layer_of(self.name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self._point, attr)

    def __repr__(self) -> str:
        return f"AliasView({self.name!r} of {self._point!r})"


@dataclass(eq=False)
class HookEntry:
    """One registered function on one point, in ``hook_point.fwd_hooks`` / ``bwd_hooks``, with TransformerLens'
    ``LensHandle`` fields (``is_permanent``, ``context_level``, ``user_hook``, ``hook``) and ``remove()``.

    `HookPoint.add_hook` returns it, so the handle it returns is the one listed on the point.

    Example:
        >>> point = model.hook_dict["blocks.0.hook_resid_post"]
        >>> entry = point.add_hook(lambda x, hook: None)
        >>> entry in point.fwd_hooks
        True
        >>> entry.remove()
    """

    fn: HookFn
    point: Any
    dir: Direction
    permanent: bool
    read_only: bool = False
    level: int | None = None  # the `context_level` it was added at (TransformerLens' hook levels)
    aliases: tuple[str, ...] | None = None  # called once per name, each replacement feeding the next

    def __call__(self, tensor: Tensor) -> Any:
        if self.aliases is None:
            return self.fn(tensor, self.point)
        replaced = None
        for alias in self.aliases:
            out = self.fn(tensor, AliasView(alias, self.point))
            if self.dir == "bwd" and isinstance(out, tuple) and len(out) == 1:  # torch-style ``(grad,)``
                out = out[0]
            if out is not None:
                tensor = replaced = out
        return replaced

    @property
    def hooks(self) -> list["HookEntry"]:
        return self.point.fwd_hooks if self.dir == "fwd" else self.point.bwd_hooks

    def remove(self) -> None:
        """Unregister this function (idempotent). The point's list is rebuilt, not edited, as TransformerLens
        does: a list read from ``fwd_hooks`` before still holds the entry."""
        self.point._owner._remove_entries([self])

    @property
    def is_permanent(self) -> bool:
        return self.permanent

    @property
    def context_level(self) -> int | None:
        return self.level

    @property
    def user_hook(self) -> HookFn:
        return self.fn

    @property
    def hook(self) -> "HookEntry":
        """TransformerLens' ``LensHandle.hook`` (its torch handle): ``.remove()`` unregisters the function."""
        return self


@dataclass(eq=False)
class HookHandle:
    """Returned by `HookRegistry.add_hook`; ``handle.remove()`` unregisters exactly that function, on every
    point it was added to."""

    _registry: Any
    _entries: list[HookEntry] = field(default_factory=list)

    def remove(self) -> None:
        entries, self._entries = self._entries, []
        self._registry._remove_entries(entries)


def by_direction(point: Any, dir: object) -> list[HookEntry]:
    """The entries of ``point`` in direction ``dir`` ("fwd", "bwd" or "both")."""
    check_direction(dir, ("fwd", "bwd", "both"))
    return [*(point.fwd_hooks if dir != "bwd" else []), *(point.bwd_hooks if dir != "fwd" else [])]


def check_level(level: object) -> None:
    """TransformerLens' hook level: None, or the int ``context_level`` a hook was added at."""
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
        raise TypeError(f"`level` must be an int (a `context_level`) or None, got {type(level).__name__} {level!r}.")
