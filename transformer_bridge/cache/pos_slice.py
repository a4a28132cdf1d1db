"""Position selections (``pos_slice``) shared by caches, caching runs and the analysis helpers: `check_pos_slice`."""

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..utils import Slice

PosSlice = int | slice | Sequence[int] | Tensor


def check_pos_slice(pos_slice: Any, n_pos: int, param: str = "pos_slice") -> int | slice | list[int]:
    """Validate a position selection over ``n_pos`` positions; returns it normalised.

    An int selects one position (negative counts from the end) and keeps the axis; a slice needs a
    positive step and must select something (a tuple is ``slice(*tuple)``, as TransformerLens reads it); a
    list / 1-d integer tensor selects those positions.

    Example:
        >>> check_pos_slice(-1, 5)
        4
    """
    if isinstance(pos_slice, Slice):  # TransformerLens' wrapper: its int / slice / index tensor
        pos_slice = pos_slice.slice
    if isinstance(pos_slice, bool):
        raise TypeError(f"`{param}` must be an int, a slice or a list of ints, got bool {pos_slice!r}.")
    if isinstance(pos_slice, Tensor) and pos_slice.dim() == 0:
        pos_slice = pos_slice.item()
    if not isinstance(pos_slice, (slice, list, tuple, range, Tensor)) and hasattr(pos_slice, "__index__"):
        index = operator.index(pos_slice)
        if not -n_pos <= index < n_pos:
            raise IndexError(f"`{param}`={index} is out of range for {n_pos} positions; use -{n_pos}..{n_pos - 1}.")
        return index % n_pos
    if isinstance(pos_slice, tuple):  # TransformerLens' Slice: a tuple is slice(*tuple), a list is positions
        if not 1 <= len(pos_slice) <= 3:
            raise ValueError(f"`{param}`={pos_slice!r}: a tuple is slice(*tuple), (stop,) to (start, stop, step).")
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, slice):
        for part in ("start", "stop", "step"):
            value = getattr(pos_slice, part)
            if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__")):
                raise TypeError(f"`{param}`={pos_slice!r}: the slice's {part} must be an int or None.")
        if pos_slice.step is not None and pos_slice.step <= 0:
            raise ValueError(f"`{param}`={pos_slice!r}: the step must be positive, got {pos_slice.step}.")
        if not range(n_pos)[pos_slice]:
            raise IndexError(f"`{param}`={pos_slice!r} selects no position out of {n_pos}.")
        return pos_slice
    if isinstance(pos_slice, Tensor):
        if pos_slice.dim() != 1 or pos_slice.dtype.is_floating_point or pos_slice.dtype == torch.bool:
            raise TypeError(
                f"`{param}` as a tensor must be 1-d integer positions, got dtype {pos_slice.dtype} shape "
                f"{tuple(pos_slice.shape)}."
            )
        pos_slice = pos_slice.tolist()
    if isinstance(pos_slice, (list, range)):
        items = list(pos_slice)
        if not items:
            raise ValueError(f"`{param}` is an empty list; give at least one position.")
        bad = [p for p in items if isinstance(p, bool) or not hasattr(p, "__index__")]
        if bad:
            raise TypeError(f"`{param}` must hold ints, got {bad[0]!r} ({type(bad[0]).__name__}).")
        out = [p.__index__() for p in items]
        outside = [p for p in out if not -n_pos <= p < n_pos]
        if outside:
            raise IndexError(f"`{param}` holds position {outside[0]}, out of range for {n_pos} positions.")
        return [p % n_pos for p in out]
    raise TypeError(
        f"`{param}` must be an int, a slice, a list of ints or None, got {type(pos_slice).__name__} {pos_slice!r}."
    )
