"""`Tokens`: text ↔ token ids for a bridge (TransformerLens' ``to_tokens`` family), mixed into `BridgeCore`.

It needs ``self.tokenizer``, ``self.cfg``, ``self.hf_model`` and ``self.device`` from the class it is mixed into.
"""

from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from .checks import ArgumentValueError, check_bool
from .inputs import PaddingSide, tokenize


class Tokens:
    """Tokenization methods of `BridgeCore` (see the module docstring).

    Example:
        >>> tokens = model.to_tokens("Hello")
        >>> model.to_str_tokens(tokens)
    """

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (None without one). Setting its ``padding_side`` afterwards changes how text is padded,
        as it does in TransformerLens (which reads the tokenizer's); `cfg.default_padding_side` decides otherwise.

        Example:
            >>> model.tokenizer.padding_side = "left"   # model.to_tokens(texts) now left-pads, as TL's does
        """
        return self.__dict__.get("_tokenizer")

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self.__dict__["_tokenizer"] = value
        # as given: a later change is the user's
        self.__dict__["_tokenizer_side"] = getattr(value, "padding_side", None)

    def _default_padding_side(self) -> PaddingSide:
        """``cfg.default_padding_side``, unless the tokenizer's ``padding_side`` was set since it was attached."""
        side = getattr(self.tokenizer, "padding_side", None)
        if side in ("left", "right") and side != self.__dict__.get("_tokenizer_side"):
            return side
        return self.cfg.default_padding_side

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:  # also an AssertionError, which TransformerLens raises here
            raise ArgumentValueError(
                "This bridge has no tokenizer, so it cannot take text (to_tokens without a tokenizer). Pass token "
                "ids, or build it with `TransformerBridge(hf_model, tokenizer)`."
            )
        return self.tokenizer

    @property
    def pad_token_id(self) -> int:
        """The id used to pad batches: the tokenizer's pad token, else its EOS, else the config's, else 0."""
        known = self._known_pad_id()
        return 0 if known is None else known

    def _known_pad_id(self) -> int | None:
        tok = self.tokenizer
        for value in (
            getattr(tok, "pad_token_id", None),
            getattr(tok, "eos_token_id", None),
            getattr(self.hf_model.config, "pad_token_id", None),
        ):
            if isinstance(value, int):
                return value
        return None

    def to_tokens(
        self,
        input: str | Sequence[str],
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Int[Tensor, "batch pos"]:
        """Tokenize text into ``[batch, pos]`` token ids, as TransformerLens does.

        ``prepend_bos`` (default ``cfg.default_prepend_bos``: True when the tokenizer has a BOS token)
        makes every row start with exactly one BOS; ``padding_side`` (default ``cfg.default_padding_side``,
        ``"right"`` as in TransformerLens, or the tokenizer's ``padding_side`` where it was set after the tokenizer
        was attached, as TransformerLens reads it) pads a batch; ``truncate`` cuts rows to the context length.
        A forward or `generate` on these ids infers the mask from left padding; for right padding,
        or to be explicit, use `to_tokens_and_mask`.

        Example:
            >>> tokens = model.to_tokens(["Hello", "The capital of France is"])
            >>> logits = model(tokens)
        """
        tokens, _ = self.to_tokens_and_mask(input, prepend_bos, padding_side, move_to_device, truncate)
        return tokens

    def to_tokens_and_mask(
        self,
        input: str | Sequence[str],
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """`to_tokens` and the matching attention mask (1 = real token).

        Example:
            >>> tokens, mask = model.to_tokens_and_mask(["Hi", "Hello there"], padding_side="left")
        """
        tok = self._require_tokenizer()
        bos = self.cfg.default_prepend_bos if prepend_bos is None else check_bool("prepend_bos", prepend_bos)
        side = self._default_padding_side() if padding_side is None else padding_side
        max_length = self.cfg.n_ctx if truncate else None
        tokens, mask = tokenize(tok, input, bos, side, self.pad_token_id, max_length)
        if self.cfg.tokenizer_appends_eos and getattr(tok, "eos_token_id", None) is not None:
            tokens, mask = _strip_eos(tokens, mask, tok.eos_token_id, self.pad_token_id, side)
        if move_to_device:
            tokens, mask = tokens.to(self.device), mask.to(self.device)
        return tokens, mask

    def to_string(self, tokens: Int[Tensor, "... pos"] | Sequence[int]) -> str | list[str]:
        """Decode tokens: one sequence → str, a batch → list of str (special tokens kept)."""
        tok = self._require_tokenizer()
        t = torch.as_tensor(tokens)
        if t.dim() <= 1:
            return tok.decode(t.reshape(-1).tolist())
        return [tok.decode(row.tolist()) for row in t]

    def to_str_tokens(
        self,
        input: str | Sequence[str] | Int[Tensor, "... pos"] | Sequence[int],
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
    ) -> list[str] | list[list[str]]:
        """The string of each token, as TransformerLens: one text or sequence → ``list[str]``; a list
        of texts or a ``[batch, pos]`` tensor → one list per row. Example:
        ``model.to_str_tokens("Hi there", prepend_bos=False) == ["Hi", " there"]``."""
        tok = self._require_tokenizer()
        if isinstance(input, (list, tuple)) and input and isinstance(input[0], str):
            return [self.to_str_tokens(text, prepend_bos, padding_side) for text in input]
        if isinstance(input, str):
            ids = self.to_tokens(input, prepend_bos=prepend_bos, move_to_device=False)[0].tolist()
        else:
            t = torch.as_tensor(input)
            if t.dim() > 1:
                if t.shape[0] != 1 or t.dim() > 2:
                    return [self.to_str_tokens(row) for row in t.reshape(-1, t.shape[-1])]
                t = t[0]
            ids = t.reshape(-1).tolist()
        return [tok.decode([i]) for i in ids]

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token (no special tokens added)."""
        tok = self._require_tokenizer()
        ids = tok(string, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"`string`={string!r} is {len(ids)} tokens ({ids}), not exactly one.")
        return ids[0]

    def get_token_position(
        self,
        single_token: str | int,
        input: str | Int[Tensor, "pos"] | Int[Tensor, "1 pos"],
        mode: Literal["first", "last"] = "first",
        prepend_bos: bool | None = None,
        padding_side: PaddingSide | None = None,
    ) -> int:
        """Position of ``single_token`` in ``input`` (its first or last occurrence), as TransformerLens.

        Example:
            >>> model.get_token_position(" Paris", "The capital of France is Paris")
        """
        if mode not in ("first", "last"):
            raise ValueError(f"`mode` must be 'first' or 'last', got {mode!r}.")
        token = self.to_single_token(single_token) if isinstance(single_token, str) else int(single_token)
        if isinstance(input, str):
            tokens = self.to_tokens(input, prepend_bos=prepend_bos, padding_side=padding_side, move_to_device=False)
        else:
            tokens = torch.as_tensor(input)
        if tokens.dim() == 2:
            if tokens.shape[0] != 1:
                raise ValueError(f"`input` must be one sequence, got a batch of shape {tuple(tokens.shape)}.")
            tokens = tokens[0]
        hits = (tokens == token).nonzero().flatten().tolist()
        if not hits:
            raise ArgumentValueError(f"`single_token`={single_token!r} (id {token}) does not occur in `input`.")
        return hits[0] if mode == "first" else hits[-1]

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id.

        Example:
            >>> model.to_single_str_token(model.to_single_token(" Paris"))
            ' Paris'
        """
        return self.to_str_tokens(torch.tensor([int(int_token)]))[0]


def _strip_eos(
    tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"], eos: int, pad: int, side: str
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """Drop the EOS tokens that end each row's real tokens (keeping at least one token), re-padded on ``side``:
    ``cfg.tokenizer_appends_eos``, for tokenizers that append EOS (the model should continue the text)."""
    rows = [t[m.bool()].tolist() for t, m in zip(tokens, mask, strict=True)]
    for r in rows:
        while len(r) > 1 and r[-1] == eos:
            r.pop()
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=tokens.dtype)
    new_mask = torch.zeros((len(rows), width), dtype=mask.dtype)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        out[i, cols] = torch.tensor(r, dtype=tokens.dtype)
        new_mask[i, cols] = 1
    return out, new_mask
