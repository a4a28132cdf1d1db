"""Argument checks shared by every layer (the core, `generate`, relevance): errors that name the parameter.

Every check runs once, before any forward. A message says which parameter (in backticks), the
value received, what is valid and how to fix it. Wrong types raise `ArgumentTypeError`, a
`TypeError` that is also a `ValueError` (what these checks raised before, so ``except ValueError``
keeps working); indices out of range raise `ArgumentIndexError` (an `IndexError` and a
`ValueError`, like numpy's ``AxisError``).

Example:
    >>> check_int("steps", 4, minimum=1)
    4
    >>> check_int("steps", 0, minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: `steps` must be an int >= 1, got 0.
"""

import difflib
import functools
import inspect
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch
from torch import Tensor

P = ParamSpec("P")
R = TypeVar("R")


class ArgumentTypeError(TypeError, ValueError):
    """A parameter of the wrong type (a `TypeError`; also a `ValueError` for older ``except`` clauses)."""


class ArgumentIndexError(IndexError, ValueError):
    """An index out of range (an `IndexError`; also a `ValueError` for older ``except`` clauses)."""


class TransformerLensDifferenceWarning(UserWarning):
    """A call whose number differs from what TransformerLens gives for the same call, on purpose; the message
    names the difference and the way to TransformerLens' number (docs/transformerlens.md lists each one)."""


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning issued by the function calling this at the first frame outside
    this package and torch (whose decorators wrap some entry points): the user's own line."""
    skip = (str(Path(__file__).parent), str(Path(torch.__file__).parent))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def warn_difference_once(model: Any, flag: str, message: str) -> None:
    """Warn ``message`` as a `TransformerLensDifferenceWarning` at the user's line, once per model: the attribute
    ``flag`` on ``model`` records that it was said (set it to True beforehand to silence it)."""
    if getattr(model, flag, False):
        return
    setattr(model, flag, True)
    warnings.warn(f"{message} Said once per model.", TransformerLensDifferenceWarning, stacklevel=caller_stacklevel())


class ArgumentValueError(ValueError, AssertionError):
    """A bad argument value (a `ValueError`; also an `AssertionError`, which TransformerLens raises for the same
    misuse, so ``except AssertionError`` written for TransformerLens keeps working)."""


class ArgumentIndexAssertionError(ArgumentIndexError, AssertionError):
    """An index out of range where TransformerLens asserts (an `ArgumentIndexError` that is an `AssertionError`)."""


def describe(value: Any) -> str:
    """A short description of ``value`` for a message: a tensor's dtype and shape, else a clipped repr."""
    if isinstance(value, Tensor):
        return f"a tensor of dtype {str(value.dtype).removeprefix('torch.')} and shape {tuple(value.shape)}"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return text if isinstance(value, (bool, int, float, str, type(None))) else f"{text} ({type(value).__name__})"


def is_int(value: object) -> bool:
    """An integer (numpy's included) that is not a bool: ``True`` as a count or an id is a caller bug."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_index(value: object) -> int | None:
    """``value`` as a Python int if it is an integer: an int, a numpy integer, or a 0-d integer tensor or array
    (what ``topk`` / ``argmax`` return), as TransformerLens takes a layer; None for anything else (bools too).

    Example:
        >>> as_index(torch.tensor(3)), as_index(3), as_index(True), as_index(torch.tensor(3.0))
        (3, 3, None, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if getattr(value, "ndim", None) != 0 or dtype is None:
        return None
    if isinstance(value, Tensor):
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    else:  # a 0-d numpy array
        integer = getattr(dtype, "kind", "") in ("i", "u")
    return int(value) if integer else None


def is_real(value: object) -> bool:
    """A real number (numpy's included) that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None, hint: str = "") -> int:
    """``value`` as a Python int, or an error naming ``name``: `ArgumentTypeError` / `ValueError`."""
    if minimum is not None and maximum is not None:
        allowed = f"an int in [{minimum}, {maximum}]"
    elif minimum is not None:
        allowed = f"an int >= {minimum}"
    else:
        allowed = "an int"
    hint = f" {hint}" if hint else ""
    if not is_int(value):
        raise ArgumentTypeError(f"`{name}` must be {allowed}, got {describe(value)}.{hint}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.{hint}")
    return int(value)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is True or False, else `ArgumentTypeError` naming ``name``."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"`{name}` must be True or False, got {describe(value)}.")
    return value


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``valid`` (difflib), or an empty string."""
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def unknown_keywords_error(where: str, unknown: Iterable[str], valid: Iterable[str]) -> TypeError:
    """The `TypeError` for keyword arguments ``where`` does not take, with the closest valid one."""
    unknown, valid = list(unknown), list(valid)
    hint = did_you_mean(unknown[0], valid) or f" Valid: {', '.join(valid)}."
    return TypeError(f"{where} got unknown keyword argument(s) {unknown}.{hint}")


def suggest_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """Make an unknown keyword argument of ``fn`` raise a `TypeError` that names the closest valid one.

    The valid names come from ``fn``'s signature, read once here; a call costs one set comparison.

    Example:
        >>> @suggest_keywords
        ... def f(*, max_new_tokens=1): ...
        >>> f(max_new_token=2)
        Traceback (most recent call last):
        ...
        TypeError: f() got unknown keyword argument(s) ['max_new_token']. Did you mean 'max_new_tokens'?
    """
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = [n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds and n != "self"]
    accepted = frozenset(valid)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if not accepted.issuperset(kwargs):
            unknown = [k for k in kwargs if k not in accepted]
            raise unknown_keywords_error(f"{fn.__name__}()", unknown, valid)
        return fn(*args, **kwargs)

    return wrapper


def check_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a `torch.device` (None stays None), or `ValueError` if it is not usable here."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"`device`={device!r} is not a valid torch device (e.g. 'cpu', 'cuda', 'cuda:0').") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device`={device!r} asks for CUDA, but no CUDA device is available here; use 'cpu'.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"`device`={device!r}: only {torch.cuda.device_count()} CUDA device(s) exist.")
    return dev
