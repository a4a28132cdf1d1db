"""Named hook points, their handles, the context a hook sees, and the `hooks()` machinery.

A `HookPoint` is a named place in the model (``blocks.3.hook_resid_post``). It holds the user's
functions and nothing else: the bridge serves each point from a torch hook on the HF module that
computes it (a *site*), and that torch hook exists only while some point it serves has a function
registered. With nothing registered the HF model runs its own code, untouched.
"""

import difflib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

Direction = Literal["fwd", "bwd"]
Phase = Literal["forward", "prefill", "decode", "recompute"]
HookFn = Callable[[Tensor, "HookPoint"], Tensor | None]
NameOrFilter = str | Callable[[str], bool]


@dataclass(frozen=True)
class HookContext:
    """What the chunk of tokens a hook sees is, during a forward or a generation step.

    Attributes:
        phase: ``"forward"`` (a plain forward), ``"prefill"``, ``"decode"`` (one new token per row with
            the KV cache) or ``"recompute"`` (the cache-building forward after generation).
        step: decode step (0 at prefill and in a plain forward).
        positions: ``[batch, chunk]`` absolute position of each token in its own row; left padding is
            accounted for, so a row's first real token is 0 (padding gets 0 too, see `pad_mask`).
        pad_mask: ``[batch, chunk]`` True where the token is left padding.
        is_generated: ``[batch, chunk]`` True where the token was produced by `generate`.

    Example:
        >>> def only_position_5(resid, hook):
        ...     keep = (hook.ctx.positions == 5)[..., None]
        ...     return resid * ~keep
    """

    phase: Phase
    step: int
    positions: Tensor
    pad_mask: Tensor
    is_generated: Tensor

    @staticmethod
    def from_mask(
        attention_mask: Tensor, phase: Phase = "forward", step: int = 0, n_prompt: Tensor | None = None
    ) -> "HookContext":
        """Context for a whole (left-padded) sequence given its 0/1 attention mask."""
        real = attention_mask.bool()
        positions = (real.long().cumsum(-1) - 1).clamp_min(0)
        if n_prompt is None:
            generated = torch.zeros_like(real)
        else:
            generated = positions >= n_prompt.to(positions.device)[:, None]
            generated &= real
        return HookContext(phase, step, positions, ~real, generated)


class HookPoint:
    """A named activation. Holds the functions registered on it; the bridge runs them.

    ``hook.name`` is the canonical TransformerLens name, ``hook.layer()`` its block index and
    ``hook.ctx`` the `HookContext` of the chunk being computed.

    Example:
        >>> def fn(resid, hook):
        ...     print(hook.name, hook.layer(), hook.ctx.phase, tuple(resid.shape))
    """

    def __init__(self, name: str, owner: "HookRegistry") -> None:
        self.name = name
        self._owner = owner
        self.fwd_hooks: list[_Entry] = []
        self.bwd_hooks: list[_Entry] = []

    def __repr__(self) -> str:
        return f"HookPoint({self.name!r}, fwd={len(self.fwd_hooks)}, bwd={len(self.bwd_hooks)})"

    @property
    def ctx(self) -> HookContext | None:
        return self._owner.ctx

    @property
    def active(self) -> bool:
        return bool(self.fwd_hooks or self.bwd_hooks)

    def layer(self) -> int:
        """Block index of this point; raises `ValueError` for points outside the blocks."""
        parts = self.name.split(".")
        if parts[0] != "blocks":
            raise ValueError(f"Hook point {self.name!r} is not inside a block, so it has no layer index.")
        return int(parts[1])

    def run(self, tensor: Tensor) -> Tensor:
        """Apply the forward functions in registration order; attach backward ones to the result."""
        for entry in list(self.fwd_hooks):
            out = entry.fn(tensor, self)
            if out is not None:
                if not isinstance(out, Tensor):
                    raise TypeError(
                        f"Hook {entry.fn!r} on {self.name!r} returned {type(out).__name__}; a hook must "
                        "return a Tensor (to replace the activation) or None (to keep it)."
                    )
                if out.shape != tensor.shape:
                    raise ValueError(
                        f"Hook {entry.fn!r} on {self.name!r} returned shape {tuple(out.shape)}, but the "
                        f"activation has shape {tuple(tensor.shape)}; a replacement must keep the shape."
                    )
                tensor = out
        if self.bwd_hooks and tensor.requires_grad:
            # A fresh alias gives the gradient a node of its own, even when the site splits a tensor.
            tensor = tensor.view_as(tensor)
            tensor.register_hook(self._run_bwd)
        return tensor

    def _run_bwd(self, grad: Tensor) -> Tensor | None:
        for entry in list(self.bwd_hooks):
            out = entry.fn(grad, self)
            if out is not None:
                grad = out
        return grad


@dataclass(eq=False)
class _Entry:
    fn: HookFn
    point: HookPoint
    dir: Direction
    permanent: bool


@dataclass(eq=False)
class HookHandle:
    """Returned by `add_hook`; ``handle.remove()`` unregisters exactly that function."""

    _registry: "HookRegistry"
    _entries: list[_Entry] = field(default_factory=list)

    def remove(self) -> None:
        for entry in self._entries:
            self._registry._remove_entry(entry)
        self._entries.clear()


class HookRegistry:
    """The set of hook points of one model, with add/remove bookkeeping and the current context.

    Subclasses implement `_activate(point)` / `_deactivate(point)`, called when a point gains its
    first function or loses its last one, to attach or detach the torch hook that serves it.
    """

    def __init__(self) -> None:
        self.hook_dict: dict[str, HookPoint] = {}
        self.ctx: HookContext | None = None

    # -- subclass interface ---------------------------------------------------------------
    def _activate(self, point: HookPoint) -> None:
        raise NotImplementedError

    def _deactivate(self, point: HookPoint) -> None:
        raise NotImplementedError

    # -- name resolution -------------------------------------------------------------------
    def resolve(self, name_or_filter: NameOrFilter) -> list[HookPoint]:
        """Hook points for a name (canonical or shorthand) or a predicate over canonical names."""
        if callable(name_or_filter):
            return [p for n, p in self.hook_dict.items() if name_or_filter(n)]
        if not isinstance(name_or_filter, str):
            raise TypeError(
                f"A hook target must be a hook name (str) or a predicate name -> bool, got "
                f"{type(name_or_filter).__name__}."
            )
        if name_or_filter not in self.hook_dict:
            raise UnknownHookError(name_or_filter, self.hook_dict)
        return [self.hook_dict[name_or_filter]]

    # -- registration ----------------------------------------------------------------------
    def add_hook(
        self,
        name: NameOrFilter,
        hook: HookFn,
        dir: Direction = "fwd",
        is_permanent: bool = False,
    ) -> HookHandle:
        """Register ``hook(tensor, hook_point) -> Tensor | None`` on a point or every matching point.

        ``dir="bwd"`` registers on the gradient of the activation. Hooks are removed by
        `reset_hooks` unless ``is_permanent``; the returned handle removes exactly this hook.

        Example:
            >>> h = model.add_hook("blocks.0.hook_resid_post", lambda x, hook: x * 0)
            >>> h.remove()
        """
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"`dir` must be 'fwd' or 'bwd', got {dir!r}.")
        if not callable(hook):
            raise TypeError(f"`hook` must be callable as fn(tensor, hook), got {type(hook).__name__}.")
        handle = HookHandle(self)
        for point in self.resolve(name):
            entry = _Entry(hook, point, dir, is_permanent)
            was_active = point.active
            (point.fwd_hooks if dir == "fwd" else point.bwd_hooks).append(entry)
            if not was_active:
                self._activate(point)
            handle._entries.append(entry)
        return handle

    def _remove_entry(self, entry: _Entry) -> None:
        point = entry.point
        hooks = point.fwd_hooks if entry.dir == "fwd" else point.bwd_hooks
        if entry in hooks:
            hooks.remove(entry)
            if not point.active:
                self._deactivate(point)

    def reset_hooks(self, including_permanent: bool = False) -> None:
        """Remove all non-permanent hooks (and permanent ones if ``including_permanent``)."""
        for point in self.hook_dict.values():
            for entry in [*point.fwd_hooks, *point.bwd_hooks]:
                if including_permanent or not entry.permanent:
                    self._remove_entry(entry)

    @contextmanager
    def hooks(
        self,
        fwd_hooks: Iterable[tuple[NameOrFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameOrFilter, HookFn]] = (),
        reset_hooks_end: bool = True,
    ) -> Iterator["HookRegistry"]:
        """Context manager: hooks added on entry are removed on exit, also after an exception.

        Only the hooks this context added are removed; permanent hooks and hooks added elsewhere
        survive.

        Example:
            >>> with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x * 0)]):
            ...     logits = model("Hello")
        """
        handles: list[HookHandle] = []
        try:
            for name, fn in fwd_hooks:
                handles.append(self.add_hook(name, fn, dir="fwd"))
            for name, fn in bwd_hooks:
                handles.append(self.add_hook(name, fn, dir="bwd"))
            yield self
        finally:
            if reset_hooks_end:
                for handle in handles:
                    handle.remove()

    @contextmanager
    def _context(self, ctx: HookContext) -> Iterator[None]:
        previous, self.ctx = self.ctx, ctx
        try:
            yield
        finally:
            self.ctx = previous


class UnknownHookError(KeyError):
    """An unknown hook name; the message lists the closest valid names."""

    def __init__(self, name: str, valid: Iterable[str]) -> None:
        valid = list(valid)
        close = difflib.get_close_matches(name, valid, n=5, cutoff=0.5)
        hint = f" Closest valid names: {close}." if close else ""
        example = valid[0] if valid else "?"
        super().__init__(
            f"Unknown hook point {name!r}.{hint} Valid names look like {example!r}; see `model.hook_dict` "
            "for all of them."
        )
        self.name = name
        self.suggestions = close

    def __str__(self) -> str:
        return str(self.args[0])
