"""TransformerLens' token helpers that read the unembedding: positions of a token in a prompt, and
tokens as residual-stream directions."""

from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..checks import ArgumentValueError
from ..inputs import PaddingSide


class TokenHelpers:
    """Mixin for the public class (needs `to_tokens`, `to_single_token` and the folded `W_U`)."""

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

    def tokens_to_residual_directions(self, tokens: str | int | Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        """The residual direction each token is read along: its column of the folded `W_U` (TransformerLens).

        Example:
            >>> paris = model.tokens_to_residual_directions(" Paris")        # [d_model]
        """
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        index = torch.as_tensor(tokens, device=self.W_U.device)
        return self.W_U[:, index].movedim(0, -1)

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id."""
        return self.to_str_tokens(torch.tensor([int(int_token)]))[0]
