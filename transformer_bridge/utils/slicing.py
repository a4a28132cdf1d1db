"""`Slice`: TransformerLens' selection along one axis (positions, batch rows, neurons)."""

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..checks import ArgumentTypeError, describe

SliceInput = (
    int | np.integer | tuple[int] | tuple[int, int] | tuple[int, int, int] | list[int] | Tensor | np.ndarray | None
)
"""What `Slice` takes: an int (one index, the axis dropped), a tuple (``slice(*tuple)``), a slice, a list /
tensor / array of indices or a boolean mask, or None (everything)."""


def _as_int(value: Any) -> int | None:
    """A Python int for an integer scalar (a 0-d integer tensor or array too), else None; bools are not ints."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (Tensor, np.ndarray)):
        integer = not value.dtype.is_floating_point and not value.dtype.is_complex and value.dtype != torch.bool \
            if isinstance(value, Tensor) else np.issubdtype(value.dtype, np.integer)  # fmt: skip
        return int(value.item()) if value.ndim == 0 and integer else None
    return int(value) if isinstance(value, (int, np.integer)) else None


class Slice:
    """TransformerLens' position / batch / neuron selection: an int (that index, its axis dropped), a tuple
    (``slice(*tuple)``), a slice, a list / 1-d tensor / array of indices or a boolean mask, or None
    (everything). Accepted wherever the bridge takes a ``pos_slice``, ``batch_slice`` or ``neuron_slice``.

    Example:
        >>> Slice(-1).apply(torch.arange(6).reshape(2, 3), dim=1)
        tensor([2, 5])
        >>> Slice((1, 3)).indices(5)
        array([1, 2])
    """

    def __init__(self, input_slice: SliceInput = None) -> None:
        if isinstance(input_slice, Slice):
            input_slice = input_slice.slice
        as_int = _as_int(input_slice)
        if as_int is not None:
            self.slice, self.mode = as_int, "int"
        elif isinstance(input_slice, tuple):
            self.slice, self.mode = slice(*input_slice), "slice"
        elif isinstance(input_slice, slice):
            self.slice, self.mode = input_slice, "slice"
        elif input_slice is None:
            self.slice, self.mode = slice(None), "identity"
        elif isinstance(input_slice, (list, range, np.ndarray, Tensor)):
            index = torch.as_tensor(np.asarray(input_slice)) if not isinstance(input_slice, Tensor) else input_slice
            if index.dtype == torch.bool:  # a mask selects the indices where it is True
                index = index.nonzero().flatten()
            if index.dim() != 1 or index.dtype.is_floating_point or index.dtype.is_complex:
                raise ArgumentTypeError(
                    f"`input_slice` as indices must be 1-d integers or a boolean mask, got {describe(input_slice)}."
                )
            self.slice, self.mode = index.long(), "array"
        else:
            raise ArgumentTypeError(
                f"`input_slice` must be an int, a tuple, a slice, indices or None, got {describe(input_slice)}."
            )

    def apply(self, tensor: Tensor, dim: int = 0) -> Tensor:
        """``tensor`` with this selection applied along ``dim`` (an int drops the axis).

        Example:
            >>> Slice([2, -3]).apply(torch.arange(3) * 10)
            tensor([20,  0])
        """
        if self.mode == "int":
            return tensor.select(dim, self.slice)
        if self.mode == "array":
            index = self.slice.to(tensor.device)
            return tensor.index_select(dim, torch.where(index < 0, index + tensor.shape[dim], index))
        return tensor[(slice(None),) * (dim % tensor.dim()) + (self.slice,)]

    def indices(self, max_ctx: int | None = None) -> np.ndarray:
        """The selected indices as an int64 array (``max_ctx``: the axis length, needed for slices and lists). As in
        TransformerLens, an int is returned as given (``Slice(-1).indices(5)`` is ``[-1]``), while a negative list
        entry or slice bound is resolved against ``max_ctx``.

        Example:
            >>> Slice(-1).indices(5), Slice([0, -1]).indices(5)
            (array([-1]), array([0, 4]))
        """
        if self.mode == "int":
            return np.array([self.slice], dtype=np.int64)
        if max_ctx is None:
            raise ValueError(f"`max_ctx` (the axis length) is needed to list the indices of {self!r}.")
        return np.arange(max_ctx, dtype=np.int64)[self.slice.cpu().numpy() if self.mode == "array" else self.slice]

    @classmethod
    def unwrap(cls, slice_input: "Slice | SliceInput") -> "Slice":
        """``slice_input`` as a `Slice`; an int becomes a one-element list, so it keeps its axis.

        Example:
            >>> Slice.unwrap(3).apply(torch.arange(5))
            tensor([3])
        """
        if isinstance(slice_input, Slice):
            return slice_input
        as_int = _as_int(slice_input)
        return cls([as_int] if as_int is not None else slice_input)

    def __repr__(self) -> str:
        return f"Slice({self.slice!r}, mode={self.mode!r})"
