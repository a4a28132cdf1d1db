"""What a relevance method explains: which token, read at which position, through which scalar.

An `ExplainedToken` is a token of the sequence (usually a generated one) and the position whose
logits predicted it. A `Target` turns those logits into the scalar that methods attribute: the
token's logit (default), its log-probability, or its logit minus a contrast token's logit.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..checks import ArgumentIndexError, ArgumentTypeError, describe, is_int
from ..core import BridgeCore

TargetKind = Literal["logit", "logprob", "logit_diff", "custom"]
TARGET_KINDS: tuple[str, ...] = ("logit", "logprob", "logit_diff", "custom")


@dataclass(frozen=True)
class ExplainedToken:
    """One token to explain.

    Attributes:
        batch_index: row of the batch.
        position: column of the token in the (left-padded) sequence; its logits are read at
            ``position - 1``, so only columns before ``position`` can be relevant.
        token_id: the token whose score is explained.
        step_index: index among the row's generated tokens (``None`` outside generation).
    """

    batch_index: int
    position: int
    token_id: int
    step_index: int | None = None

    @property
    def logit_position(self) -> int:
        return self.position - 1


@dataclass(frozen=True)
class Target:
    """The scalar a method explains, computed from one position's logits.

    ``kind="custom"`` calls ``fn(logits [..., d_vocab], token [...]) -> [...]`` (any differentiable
    metric of the logits at the predicting position, e.g. for attribution patching).

    Example:
        >>> t = Target("logit_diff", contrast=7)
        >>> t(torch.arange(10.0), torch.tensor(3))
        tensor(-4.)
    """

    kind: TargetKind = "logit"
    contrast: int | None = None
    fn: Callable[[Tensor, Tensor], Tensor] | None = None

    def __call__(
        self, logits: Float[Tensor, "*rows d_vocab"], token: Int[Tensor, "*rows"] | int
    ) -> Float[Tensor, "*rows"]:
        token = torch.as_tensor(token, device=logits.device)
        if self.fn is not None:
            return _checked(self.fn, self.fn(logits, token.expand(logits.shape[:-1])), logits)
        picked = logits.gather(-1, token.expand(logits.shape[:-1])[..., None])[..., 0]
        if self.kind == "logit":
            return picked
        if self.kind == "logprob":
            return picked.float() - logits.float().logsumexp(-1)
        return picked - logits[..., self.contrast]

    def __str__(self) -> str:
        if self.fn is not None:
            return f"custom({getattr(self.fn, '__name__', 'fn')})"
        return self.kind if self.contrast is None else f"{self.kind}(contrast={self.contrast})"

    @property
    def is_linear_in_logits(self) -> bool:
        """Whether the target is a fixed linear read-out of the logits (needed by direct logit attribution)."""
        return self.kind in ("logit", "logit_diff")


def parse_target(target: Any, model: BridgeCore) -> Target:
    """Accept ``"logit"``, ``"logprob"``, ``("logit_diff", contrast)`` (id or single-token string), a function
    ``fn(logits, token)`` or a `Target`."""
    if isinstance(target, Target):
        spec = target
    elif callable(target):
        spec = Target("custom", fn=target)
    elif isinstance(target, str) and target in ("logit", "logprob"):
        spec = Target(target)  # type: ignore[arg-type]
    elif isinstance(target, (tuple, list)) and len(target) == 2 and target[0] == "logit_diff":
        contrast = target[1]
        if isinstance(contrast, str):
            contrast = model.to_single_token(contrast)
        if not is_int(contrast):
            raise ArgumentTypeError(
                f"`target`=('logit_diff', {describe(target[1])}): the contrast must be a token id (int) or a string "
                "that is exactly one token."
            )
        spec = Target("logit_diff", int(contrast))
    else:
        raise ValueError(
            f"`target`={target!r} is not valid; use 'logit' (default), 'logprob', ('logit_diff', contrast_token) "
            "or a function fn(logits, token) -> scalar per row."
        )
    if spec.kind not in TARGET_KINDS:
        raise ValueError(f"`target` kind {spec.kind!r} is not one of {TARGET_KINDS}.")
    if spec.contrast is not None and not 0 <= spec.contrast < model.cfg.d_vocab:
        raise ArgumentIndexError(
            f"`target` contrast token {spec.contrast} is outside the vocabulary [0, {model.cfg.d_vocab - 1}]."
        )
    return spec


def explained_from_positions(
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"],
    positions: Sequence[tuple[int, int]],
) -> list[ExplainedToken]:
    """`ExplainedToken`s for ``(batch_index, position)`` pairs, checked against the sequence.

    Example:
        >>> explained_from_positions(torch.tensor([[5, 6, 7]]), torch.ones(1, 3), [(0, 2)])[0].token_id
        7
    """
    batch, width = tokens.shape
    out = []
    for pair in positions:
        if not (isinstance(pair, Sequence) and len(pair) == 2 and is_int(pair[0]) and is_int(pair[1])):
            raise ArgumentTypeError(
                f"`positions` must hold (batch_index, position) pairs of ints, got {describe(pair)}."
            )
        b, p = int(pair[0]), int(pair[1])
        if not 0 <= b < batch:
            raise ArgumentIndexError(f"`positions` has batch index {b}; valid batch indices are 0..{batch - 1}.")
        if not 1 <= p < width:
            raise ArgumentIndexError(
                f"`positions` has position {p}; valid positions are 1..{width - 1} (position 0 has no logits "
                "before it)."
            )
        if not bool(attention_mask[b, p]) or not bool(attention_mask[b, p - 1]):
            raise ValueError(
                f"`positions` has ({b}, {p}), which is padding or the row's first real token; explain a real "
                "token that has a real token before it."
            )
        out.append(ExplainedToken(b, p, int(tokens[b, p])))
    return out


def _checked(fn: Callable, value: object, logits: Tensor) -> Tensor:
    """A custom target's value, which must be one float per row of ``logits`` (shape and dtype checks only)."""
    rows = logits.shape[:-1]
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise ArgumentTypeError(
            f"`target` function {getattr(fn, '__name__', type(fn).__name__)} must return a float tensor (one value "
            f"per row, shape {tuple(rows)}) computed from the logits, got {describe(value)}."
        )
    if value.shape != rows:
        raise ValueError(
            f"`target` function {getattr(fn, '__name__', type(fn).__name__)} must return one value per row: shape "
            f"{tuple(rows)} for logits {tuple(logits.shape)}, got {describe(value)}. Index the last axis (the "
            "vocabulary), e.g. `lambda logits, token: logits[..., 42] - logits[..., 7]`."
        )
    return value
