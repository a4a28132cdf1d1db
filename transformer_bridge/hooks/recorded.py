"""The forward hooks a run was made under, and running again under exactly them.

A generation records the forward hook entries active when its cache is computed (`active_forward_hooks`); a later
computation that must explain that run (a gradient relevance method) runs inside `only(registry, entries)`, which
sets aside every other hook for the duration of the block (backward ones included) and puts each point's own
lists back afterwards, after an exception too.

Example:
    >>> with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", steer)]):
    ...     recorded = active_forward_hooks(model)
    >>> with only(model, recorded):      # steered again, whatever is registered now
    ...     logits = model(tokens)
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .entries import HookEntry
from .points import HookPoint, HookRegistry


def active_forward_hooks(registry: HookRegistry) -> tuple[HookEntry, ...]:
    """Every forward hook entry registered now, point by point in canonical order, each point's in running order.

    Example:
        >>> active_forward_hooks(model)     # () on a model without hooks
        ()
    """
    return tuple(entry for point in registry.hook_dict.values() for entry in point.fwd_hooks)


def hooks_besides(registry: HookRegistry, entries: Sequence[HookEntry]) -> list[HookEntry]:
    """The hook entries registered now (forward and backward) that are not in ``entries``.

    Example:
        >>> hooks_besides(model, active_forward_hooks(model))
        []
    """
    kept = set(map(id, entries))
    return [e for point in registry.hook_dict.values() for e in [*point.fwd_hooks, *point.bwd_hooks]
            if id(e) not in kept]  # fmt: skip


def describe_hooks(entries: Sequence[HookEntry]) -> str:
    """``"blocks.0.hook_resid_post (steer), blocks.1.attn.hook_z (Steering, backward)"``: where and what each is."""
    shown = []
    for entry in entries:
        fn = getattr(entry.fn, "__name__", type(entry.fn).__name__)
        shown.append(f"{entry.point.name} ({fn}{', backward' if entry.dir == 'bwd' else ''})")
    return ", ".join(shown)


@contextmanager
def only(registry: HookRegistry, entries: Sequence[HookEntry]) -> Iterator[None]:
    """Run the block with ``entries`` as the only hooks (forward, in the order given) and no backward hooks.

    Hooks the block adds itself (``model.hooks(...)`` inside it) run after ``entries``, as usual. On exit every
    point's own forward and backward lists are back as they were (the same entry objects) and its torch hooks
    synced, after an exception too.

    Example:
        >>> with only(model, ()):           # a forward without any hook, whatever is registered
        ...     logits = model(tokens)
    """
    wanted: dict[int, list[HookEntry]] = {}
    points: dict[int, HookPoint] = {}
    for entry in entries:
        wanted.setdefault(id(entry.point), []).append(entry)
        points[id(entry.point)] = entry.point
    for point in registry.hook_dict.values():
        if point.fwd_hooks or point.bwd_hooks:
            points[id(point)] = point
    saved = {key: (point.fwd_hooks, point.bwd_hooks) for key, point in points.items()}
    try:
        for key, point in points.items():
            point.fwd_hooks, point.bwd_hooks = list(wanted.get(key, ())), []
            registry._sync(point)
        yield
    finally:
        error: BaseException | None = None
        for key, point in points.items():
            point.fwd_hooks, point.bwd_hooks = saved[key]
            try:
                registry._sync(point)
            except BaseException as e:  # put every point back, then report the first failure
                error = error or e
        if error is not None:
            raise error
