# ruff: noqa: N802, N803, N806  (TransformerLens' names: A, B, AB, T, S, QK, OV)
"""A low-rank matrix kept as its two factors, ``A @ B``: TransformerLens' ``FactoredMatrix`` shape.

``model.QK`` is ``W_Q @ W_Kᵀ`` and ``model.OV`` is ``W_V @ W_O``, both ``[layer, head, d_model, d_model]``
but of rank ``d_head``: storing ``A [..., ldim, mdim]`` and ``B [..., mdim, rdim]`` keeps them small, and
the norm, the singular values and products are computed from the factors.
"""

from typing import Any, Union

import torch
from jaxtyping import Float
from torch import Tensor

from ..checks import ArgumentTypeError, describe


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
            if not isinstance(t, Tensor) or t.dim() < 2:
                raise ArgumentTypeError(f"`{name}` must be a tensor of at least 2 dimensions, got {describe(t)}.")
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(
                f"`A` [..., ldim, mdim] and `B` [..., mdim, rdim] must share mdim; got A {tuple(A.shape)} and "
                f"B {tuple(B.shape)}."
            )
        self.A, self.B = A, B
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.shape = torch.Size((*torch.broadcast_shapes(A.shape[:-2], B.shape[:-2]), self.ldim, self.rdim))

    @property
    def AB(self) -> Float[Tensor, "... ldim rdim"]:
        """The full matrix ``A @ B``."""
        return self.A @ self.B

    @property
    def BA(self) -> Float[Tensor, "... mdim mdim"]:
        """``B @ A`` (square, ``mdim``); needs ``ldim == rdim``."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA needs a square matrix (ldim == rdim), got ldim {self.ldim}, rdim {self.rdim}.")
        return self.B @ self.A

    @property
    def T(self) -> "FactoredMatrix":
        """The transpose ``Bᵀ @ Aᵀ``."""
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __matmul__(self, other: Union["FactoredMatrix", Tensor]) -> Union["FactoredMatrix", Tensor]:
        if isinstance(other, FactoredMatrix):
            if self.mdim <= other.mdim:
                return FactoredMatrix(self.A, (self.B @ other.A) @ other.B)
            return FactoredMatrix((self.A @ self.B) @ other.A, other.B)
        if isinstance(other, Tensor):
            if other.dim() == 1:
                return self.A @ (self.B @ other)
            return FactoredMatrix(self.A, self.B @ other)
        return NotImplemented

    def __rmatmul__(self, other: Tensor) -> Union["FactoredMatrix", Tensor]:
        if isinstance(other, Tensor):
            if other.dim() == 1:
                return (other @ self.A) @ self.B
            return FactoredMatrix(other @ self.A, self.B)
        return NotImplemented

    def __mul__(self, scalar: float | Tensor) -> "FactoredMatrix":
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    def __getitem__(self, index: Any) -> "FactoredMatrix":
        """Index the leading (batch) dimensions only: ``model.QK[layer, head]``."""
        index = index if isinstance(index, tuple) else (index,)
        lead = len(self.shape) - 2
        if len(index) > lead:
            raise IndexError(f"FactoredMatrix indexes its {lead} leading dimensions only, got {len(index)} indices.")
        A = self.A.expand(*self.shape[:-2], self.ldim, self.mdim)
        B = self.B.expand(*self.shape[:-2], self.mdim, self.rdim)
        return FactoredMatrix(A[index], B[index])

    def unsqueeze(self, dim: int) -> "FactoredMatrix":
        """A new leading dimension at ``dim`` (counted among the leading dimensions)."""
        return FactoredMatrix(self.A.unsqueeze(dim), self.B.unsqueeze(dim))

    def norm(self) -> Float[Tensor, "..."]:
        """Frobenius norm of ``A @ B`` per leading index: ``sqrt(trace((AᵀA)(BBᵀ)))``, from the factors."""
        gram_a = self.A.transpose(-2, -1) @ self.A
        gram_b = self.B @ self.B.transpose(-2, -1)
        return (gram_a * gram_b).sum((-2, -1)).clamp_min(0).sqrt()

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(U [..., ldim, mdim], S [..., mdim], Vh [..., mdim, rdim])`` with ``U @ diag(S) @ Vh == A @ B``."""
        Ua, Sa, Vha = torch.linalg.svd(self.A, full_matrices=False)
        Ub, Sb, Vhb = torch.linalg.svd(self.B, full_matrices=False)
        core = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]
        Uc, S, Vhc = torch.linalg.svd(core, full_matrices=False)
        return Ua @ Uc, S, Vhc @ Vhb

    @property
    def S(self) -> Float[Tensor, "... mdim"]:
        """Singular values of ``A @ B`` (at most ``mdim`` of them), largest first."""
        return self.svd()[1]

    @property
    def eigenvalues(self) -> Tensor:
        """Eigenvalues of ``A @ B`` (its non-zero ones are those of ``B @ A``)."""
        return torch.linalg.eigvals(self.BA)

    def get_corner(self, k: int = 3) -> Tensor:
        """The top-left ``k × k`` corner of ``A @ B`` per leading index."""
        return self.A[..., :k, :] @ self.B[..., :, :k]

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={tuple(self.shape)}, mdim={self.mdim})"
