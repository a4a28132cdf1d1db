"""Tensor helpers with TransformerLens' names and behaviour (``transformer_lens.utilities.tensors`` and
``.matrix``): conversions, corners, structure checks, cumulative sums, padding positions and composition
scores of factored matrices."""

from typing import Any, Protocol

import einops
import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..checks import ArgumentTypeError, ArgumentValueError, describe


class Factored(Protocol):
    """What `composition_scores` and `get_matrix_corner` use of a factored matrix (``FactoredMatrix`` here or
    in TransformerLens)."""

    ldim: int
    rdim: int
    ndim: int

    def unsqueeze(self, dim: int) -> "Factored": ...
    def norm(self) -> Tensor: ...
    def __matmul__(self, other: Any) -> Any: ...
    def __getitem__(self, index: Any) -> Any: ...


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array of a tensor (detached, on the CPU; bfloat16 as float32), list, tuple, number or array.

    Example:
        >>> to_numpy(torch.tensor([1.0, 2.0]))
        array([1., 2.], dtype=float32)
    """
    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, (list, tuple)):
        return np.array(tensor)
    if isinstance(tensor, Tensor):
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    if isinstance(tensor, (int, float, bool, str)):
        return np.array(tensor)
    raise ArgumentTypeError(
        f"`tensor` must be a tensor, numpy array, list, tuple or scalar, got {type(tensor).__name__}."
    )


def get_corner(tensor: Any, n: int = 3) -> Any:
    """The first ``n`` entries along every axis (a tensor, array or ``FactoredMatrix``).

    Example:
        >>> get_corner(torch.arange(16).reshape(4, 4), n=2)
        tensor([[0, 1],
                [4, 5]])
    """
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def remove_batch_dim(tensor: Tensor) -> Tensor:
    """``tensor[0]`` if its first axis has size 1, else ``tensor`` unchanged (a 0-d tensor too).

    Example:
        >>> remove_batch_dim(torch.zeros(1, 5, 3)).shape
        torch.Size([5, 3])
    """
    return tensor.squeeze(0) if tensor.dim() > 0 and tensor.shape[0] == 1 else tensor


def transpose(tensor: Float[Tensor, "... a b"]) -> Float[Tensor, "... b a"]:
    """The last two axes swapped.

    Example:
        >>> transpose(torch.zeros(2, 3, 5)).shape
        torch.Size([2, 5, 3])
    """
    return tensor.transpose(-2, -1)


def is_square(x: Tensor) -> bool:
    """Whether ``x`` is a square matrix (2-d, equal sides).

    Example:
        >>> is_square(torch.zeros(3, 3)), is_square(torch.zeros(2, 3, 3))
        (True, False)
    """
    return x.dim() == 2 and x.shape[0] == x.shape[1]


def is_lower_triangular(x: Tensor) -> bool:
    """Whether ``x`` is a square matrix with nothing above its diagonal.

    Example:
        >>> is_lower_triangular(torch.ones(3, 3).tril()), is_lower_triangular(torch.ones(3, 3))
        (True, False)
    """
    return is_square(x) and bool(x.equal(x.tril()))


def check_structure(t1: Tensor, t2: Tensor, *, verbose: bool = False) -> None:
    """Print whether two matrices order their neighbouring entries alike: for each pair of adjacent rows (then
    columns), ``t1[i] >= t1[i + 1]`` must equal ``t2[i] >= t2[i + 1]`` entry by entry. Prints ``PASSED``, or the
    first kind of mismatch with the offending indices (``verbose``: every comparison as it goes). A debugging
    aid for comparing attention patterns or scores computed two ways.

    Example:
        >>> check_structure(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[10.0, 20.0], [30.0, 40.0]]))
        PASSED
    """
    if not isinstance(t1, Tensor) or t1.dim() != 2:
        raise ArgumentValueError(f"`t1` must be a 2-d tensor, got {describe(t1)}.")
    if not isinstance(t2, Tensor) or t2.shape != t1.shape:
        raise ArgumentValueError(f"`t2` must have `t1`'s shape {tuple(t1.shape)}, got {describe(t2)}.")
    mismatches = {}
    for axis, label in ((0, "rows"), (1, "columns")):
        if verbose:
            print(f"Checking {label}")
        a, b = t1.movedim(axis, 0), t2.movedim(axis, 0)
        mismatches[axis] = []
        for i in range(a.shape[0] - 1):
            left, right = a[i].ge(a[i + 1]), b[i].ge(b[i + 1])
            if not left.equal(right):
                mismatches[axis].append(i)
                if verbose:
                    print(f"\trows {i}:{i + 1}")  # TransformerLens' wording, for columns too
                    print(f"\tt1: {left.tolist()}")
                    print(f"\tt2: {right.tolist()}")
    if not mismatches[0] and not mismatches[1]:
        print("PASSED")
    elif mismatches[0]:
        print(f"row mismatch: {mismatches[0]}")
    else:
        print(f"column mismatch: {mismatches[1]}")


def get_offset_position_ids(
    past_kv_pos_offset: int, attention_mask: Int[Tensor, "batch offset_pos"]
) -> Int[Tensor, "batch pos"]:
    """Each token's position counted from its row's first real token (0 there and on the padding before
    it), from column ``past_kv_pos_offset`` on: TransformerLens' positions for left-padded rows.

    Example:
        >>> get_offset_position_ids(0, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        tensor([[0, 0, 0, 1],
                [0, 1, 2, 3]])
    """
    positions = attention_mask.long().cumsum(1) - 1
    return positions.clamp_min(0)[:, past_kv_pos_offset:]


def get_cumsum_along_dim(tensor: Tensor, dim: int, reverse: bool = False) -> Tensor:
    """Cumulative sum along ``dim``; ``reverse`` sums from the end (entry ``i`` is the sum of ``i`` onwards).

    Example:
        >>> get_cumsum_along_dim(torch.tensor([1, 2, 3]), 0, reverse=True)
        tensor([6, 5, 3])
    """
    if not reverse:
        return tensor.cumsum(dim=dim)
    return tensor.flip(dims=(dim,)).cumsum(dim=dim).flip(dims=(dim,))


def repeat_along_head_dimension(
    tensor: Float[Tensor, "batch pos d_model"], n_heads: int, clone_tensor: bool = True
) -> Float[Tensor, "batch pos head d_model"]:
    """``tensor`` repeated for each of ``n_heads`` heads; a copy unless ``clone_tensor`` is False (then a view
    that shares one storage across heads, so it must not be edited in place).

    Example:
        >>> repeat_along_head_dimension(torch.zeros(2, 5, 7), n_heads=4).shape
        torch.Size([2, 5, 4, 7])
    """
    repeated = einops.repeat(tensor, "batch pos d_model -> batch pos head d_model", head=n_heads)
    return repeated.clone() if clone_tensor else repeated


def filter_dict_by_prefix(dictionary: dict, prefix: str) -> dict:
    """The entries whose key starts with ``prefix`` followed by a dot, with that prefix and dot removed
    (a ``prefix`` may end with the dot itself).

    Example:
        >>> filter_dict_by_prefix({"blocks.0.attn.W_Q": 1, "blocks.0.mlp.W_in": 2, "blocks.1.attn.W_Q": 3}, "blocks.0")
        {'attn.W_Q': 1, 'mlp.W_in': 2}
    """
    start = prefix if prefix.endswith(".") else prefix + "."
    return {key[len(start) :]: value for key, value in dictionary.items() if key.startswith(start)}


def composition_scores(
    left: Factored, right: Factored, broadcast_dims: bool = True
) -> Float[Tensor, "*leading_dims"] | Float[Tensor, "*leading_dims_left_and_right"]:
    """``‖left @ right‖_F / (‖left‖_F ‖right‖_F)`` for factored matrices (e.g. ``model.OV`` and ``model.QK``),
    from the factors. With ``broadcast_dims`` every leading index of ``left`` is scored against every one of
    ``right`` (``left``'s leading dimensions first); without it the leading dimensions broadcast as they are.

    Example:
        >>> from transformer_bridge.compat.factored import FactoredMatrix
        >>> ov = FactoredMatrix(torch.randn(3, 8, 2), torch.randn(3, 2, 8))
        >>> composition_scores(ov, ov).shape
        torch.Size([3, 3])
    """
    if broadcast_dims:
        n_left, n_right = left.ndim - 2, right.ndim - 2
        for i in range(n_left):
            right = right.unsqueeze(i)
        for i in range(n_right):
            left = left.unsqueeze(n_left + i)
    if left.rdim != right.ldim:
        raise ArgumentValueError(
            f"Composition scores need `left`'s columns to match `right`'s rows (left.rdim == right.ldim); got "
            f"`left` of shape {tuple(left.shape)} and `right` of shape {tuple(right.shape)}."
        )
    return (left @ right).norm() / left.norm() / right.norm()


def get_matrix_corner(matrix: Factored, n: int = 3) -> Tensor:
    """The first ``n`` entries along every axis of a factored matrix, formed as a tensor (only the corner is
    multiplied out).

    Example:
        >>> from transformer_bridge.compat.factored import FactoredMatrix
        >>> get_matrix_corner(FactoredMatrix(torch.ones(5, 2), torch.ones(2, 6)), n=2)
        tensor([[2., 2.],
                [2., 2.]])
    """
    return get_corner(matrix[tuple(slice(n) for _ in range(matrix.ndim))]).AB
