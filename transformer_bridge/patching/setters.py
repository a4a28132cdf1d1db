"""Patch setters: how one index of a sweep copies the clean activation into the corrupted one.

TransformerLens' names and contract: ``setter(corrupted_activation, index, clean_activation)`` edits the
corrupted activation (in place, and returns it) where ``index`` (a list of ints, layer first) says. In a
batched sweep the corrupted activation a setter sees is the slice of the batch that belongs to one patch
(``[batch, ...]``, the corrupted batch's own rows), so a setter written for TransformerLens' one-patch-per-forward
loop works unchanged. A setter may also return a new tensor of the slice's shape; the sweep copies it in.

Axis layouts: residual-stream and head-vector points are ``[batch, pos, ...]`` (``hook_q/k/v/z/result``:
``[batch, pos, head, d_head]``; ``hook_k`` / ``hook_v`` have ``kv_head`` heads in grouped-query models);
attention scores and patterns are ``[batch, head, query_pos, key_pos]``.
"""

from collections.abc import Sequence

from jaxtyping import Float
from torch import Tensor

from ..checks import ArgumentValueError


def _index(index: Sequence[int], n: int, setter: str, axes: str) -> list[int]:
    if len(index) != n:
        raise ArgumentValueError(f"`{setter}` takes an index of {n} ints ({axes}), got {list(index)!r}.")
    return [int(i) for i in index]


def layer_pos_patch_setter(
    corrupted_activation: Float[Tensor, "batch pos ..."],
    index: Sequence[int],
    clean_activation: Float[Tensor, "batch pos ..."],
) -> Float[Tensor, "batch pos ..."]:
    """Patch one position of a ``[batch, pos, ...]`` activation; ``index = [layer, pos]``.

    Example:
        >>> layer_pos_patch_setter(torch.zeros(1, 3, 2), [0, 1], torch.ones(1, 3, 2))[0, :, 0]
        tensor([0., 1., 0.])
    """
    _, pos = _index(index, 2, "layer_pos_patch_setter", "layer, pos")
    corrupted_activation[:, pos, ...] = clean_activation[:, pos, ...]
    return corrupted_activation


def layer_pos_head_vector_patch_setter(
    corrupted_activation: Float[Tensor, "batch pos head d_head"],
    index: Sequence[int],
    clean_activation: Float[Tensor, "batch pos head d_head"],
) -> Float[Tensor, "batch pos head d_head"]:
    """Patch one head at one position (``hook_q/k/v/z/result``); ``index = [layer, pos, head]``.

    Example:
        >>> out = layer_pos_head_vector_patch_setter(torch.zeros(1, 3, 2, 4), [0, 2, 1], torch.ones(1, 3, 2, 4))
        >>> out[0, 2, 1].sum().item(), out.sum().item()
        (4.0, 4.0)
    """
    _, pos, head = _index(index, 3, "layer_pos_head_vector_patch_setter", "layer, pos, head")
    corrupted_activation[:, pos, head] = clean_activation[:, pos, head]
    return corrupted_activation


def layer_head_vector_patch_setter(
    corrupted_activation: Float[Tensor, "batch pos head d_head"],
    index: Sequence[int],
    clean_activation: Float[Tensor, "batch pos head d_head"],
) -> Float[Tensor, "batch pos head d_head"]:
    """Patch one head at every position (``hook_q/k/v/z/result``); ``index = [layer, head]``.

    Example:
        >>> layer_head_vector_patch_setter(torch.zeros(1, 3, 2, 4), [0, 1], torch.ones(1, 3, 2, 4)).sum().item()
        12.0
    """
    _, head = _index(index, 2, "layer_head_vector_patch_setter", "layer, head")
    corrupted_activation[:, :, head] = clean_activation[:, :, head]
    return corrupted_activation


def layer_head_pattern_patch_setter(
    corrupted_activation: Float[Tensor, "batch head query_pos key_pos"],
    index: Sequence[int],
    clean_activation: Float[Tensor, "batch head query_pos key_pos"],
) -> Float[Tensor, "batch head query_pos key_pos"]:
    """Patch one head's whole pattern (or scores); ``index = [layer, head]``.

    Example:
        >>> layer_head_pattern_patch_setter(torch.zeros(1, 2, 3, 3), [0, 1], torch.ones(1, 2, 3, 3)).sum().item()
        9.0
    """
    _, head = _index(index, 2, "layer_head_pattern_patch_setter", "layer, head")
    corrupted_activation[:, head, :, :] = clean_activation[:, head, :, :]
    return corrupted_activation


def layer_head_pos_pattern_patch_setter(
    corrupted_activation: Float[Tensor, "batch head query_pos key_pos"],
    index: Sequence[int],
    clean_activation: Float[Tensor, "batch head query_pos key_pos"],
) -> Float[Tensor, "batch head query_pos key_pos"]:
    """Patch one head's pattern row at one destination (query) position; ``index = [layer, head, dest_pos]``.

    Example:
        >>> out = layer_head_pos_pattern_patch_setter(torch.zeros(1, 2, 3, 3), [0, 1, 2], torch.ones(1, 2, 3, 3))
        >>> out[0, 1, 2].tolist(), out.sum().item()
        ([1.0, 1.0, 1.0], 3.0)
    """
    _, head, dest = _index(index, 3, "layer_head_pos_pattern_patch_setter", "layer, head, dest_pos")
    corrupted_activation[:, head, dest, :] = clean_activation[:, head, dest, :]
    return corrupted_activation


def layer_head_dest_src_pos_pattern_patch_setter(
    corrupted_activation: Float[Tensor, "batch head query_pos key_pos"],
    index: Sequence[int],
    clean_activation: Float[Tensor, "batch head query_pos key_pos"],
) -> Float[Tensor, "batch head query_pos key_pos"]:
    """Patch one entry of one head's pattern; ``index = [layer, head, dest_pos, src_pos]``.

    Example:
        >>> out = layer_head_dest_src_pos_pattern_patch_setter(torch.zeros(1, 2, 3, 3), [0, 1, 2, 0],
        ...                                                    torch.ones(1, 2, 3, 3))
        >>> out[0, 1, 2, 0].item(), out.sum().item()
        (1.0, 1.0)
    """
    _, head, dest, src = _index(index, 4, "layer_head_dest_src_pos_pattern_patch_setter",
                                "layer, head, dest_pos, src_pos")  # fmt: skip
    corrupted_activation[:, head, dest, src] = clean_activation[:, head, dest, src]
    return corrupted_activation
