# ruff: noqa: N802, N803, N806  (TransformerLens' names: A, B, AB, T, S, U, V, QK, OV)
"""A low-rank matrix kept as its two factors, ``A @ B``: TransformerLens' ``FactoredMatrix`` interface.

``model.QK`` is ``W_Q @ W_Kᵀ`` and ``model.OV`` is ``W_V @ W_O``, both ``[layer, head, d_model, d_model]``
but of rank ``d_head``: storing ``A [..., ldim, mdim]`` and ``B [..., mdim, rdim]`` keeps them small, and
the norm, the singular values and products are computed from the factors. The leading (batch) dimensions
of the factors are broadcast against each other at construction. As in TransformerLens, `svd` returns
``(U, S, V)`` with ``U @ diag(S) @ Vᵀ == A @ B``, and a product keeps the cheaper factorisation.
"""

import warnings
from functools import cached_property
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ..checks import ArgumentIndexError, ArgumentTypeError, ArgumentValueError, describe


def _linalg_dtype(x: Tensor) -> Tensor:
    """16-bit tensors in float32: CPU linear algebra (svd, eig) has no half-precision kernels."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class FactoredMatrix:
    """``A @ B`` without forming it; leading (batch) dimensions broadcast as in ``torch.matmul``.

    Example:
        >>> import torch
        >>> m = FactoredMatrix(torch.randn(3, 8, 2), torch.randn(3, 2, 5))
        >>> m.shape, m.AB.shape
        (torch.Size([3, 8, 5]), torch.Size([3, 8, 5]))
        >>> torch.allclose(m.norm(), m.AB.norm(dim=(-2, -1)), rtol=1e-4)
        True
    """

    def __init__(self, A: Float[Tensor, "... ldim mdim"], B: Float[Tensor, "... mdim rdim"]) -> None:
        for name, t in (("A", A), ("B", B)):
            if not hasattr(t, "shape") or len(t.shape) < 2:
                raise ArgumentTypeError(f"`{name}` must be a tensor of at least 2 dimensions, got {describe(t)}.")
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(
                f"`A` [..., ldim, mdim] and `B` [..., mdim, rdim] must share mdim; got A {tuple(A.shape)} and "
                f"B {tuple(B.shape)}."
            )
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        try:
            lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError as e:
            raise RuntimeError(
                f"The leading dimensions of A {tuple(A.shape)} and B {tuple(B.shape)} do not broadcast (shape "
                "mismatch)."
            ) from e
        self.shape = torch.Size((*lead, self.ldim, self.rdim))
        if isinstance(A, Tensor) and isinstance(B, Tensor):
            A, B = A.broadcast_to((*lead, self.ldim, self.mdim)), B.broadcast_to((*lead, self.mdim, self.rdim))
        self.A, self.B = A, B
        self.has_leading_dims = len(lead) > 0

    # -- shape ---------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def unsqueeze(self, dim: int) -> "FactoredMatrix":
        """A new leading dimension at ``dim`` (counted among the leading dimensions)."""
        return FactoredMatrix(self.A.unsqueeze(dim), self.B.unsqueeze(dim))

    @property
    def pair(self) -> tuple[Tensor, Tensor]:
        """``(A, B)``."""
        return self.A, self.B

    # -- products ------------------------------------------------------------------------------------
    @property
    def AB(self) -> Float[Tensor, "... ldim rdim"]:
        """The full matrix ``A @ B``."""
        return self.A @ self.B

    @property
    def BA(self) -> Float[Tensor, "... mdim mdim"]:
        """``B @ A`` (square, ``mdim``); needs ``ldim == rdim``."""
        if self.ldim != self.rdim:
            raise ArgumentValueError(
                f"BA needs a square matrix (ldim == rdim), got ldim {self.ldim}, rdim {self.rdim}."
            )
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        """The transpose ``Bᵀ @ Aᵀ``."""
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def __matmul__(self, other: Any) -> Any:
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if len(other.shape) < 2:  # a vector: the product is a vector
            return (self.A @ (self.B @ other.unsqueeze(-1))).squeeze(-1)
        if other.shape[-2] != self.rdim:
            raise ArgumentValueError(
                f"Cannot multiply {self!r} by a matrix of shape {tuple(other.shape)}: rdim differs."
            )
        # Keep the smaller inner dimension.
        return FactoredMatrix(self.A, self.B @ other) if self.rdim > self.mdim else FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: Any) -> Any:
        if isinstance(other, FactoredMatrix):
            return other.A @ (other.B @ self)
        if other.shape[-1] != self.ldim:
            raise ArgumentValueError(
                f"Cannot multiply a matrix of shape {tuple(other.shape)} by {self!r}: ldim differs."
            )
        if len(other.shape) < 2:
            return ((other.unsqueeze(-2) @ self.A) @ self.B).squeeze(-2)
        return FactoredMatrix(other @ self.A, self.B) if self.ldim > self.mdim else FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: float | Tensor) -> "FactoredMatrix":
        if isinstance(scalar, Tensor) and scalar.numel() != 1:
            raise ArgumentValueError(
                f"`*` takes a scalar, got a tensor of shape {tuple(scalar.shape)}; use `@` for products."
            )
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    # -- spectra -------------------------------------------------------------------------------------
    @cached_property
    def _svd(self) -> tuple[Tensor, Tensor, Tensor]:
        A, B = _linalg_dtype(self.A), _linalg_dtype(self.B)
        Ua, Sa, Vha = torch.linalg.svd(A, full_matrices=False)
        Ub, Sb, Vhb = torch.linalg.svd(B, full_matrices=False)
        core = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]
        Uc, S, Vhc = torch.linalg.svd(core, full_matrices=False)
        return Ua @ Uc, S, (Vhc @ Vhb).transpose(-2, -1)

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(U [..., ldim, k], S [..., k], V [..., rdim, k])`` with ``U @ diag(S) @ Vᵀ == A @ B``, from the
        factors (``k`` is at most ``mdim``); computed once per matrix."""
        return self._svd

    @property
    def U(self) -> Tensor:
        return self.svd()[0]

    @property
    def S(self) -> Float[Tensor, "... mdim"]:
        """Singular values of ``A @ B`` (at most ``mdim`` of them), largest first."""
        return self.svd()[1]

    @property
    def V(self) -> Tensor:
        """Right singular vectors: ``A @ B == U @ diag(S) @ Vᵀ``."""
        return self.svd()[2]

    @property
    def Vh(self) -> Tensor:
        """TransformerLens' old name for `V` (it is V, not its transpose)."""
        warnings.warn("FactoredMatrix.Vh is V (not its transpose); use .V.", DeprecationWarning, stacklevel=2)
        return self.V

    @property
    def eigenvalues(self) -> Tensor:
        """Eigenvalues of ``A @ B``: its non-zero ones are those of the small ``B @ A``."""
        return torch.linalg.eigvals(_linalg_dtype(self.BA))

    def norm(self) -> Float[Tensor, "..."]:
        """Frobenius norm of ``A @ B`` per leading index: ``sqrt(trace((AᵀA)(BBᵀ)))``, from the factors."""
        gram_a = self.A.transpose(-2, -1) @ self.A
        gram_b = self.B @ self.B.transpose(-2, -1)
        return (gram_a * gram_b).sum((-2, -1)).clamp_min(0).sqrt()

    def collapse_l(self) -> Tensor:
        """``diag(S) @ Vᵀ`` (``[..., k, rdim]``): the matrix with its left orthogonal factor removed."""
        return self.S[..., :, None] * self.V.transpose(-2, -1)

    def collapse_r(self) -> Tensor:
        """``U @ diag(S)`` (``[..., ldim, k]``)."""
        return self.U * self.S[..., None, :]

    def make_even(self) -> "FactoredMatrix":
        """The same matrix as ``(U √S) @ (√S Vᵀ)``: both factors orthogonal, each with half the spectrum."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root[..., None, :], root[..., :, None] * self.V.transpose(-2, -1))

    def get_corner(self, k: int = 3) -> Tensor:
        """The first ``k`` entries of every dimension of ``A @ B``."""
        corner = self.A[..., :k, :] @ self.B[..., :, :k]
        return corner[tuple(slice(None, k) for _ in range(corner.dim()))]

    # -- indexing -----------------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> "FactoredMatrix":
        """Index as ``A @ B`` would be, without forming it: leading dimensions, then rows (of ``A``) and
        columns (of ``B``). An int row or column keeps a length-1 axis, so the result stays a matrix."""
        index = index if isinstance(index, tuple) else (index,)
        if sum(item is Ellipsis for item in index) > 1:
            raise IndexError("An index can only have a single ellipsis.")
        used = sum(_axes(item) for item in index if item is not Ellipsis and item is not None)
        if used > self.ndim:
            raise ArgumentIndexError(
                f"`index` {index!r} is too long an index: {used} indices for a FactoredMatrix of shape "
                f"{tuple(self.shape)}."
            )
        if any(item is Ellipsis for item in index):
            at = next(i for i, item in enumerate(index) if item is Ellipsis)
            index = index[:at] + (slice(None),) * (self.ndim - used) + index[at + 1 :]
            used = self.ndim
        if used > self.ndim:
            raise IndexError(f"Too many indices ({used}) for a FactoredMatrix of shape {tuple(self.shape)}.")
        lead, rest, new_axes, n_lead, seen = [], [], [], self.ndim - 2, 0
        for item in index:
            if item is None and seen >= n_lead:  # a new axis among the matrix dimensions
                new_axes.append(seen - n_lead)
                continue
            (lead if seen < n_lead else rest).append(item)
            seen += 0 if item is None else _axes(item)
        row = _keep_axis(rest[0]) if rest else slice(None)
        col = _keep_axis(rest[1]) if len(rest) > 1 else slice(None)
        out = FactoredMatrix(self.A[(*lead, row)], self.B[(*lead, slice(None), col)])
        for where in new_axes:  # 0: before the rows, 1: between rows and columns, 2: after the columns
            if where == 0:
                out = out.unsqueeze(out.ndim - 2)
            elif where == 1:  # the rows become a leading axis of length ldim, the matrix [1, rdim]
                out = FactoredMatrix(out.A.unsqueeze(-2), out.B.unsqueeze(-3))
            else:  # the columns become the rows of a [rdim, 1] matrix
                out = FactoredMatrix(out.B.transpose(-2, -1).unsqueeze(-3), out.A.unsqueeze(-1))
        return out

    def __repr__(self) -> str:
        # TransformerLens' printout, which its demos print (`print(model.OV)`)
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"


def _axes(item: Any) -> int:
    """How many axes an index item consumes (a boolean mask: one per mask dimension)."""
    if isinstance(item, np.ndarray):
        item = torch.from_numpy(item)
    if isinstance(item, Tensor) and item.dtype in (torch.bool, torch.uint8):
        return max(item.dim(), 1)
    if isinstance(item, (list, tuple)):
        t = torch.as_tensor(item)
        return t.dim() if t.dtype == torch.bool else 1
    return 1


def _keep_axis(item: Any) -> Any:
    """An int row / column index as a length-1 slice, so indexing keeps the matrix shape."""
    if isinstance(item, np.integer):
        item = int(item)
    if isinstance(item, int) and not isinstance(item, bool):
        return slice(item, item + 1 if item != -1 else None)
    if isinstance(item, Tensor) and item.dim() == 0 and not item.dtype.is_floating_point:
        return _keep_axis(int(item))
    return item
