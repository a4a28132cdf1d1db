"""Named hook points, their handles, the context a hook sees, and the `hooks()` machinery.

A `HookPoint` is a named place in the model (``blocks.3.hook_resid_post``). It holds the user's
functions and nothing else: the bridge serves each point from a torch hook on the HF module that
computes it (a *site*), and that torch hook exists only while some point it serves has a function
registered. With nothing registered the HF model runs its own code, untouched.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import count
from types import MappingProxyType
from typing import Any, Literal

from torch import Tensor

from .apply import apply_backward, apply_forward
from .checks import HookDirectionError, check_direction, check_hook_fn
from .context import HookContext, PointContext
from .entries import Direction, HookEntry, HookFn, HookHandle, by_direction, check_level, layer_of
from .names import HookNames, LayerOutOfRangeError, NameFilter, NotCachedError, UnknownHookError

NameOrFilter = NameFilter
# Each point's creation rank: `HookedRootModule.setup` orders a module's own points among its child modules by it,
# which is the order of assignment TransformerLens' `named_modules()` gives when points are created where assigned.
_CREATED = count()

__all__ = [
    "HookContext",
    "HookDirectionError",
    "HookEntry",
    "HookHandle",
    "HookPoint",
    "HookRegistry",
    "LayerOutOfRangeError",
    "NotCachedError",
    "UnknownHookError",
]


class HookPoint:
    """A named activation. Holds the functions registered on it; the bridge runs them.

    ``hook.name`` is the canonical TransformerLens name, ``hook.layer()`` its block index and
    ``hook.ctx`` the `HookContext` of the chunk being computed.

    A function may return a replacement tensor (same shape, dtype and device), or edit the tensor in
    place and return it or None: every way is what the model computes. The tensor's version counter
    tells whether a function wrote to it, so read-only functions cost no copy.

    Example:
        >>> def fn(resid, hook):
        ...     print(hook.name, hook.layer(), hook.ctx.phase, tuple(resid.shape))
    """

    def __init__(self, name: str | None = None, owner: "HookRegistry | None" = None) -> None:
        self.name = name
        self.created = next(_CREATED)
        parts = (name or "").split(".")
        # Block index; model-level points before the blocks are -1, those after them are large.
        self.layer_index = int(parts[1]) if parts[0] == "blocks" else (-1 if parts[0].startswith("hook_") else 1 << 30)
        self.fwd_hooks: list[HookEntry] = []
        self.bwd_hooks: list[HookEntry] = []
        self._ctx = PointContext(self)
        self.hook_conversion: Any = None  # see `enable_reshape`
        # Set on points a tensor-parallel plan splits (`distributed.ShardSpec`): their hooks see the gathered tensor.
        self.shard = None
        if owner is None:  # TransformerLens' standalone `HookPoint()`: its own registry; calling it runs the hooks
            owner = HookRegistry()
            owner._set_points({"": self}, 0)
        self._owner = owner

    def __repr__(self) -> str:
        bits = [f"name={self.name!r}"] if self.name is not None else []
        bits += [f"{len(hooks)} {d}" for d, hooks in (("fwd", self.fwd_hooks), ("bwd", self.bwd_hooks)) if hooks]
        return f"HookPoint({', '.join(bits)})"

    @property
    def ctx(self) -> PointContext:
        """TransformerLens' per-point dict, which also reads the current `HookContext` (see `PointContext`)."""
        return self._ctx

    @property
    def chunk(self) -> HookContext | None:
        """The `HookContext` of the chunk being computed (None outside a bridge call); unlike
        ``hook.ctx``, which reads it while the call runs, this object can be kept."""
        return self._owner.ctx

    def clear_context(self) -> None:
        """Empty ``hook.ctx`` (TransformerLens)."""
        self._ctx.clear()

    # -- TransformerLens' HookPoint methods ------------------------------------------------
    def add_hook(
        self, hook: HookFn, dir: Direction = "fwd", is_permanent: bool = False, level: int | None = None,
        prepend: bool = False, alias_names: Sequence[str] | None = None,
    ) -> HookEntry:  # fmt: skip
        """Register ``hook`` on this point (see `HookRegistry.add_hook`) and return its entry, the one listed
        in ``fwd_hooks`` / ``bwd_hooks`` (``entry.remove()`` unregisters it).

        ``alias_names`` (TransformerLens): call ``hook`` once per name, with a ``hook`` whose ``.name`` is
        that name; a tensor one call returns is what the next call sees, and the last one returned is kept.

        Example:
            >>> entry = model.blocks[0].attn.hook_pattern.add_hook(lambda p, hook: p * 0)
            >>> entry.remove()
        """
        check_direction(dir, ("fwd", "bwd"))
        check_hook_fn(hook)
        check_level(level)
        if alias_names is not None:
            if isinstance(alias_names, str) or not all(isinstance(a, str) for a in alias_names):
                raise TypeError(f"`alias_names` must be a list of hook names (str), got {alias_names!r}.")
            alias_names = tuple(alias_names)
        entry = HookEntry(hook, self, dir, bool(is_permanent), level=level, aliases=alias_names)
        self._owner._add([entry], prepend)
        return entry

    def add_perma_hook(self, hook: HookFn, dir: Direction = "fwd") -> HookEntry:
        """Register a hook that `reset_hooks` keeps (``including_permanent=True`` removes it)."""
        return self.add_hook(hook, dir=dir, is_permanent=True)

    def remove_hooks(self, dir: Direction | Literal["both"] = "fwd", including_permanent: bool = False,
                     level: int | None = None) -> None:  # fmt: skip
        """Remove this point's hooks in direction ``dir`` (permanent ones only if asked; only those added at
        ``level`` if given)."""
        check_level(level)
        entries = by_direction(self, dir)
        self._owner._remove_entries(e for e in entries if (including_permanent or not e.permanent)
                                    and (level is None or e.level == level))  # fmt: skip

    def has_hooks(
        self, dir: Direction | Literal["both"] = "both", including_permanent: bool = True, level: int | None = None
    ) -> bool:
        """Whether this point has hooks in direction ``dir`` (permanent ones counted unless
        ``including_permanent=False``; only those added at context ``level`` if given), as TransformerLens.

        Example:
            >>> with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", fn)]):
            ...     assert model.blocks[0].hook_resid_post.has_hooks(level=model.context_level)
        """
        check_level(level)
        return any(
            (including_permanent or not e.permanent) and (level is None or e.level == level)
            for e in by_direction(self, dir)
        )

    @property
    def active(self) -> bool:
        # len(), not bool(list): read inside compiled steps, and dynamo before torch 2.13 cannot trace bool(list)
        return len(self.fwd_hooks) > 0 or len(self.bwd_hooks) > 0

    def layer(self) -> int:
        """Block index of this point; raises `ValueError` for points outside the blocks."""
        return layer_of(self.name)

    def enable_reshape(self, hook_conversion: Any = None) -> None:
        """TransformerLens: let this point's functions see ``hook_conversion.convert(x)`` instead of ``x``; a
        tensor a function returns goes through ``hook_conversion.revert`` before it replaces ``x`` (None: no
        conversion, the default). Each function (forward or backward) gets the conversion of the tensor as
        the functions before it left it; an in-place edit reaches the model only where ``convert`` returns a
        view.

        Example:
            >>> class Heads:   # [batch, pos, d_model] <-> [batch, pos, head, d_head]
            ...     def convert(self, x): return x.unflatten(-1, (4, -1))
            ...     def revert(self, x): return x.flatten(-2)
            >>> point = HookPoint()
            >>> point.enable_reshape(Heads())
        """
        if hook_conversion is not None and not all(
            callable(getattr(hook_conversion, m, None)) for m in ("convert", "revert")
        ):
            raise TypeError(
                "`hook_conversion` must be None or have `convert(tensor)` and `revert(tensor)` methods, got "
                f"{type(hook_conversion).__name__}."
            )
        self.hook_conversion = hook_conversion

    def __call__(self, tensor: Tensor) -> Tensor:
        """Run the point's hooks on ``tensor``, as calling TransformerLens' identity `HookPoint` module does:
        the tensor itself when no hook changed it, else the edited one.

        Example:
            >>> x = torch.ones(1, 3, model.cfg.d_model)
            >>> y = model.blocks[0].hook_resid_post(x)    # what the hooks make of x
        """
        if not isinstance(tensor, Tensor):
            raise TypeError(f"A hook point is called with the activation tensor, got {type(tensor).__name__}.")
        return self.run(tensor)

    forward = __call__

    def run(self, tensor: Tensor) -> Tensor:
        """Apply the forward functions in registration order; attach backward ones to the result.

        Returns ``tensor`` itself when no function changed it, and a different tensor object when
        one did (a replacement, or ``tensor`` edited in place under a fresh alias), so a site
        knows when to write the activation back into the model.
        """
        if self.shard is not None and not self._owner.shard_local:
            return self.shard.run(self._apply, tensor)
        return self._apply(tensor)

    def _apply(self, tensor: Tensor) -> Tensor:
        return apply_forward(self, tensor)

    def _run_bwd(self, entries: list[HookEntry], grad: Tensor) -> Tensor | None:
        return apply_backward(self, entries, grad)


class HookRegistry:
    """The set of hook points of one model, with add/remove bookkeeping and the current context.

    ``sync(*points)`` (given by the model: `BridgeCore` attaches its sites) makes the torch hooks that serve
    ``points`` present exactly when one of them (or a point sharing them) has a function; it is called once per
    registration or removal with every point it touched (a cache of 700 points syncs each site once). It must be
    idempotent, so that
    registration and removal can be rolled back or completed after a failure: an exception, KeyboardInterrupt
    included, inside `add_hook`, `hooks()` or `reset_hooks` leaves the old state or the new one. Without it
    (a standalone `HookPoint`) there is nothing to attach.
    """

    def __init__(self, sync: Callable[[HookPoint], None] | None = None) -> None:
        self._sync = sync if sync is not None else _nothing_to_attach
        self.hook_dict: dict[str, HookPoint] = {}
        self.names = HookNames([], 0)
        self.ctx: HookContext | None = None
        self.start_layer: int | None = None  # set while a forward starts at a block (`start_at_layer`)
        self.shard_local = False  # `distributed.local_shards`: hooks see tensor-parallel shards as they are
        self.context_level = 0  # how many `hooks()` contexts are open (TransformerLens' name)

    # -- the model's points ----------------------------------------------------------------
    def _set_points(self, points: dict[str, HookPoint], n_layers: int) -> None:
        self.hook_dict = points
        self.names = HookNames(list(points), n_layers)

    # -- name resolution -------------------------------------------------------------------
    def resolve(self, name_or_filter: NameFilter, param: str = "name") -> list[HookPoint]:
        """Hook points for a name, a shorthand key, a predicate, or a list of those (see `names`)."""
        if type(name_or_filter) is str and name_or_filter in self.hook_dict:  # a canonical name: no search
            return [self.hook_dict[self.names._on(name_or_filter)]]
        return [self.hook_dict[n] for n in self.names.select(name_or_filter, param)]

    # -- registration ----------------------------------------------------------------------
    def add_hook(
        self,
        name: NameFilter,
        hook: HookFn,
        dir: Direction = "fwd",
        is_permanent: bool = False,
        read_only: bool = False,
        level: int | None = None,
        prepend: bool = False,
    ) -> HookHandle:
        """Register ``hook(tensor, hook_point) -> Tensor | None`` on a point or every matching point.

        ``dir="bwd"`` registers on the gradient of the activation. Hooks are removed by
        `reset_hooks` unless ``is_permanent``; the returned handle removes exactly this hook.
        ``read_only=True`` promises the hook never edits (its return value is ignored).
        ``prepend=True`` runs it before the point's other hooks. ``level`` tags it for
        ``reset_hooks(level=...)`` (a `hooks()` context tags its hooks with its `context_level`).

        Example:
            >>> h = model.add_hook("blocks.0.hook_resid_post", lambda x, hook: x * 0)
            >>> h.remove()
        """
        check_direction(dir, ("fwd", "bwd"))
        check_hook_fn(hook)
        check_level(level)
        points = self.resolve(name)
        entries = [HookEntry(hook, point, dir, bool(is_permanent), read_only, level) for point in points]
        self._add(entries, prepend)
        return HookHandle(self, entries)

    def _add(self, entries: list[HookEntry], prepend: bool) -> None:
        done: list[HookEntry] = []
        try:
            for entry in entries:
                if prepend:
                    entry.hooks.insert(0, entry)
                else:
                    entry.hooks.append(entry)
                done.append(entry)
            self._sync(*dict.fromkeys(e.point for e in entries))  # every site once, after all are in
        except BaseException:
            self._undo_add(done)
            raise

    def _undo_add(self, entries: list[HookEntry]) -> None:
        for entry in entries:
            if entry in entry.hooks:
                entry.hooks.remove(entry)
        self._sync(*dict.fromkeys(e.point for e in entries))

    def _remove_entries(self, entries: Iterable[HookEntry]) -> None:
        """Remove ``entries``; every one is removed even if syncing one fails (then it is retried).

        A point's list is replaced, not edited (as TransformerLens' ``remove_hooks`` does), so code that
        holds the old list (a teardown looping over ``fwd_hooks``) can still edit it without effect."""
        entries = list(entries)
        gone = set(map(id, entries))
        for point in dict.fromkeys(e.point for e in entries):
            point.fwd_hooks = [e for e in point.fwd_hooks if id(e) not in gone]
            point.bwd_hooks = [e for e in point.bwd_hooks if id(e) not in gone]
        points = dict.fromkeys(e.point for e in entries)
        try:
            self._sync(*points)
        except BaseException:  # heal: syncing is idempotent, so a second pass completes what the first left
            self._sync(*points)
            raise

    def reset_hooks(
        self,
        clear_contexts: bool = True,
        direction: Direction | Literal["both"] = "both",
        including_permanent: bool = False,
        level: int | None = None,
    ) -> None:
        """Remove all non-permanent hooks (and permanent ones if ``including_permanent``; only those added
        at ``level`` if given), as TransformerLens' ``reset_hooks``; ``clear_contexts`` also empties every
        ``hook.ctx``."""
        check_level(level)
        check_direction(direction, ("fwd", "bwd", "both"), "direction")
        entries = [
            entry
            for point in self.hook_dict.values()
            for entry in by_direction(point, direction)
            if (including_permanent or not entry.permanent) and (level is None or entry.level == level)
        ]
        self._remove_entries(entries)
        self._sync(*self.hook_dict.values())  # heals any state a failure elsewhere left half done
        if clear_contexts:
            self.clear_contexts()

    def remove_all_hook_fns(
        self,
        direction: Direction | Literal["both"] = "both",
        including_permanent: bool = False,
        level: int | None = None,
    ) -> None:
        """TransformerLens' name: remove hooks in ``direction`` (contexts are kept)."""
        self.reset_hooks(
            clear_contexts=False, direction=direction, including_permanent=including_permanent, level=level
        )

    def clear_contexts(self) -> None:
        """Empty every point's ``hook.ctx``."""
        for point in self.hook_dict.values():
            point.clear_context()

    def add_perma_hook(self, name: NameFilter, hook: HookFn, dir: Direction = "fwd") -> HookHandle:
        """A hook `reset_hooks` keeps unless ``including_permanent=True``.

        Example:
            >>> model.add_perma_hook("blocks.0.hook_resid_post", lambda x, hook: None)
        """
        return self.add_hook(name, hook, dir=dir, is_permanent=True)

    def hook_points(self) -> list[HookPoint]:
        """Every hook point, in canonical order."""
        return list(self.hook_dict.values())

    @property
    def _hook_registry(self) -> Mapping[str, HookPoint]:
        """TransformerLens' ``{name: HookPoint}`` of every point: a read-only view of `hook_dict`."""
        return MappingProxyType(self.hook_dict)

    def list_hooks(
        self,
        name_filter: NameFilter = None,
        dir: Direction | Literal["both"] = "both",
        including_permanent: bool = True,
    ) -> dict[str, list[HookEntry]]:
        """TransformerLens' ``list_hooks``: ``{point name: its hook entries}`` for the points ``name_filter``
        selects (None: all) that have hooks; each entry has ``.user_hook``, ``.is_permanent``, ``.context_level``.

        Example:
            >>> model.add_hook("blocks.0.hook_resid_post", fn)
            >>> model.list_hooks()["blocks.0.hook_resid_post"][0].user_hook is fn
            True
        """
        points = self.hook_dict
        if name_filter is None or callable(name_filter):  # a predicate matching nothing gives {}, as in TransformerLens
            names = [n for n in points if name_filter is None or name_filter(n)]
        else:
            keep = {name_filter} if isinstance(name_filter, str) else set(name_filter)
            exact = all(isinstance(n, str) and n in points for n in keep)
            names = [n for n in points if n in keep] if exact else self.names.select(name_filter, "name_filter")
        out = {}
        for name in names:
            entries = [e for e in by_direction(points[name], dir) if including_permanent or not e.permanent]
            if entries:
                out[name] = entries
        return out

    @contextmanager
    def hooks(
        self,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        reset_hooks_end: bool = True,
        read_only: bool = False,
        clear_contexts: bool = False,
    ) -> Iterator["HookRegistry"]:
        """Context manager: hooks added on entry are removed on exit, also after an exception.

        Only the hooks this context added are removed; permanent hooks and hooks added elsewhere
        survive. Registration is all or nothing: if one name is bad, none is added.
        ``read_only=True`` promises the functions never edit (see `add_hook`).

        Example:
            >>> with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x * 0)]):
            ...     logits = model("Hello")
        """
        pairs = [*_hook_pairs(fwd_hooks, "fwd_hooks"), *_hook_pairs(bwd_hooks, "bwd_hooks")]
        resolved, checked = [], set()
        for (name, fn), param in pairs:
            if id(fn) not in checked:  # a cache registers one function on every point: checked once
                check_hook_fn(fn, f"{param}` entry for `{name!r}")
                checked.add(id(fn))
            resolved.append(self.resolve(name, param))  # every name is checked before anything is added
        handles: list[HookHandle] = []
        self.context_level += 1
        try:
            own_add = type(self).add_hook is HookRegistry.add_hook  # else a subclass checks each (HookedRootModule)
            pending: list[HookHandle] = []
            for ((name, fn), param), points in zip(pairs, resolved, strict=True):
                direction, level = "bwd" if param == "bwd_hooks" else "fwd", self.context_level
                if not own_add:
                    handles.append(self.add_hook(name, fn, dir=direction, read_only=read_only, level=level))
                    continue
                entries = [HookEntry(fn, point, direction, False, read_only, level) for point in points]
                pending.append(HookHandle(self, entries))  # the names are resolved above: no second lookup
            self._add([e for handle in pending for e in handle._entries], False)  # all or nothing, one sync
            handles += pending
            yield self
        finally:
            self.context_level -= 1
            if reset_hooks_end:
                self._remove_entries(e for handle in handles for e in handle._entries)
            if clear_contexts:
                self.clear_contexts()

    @contextmanager
    def _context(self, ctx: HookContext) -> Iterator[None]:
        previous, self.ctx = self.ctx, ctx
        try:
            yield
        finally:
            self.ctx = previous


def _nothing_to_attach(*points: HookPoint) -> None:
    """The sync of a registry without a model (a standalone `HookPoint`): the point runs when called."""


def _hook_pairs(pairs: object, param: str) -> list[tuple[tuple[NameFilter, HookFn], str]]:
    if isinstance(pairs, Mapping):
        raise TypeError(f"`{param}` must be a list of (name, fn) pairs, got a dict; write `{param}=list(d.items())`.")
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise TypeError(f"`{param}` must be a list of (name, fn) pairs, got {type(pairs).__name__} {pairs!r}.")
    out = []
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                f"`{param}` entries must be (name, fn) pairs, got {pair!r}; e.g. [('blocks.0.hook_resid_post', fn)]."
            )
        out.append(((pair[0], pair[1]), param))
    return out
