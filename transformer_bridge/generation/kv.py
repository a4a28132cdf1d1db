"""`KVRows`: the only place the controlled engine touches the KV cache.

The engine keeps each row's cached entries right-aligned (left padding, as a fresh left-padded batch
has them), so a row's newest token is always the last column and positions stay ``cumsum(mask) - 1``.
Every change of shape the engine needs is one of four operations: `select` (drop finished rows, copy
a row for a fork), `realign` (after a backtrack or an uneven chunk: move each row's kept entries to
the right, drop columns no row uses), `drop_leading` (columns every row has left) and `clear`
(``use_cache=False``). A static cache (the fast path) can implement the same on preallocated tensors.

HF's ``DynamicCache.crop`` takes a count but cuts every row alike; a per-row rewind is a gather.
The cache is built without the model config, so sliding-window layers keep every entry: a rewind may
need entries a window would have dropped, and the window itself is applied by the mask.
"""

import torch
from jaxtyping import Bool, Int
from torch import Tensor
from transformers import DynamicCache


class KVRows:
    """A `DynamicCache` whose rows the engine can select, rewind and copy.

    Example:
        >>> kv = KVRows()
        >>> kv.length
        0
    """

    def __init__(self) -> None:
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def clear(self) -> None:
        self.cache = DynamicCache()

    def select(self, index: Int[Tensor, " batch"]) -> None:
        """Keep rows ``index`` (repeats copy a row: a fork)."""
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)

    def realign(self, order: Int[Tensor, "batch key_pos"], start: int) -> None:
        """Reorder each row's columns by ``order`` (kept entries last), then drop the first ``start`` columns."""
        for layer in self._layers():
            idx = order[:, None, start:, None]
            layer.keys = layer.keys.gather(2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1]))
            layer.values = layer.values.gather(2, idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[-1]))

    def drop_leading(self, n: int) -> None:
        """Drop the first ``n`` columns (empty in every row)."""
        for layer in self._layers():
            layer.keys = layer.keys[:, :, n:]
            layer.values = layer.values[:, :, n:]

    def _layers(self) -> list:
        return [layer for layer in self.cache.layers if layer.is_initialized and layer.keys.numel()]


def realignment(real: Bool[Tensor, "batch key_pos"]) -> tuple[Int[Tensor, "batch key_pos"], int]:
    """The column order that moves each row's kept entries (``real``) to the right, in order, and how
    many leading columns are then empty in every row."""
    order = torch.argsort(real.to(torch.int8), dim=1, stable=True)
    start = real.shape[1] - int(real.sum(1).max()) if real.shape[0] else 0
    return order, start
