"""`HookedRootModule`: TransformerLens' base class for hooked models of your own.

Subclass it, assign `HookPoint`s as attributes (of the model or of any child module; a list or tuple of points
also works), call ``self.setup()`` at the end of ``__init__``, and call the points in ``forward``
(``x = self.hook_act(x)``). `setup` names every point by its attribute path (``hook_act``, ``blocks.0.hook_x``);
then `run_with_hooks`, `run_with_cache`, ``hooks()``, `add_hook`, `add_caching_hooks` and `reset_hooks` work
as on a bridge: temporary hooks go at the end of the call or context, permanent ones stay until
``reset_hooks(including_permanent=True)``, and names follow the bridge's grammar (a name, a list, a predicate).

Our `HookPoint` is not an ``nn.Module`` (a bridge serves its points from the HF modules), so `setup` finds the
points by walking the module tree's attributes rather than ``named_modules()``; `hook_dict` and `mod_dict` still
list them in TransformerLens' order (each module's points and children in the order they were assigned, read
from the points' creation order; a child module holding no point has no such rank and follows the item before
it in ``_modules``, which only `mod_dict` shows). The bookkeeping is `HookRegistry`'s, as for a bridge.
"""

import re
import warnings
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch import Tensor, nn

from ..cache.activation_cache import ActivationCache
from ..checks import ArgumentValueError, check_bool, describe
from ..hooks.checks import check_direction, check_hook_fn
from ..hooks.entries import Direction, HookFn
from ..hooks.names import NameFilter
from ..hooks.points import HookHandle, HookPoint, HookRegistry
from .caching_hooks import HookPair, caching_hooks

__all__ = ["HookedRootModule", "SetupError"]

_BLOCK = re.compile(r"blocks\.(\d+)\.")


class SetupError(RuntimeError):
    """A `HookedRootModule` used by name before ``self.setup()`` ran."""


class HookedRootModule(nn.Module, HookRegistry):
    """An ``nn.Module`` whose `HookPoint` attributes are named hook points, with TransformerLens' hook API.

    `hook_dict` maps each point's attribute path to it, `mod_dict` also maps each child module's path to the
    module (`setup` sets ``module.name`` to it, as TransformerLens does). ``context_level`` counts the open
    ``hooks()`` contexts, which tag their hooks with it (``reset_hooks(level=k)`` removes only those).

    Example:
        >>> class Toy(HookedRootModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(4, 4)
        ...         self.hook_act = HookPoint()
        ...         self.setup()
        ...     def forward(self, x):
        ...         return self.hook_act(self.lin(x)).relu()
        >>> model = Toy()
        >>> out = model.run_with_hooks(torch.ones(1, 4), fwd_hooks=[("hook_act", lambda a, hook: a * 0)])
        >>> out, cache = model.run_with_cache(torch.ones(1, 4))
        >>> cache["hook_act"].shape
        torch.Size([1, 4])
    """

    def __init__(self) -> None:
        nn.Module.__init__(self)
        HookRegistry.__init__(self)
        self.mod_dict: dict[str, Any] = {}
        self._is_set_up = False

    def setup(self) -> None:
        """Name every `HookPoint` reachable from this module by its attribute path and fill `hook_dict` and
        `mod_dict`. Call it at the end of ``__init__``, after the points and child modules are assigned (and
        again after adding some later). A point reachable under two paths keeps the first.

        Example:
            >>> model.setup(); list(model.hook_dict)
            ['hook_act']
        """
        points: dict[str, HookPoint] = {}
        modules: dict[str, Any] = {}
        seen: set[int] = set()
        for name, obj in _tl_order(self, "", {id(self)}):
            if not isinstance(obj, nn.Module):
                if id(obj) in seen:
                    continue
                seen.add(id(obj))
                points[name] = obj
            obj.name = name  # TransformerLens' setup names each child module (and each point)
            modules[name] = obj
        n_layers = 1 + max((int(m.group(1)) for n in points if (m := _BLOCK.match(n))), default=-1)
        self._set_points(points, n_layers)
        self.mod_dict = modules
        self._is_set_up = True

    # -- names ---------------------------------------------------------------------------------------------
    def _check_set_up(self) -> None:
        if not self._is_set_up:
            raise SetupError(
                f"{type(self).__name__} has no hook names yet: call `self.setup()` at the end of `__init__`, after "
                "assigning its HookPoints and child modules."
            )

    def resolve(self, name_or_filter: NameFilter, param: str = "name") -> list[HookPoint]:
        """Hook points for a name, a predicate, or a list of those (see `HookRegistry.resolve`)."""
        self._check_set_up()
        return super().resolve(name_or_filter, param)

    def names_matching(self, names_filter: NameFilter, param: str = "names_filter") -> list[str]:
        """The names ``names_filter`` selects: None (all), a name, a list of names, or a predicate.

        Example:
            >>> model.names_matching(lambda n: n.endswith("hook_act"))
            ['hook_act']
        """
        self._check_set_up()
        return self.names.select(names_filter, param)

    # -- registration ----------------------------------------------------------------------------------------
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
        """Register ``hook(tensor, hook_point)`` on the point ``name`` names (or every point a predicate or list
        selects), after `check_hooks_to_add` accepted each; see `HookRegistry.add_hook`.

        Example:
            >>> handle = model.add_hook("hook_act", lambda a, hook: a * 2)
            >>> handle.remove()
        """
        check_direction(dir, ("fwd", "bwd"))
        check_hook_fn(hook)
        for point in self.resolve(name):
            self.check_hooks_to_add(point, point.name, hook, dir=dir, is_permanent=is_permanent, prepend=prepend)
        return super().add_hook(name, hook, dir, is_permanent, read_only, level, prepend)

    def check_hooks_to_add(
        self,
        hook_point: HookPoint,
        hook_point_name: str | None,
        hook: HookFn,
        dir: Direction = "fwd",
        is_permanent: bool = False,
        prepend: bool = False,
    ) -> None:
        """Override to refuse some hooks (raise); called once per point by `add_hook`, ``hooks()`` and the
        ``run_with_*`` methods before anything is added. Accepts everything by default.

        Example:
            >>> class NoBackward(Toy):
            ...     def check_hooks_to_add(self, hook_point, hook_point_name, hook, dir="fwd", **kw):
            ...         if dir == "bwd":
            ...             raise ValueError("no backward hooks on this model")
        """

    # -- running ---------------------------------------------------------------------------------------------
    def run_with_hooks(
        self,
        *model_args: Any,
        fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        bwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        **model_kwargs: Any,
    ) -> Any:
        """``self(*model_args, **model_kwargs)`` with the hooks added for the call (removed afterwards, also on
        error). Backward hooks fire only on a backward pass run while they are on: with ``reset_hooks_end=True``
        (the default) that is never, and a warning says so.

        Example:
            >>> out = model.run_with_hooks(torch.ones(1, 4), fwd_hooks=[("hook_act", lambda a, hook: a + 1)])
        """
        check_bool("reset_hooks_end", reset_hooks_end)
        if reset_hooks_end and isinstance(bwd_hooks, Sized) and len(bwd_hooks) > 0:
            warnings.warn(
                "run_with_hooks removes its hooks when the forward returns, before any backward pass can run the "
                "`bwd_hooks`; pass reset_hooks_end=False (then reset_hooks()) or use `with model.hooks(...)`.",
                stacklevel=2,
            )
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts):
            return self(*model_args, **model_kwargs)

    def run_with_cache(
        self,
        *model_args: Any,
        names_filter: NameFilter = None,
        device: str | torch.device | None = None,
        remove_batch_dim: bool = False,
        incl_bwd: bool = False,
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        return_cache_object: bool = True,
        **model_kwargs: Any,
    ) -> tuple[Any, ActivationCache | dict[str, Tensor]]:
        """``(self(*model_args, **model_kwargs), cache)``: every point ``names_filter`` selects (None: all), as
        it was when the model called it (after the hooks on it), stored detached on ``device`` (None: where it
        is) under its name.

        ``remove_batch_dim=True`` drops the leading axis of size 1 of each tensor; when the first positional
        argument is a tensor, its leading size is the batch size and must be 1. ``incl_bwd=True`` backpropagates
        the output (a one-element tensor) and stores each point's gradient under ``<name>_grad``.
        ``reset_hooks_end=False`` leaves the caching hooks on (later forwards refill the cache) until
        `reset_hooks`. ``return_cache_object=False`` returns the plain ``{name: tensor}`` dict TransformerLens'
        `HookedRootModule` returns; the `ActivationCache` (the default) reads the same and has
        ``cache.model is self``. Caching hooks are added after the hooks already on each point; no autograd
        mode is changed.

        Example:
            >>> out, cache = model.run_with_cache(torch.ones(1, 4), names_filter=["hook_act"], remove_batch_dim=True)
            >>> cache["hook_act"].shape
            torch.Size([4])
        """
        for name, value in (("incl_bwd", incl_bwd), ("reset_hooks_end", reset_hooks_end),
                            ("return_cache_object", return_cache_object)):  # fmt: skip
            check_bool(name, value)
        if incl_bwd and not torch.is_grad_enabled():
            raise ValueError(
                "`incl_bwd=True` backpropagates the output, but gradient tracking is off (inside torch.no_grad() "
                "or torch.set_grad_enabled(False)); call run_with_cache outside it."
            )
        if "pos_slice" in model_kwargs:
            raise TypeError(
                "`pos_slice` is not supported by HookedRootModule.run_with_cache: the position axis of a custom "
                "model's tensors is not known; slice the cached tensors yourself."
            )
        first = model_args[0] if model_args else None
        if remove_batch_dim and isinstance(first, Tensor) and first.dim() > 0 and first.shape[0] != 1:
            raise ArgumentValueError(
                f"`remove_batch_dim=True` needs a batch of one, got batch size {first.shape[0]} (the leading size "
                "of the first positional argument); run one example, or drop `remove_batch_dim`."
            )
        tensors, fwd, bwd = self.get_caching_hooks(names_filter, incl_bwd, device, remove_batch_dim)
        with self.hooks(fwd, bwd, reset_hooks_end=reset_hooks_end, read_only=True, clear_contexts=clear_contexts):
            out = self(*model_args, **model_kwargs)
            if incl_bwd:
                _backward(out)
        if not return_cache_object:
            return out, tensors
        return out, ActivationCache(tensors, self, has_batch_dim=not remove_batch_dim)

    # -- caching hooks (compat/caching_hooks.py) -----------------------------------------------------------
    def get_caching_hooks(
        self,
        names_filter: NameFilter = None,
        incl_bwd: bool = False,
        device: str | torch.device | None = None,
        remove_batch_dim: bool = False,
        cache: dict | None = None,
    ) -> tuple[dict, list[HookPair], list[HookPair]]:
        """``(cache, fwd_hooks, bwd_hooks)``: hooks (not added) that store each selected point's tensor into
        ``cache`` (a new dict unless given) under its name, gradients under ``<name>_grad`` (``bwd_hooks`` is
        empty unless ``incl_bwd``); ``remove_batch_dim`` drops a leading axis of size 1 of each tensor.

        Example:
            >>> cache, fwd, _ = model.get_caching_hooks(["hook_act"])
            >>> with model.hooks(fwd_hooks=fwd):
            ...     _ = model(torch.ones(1, 4))
        """
        self._check_set_up()
        return caching_hooks(self, names_filter, incl_bwd, device, remove_batch_dim, cache)

    def add_caching_hooks(
        self,
        names_filter: NameFilter = None,
        incl_bwd: bool = False,
        device: str | torch.device | None = None,
        remove_batch_dim: bool = False,
        cache: dict | None = None,
    ) -> dict:
        """Add caching hooks (removed by `reset_hooks`) and return the dict they fill on every later forward
        (and backward, with ``incl_bwd``); see `get_caching_hooks`.

        Example:
            >>> cache = model.add_caching_hooks("hook_act")
            >>> _ = model(torch.ones(1, 4)); model.reset_hooks()
        """
        cache, fwd, bwd = self.get_caching_hooks(names_filter, incl_bwd, device, remove_batch_dim, cache)
        for direction, pairs in (("fwd", fwd), ("bwd", bwd)):
            for name, fn in pairs:
                self.add_hook(name, fn, dir=direction, read_only=True)
        return cache


def _tl_order(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, "nn.Module | HookPoint"]]:
    """``(path, child module or point)`` below ``module`` in the order of TransformerLens' ``named_modules()``,
    where points are modules: depth first, each module's children and points in the order they were assigned.
    That order is read from the points' creation ranks (a point is created where it is assigned; a child module
    is assigned after its own points are created): a child module with points sorts by its first point, one
    without any stays right after the item before it. A module reached twice is listed once, as torch does."""
    entries: list[tuple[int, str, nn.Module | HookPoint]] = [(p.created, path, p) for path, p in _points_of(module)]
    rank = -1
    for name, child in module.named_children():
        ranks = [p.created for m in child.modules() for _, p in _points_of(m)]
        rank = min(ranks) if ranks else rank
        entries.append((rank, name, child))
    for _, path, obj in sorted(entries, key=lambda e: e[0]):  # stable: equal ranks keep their order
        name = f"{prefix}.{path}" if prefix else path
        if isinstance(obj, nn.Module):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            yield name, obj
            yield from _tl_order(obj, name, seen)
        else:
            yield name, obj


def _points_of(module: nn.Module) -> Iterator[tuple[str, HookPoint]]:
    """``(attribute path, point)`` for the points held by ``module`` itself: attributes, and lists or tuples
    of points (``name.0``, ``name.1`` …), the counterpart of TransformerLens' ``nn.ModuleList`` of points."""
    for attr, value in vars(module).items():
        if isinstance(value, HookPoint):
            yield attr, value
        elif isinstance(value, (list, tuple)):
            yield from ((f"{attr}.{i}", p) for i, p in enumerate(value) if isinstance(p, HookPoint))


def _backward(out: Any) -> None:
    if not isinstance(out, Tensor) or out.numel() != 1:
        raise ValueError(
            f"`incl_bwd=True` backpropagates the model's output, which must be a one-element tensor; got "
            f"{describe(out)}. Return a scalar (a loss) from forward, or cache without `incl_bwd`."
        )
    if not out.requires_grad:
        raise ValueError(
            "`incl_bwd=True` backpropagates the model's output, but it has no grad_fn: no parameter or input "
            "it depends on requires grad."
        )
    out.backward()
