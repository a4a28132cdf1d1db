"""`HookContext`: what the chunk of tokens a hook sees is (``hook.ctx``), in a forward or a generation step;
`PointContext`: the per-point dict that ``hook.ctx`` is, which also answers the current chunk's attributes."""

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

Phase = Literal["forward", "prefill", "decode", "recompute"]


@dataclass(frozen=True)
class HookContext:
    """What the chunk of tokens a hook sees is, during a forward or a generation step.

    Attributes:
        phase: ``"forward"`` (a plain forward), ``"prefill"``, ``"decode"`` (one new token per row with
            the KV cache) or ``"recompute"`` (the cache-building forward after generation).
        step: decode step (0 at prefill and in a plain forward).
        positions: ``[batch, chunk]`` absolute position of each token in its own row, as the model runs it:
            in a row with padding before its tokens the first real token is 0 (that padding gets 0 too, see
            `pad_mask`); other rows count from their first column.
        pad_mask: ``[batch, chunk]`` True where the token is padding.
        is_generated: ``[batch, chunk]`` True where the token was produced by `generate`.
        kind: what the chunk holds: ``"forward"``, ``"prompt"``, ``"sampled"`` (tokens just sampled),
            ``"forced"`` (tokens a controller appended without sampling: k of them in one forward),
            ``"refeed"`` (a row's last kept token again, after a backtrack), ``"recompute"`` (a whole
            row again, ``use_cache=False``), ``"verify"`` (speculative decoding: a row's newest token
            and its drafts, which are checked against the logits of this forward; rejected ones are
            rolled back), ``"finished"`` (a static cache keeps a finished row's slot: padding), or
            ``"mixed"`` when rows differ (see ``row_kinds``).
        row_kinds: one of those per row of the batch, in a controlled or speculative `generate` (else
            empty).
        rows: the output row each batch row is, in a controlled or speculative `generate` (forks add
            rows; a finished row leaves the batch, or keeps its slot as -1 with a static cache), else
            empty.

    Example:
        >>> def only_position_5(resid, hook):
        ...     keep = (hook.ctx.positions == 5)[..., None]
        ...     return resid * ~keep
    """

    phase: Phase
    step: int
    positions: Tensor
    pad_mask: Tensor
    is_generated: Tensor
    kind: str = "forward"
    row_kinds: tuple[str, ...] = ()
    rows: tuple[int, ...] = ()

    @staticmethod
    def from_mask(
        attention_mask: Tensor,
        phase: Phase = "forward",
        step: int = 0,
        n_prompt: Tensor | None = None,
        hf_positions: bool = False,
    ) -> "HookContext":
        """Context for a whole sequence given its 0/1 attention mask. A row with padding before a real token
        counts positions from its first real token (``cumsum(mask) - 1``, 0 on the padding before it); every
        other row (unpadded, right-padded, all padding) keeps HF's default positions ``0 .. pos - 1``;
        ``hf_positions``: every row does (a 4-D mask, which says nothing about positions)."""
        real = attention_mask.bool()
        derived = (real.long().cumsum(-1) - 1).clamp_min(0)
        default = torch.arange(real.shape[-1], device=real.device)
        shifted = ((derived != default) & real & (not hf_positions)).any(-1, keepdim=True)
        positions = torch.where(shifted, derived, default)
        if n_prompt is None:
            generated = torch.zeros_like(real)
        else:
            generated = positions >= n_prompt.to(positions.device)[:, None]
            generated &= real
        return HookContext(phase, step, positions, ~real, generated)


class PointContext(dict):
    """``hook.ctx``: TransformerLens' per-point dict (``hook.ctx["key"] = value`` survives across
    forwards until ``hook.clear_context()``), which also answers the attributes of the current
    chunk's `HookContext` (``hook.ctx.phase``, ``hook.ctx.positions`` …) while a bridge call runs.

    Example:
        >>> def remember(x, hook):
        ...     hook.ctx["last_norm"] = x.norm()
        ...     print(hook.ctx.phase)
    """

    def __init__(self, point: Any) -> None:
        super().__init__()
        self._point = point

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(name)
        ctx = self._point._owner.ctx
        if ctx is None:
            raise AttributeError(
                f"hook.ctx.{name} describes the chunk being computed and exists only while a bridge call runs; "
                "keep `hook.chunk` (a HookContext) to read it later."
            )
        return getattr(ctx, name)
