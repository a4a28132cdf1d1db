"""Tokenization helpers with TransformerLens' names and behaviour: masks of padded ids, BOS handling, and
packing a text dataset into rows of tokens (`tokenize_and_concatenate`).

The dataset helpers take a HuggingFace ``datasets.Dataset`` (or ``IterableDataset``) and only call its
methods, so ``datasets`` is needed by the caller, never imported here.
"""

import copy
import os
from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor
from transformers import AutoTokenizer

from ..checks import ArgumentValueError, describe
from .tensors import get_cumsum_along_dim


def get_attention_mask(
    tokenizer: Any, tokens: Int[Tensor, "batch pos"], prepend_bos: bool, padding_side: str | None = None
) -> Int[Tensor, "batch pos"]:
    """TransformerLens' mask for padded token ids: 1 for real tokens, 0 for the pad tokens at the padded end
    (``padding_side``, default the tokenizer's). Only the run of pad ids at that end counts as padding; with
    left padding and ``prepend_bos`` where BOS is the pad token, the BOS just before the text is kept.

    Example:
        >>> tok = type("Tok", (), {"pad_token_id": 0, "bos_token_id": 0, "padding_side": "left"})()
        >>> get_attention_mask(tok, torch.tensor([[0, 0, 5, 0], [0, 7, 8, 9]]), prepend_bos=True)
        tensor([[0, 1, 1, 1],
                [1, 1, 1, 1]])
    """
    mask = torch.ones_like(tokens)
    if tokenizer is None or tokenizer.pad_token_id is None:
        return mask
    side = padding_side or tokenizer.padding_side
    if side not in ("left", "right"):
        raise ArgumentValueError(f"`padding_side` must be 'left' or 'right', got {side!r}.")
    real = tokens.ne(tokenizer.pad_token_id).long()
    if side == "right":
        mask[get_cumsum_along_dim(real, -1, reverse=True) == 0] = 0
        return mask
    leading = real.cumsum(-1) == 0
    mask[leading] = 0
    if prepend_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        n_leading = leading.sum(-1)
        keep = n_leading > 0
        mask[rows[keep], n_leading[keep] - 1] = 1
    return mask


def get_tokens_with_bos_removed(
    tokenizer: Any, tokens: Int[Tensor, "... pos"], padding_side: str | None = None
) -> Int[Tensor, "... pos_minus_1"]:
    """``tokens`` without the BOS each row starts with: the first column under right padding; under left
    padding the BOS after each row's padding (the last leading pad where the pad token is BOS; else the first
    real token, which must be BOS or CLS, or this raises `ValueError`). A tokenizer without a BOS token
    changes nothing.

    Example:
        >>> tok = type("Tok", (), {"pad_token_id": 0, "bos_token_id": 1, "padding_side": "left"})()
        >>> get_tokens_with_bos_removed(tok, torch.tensor([[0, 1, 5, 6], [1, 7, 8, 9]]))
        tensor([[0, 5, 6],
                [7, 8, 9]])
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        return tokens
    side = padding_side or tokenizer.padding_side
    if side == "right":
        return tokens[..., 1:]
    pad = tokenizer.pad_token_id
    n_pos = tokens.shape[-1]
    n_leading = (
        torch.zeros(tokens.shape[:-1], dtype=torch.long, device=tokens.device)
        if pad is None
        else (get_cumsum_along_dim(tokens.ne(pad).long(), -1) == 0).sum(-1)
    )
    if bos == pad:
        where, found = n_leading - 1, n_leading > 0
    else:
        starters = [bos] + ([tokenizer.cls_token_id] if isinstance(getattr(tokenizer, "cls_token_id", None), int)
                            else [])  # fmt: skip
        where = n_leading
        first = tokens.gather(-1, n_leading.clamp(max=max(n_pos - 1, 0))[..., None])[..., 0] if n_pos else n_leading
        found = (n_leading < n_pos) & torch.isin(first, torch.tensor(starters, device=tokens.device))
    if not bool(found.all()):
        raise ValueError(
            f"Cannot remove BOS: {int((~found).sum())} left-padded row(s) of `tokens` do not start with the BOS "
            f"token (id {bos}) after their padding. Pass rows that each carry the BOS the tokenizer prepends."
        )
    keep = torch.arange(n_pos, device=tokens.device) != where[..., None]
    return tokens[keep].reshape(*tokens.shape[:-1], n_pos - 1)


def get_input_with_manually_prepended_bos(bos_token: str | None, input: str | list[str]) -> str | list[str]:
    """The text(s) with the BOS string in front (unchanged where there is no BOS token).

    Example:
        >>> get_input_with_manually_prepended_bos("<s>", ["Hi", "Yo"])
        ['<s>Hi', '<s>Yo']
    """
    if bos_token is None:
        return input
    return bos_token + input if isinstance(input, str) else [bos_token + text for text in input]


def get_tokenizer_with_bos(tokenizer: Any) -> Any:
    """The tokenizer, made to add BOS itself (``add_bos_token=True``): returned as it is when it already does
    or has no BOS token; else loaded again from its folder with that flag (``padding_side`` kept), or, for a
    tokenizer built in memory, a copy with the flag set. A tokenizer whose template cannot add BOS (special
    tokens with ``:``) is returned as it is.

    Example:
        >>> tok = get_tokenizer_with_bos(model.tokenizer)  # doctest: +SKIP
    """
    if tokenizer.bos_token is None:
        return tokenizer
    kwargs = copy.deepcopy(tokenizer.init_kwargs)
    source = kwargs.pop("name_or_path", "") or getattr(tokenizer, "name_or_path", "")
    adds = kwargs.pop("add_bos_token", None)
    if adds if adds is not None else getattr(tokenizer, "add_bos_token", False):
        return tokenizer
    try:
        if source:
            token = os.environ.get("HF_TOKEN") or None
            with_bos = AutoTokenizer.from_pretrained(source, add_bos_token=True, token=token, **kwargs)
        else:  # built in memory: nothing to load again
            with_bos = copy.deepcopy(tokenizer)
            with_bos.add_bos_token = True
    except ValueError:  # the template cannot express the BOS token (e.g. '<seed:bos>'): such models add none
        return tokenizer
    with_bos.padding_side = tokenizer.padding_side
    return with_bos


def keep_single_column(dataset: Any, col_name: str) -> Any:
    """The dataset with every column but ``col_name`` removed (a HuggingFace ``Dataset`` or ``IterableDataset``).

    Example:
        >>> keep_single_column(datasets.Dataset.from_dict({"text": ["a"], "id": [0]}), "text")  # doctest: +SKIP
    """
    for key in list(dataset.features):
        if key != col_name:
            dataset = dataset.remove_columns(key)
    return dataset


def tokenize_and_concatenate(
    dataset: Any,
    tokenizer: Any,
    streaming: bool = False,
    max_length: int = 1024,
    column_name: str = "text",
    add_bos_token: bool = True,
    num_proc: int | None = 10,
    set_format: bool = True,
) -> Any:
    """A text dataset packed into rows of ``max_length`` tokens, in one column ``"tokens"``, TransformerLens'
    way: within each ``map`` batch (1,000 documents), the documents are tokenized without special tokens and
    joined with one EOS between them, cut into rows of ``max_length - 1`` tokens (``max_length`` without
    ``add_bos_token``; the tail that does not fill a row is dropped, and a batch shorter than one row is padded
    with the pad token, or EOS without one), and each row gets BOS in front. ``num_proc`` processes tokenize
    (``None``: in this process; ignored when ``streaming``); ``set_format`` makes ``tokens`` torch tensors.
    Rows are led by BOS and hold EOS separators: pass them to the bridge as they are (every token is real).
    Unlike TransformerLens, a tokenizer without a pad token is not given one.

    Example:
        >>> rows = tokenize_and_concatenate(dataset, model.tokenizer, max_length=128, num_proc=None)  # doctest: +SKIP
        >>> logits = model(rows["tokens"][:4])  # doctest: +SKIP
    """
    if tokenizer.eos_token_id is None:
        raise ArgumentValueError("`tokenizer` has no EOS token, which separates the documents; set one first.")
    if add_bos_token and tokenizer.bos_token_id is None:
        raise ArgumentValueError("`tokenizer` has no BOS token to lead each row; pass `add_bos_token=False`.")
    if not isinstance(max_length, int) or max_length < (2 if add_bos_token else 1):
        raise ArgumentValueError(
            f"`max_length` must be an int of at least 2 (1 without BOS), got {describe(max_length)}."
        )
    dataset = keep_single_column(dataset, column_name)
    width = max_length - 1 if add_bos_token else max_length
    filler = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def pack(batch: dict[str, list]) -> dict[str, np.ndarray]:
        texts = batch[column_name]
        if not texts:
            return {"tokens": np.zeros((0, max_length), dtype=np.int64)}
        pieces = []
        for i, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
            pieces += [[tokenizer.eos_token_id]] if i else []
            pieces.append(ids)
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
        if len(ids) < width:
            ids = np.concatenate([ids, np.full(width - len(ids), filler, dtype=np.int64)])
        rows = ids[: len(ids) // width * width].reshape(-1, width)
        if add_bos_token:
            rows = np.concatenate([np.full((len(rows), 1), tokenizer.bos_token_id, dtype=np.int64), rows], axis=1)
        return {"tokens": rows}

    # Long documents exceed the tokenizer's model_max_length on purpose (they are cut into rows afterwards).
    saved = dict(getattr(tokenizer, "deprecation_warnings", {}))
    if hasattr(tokenizer, "deprecation_warnings"):
        tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = False
    try:
        extra = {} if streaming else {"num_proc": num_proc}
        packed = dataset.map(pack, batched=True, remove_columns=[column_name], **extra)
    finally:
        if hasattr(tokenizer, "deprecation_warnings"):
            tokenizer.deprecation_warnings.clear()
            tokenizer.deprecation_warnings.update(saved)
    if set_format:
        packed.set_format(type="torch", columns=["tokens"])
    return packed
