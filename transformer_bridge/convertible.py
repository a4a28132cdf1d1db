"""Results that hold one tensor of numbers convert in one call: ``torch.as_tensor(result)`` and
``np.asarray(result)``.

A result object (a store's rows, a patching result, a relevance result, a stack with its labels …) that is a
sequence would otherwise be read by torch element by element, which fails on tensor elements ("only one element
tensors can be converted"). `Convertible` gives it the DLPack protocol, which torch reads before the sequence
protocol, and numpy's ``__array__``; `LabelledStack` is the ``(stack, labels)`` pair an analysis returns with
``return_labels=True``, still unpacked as a pair.

Example:
    >>> pair = LabelledStack(torch.ones(2, 3), ["a", "b"])
    >>> stack, labels = pair
    >>> torch.as_tensor(pair).shape, np.asarray(pair).shape
    (torch.Size([2, 3]), (2, 3))
"""

from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["Convertible", "LabelledStack"]


class Convertible:
    """Mixin: an object whose numbers are one tensor, `as_tensor()`, handed to torch or numpy in one call."""

    def as_tensor(self) -> Tensor:
        """The tensor ``torch.as_tensor(self)`` and ``np.asarray(self)`` give."""
        raise NotImplementedError

    def _exported(self) -> Tensor:
        return self.as_tensor().detach()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._exported().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._exported().__dlpack_device__()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        t = self._exported().cpu()
        array = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        return array if dtype is None else array.astype(dtype)


class LabelledStack(Convertible, tuple):
    """``(stack, labels)``: unpacks as the pair TransformerLens returns, converts as ``stack``."""

    def __new__(cls, stack: Tensor, labels: list[str]) -> "LabelledStack":
        return super().__new__(cls, (stack, labels))

    def as_tensor(self) -> Tensor:
        return self[0]
