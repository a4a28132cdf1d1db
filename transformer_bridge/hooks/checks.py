"""Checks on what a hook function is and returns: callable as ``fn(tensor, hook)``, and a replacement
tensor like the activation it replaces (shape, dtype, device)."""

import inspect
import weakref
from collections.abc import Callable

from jaxtyping import TypeCheckError
from torch import Tensor


class HookDirectionError(ValueError, TypeCheckError):
    """A hook direction that is not one of those allowed. A `ValueError`; also the `TypeError` jaxtyping raises
    for an argument outside its ``Literal`` annotation (what TransformerLens' type-checked signatures raise)."""


def check_direction(dir: object, allowed: tuple[str, ...], param: str = "dir") -> None:
    """``dir`` must be one of ``allowed`` (``"fwd"``, ``"bwd"``, and ``"both"`` where both directions make sense)."""
    if not isinstance(dir, str) or dir not in allowed:
        names = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
        raise HookDirectionError(f"`{param}` must be {names}, got {dir!r}.")


def _saved_for_backward(tensor: Tensor) -> bool:
    """Whether the op that produced ``tensor`` (or the tensor it is a view of) saved its output."""
    for t in (tensor, tensor._base):
        fn = t.grad_fn if t is not None else None
        if fn is not None and any(hasattr(fn, a) for a in ("_saved_result", "_saved_output", "_saved_out")):
            return True
    return False


def check_replacement(out: object, tensor: Tensor, fn: Callable, name: str) -> None:
    """A hook's return value must be a tensor like the activation it replaces."""
    if not isinstance(out, Tensor):
        raise TypeError(
            f"Hook {_fn_name(fn)} on {name!r} returned {type(out).__name__}; a hook must return a Tensor "
            "(to replace the activation) or None (to keep it, edited in place or not)."
        )
    if out.shape != tensor.shape:
        raise ValueError(
            f"Hook {_fn_name(fn)} on {name!r} returned shape {tuple(out.shape)}, but the activation has shape "
            f"{tuple(tensor.shape)}; a replacement must keep the shape."
        )
    if out.dtype != tensor.dtype:
        raise TypeError(
            f"Hook {_fn_name(fn)} on {name!r} returned dtype {out.dtype}, but the activation is {tensor.dtype}; "
            f"return `new.to({tensor.dtype})`."
        )
    if out.device != tensor.device:
        raise ValueError(
            f"Hook {_fn_name(fn)} on {name!r} returned a tensor on device {out.device}, but the activation is on "
            f"{tensor.device}; return `new.to(tensor.device)`."
        )


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# Functions already seen to take (tensor, hook), and the functions of methods seen so: a `run_with_cache` registers
# one bound method of a fresh writer per point, and `inspect.signature` on each was ~8% of the call.
_PLAIN_OK: "weakref.WeakSet[Callable]" = weakref.WeakSet()
_METHOD_OK: "weakref.WeakSet[Callable]" = weakref.WeakSet()


def check_hook_fn(fn: object, param: str = "hook") -> None:
    """``fn`` must be callable as ``fn(tensor, hook)``."""
    if not callable(fn):
        raise TypeError(f"`{param}` must be callable as fn(tensor, hook), got {type(fn).__name__} {fn!r}.")
    method = inspect.ismethod(fn)
    seen, key = (_METHOD_OK, fn.__func__) if method else (_PLAIN_OK, fn)  # type: ignore[attr-defined]
    try:
        if key in seen:
            return
    except TypeError:  # not weak-referenceable (a callable object of a class with __slots__): check each time
        seen = None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C callables: nothing to check
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"`{param}` {_fn_name(fn)}{signature} cannot be called as fn(tensor, hook): a hook takes two "
            "arguments, the activation and the hook point (write `lambda x, hook: ...`)."
        ) from None
    if seen is not None and (method or inspect.isfunction(fn)):  # a callable object's __call__ may be rebound
        seen.add(key)
