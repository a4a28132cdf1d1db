"""Weights prepacked for oneDNN, for the compiled decode step's matrix products of several rows on CPU.

At batch > 1 a CPU decode step's linear layers are ``[b, k] @ [k, n]`` products with a few rows. On the
CPUs measured here BLAS (MKL) runs the 211 products of a SmolLM2 batch-8 step in ~75 ms; oneDNN with the
weights reordered once into its blocked layout runs them in ~44 ms (docs/benchmarks.md). The graph pass
in `compiled` sends such products to `packed_mm`, a custom op that multiplies by a packed copy of the
weight, made on first use and kept here, keyed by the weight's storage.

The weight stays an input of the compiled graph, and its packed copy is never stale:

- every call checks the weight's storage (replacing the Parameter, ``p.data = ...``), its offset, shape
  and strides, and its version counter (in-place ops such as ``p.mul_(2)`` or ``load_state_dict``, which
  copies into the parameter); any change re-packs;
- edits the version counter does not see (``p.data.copy_(...)``, ``p.data[...] = ...``: ``.data`` has
  its own counter) are caught by `revalidate`, which every ``generate(..., compile=True)`` call runs
  before decoding: it compares each packed weight's row and column sums of its bit patterns (integer
  sums, so one changed bit in one element changes them) with those taken when it was packed, and
  re-packs what changed. It reads every packed weight once (~0.1 s for SmolLM2's 0.54 GB here). An edit
  made *during* a call through ``.data`` (from a streamer, say) is seen from the next call on.

A packed copy costs as much memory as its weight (`memory_bytes`); copies go when their weight's storage
is freed, or with `clear`.
"""

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# Products with at least this many rows (and fp32 weights on CPU) are sent to the packed op by the pass.
MIN_ROWS = 2


@dataclass
class _Pack:
    storage: "weakref.ref[torch.UntypedStorage]"
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    version: int
    packed: Tensor
    rows: Tensor  # row sums of the weight's bit patterns (int32, wrapping) when it was packed
    cols: Tensor  # column sums
    hint: int  # the rows of the product it was packed for (oneDNN's layout hint; any product may use it)


# (storage data pointer, offset, shape, stride) -> its pack: one per weight, whatever the batch size (a copy
# packed for products of m rows serves products of any number of rows), so packs hold at most the weights' size
_PACKS: dict[tuple, _Pack] = {}


def packable(weight: Any) -> bool:
    """Whether oneDNN can pack ``weight`` (a 2-D fp32 CPU tensor) on this build.

    Example:
        >>> import torch
        >>> packable(torch.ones(4, 3)) == torch.backends.mkldnn.is_available()
        True
    """
    return (isinstance(weight, Tensor) and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and torch.backends.mkldnn.is_available())  # fmt: skip


def _sums(weight: Tensor) -> tuple[Tensor, Tensor]:
    bits = weight.view(torch.int32)
    return bits.sum(1, dtype=torch.int32), bits.sum(0, dtype=torch.int32)


def _key(weight: Tensor) -> tuple:
    return (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride())


def _pack(weight: Tensor, m: int, key: tuple) -> _Pack:
    rows, cols = _sums(weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), m)

    def gone(ref: "weakref.ref[torch.UntypedStorage]") -> None:  # the weight's storage was freed
        if key in _PACKS and _PACKS[key].storage is ref:
            del _PACKS[key]

    entry = _Pack(weakref.ref(weight.untyped_storage(), gone), weight.storage_offset(), tuple(weight.shape),
                  weight.stride(), weight._version, packed, rows, cols, m)  # fmt: skip
    _PACKS[key] = entry
    return entry


def _current(weight: Tensor, m: int) -> Tensor:
    """The packed copy of ``weight`` ((re)packed for products of ``m`` rows if missing or out of date)."""
    key = _key(weight)
    entry = _PACKS.get(key)
    if entry is None or entry.storage() is not weight.untyped_storage() or entry.version != weight._version:
        entry = _pack(weight, m, key)
    return entry.packed


@torch.library.custom_op("transformer_bridge::packed_mm", mutates_args=())
def packed_mm(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` through oneDNN with a packed copy of ``weight`` (``[n, k]``, fp32, CPU), kept between
    calls and re-packed when ``weight`` changes.

    Example:
        >>> import torch
        >>> x, w = torch.randn(8, 16), torch.randn(4, 16)
        >>> torch.allclose(packed_mm(x, w), x @ w.T, atol=1e-5)
        True
    """
    if not packable(weight) or x.dtype != weight.dtype or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"packed_mm: `x` [m, k] and `weight` [n, k] must be fp32 CPU matrices (oneDNN available), "
                         f"got x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)} on "
                         f"{weight.device}.")  # fmt: skip
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _current(weight, x.shape[0]), None, "none", [], "")


@packed_mm.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _weight(entry: _Pack) -> Tensor | None:
    storage = entry.storage()
    if storage is None:
        return None
    return torch.empty(0).set_(storage, entry.offset, entry.shape, entry.stride)


def revalidate() -> int:
    """Re-pack every packed weight whose contents changed since it was packed (edits through ``.data``, which
    the version counter does not see); returns how many were re-packed.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.randn(4, 16))
        >>> x = torch.randn(8, 16)
        >>> _ = packed_mm(x, w)
        >>> w.data[0, 0] += 1.0          # not seen by w's version counter
        >>> revalidate()
        1
        >>> torch.allclose(packed_mm(x, w), x @ w.T, atol=1e-5)
        True
    """
    changed = 0
    for key, entry in list(_PACKS.items()):
        weight = _weight(entry)
        if weight is None:
            _PACKS.pop(key, None)
            continue
        rows, cols = _sums(weight)
        if not (torch.equal(rows, entry.rows) and torch.equal(cols, entry.cols)):
            # the new entry holds this view's version (0), not the parameter's: where they differ, the next
            # step packs once more (it trusts no version it has not seen)
            _pack(weight, entry.hint, key)
            changed += 1
    return changed


def memory_bytes() -> int:
    """Bytes held by packed copies (each as large as its weight).

    Example:
        >>> clear(); memory_bytes()
        0
    """
    return sum(entry.shape[0] * entry.shape[1] * 4 for entry in _PACKS.values())


def clear() -> None:
    """Drop every packed copy (they are made again on next use)."""
    _PACKS.clear()
