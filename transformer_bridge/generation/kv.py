"""The KV cache of both decode drivers: `KVRows` (dynamic), `StaticKVRows` (preallocated), and `run_chunk`.

The controlled engine keeps each row's cached entries right-aligned (left padding, as a fresh
left-padded batch has them), so a row's newest token is always the last used column and positions stay
``cumsum(mask) - 1``. Every change of shape the engine needs is one of four operations: `select` (drop
finished rows, copy a row for a fork), `realign` (after a backtrack or an uneven chunk: move each row's
kept entries to the right, drop columns no row uses), `drop_leading` (columns every row has left) and
`clear` (``use_cache=False``). Both caches implement them; the plain loop (`decode.decode_steps`) only
appends.

* `KVRows`: HF's `DynamicCache`, which grows by concatenation. HF's ``DynamicCache.crop`` takes a count
  but cuts every row alike; a per-row rewind is a gather. It is built without the model config, so
  sliding-window layers keep every entry: a rewind may need entries a window would have dropped, and
  the window itself is applied by the mask.
* `StaticKVRows`: HF's `StaticCache` of a fixed length (a `fast.bucket_length` bucket of the positions
  needed + `SLACK`), written in place
  at ``cache_position`` (the used columns so far: every row writes the same columns, as in the dynamic
  cache); the attention mask covers the whole bucket, 0 on columns not yet written. Sliding-window
  layers are full ones here too. The four operations copy into the same preallocated tensors (a compiled
  step keeps reading the same addresses); a change of batch size (fork, retire) copies into the cache
  of the new size, and a chunk that would pass the end moves to a longer bucket. Caches are kept per
  model and (batch, length) and reused by later calls, as the compiled step's graphs are.

`run_chunk` is the one forward over either cache: it adds ``cache_position`` and pads the mask to the
bucket for a static cache, and runs the compiled one-token step when given one.
"""

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from torch._dynamo.utils import counters
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticLayer

from ..core import BridgeCore
from ..hooks.points import HookContext
from . import fast
from .fast import COMPILE_SECONDS, RECOMPILE_LIMIT, bucket_length

logger = logging.getLogger(__name__)

# Positions a static cache keeps beyond prompt + max_new_tokens (the engine's uneven or forced chunks; the
# plain loop's cache has it too, so both drivers of one call land in the same bucket and compiled graph).
SLACK = 16


class KVRows:
    """A `DynamicCache` whose rows the engine can select, rewind and copy.

    Example:
        >>> kv = KVRows()
        >>> kv.length
        0
    """

    static = False

    def __init__(self, config: Any = None) -> None:
        # With the model's config HF drops entries older than a sliding window (the plain loop, as HF's
        # generate); without it every entry stays (the engine: a rewind may need them).
        self.config = config
        self.cache = DynamicCache(config=config)

    @property
    def length(self) -> int:
        """Columns in use (every row has this many, padding included)."""
        return self.cache.get_seq_length()

    def clear(self) -> None:
        self.cache = DynamicCache(config=self.config)

    def select(self, index: Int[Tensor, " batch"]) -> None:
        """Keep rows ``index`` (repeats copy a row: a fork)."""
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        for layer in self.cache.layers:
            # State-space / convolution layers (Mamba, hybrids) hold per-row conv and recurrent states, no keys:
            # HF's own row selection (beam search's reorder).
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.reorder_cache(index)

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

    def reserve(self, width: int) -> None:
        """Make room for ``width`` more columns (a dynamic cache grows by itself)."""

    def key_mask(self, mask: Int[Tensor, "batch key_pos"]) -> Int[Tensor, "batch key_pos"]:
        """The attention mask over cached + new columns, as the model takes it."""
        return mask

    def chunk_kwargs(self, width: int) -> dict[str, Any]:
        """Extra arguments of the forward that appends ``width`` columns."""
        return {}

    def advance(self, width: int) -> None:
        """Count ``width`` columns written by a forward (a dynamic cache counts itself)."""

    def _layers(self) -> list:
        # State-space layers have neither keys nor `is_initialized`; HF's placeholder for layers without a cache
        # (Nemotron-H's MLP blocks) has no keys.
        layers = [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]
        return [layer for layer in layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]


class StaticKVRows(KVRows):
    """A preallocated `StaticCache` with the same operations as `KVRows`; see the module docstring.

    Example:
        >>> kv = StaticKVRows(model, batch=2, length=70)   # 70 + SLACK positions: a 128-column bucket
        >>> kv.capacity, kv.length
        (128, 0)
    """

    static = True

    def __init__(self, model: BridgeCore, batch: int, length: int) -> None:
        self.model, self.batch, self.used = model, batch, 0
        self.cache = static_cache(model, batch, bucket_length(length + SLACK))

    @property
    def length(self) -> int:
        return self.used

    @property
    def capacity(self) -> int:
        return self.cache.layers[0].max_cache_len

    def clear(self) -> None:
        self.cache.reset()
        self.used = 0

    def select(self, index: Int[Tensor, " batch"]) -> None:
        picked = {i: (layer.keys.index_select(0, index), layer.values.index_select(0, index))
                  for i, layer in self._numbered()}  # fmt: skip
        self.batch = len(index)
        if self.batch:  # the cache of the new batch size (the same object when the size is unchanged)
            self._move_to(static_cache(self.model, self.batch, self.capacity, reset=False), picked)

    def copy_rows(self, sources: Int[Tensor, " n"], targets: Int[Tensor, " n"]) -> None:
        """Copy rows ``sources`` into rows ``targets`` (a fork into free rows: the batch size stays)."""
        for layer in self._layers():
            for t in (layer.keys, layer.values):
                t[targets] = t[sources]

    def realign(self, order: Int[Tensor, "batch key_pos"], start: int) -> None:
        n = self.used
        for layer in self._layers():
            for t in (layer.keys, layer.values):
                idx = order[:, None, start:, None].expand(-1, t.shape[1], -1, t.shape[-1])
                t[:, :, : n - start] = t[:, :, :n].gather(2, idx)
        self._set_used(n - start)

    def drop_leading(self, n: int) -> None:
        m = self.used
        for layer in self._layers():
            for t in (layer.keys, layer.values):
                t[:, :, : m - n] = t[:, :, n:m].clone()
        self._set_used(m - n)

    def reserve(self, width: int) -> None:
        """Move to a longer bucket when ``width`` more columns would pass the end (a new compiled graph)."""
        if self.used + width > self.capacity:
            n = self.used
            picked = {i: (layer.keys[:, :, :n], layer.values[:, :, :n]) for i, layer in self._numbered()}
            self._move_to(static_cache(self.model, self.batch, bucket_length(self.used + width + SLACK)), picked)

    def key_mask(self, mask: Int[Tensor, "batch key_pos"]) -> Int[Tensor, "batch key_pos"]:
        if mask.shape[1] == self.capacity:  # already over the whole cache (the plain loop's buffer)
            return mask
        full = mask.new_zeros((mask.shape[0], self.capacity))
        full[:, : mask.shape[1]] = mask
        return full

    def chunk_kwargs(self, width: int) -> dict[str, Any]:
        device = self.model.device
        return {"cache_position": torch.arange(self.used, self.used + width, device=device)}

    def advance(self, width: int) -> None:
        self.used += width  # HF's layers count their own `cumulative_length`

    def _numbered(self) -> list[tuple[int, Any]]:
        return [(i, layer) for i, layer in enumerate(self.cache.layers) if layer.is_initialized]

    def _move_to(self, cache: StaticCache, picked: dict[int, tuple[Tensor, Tensor]]) -> None:
        for i, (keys, values) in picked.items():
            layer = cache.layers[i]
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            n = keys.shape[2]
            layer.keys[:, :, :n] = keys
            layer.values[:, :, :n] = values
        self.cache = cache
        self._set_used(self.used)

    def _set_used(self, n: int) -> None:
        self.used = n
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(n)  # where HF's `StaticLayer.update` writes next


def make_kv(model: BridgeCore, batch: int, length: int, static: bool) -> KVRows:
    """The plain loop's cache for ``batch`` rows of up to ``length`` positions: static (bucketed), or
    dynamic with the model's config (sliding-window layers keep their window, as in HF's generate)."""
    return StaticKVRows(model, batch, length) if static else KVRows(model.hf_model.config)


def run_chunk(
    model: BridgeCore,
    kv: KVRows,
    tokens: Int[Tensor, "batch chunk"],
    mask: Int[Tensor, "batch key_pos"] | None,
    positions: Int[Tensor, "batch chunk"],
    ctx: HookContext,
    keep: int | Tensor,
    step: Callable | None = None,
    embeds: Float[Tensor, "batch chunk d_model"] | None = None,
) -> Float[Tensor, "batch kept d_vocab"]:
    """One forward of ``tokens`` over ``kv`` (appending them); the logits of the kept positions.

    ``mask`` covers cached + new columns (None: no padding anywhere, HF's fastest path); ``keep`` is
    ``logits_to_keep``. ``step``: a compiled one-token step (`fast.compiled_step`), used when the chunk is
    one token per row over a static cache; every other chunk runs eagerly. ``embeds``: the chunk given as
    embeddings (HF's ``inputs_embeds``; ``tokens`` are then placeholders for its shape).
    """
    width = tokens.shape[1]
    kv.reserve(width)
    key_mask = None if mask is None else kv.key_mask(mask)
    extra = kv.chunk_kwargs(width)
    logits = None
    if step is not None and kv.static and width == 1 and embeds is None and not fast.refused(model):
        logits = _compiled(model, kv, step, tokens, key_mask, positions, ctx, extra["cache_position"])
    if logits is None:
        if embeds is not None:
            extra = {**extra, "inputs_embeds": embeds}
        out = model.run_model(tokens, key_mask, ctx, past_key_values=kv.cache, position_ids=positions,
                              logits_to_keep=keep, **extra)  # fmt: skip
        logits = out.logits
    kv.advance(width)
    return logits


def _compiled(
    model: BridgeCore,
    kv: "StaticKVRows",
    step: Callable,
    tokens: Int[Tensor, "batch 1"],
    key_mask: Int[Tensor, "batch bucket"] | None,
    positions: Int[Tensor, "batch 1"],
    ctx: HookContext,
    cache_position: Int[Tensor, " 1"],
) -> Float[Tensor, "batch 1 d_vocab"] | None:
    """The compiled one-token step; None when dynamo cannot trace it whole with these hooks (warned once)."""
    # Fresh contiguous inputs: the compiled graph is specialised to their strides, and the two drivers
    # (slices of the plain loop's buffers, the engine's own tensors) then share one graph per bucket.
    token, position = (t.new_empty(t.shape).copy_(t) for t in (tokens, positions))
    graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
    for attempt in (0, 1):  # the second: compiled in pieces after the model's own code stopped a whole trace
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), model.sites_checked():
                logits = step(model, token, position, key_mask, kv.cache, cache_position, ctx)[:, None]
            break
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:  # a graph break, or a
            # branch on data: the step is compiled with fullgraph, so dynamo raises instead of cutting it
            if attempt:
                raise  # compiled in pieces, dynamo cuts the graph instead: not a case to fall back from
            if not fast.refuse(model, error):
                return None  # a hook cannot be traced: eager, warned once
    if logits.is_cuda:  # a CUDA graph's output buffer is rewritten by its next replay: keep a copy
        logits = logits.clone()
    if counters["stats"]["unique_graphs"] != graphs:  # this call traced and compiled the step
        _report_compile(tokens.shape[0], kv.capacity, time.perf_counter() - start)
    return logits


def _report_compile(batch: int, bucket: int, seconds: float) -> None:
    COMPILE_SECONDS[(batch, bucket)] = seconds
    logger.info("compiled the decode step for batch %d, cache bucket %d in %.1f s", batch, bucket, seconds)


# Per model (by id, checked through a weak reference): its static caches by (batch, length).
_CACHES: dict[int, tuple[weakref.ref, dict[tuple[int, int], StaticCache]]] = {}


def static_cache(model: BridgeCore, batch: int, length: int, reset: bool = True) -> StaticCache:
    """The model's static cache of this shape, made once and reused (reset unless ``reset=False``)."""
    entry = _CACHES.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = (weakref.ref(model), {})
        _CACHES[id(model)] = entry
    caches = entry[1]
    cache = caches.get((batch, length))
    if cache is None:
        cache = StaticCache(config=model.hf_model.config, max_cache_len=length)
        # Sliding-window layers as full ones (the mask applies the window): HF's sliding static layer keeps
        # its length as a Python int, which a compiled step would be re-traced for at every step, and a
        # rewind may need entries a window would have dropped.
        cache.layers = [StaticLayer(max_cache_len=length) if getattr(layer, "is_sliding", False) else layer
                        for layer in cache.layers]  # fmt: skip
        caches[(batch, length)] = cache
    elif reset:
        cache.reset()
    return cache


def realignment(real: Bool[Tensor, "batch key_pos"]) -> tuple[Int[Tensor, "batch key_pos"], int]:
    """The column order that moves each row's kept entries (``real``) to the right, in order, and how
    many leading columns are then empty in every row."""
    order = torch.argsort(real.to(torch.int8), dim=1, stable=True)
    start = real.shape[1] - int(real.sum(1).max()) if real.shape[0] else 0
    return order, start
