"""TransformerLens' KV-cache object, `TransformerLensKeyValueCache`, over HF's `DynamicCache`.

TransformerLens decodes by hand with a cache object it owns: one entry per layer holding the past keys and
values ``[batch, pos_so_far, kv_head, d_head]``, plus the attention mask of every position so far. Each
``model(new_tokens, past_kv_cache=cache)`` attends to the cached positions and appends the new ones (unless
the cache is frozen, which makes it a reusable prefix). Here the entries are kept in TransformerLens'
layout as views of the tensors HF's cache holds; a cached forward hands them to the HF model as a
`DynamicCache` and takes the grown tensors back, so the model's own attention code does the work.

The attention mask passed with a cached step covers the new tokens only (TransformerLens' rule); the
cache appends it to the mask of the positions before, and positions are counted from the whole mask, so a
padded prefix or a masked-out token steps to the logits of the unpadded sequence.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import DynamicCache

from ..cache.caching import next_token_loss, next_token_losses
from ..checks import describe
from ..core import BridgeCore
from ..hooks.context import HookContext
from ..inputs import left_padding_mask

__all__ = ["TransformerLensKeyValueCache", "TransformerLensKeyValueCacheEntry", "get_pos_offset"]


@dataclass
class TransformerLensKeyValueCacheEntry:
    """One layer's past keys and values, ``[batch, pos_so_far, kv_head, d_head]`` (TransformerLens' layout).

    Example:
        >>> entry = TransformerLensKeyValueCacheEntry.init_cache_entry(model.cfg, "cpu", batch_size=2)
        >>> keys, values = entry.append(torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8))
        >>> entry.past_keys.shape                      # [2, 3, 2, 8] (unless frozen)
    """

    past_keys: Float[Tensor, "batch pos_so_far kv_head d_head"]
    past_values: Float[Tensor, "batch pos_so_far kv_head d_head"]
    frozen: bool = False

    @classmethod
    def init_cache_entry(
        cls, cfg: Any, device: str | torch.device | None, batch_size: int = 1
    ) -> "TransformerLensKeyValueCacheEntry":
        """An empty entry for ``cfg`` (``n_key_value_heads`` or ``n_heads``, ``d_head``, ``dtype``)."""
        kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
        shape = (_batch(batch_size), 0, kv, cfg.d_head)
        dtype = getattr(cfg, "dtype", None) or torch.get_default_dtype()
        return cls(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))

    def append(
        self,
        new_keys: Float[Tensor, "batch new_tokens kv_head d_head"],
        new_values: Float[Tensor, "batch new_tokens kv_head d_head"],
    ) -> tuple[Float[Tensor, "batch pos kv_head d_head"], Float[Tensor, "batch pos kv_head d_head"]]:
        """Past and new keys and values; stored unless the entry is frozen."""
        keys = torch.cat([self.past_keys, new_keys], dim=1)
        values = torch.cat([self.past_values, new_values], dim=1)
        if not self.frozen:
            self.past_keys, self.past_values = keys, values
        return keys, values


@dataclass
class TransformerLensKeyValueCache:
    """Past keys and values of every layer and the attention mask so far: pass it as
    ``model(new_tokens, past_kv_cache=cache)`` to decode by hand (TransformerLens' API).

    ``freeze()`` keeps the cache as it is (a prefix to run many continuations from); ``unfreeze()`` lets it
    grow again. ``cache[layer]`` is that layer's `TransformerLensKeyValueCacheEntry`.

    Example:
        >>> cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch_size=1)
        >>> logits = model(prompt_tokens, past_kv_cache=cache)          # prefill
        >>> next_logits = model(next_token, past_kv_cache=cache)       # one step: [1, 1, d_vocab]
    """

    entries: list[TransformerLensKeyValueCacheEntry]
    previous_attention_mask: Int[Tensor, "batch pos_so_far"]
    frozen: bool = False
    # The HF model's config, for a DynamicCache with its layer types (sliding windows); set by a bridge forward.
    hf_config: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def init_cache(
        cls, cfg: Any, device: str | torch.device | None = None, batch_size: int = 1
    ) -> "TransformerLensKeyValueCache":
        """An empty cache with ``cfg.n_layers`` entries for a batch of ``batch_size``.

        Example:
            >>> cache = TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", batch_size=2)
        """
        if device is None:
            device = getattr(cfg, "device", None) or "cpu"
        entries = [
            TransformerLensKeyValueCacheEntry.init_cache_entry(cfg, device, batch_size) for _ in range(cfg.n_layers)
        ]
        return cls(entries, torch.empty((_batch(batch_size), 0), device=device, dtype=torch.int))

    def freeze(self) -> None:
        """Stop storing: later forwards read the cache and leave it as it is."""
        self.frozen = True
        for entry in self.entries:
            entry.frozen = True

    def unfreeze(self) -> None:
        """Store again: each forward appends its positions."""
        self.frozen = False
        for entry in self.entries:
            entry.frozen = False

    def append_attention_mask(self, attention_mask: Int[Tensor, "batch new_tokens"]) -> Int[Tensor, "batch pos"]:
        """The mask of the cached and the new positions; stored unless frozen."""
        mask = torch.cat([self.previous_attention_mask, attention_mask.to(self.previous_attention_mask.device)], -1)
        if not self.frozen:
            self.previous_attention_mask = mask
        return mask

    def __getitem__(self, layer: int) -> TransformerLensKeyValueCacheEntry:
        return self.entries[layer]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[TransformerLensKeyValueCacheEntry]:
        return iter(self.entries)

    @property
    def pos_so_far(self) -> int:
        """How many positions the cache holds."""
        return self.entries[0].past_keys.shape[1] if self.entries else 0

    def bridge_forward(
        self,
        core: BridgeCore,
        input: Any,
        attention_mask: Tensor | None = None,
        prepend_bos: bool | None = None,
        padding_side: str | None = None,
        return_type: str | None = "logits",
        loss_per_token: bool = False,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
    ) -> Any:
        """``core.forward(input, past_kv_cache=self)``: run the new tokens on the cached positions.

        ``attention_mask`` covers the new tokens only; without it every new token is real, or, with
        ``padding_side``, pad tokens on that side are padding (TransformerLens' ``get_attention_mask``).
        """
        if start_at_layer is not None or stop_at_layer is not None:
            raise ValueError(
                "A forward with `past_kv_cache` runs the whole model on the new tokens: it takes no `start_at_layer` "
                f"or `stop_at_layer` (got {start_at_layer!r}, {stop_at_layer!r})."
            )
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(
                f"A forward with `past_kv_cache` returns 'logits', 'loss', 'both' or None, got `return_type`="
                f"{return_type!r}."
            )
        if len(self.entries) != core.cfg.n_layers:
            raise ValueError(
                f"`past_kv_cache` has {len(self.entries)} layers, the model {core.cfg.n_layers}: build it with "
                "TransformerLensKeyValueCache.init_cache(model.cfg, device, batch_size)."
            )
        tokens, new_mask = _new_tokens(core, input, attention_mask, prepend_bos, padding_side, self.pos_so_far)
        if tokens.shape[0] != self.previous_attention_mask.shape[0]:
            raise ValueError(
                f"`past_kv_cache` was made for a batch of {self.previous_attention_mask.shape[0]}, the input has "
                f"{tokens.shape[0]} rows."
            )
        mask = self.append_attention_mask(new_mask).to(tokens.device).long()
        full = HookContext.from_mask(mask, phase="prefill" if self.pos_so_far == 0 else "decode")
        new = slice(mask.shape[1] - tokens.shape[1], None)
        ctx = HookContext(full.phase, 0, full.positions[:, new], full.pad_mask[:, new], full.is_generated[:, new])
        past = self._hf_cache(core)
        padded = not bool(mask.all())
        out = core.run_model(tokens, mask if padded else None, ctx, past_key_values=past,
                             position_ids=ctx.positions if padded else None)  # fmt: skip
        if not self.frozen:
            for entry, layer in zip(self.entries, past.layers, strict=True):
                entry.past_keys, entry.past_values = layer.keys.transpose(1, 2), layer.values.transpose(1, 2)
        logits = out.logits
        if return_type == "logits":
            return logits
        if return_type is None:
            return None
        loss = (next_token_losses if loss_per_token else next_token_loss)(logits, tokens, new_mask.to(tokens.device))
        return loss if return_type == "loss" else (logits, loss)

    def _hf_cache(self, core: BridgeCore) -> DynamicCache:
        """A `DynamicCache` holding the entries (HF's layout ``[batch, kv_head, pos, d_head]``; views, no copy
        when the entries came from the previous step)."""
        cache = DynamicCache(config=core.hf_model.config)
        if self.pos_so_far == 0:
            return cache
        for entry, layer in zip(self.entries, cache.layers, strict=True):
            layer.update(entry.past_keys.transpose(1, 2), entry.past_values.transpose(1, 2))
        return cache


def get_pos_offset(past_kv_cache: TransformerLensKeyValueCache | None, batch_size: int = 1) -> int:
    """TransformerLens' ``utilities.cache.get_pos_offset``: positions already cached (0 without a cache).

    Example:
        >>> get_pos_offset(None, 1)
        0
    """
    if past_kv_cache is None:
        return 0
    return int(past_kv_cache[0].past_keys.shape[1])


def _batch(batch_size: object) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {describe(batch_size)}.")
    return batch_size


def _new_tokens(
    core: BridgeCore, input: Any, attention_mask: Tensor | None, prepend_bos: bool | None,
    padding_side: str | None, n_past: int,
) -> tuple[Int[Tensor, "batch new"], Int[Tensor, "batch new"]]:  # fmt: skip
    """The new token ids and their mask (1 = real): text is tokenized (BOS only before an empty cache)."""
    if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and isinstance(input[0], str)):
        bos = (core.cfg.default_prepend_bos if prepend_bos is None else prepend_bos) and n_past == 0
        side = padding_side or ("left" if n_past == 0 else "right")
        tokens, mask = core.to_tokens_and_mask(input, prepend_bos=bos, padding_side=side)  # type: ignore[attr-defined]
        if attention_mask is not None:
            raise ValueError("`attention_mask` is only accepted with token inputs; text is padded for you.")
        return tokens, mask
    if not isinstance(input, Tensor) or input.is_floating_point() or input.dim() not in (1, 2):
        raise TypeError(
            f"With `past_kv_cache`, `input` is text or the new token ids [batch, new], got {describe(input)}."
        )
    tokens = (input[None] if input.dim() == 1 else input).to(core.device).long()
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(tokens.shape) or not bool(
            ((attention_mask == 0) | (attention_mask == 1)).all()
        ):
            raise ValueError(
                f"With `past_kv_cache`, `attention_mask` is 0/1 over the new tokens only, shape {tuple(tokens.shape)} "
                f"(the cache keeps the mask of the positions before); got {describe(attention_mask)}."
            )
        return tokens, attention_mask.to(tokens.device).long()
    if padding_side is None:
        return tokens, torch.ones_like(tokens)
    if padding_side not in ("left", "right"):
        raise ValueError(f"`padding_side` must be None, 'left' or 'right', got {describe(padding_side)}.")
    bos = (core.cfg.default_prepend_bos if prepend_bos is None else prepend_bos) and n_past == 0
    return tokens, _pad_mask(core, tokens, padding_side, bos)


def _pad_mask(core: BridgeCore, tokens: Int[Tensor, "batch pos"], side: str, bos: bool) -> Int[Tensor, "batch pos"]:
    """TransformerLens' ``get_attention_mask``: the run of pad tokens on ``side`` is padding (on the left, a BOS
    that is the pad token is kept when rows start with BOS)."""
    pad = core._known_pad_id()
    if side == "left":
        return left_padding_mask(tokens, pad, core.cfg.bos_token_id, bos)
    if pad is None:
        return torch.ones_like(tokens)
    return ((tokens != pad).flip(-1).long().cumsum(-1).flip(-1) > 0).long()
