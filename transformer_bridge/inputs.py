"""Token inputs: tokenizing text into padded batches, validating attention masks, masks from token values.

Text is padded as `to_tokens` pads it: ``padding_side``, default ``cfg.default_padding_side`` (right, as in
TransformerLens), for forward, run_with_hooks, run_with_cache and the loss; generation (and a KV-cached forward)
left-pads, so that each row's last token is in the last column. Token ids
given without a mask mean what they mean to HF's forward: every token is real, whatever its id (rows led
by BOS, EOS or pad ids are ordinary data in packed and SAE datasets). A mask is read off token values only
on request: `left_padding_mask` when the user says the ids are left-padded (TransformerLens'
``padding_side="left"``), `hf_generate_mask` for `generate`, which follows HF's ``generate``.
"""

from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from .checks import describe, warn_difference_once

PaddingSide = Literal["left", "right"]


def tokenize(
    tokenizer: Any,
    input: str | Sequence[str],
    prepend_bos: bool,
    padding_side: PaddingSide,
    pad_token_id: int,
    max_length: int | None = None,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """``(tokens, attention_mask)`` for text; ``prepend_bos`` makes every row start with exactly one BOS
    (``False``: no special tokens at all); rows longer than ``max_length`` keep their first tokens.

    Example:
        >>> tokens, mask = tokenize(tok, ["Hi", "Hello"], True, "left", tok.pad_token_id)
    """
    texts = [input] if isinstance(input, str) else list(input) if isinstance(input, (list, tuple)) else None
    if not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"`input` must be a str or a non-empty list of str, got {describe(input)}.")
    if padding_side not in ("left", "right"):
        raise ValueError(f"`padding_side` must be 'left' or 'right', got {describe(padding_side)}.")
    rows = [tokenizer(t, add_special_tokens=prepend_bos)["input_ids"] for t in texts]
    bos = getattr(tokenizer, "bos_token_id", None)
    if prepend_bos and bos is not None:
        rows = [r if r[:1] == [bos] else [bos, *r] for r in rows]
    if max_length is not None:
        rows = [r[:max_length] for r in rows]
    if any(len(r) == 0 for r in rows):
        raise ValueError("`input` contains a string that tokenizes to no tokens; give it some text or BOS.")
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if padding_side == "left" else slice(0, len(r))
        tokens[i, cols] = torch.tensor(r)
        mask[i, cols] = 1
    return tokens, mask


def left_padding_mask(
    tokens: Int[Tensor, "batch pos"], pad_token_id: int | None, bos_token_id: int | None, prepend_bos: bool
) -> Int[Tensor, "batch pos"]:
    """The mask of ids the caller says are left-padded (TransformerLens' ``get_attention_mask`` for
    ``padding_side="left"``): leading pad tokens are padding, except the last of them when the pad token is
    BOS and rows start with BOS. A row of nothing but pad ids keeps its last token.

    Example:
        >>> left_padding_mask(torch.tensor([[0, 0, 5, 6]]), 0, 1, True)
        tensor([[0, 0, 1, 1]])
    """
    mask = torch.ones_like(tokens)
    if pad_token_id is None:
        return mask
    leading = (tokens != pad_token_id).long().cumsum(-1) == 0
    mask[leading] = 0
    n_leading = leading.sum(-1)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    if prepend_bos and bos_token_id == pad_token_id:
        mask[rows, (n_leading - 1).clamp_min(0)] = 1
    mask[rows, -1] = 1  # a row of pad ids only: the last one is the row
    return mask


def hf_generate_mask(
    tokens: Int[Tensor, "batch pos"], pad_token_id: int | None, eos_token_ids: Sequence[int]
) -> Int[Tensor, "batch pos"]:
    """The mask HF's ``generate`` builds for ids given without one: ``tokens != pad`` when the pad id occurs
    and is not an EOS id; otherwise every token is real.

    Example:
        >>> hf_generate_mask(torch.tensor([[0, 5, 6]]), 0, [2])
        tensor([[0, 1, 1]])
    """
    if pad_token_id is None or pad_token_id in eos_token_ids or not bool((tokens == pad_token_id).any()):
        return torch.ones_like(tokens)
    return (tokens != pad_token_id).long()


def check_attention_mask(mask: Any, shape: torch.Size, left_padded: bool = False) -> Int[Tensor, "batch pos"]:
    """A 0/1 mask of ``shape`` with a real token in every row (and only left padding if asked)."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"`attention_mask` must be a tensor [batch, pos] of 0/1, got {describe(mask)}.")
    mask = mask[None] if mask.dim() == 1 else mask
    if mask.dim() == 4:
        raise ValueError(
            f"`attention_mask` is 4-D {tuple(mask.shape)}: a custom attention pattern goes to `forward`, "
            "`run_with_hooks` and `run_with_cache`; here give the 2-D [batch, pos] mask of 0 (padding) and 1."
        )
    if mask.shape != shape:
        raise ValueError(
            f"`attention_mask` shape {tuple(mask.shape)} does not match the prompt shape {tuple(shape)}: it must "
            "equal the tokens' shape."
        )
    if mask.dtype.is_complex or mask.device.type == "meta":
        raise TypeError(f"`attention_mask` must be a real 0/1 tensor, got dtype {mask.dtype} on {mask.device}.")
    binary = (mask == 0) | (mask == 1)
    checks = [binary.all(), (mask != 0).any(-1).all()]
    if left_padded:
        real = mask != 0
        checks.append((real[:, 1:] >= real[:, :-1]).all())
    ok = torch.stack(checks).tolist()  # one device sync
    if not ok[0]:
        bad = mask[~binary].flatten()[0].item()
        raise ValueError(
            f"`attention_mask` must hold only 0 (padding) and 1 (real token); it holds {bad!r}. Build it with "
            "`(tokens != pad).long()` or take the tokenizer's."
        )
    if not ok[1]:
        row = int((mask != 0).any(-1).logical_not().nonzero()[0])
        raise ValueError(f"`attention_mask` row {row} is all padding; every row needs at least one real token.")
    if left_padded and not ok[2]:
        row = int((~(real[:, 1:] >= real[:, :-1]).all(-1)).nonzero()[0])
        raise ValueError(
            f"`attention_mask` row {row} is not left-padded ({mask[row].tolist()}): generation needs each row's "
            "padding before its tokens (right padding is moved there for you; padding between tokens is refused)."
        )
    return mask.long()


def split_4d_mask(mask: Tensor, shape: torch.Size) -> tuple[Int[Tensor, "batch pos"], Tensor]:
    """``(token mask [batch, pos], the mask)`` for a 4-D attention mask ``[batch or 1, 1, pos, pos]``, which
    HF takes as the whole attention pattern (no causal mask is added to it): a bool mask keeps ``True``
    (HF's own masks and SDPA's convention), a float mask is added to the attention scores (0 attends, a
    large negative number blocks). A token is real when it attends to itself (a float entry of -1 or more,
    TransformerLens' rule); the token mask gives the loss and ``hook.ctx.pad_mask``.

    Example:
        >>> keep = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
        >>> split_4d_mask(keep, torch.Size([1, 4]))[0]
        tensor([[1, 1, 1, 1]])
    """
    batch, pos = shape
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"A 4-D `attention_mask` must be bool (True attends) or float (added to the scores), got dtype "
            f"{mask.dtype}; a 0/1 integer mask is 2-D [batch, pos]."
        )
    if mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (pos, pos):
        raise ValueError(
            f"A 4-D `attention_mask` must have shape [{batch} or 1, 1, {pos}, {pos}] (batch, heads broadcast, query "
            f"positions, key positions: the whole pattern, HF adds no causal mask to it), got {tuple(mask.shape)}."
        )
    diagonal = mask[:, 0].diagonal(dim1=-2, dim2=-1)
    if mask.dtype == torch.bool:
        check_keep_convention(mask)
    real = diagonal if mask.dtype == torch.bool else diagonal >= -1.0
    return real.long().expand(batch, pos), mask


class MaskConventionError(ValueError):
    """A bool 4-D mask that reads as TransformerLens' convention (True = blocked) rather than HF's (True = keep)."""


def check_keep_convention(mask: Bool[Tensor, "batch 1 query_pos key_pos"]) -> None:
    """Refuse a bool 4-D mask that cannot be HF's (True = attend) and looks like TransformerLens' (True = blocked):
    a sequence in which no token attends to itself, or a token that does not attend to itself but attends to a
    later one. HF's own masks never do either (a padding token attends to nothing or to earlier tokens), while
    TransformerLens' causal mask read as HF's does both.

    Example:
        >>> causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
        >>> check_keep_convention(causal)          # HF's convention: fine
        >>> check_keep_convention(~causal)         # TransformerLens' causal mask (True = blocked)
        Traceback (most recent call last):
        ...
        transformer_bridge.inputs.MaskConventionError: ...
    """
    square = mask[:, 0]
    itself = square.diagonal(dim1=-2, dim2=-1)
    ahead = square.triu(1).any(-1) & ~itself
    empty = (~itself).all(-1)
    if not (ahead.any() or empty.any()):
        return
    if ahead.any():
        row, query = (int(i) for i in ahead.nonzero()[0])
        key = int(square[row].triu(1)[query].nonzero()[0])
        what = f"query {query} (row {row}) does not attend to itself but attends to the later key {key}"
    else:
        what = f"no token of row {int(empty.nonzero()[0])} attends to itself"
    raise MaskConventionError(
        f"This bool 4-D `attention_mask` reads as TransformerLens' convention: {what}. The bridge runs the HF model, "
        "which takes HF's convention, True = attend (keep) and False = blocked, and the mask is the whole pattern "
        "(no causal mask is added). TransformerLens' HookedTransformer takes the opposite, True = blocked. If your "
        "mask is TransformerLens', pass `~mask`; or give a float mask (0 attends, -inf blocks), which both read alike."
    )


def mask_for_implementation(mask: Tensor, implementation: str | None, dtype: torch.dtype) -> Tensor:
    """A 4-D mask in the form HF's own mask function makes for ``implementation``: SDPA takes a bool mask
    as it is; eager attention adds its mask to the scores, so a bool mask becomes 0 / the dtype's minimum
    (HF's ``eager_mask``). Other implementations (flash, flex) take no 4-D mask and are refused.

    Example:
        >>> mask_for_implementation(torch.tensor([True, False]), "eager", torch.float32)
        tensor([ 0.0000e+00, -3.4028e+38])
    """
    if implementation not in ("eager", "sdpa", None):
        raise ValueError(
            f"A 4-D `attention_mask` runs with attention implementation 'eager' or 'sdpa'; this model uses "
            f"{implementation!r}. Load it with `attn_implementation='sdpa'`, or give a 2-D mask."
        )
    if mask.dtype != torch.bool or implementation == "sdpa":
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def is_text(input: Any) -> bool:
    """Whether ``input`` is text (a str or a non-empty list / tuple of str), which the bridge tokenizes and pads."""
    return isinstance(input, str) or (isinstance(input, (list, tuple)) and bool(input) and isinstance(input[0], str))


def warn_masked_text_padding(model: Any, input: Any, mask: Tensor) -> None:
    """Once per model: a right-padded text batch runs with the tokenizer's attention mask (HF's reading), where
    TransformerLens runs right-padded text unmasked. Each row's real positions are the same numbers either way;
    the padding positions' logits and activations, and a loss (which here leaves padding out), differ."""
    if not is_text(input) or isinstance(input, str):
        return
    if bool(mask.all()) or not bool(mask[:, 0].all()):  # no padding, or left padding (masked in both)
        return
    warn_difference_once(model, "_warned_text_padding", (
        "This text batch is right-padded and runs with the tokenizer's attention mask, as HF reads it: each row's "
        "real positions are TransformerLens' numbers, but the logits and activations at padding positions, and a "
        "loss (which here leaves padding out), differ from TransformerLens, which runs right-padded text unmasked. "
        "For its numbers pass the tokens: model(model.to_tokens(texts))."
    ))  # fmt: skip


def is_embeds(input: Any) -> bool:
    """Whether ``input`` is token embeddings (a float ``[batch, pos, d_model]`` tensor), not ids or text."""
    return isinstance(input, Tensor) and input.is_floating_point() and input.dim() == 3


def embedding_points(model: Any) -> list[str]:
    """The points of ``model`` (a bridge) read at the input embedding (``hook_tokens``, ``hook_embed``), which
    embeddings given as input skip."""
    embedding = model.hf_model.get_input_embeddings()
    return [n for n, sites in model._sites_for.items() if any(getattr(s, "module", None) is embedding for s in sites)]


def embeds_stand_in(
    model: Any, embeds: Any, input: Any, tokens: Tensor | None, attention_mask: Tensor | None,
    position_ids: Tensor | None = None,
) -> tuple[Int[Tensor, "batch pos"], Any]:  # fmt: skip
    """Token ids standing in for ``embeds`` (``[batch, pos, d_model]``, checked) in ``model``'s forward: they give
    the shape and the loss targets (``tokens``; zeros without), HF reads the embeddings; and the mask, all ones
    unless given, so the stand-in ids are never read as padding. A mask with padding before a real token gives
    the positions from the mask, as for token ids; TransformerLens counts 0, 1, ... on embeddings (as HF's own
    forward does in most families), so that warns once per model unless ``position_ids`` are given."""
    d_model = model.cfg.d_model
    if not isinstance(embeds, Tensor) or not embeds.is_floating_point() or embeds.shape[2:] != (d_model,) or (
        0 in embeds.shape[:2]
    ):  # fmt: skip
        raise ValueError(f"`inputs_embeds` must be a float tensor [batch, pos, {d_model}], got {describe(embeds)}.")
    if input is not None:
        raise ValueError("Give `inputs_embeds` or token ids (`input` / `input_ids`), not both.")
    shape = tuple(embeds.shape[:2])
    if tokens is not None and (not isinstance(tokens, Tensor) or tuple(tokens.shape) != shape):
        raise ValueError(
            f"`tokens` (the loss targets) must have the embeddings' shape {shape}, got {describe(tokens)}."
        )
    stand_in = torch.zeros(shape, dtype=torch.long, device=embeds.device) if tokens is None else tokens
    if attention_mask is None:
        attention_mask = torch.ones(shape, dtype=torch.long, device=embeds.device)
    elif isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        raise ValueError("`inputs_embeds` take a 2-D `attention_mask` [batch, pos] here, not a 4-D one.")
    elif position_ids is None and isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        _warn_embeds_positions(model, attention_mask)
    return stand_in, attention_mask


def _warn_embeds_positions(model: Any, mask: Tensor) -> None:
    real = mask != 0
    moved = (real.long().cumsum(-1) - 1 != torch.arange(mask.shape[-1], device=mask.device)) & real
    if bool(moved.any()):
        warn_difference_once(model, "_warned_embeds_positions", (
            "These embeddings come with padding before real tokens: their positions are counted from the mask, as "
            "for token ids (HF's generate rule), while TransformerLens counts 0, 1, ... on embeddings whatever the "
            "mask (as HF's own forward does in most families). For those numbers pass "
            "position_ids=torch.arange(pos) (expanded to the batch)."
        ))  # fmt: skip
