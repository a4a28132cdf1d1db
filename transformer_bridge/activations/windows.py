"""What a harvest reads: documents (texts or token ids) cut into windows of at most ``context_length`` tokens.

Accepted data: one text, an iterable of texts, token ids (a ``[doc, pos]`` tensor, optionally with an
``attention_mask`` or as a ``(tokens, mask)`` pair; a 1-D tensor; an iterable of 1-D tensors or lists of ints),
or a ``datasets.Dataset`` / ``IterableDataset`` (its ``text_column``, else its ``input_ids`` with
``attention_mask`` when present). Token ids are read as HF's forward reads them: every token is real unless a
mask says it is padding (then the document is its real tokens, in order); nothing is inferred from token
values. Texts are tokenized by the model's tokenizer, BOS as ``prepend_bos`` says, a few dozen at a time.

Everything is lazy: documents are read one by one, so a harvest holds one batch of windows whatever the size
of the data. A document longer than ``context_length`` becomes consecutive windows (the later ones start
mid-document, as in packed training data); each window records its document index and the position of its
first token there. Documents of other ranks (data parallel) and documents already harvested (resume) are
skipped before they are tokenized.
"""

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..checks import ArgumentTypeError, ArgumentValueError, describe

TOKENIZE_GROUP = 64  # texts per tokenizer call


@dataclass(frozen=True)
class Window:
    """Up to ``context_length`` consecutive tokens of document ``doc``, the first at position ``start`` there."""

    doc: int
    start: int
    tokens: Int[Tensor, " pos"]


@dataclass(frozen=True)
class Cursor:
    """Where a harvest stands: the next window is document ``doc`` from position ``start``; ``windows`` were done."""

    doc: int = 0
    start: int = 0
    windows: int = 0


def raw_documents(data: Any, text_column: str, attention_mask: Tensor | None) -> tuple[str, Iterator[Any]]:
    """``("text" | "tokens", iterator of documents)``: texts, or 1-D token tensors with their padding removed."""
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        if attention_mask is not None:
            raise ArgumentValueError("Give the mask once: a `(tokens, mask)` pair as `data` or `attention_mask=`.")
        data, attention_mask = data
    if attention_mask is not None and not isinstance(data, Tensor):
        raise ArgumentValueError(
            f"`attention_mask` goes with token-id data (a [doc, pos] tensor); `data` is {describe(data)}. A dataset "
            "brings its own `attention_mask` column; text is tokenized without padding."
        )
    if isinstance(data, str):
        return "text", iter([data])
    if isinstance(data, Tensor):
        return "tokens", _tensor_documents(data, attention_mask)
    columns = getattr(data, "column_names", None)
    if columns is not None:  # a `datasets.Dataset` / `IterableDataset`
        return _dataset_documents(data, list(columns), text_column)
    if not isinstance(data, Iterable) or isinstance(data, (bytes, dict)):
        raise ArgumentTypeError(f"`data` must be texts, token ids or a datasets.Dataset, got {describe(data)}.")
    items = iter(data)
    first = next(items, None)
    if first is None:
        raise ArgumentValueError("`data` is empty: there is nothing to harvest.")
    items = itertools.chain([first], items)
    if isinstance(first, str):
        return "text", items
    return "tokens", (_token_row(item, i) for i, item in enumerate(items))


def _tensor_documents(data: Tensor, mask: Tensor | None) -> Iterator[Tensor]:
    if data.is_floating_point() or data.dim() not in (1, 2) or data.numel() == 0:
        raise ArgumentValueError(f"Token-id `data` must be an integer tensor [doc, pos] or [pos], got {describe(data)}"
                                 ".")  # fmt: skip
    rows = data[None] if data.dim() == 1 else data
    if mask is not None:
        mask = mask[None] if mask.dim() == 1 else mask
        if mask.shape != rows.shape:
            raise ArgumentValueError(
                f"`attention_mask` shape {tuple(mask.shape)} must equal the tokens' shape {tuple(rows.shape)}."
            )
    for i in range(rows.shape[0]):
        yield rows[i].cpu().long() if mask is None else rows[i][mask[i].cpu().bool()].cpu().long()


def _dataset_documents(data: Any, columns: list[str], text_column: str) -> tuple[str, Iterator[Any]]:
    if text_column in columns:
        return "text", (row[text_column] for row in data)
    if "input_ids" in columns:
        masked = "attention_mask" in columns

        def rows() -> Iterator[Tensor]:
            for i, row in enumerate(data):
                ids = _token_row(row["input_ids"], i)
                yield ids[torch.as_tensor(row["attention_mask"]).bool()] if masked else ids

        return "tokens", rows()
    raise ArgumentValueError(
        f"The dataset has columns {columns}: none is `text_column`={text_column!r} nor 'input_ids'. Pass "
        "`text_column=` naming its text column."
    )


def _token_row(item: Any, i: int) -> Tensor:
    try:
        row = torch.as_tensor(item)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ArgumentTypeError(f"`data` document {i} is not token ids: {describe(item)}.") from e
    if row.is_floating_point() or row.dim() != 1:
        raise ArgumentTypeError(f"`data` document {i} must be a 1-D list or tensor of token ids, got {describe(row)}.")
    return row.cpu().long()


def tokenize_texts(tokenizer: Any, texts: list[str], prepend_bos: bool) -> list[list[int]]:
    """The bridge's tokenization of each text without padding: BOS first (exactly one) when ``prepend_bos``,
    no special tokens otherwise."""
    rows = tokenizer(texts, add_special_tokens=prepend_bos)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if prepend_bos and bos is not None:
        rows = [r if r[:1] == [bos] else [bos, *r] for r in rows]
    return rows


def fingerprint(tokens: Tensor) -> str:
    """A short hash of a document's token ids: the check that a resumed harvest reads the same data."""
    return hashlib.sha256(tokens.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def windows(
    kind: str,
    documents: Iterator[Any],
    context_length: int,
    cursor: Cursor,
    tokenizer: Any = None,
    prepend_bos: bool = True,
    rank: int = 0,
    world: int = 1,
    seen: dict[str, str] | None = None,
) -> Iterator[Window]:
    """Windows of this rank's documents (``doc % world == rank``) from ``cursor`` on.

    Documents before the cursor are skipped without tokenizing, except this rank's first one, whose
    `fingerprint` goes into ``seen["first"]`` (so a resumed run can tell whether the data changed).
    """
    seen = {} if seen is None else seen
    group: list[tuple[int, Any]] = []
    for doc, raw in enumerate(documents):
        if doc % world != rank:
            continue
        first = "first" not in seen
        if doc < cursor.doc and not first:
            continue
        group.append((doc, raw))
        if kind == "text" and len(group) < TOKENIZE_GROUP and not first:
            continue
        yield from _cut(kind, group, context_length, cursor, tokenizer, prepend_bos, seen)
        group = []
    yield from _cut(kind, group, context_length, cursor, tokenizer, prepend_bos, seen)


def _cut(
    kind: str, group: list[tuple[int, Any]], context_length: int, cursor: Cursor, tokenizer: Any, prepend_bos: bool,
    seen: dict[str, str],
) -> Iterator[Window]:  # fmt: skip
    if not group:
        return
    if kind == "text":
        texts = [raw if isinstance(raw, str) else None for _, raw in group]
        bad = next((i for i, t in enumerate(texts) if t is None), None)
        if bad is not None:
            raise ArgumentTypeError(f"`data` document {group[bad][0]} is not a str: {describe(group[bad][1])}.")
        rows = [torch.tensor(r, dtype=torch.long) for r in tokenize_texts(tokenizer, texts, prepend_bos)]
    else:
        rows = [raw for _, raw in group]
    for (doc, _), tokens in zip(group, rows, strict=True):
        if "first" not in seen:
            seen["first"] = fingerprint(tokens)
        if doc < cursor.doc:
            continue
        start = cursor.start if doc == cursor.doc else 0
        for begin in range(start, tokens.shape[0], context_length):
            yield Window(doc, begin, tokens[begin : begin + context_length])
