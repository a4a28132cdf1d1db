"""`Branch` (what a controller returns for a row), `View` (what it sees), and the checks of both.

The protocol is AICI's ``mid_process``: after each forward a controller returns, per row, a list of
branches. Zero branches stop the row (finish reason ``"controller"``), one continues it, several fork
it: each further branch continues a copy of the row (tokens and KV cache), recorded as its child.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..checks import ArgumentTypeError, describe, is_int


class _AnyToken:
    """The mask that allows every token (`Branch.sample()`)."""

    def __repr__(self) -> str:
        return "ANY_TOKEN"


ANY_TOKEN = _AnyToken()


@dataclass(frozen=True)
class Branch:
    """One continuation of a row: rewind, then sample (within a mask) or append forced tokens.

    Attributes:
        backtrack: generated tokens to remove first (their KV entries too). It cannot reach into the
            prompt: at most the row's generated tokens.
        sample_mask: ``None``: no sampling, append ``ff_tokens[0]`` (exactly one sequence, fed in one
            forward). Otherwise the tokens that may be sampled: a bool tensor ``[d_vocab]``, a
            collection of token ids, or `ANY_TOKEN` (`Branch.sample()`); with ``ff_tokens``, if the
            sampled token starts one of those sequences, the whole sequence is appended.
        ff_tokens: token sequences (see ``sample_mask``).

    After a backtrack the next-token logits belong to a removed position, so a branch that backtracks
    and samples (or appends nothing) re-feeds the last kept token first, in the next forward (batched
    with the other rows, no extra forward), and then samples; the controller is not called in between.

    Example:
        >>> Branch.sample()                           # sample freely (the loop's own sampling settings)
        >>> Branch.sample([5, 7, 9])                  # only these tokens
        >>> Branch.forced([11, 12, 13])               # append three tokens in one forward
        >>> Branch(backtrack=1, sample_mask=~banned)  # replace the last token, avoiding `banned`
    """

    backtrack: int = 0
    sample_mask: Any = None
    ff_tokens: Sequence[Sequence[int]] = field(default_factory=tuple)

    @staticmethod
    def sample(mask: Any = ANY_TOKEN, backtrack: int = 0, ff_tokens: Sequence[Sequence[int]] = ()) -> "Branch":
        """Sample among ``mask`` (default: any token)."""
        return Branch(backtrack, mask, tuple(ff_tokens))

    @staticmethod
    def forced(tokens: Sequence[int], backtrack: int = 0) -> "Branch":
        """Append ``tokens`` without sampling (one forward for all of them)."""
        return Branch(backtrack, None, (tuple(tokens),))


@dataclass
class View:
    """What a controller sees of one row after a forward.

    Attributes:
        row: the row's index in the output (forks are appended after the input's rows).
        step: the engine step (0: after the prompt).
        tokens: the row's real tokens so far, prompt + generated.
        prompt_length: how many of ``tokens`` are the prompt.
        branch: the index of the branch that created this row (0 unless it is a fork).
        parent: the row it was forked from (-1 otherwise).
        backtracked, appended: what the last branch applied to this row removed and appended.
        logits: ``[d_vocab]`` the next-token logits (raw, before any processor).
        reads: the activations the controller declared in ``reads``, at this row's newest position(s),
            from the forward that produced ``logits``: ``name → [new, ...]`` (the pattern and scores:
            ``[head, new, key_pos]``).
    """

    row: int
    step: int
    tokens: list[int]
    prompt_length: int
    branch: int
    parent: int
    backtracked: int
    appended: list[int]
    logits: Float[Tensor, " d_vocab"]
    reads: Mapping[str, Tensor]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]


def as_branches(result: Any, where: str) -> list[Branch]:
    """A controller's answer as a list of branches (``None``: sample freely; one `Branch`: a list of it)."""
    if result is None:
        return [Branch.sample()]
    if isinstance(result, Branch):
        return [result]
    if isinstance(result, (list, tuple)) and all(isinstance(b, Branch) for b in result):
        return list(result)
    raise ArgumentTypeError(
        f"{where} must return a list of `Branch` (empty: stop the row), a `Branch`, or None (sample freely); "
        f"got {describe(result)}."
    )


def check_branch(branch: Branch, generated: int, d_vocab: int, where: str) -> Tensor | None:
    """Validate ``branch`` for a row with ``generated`` tokens; returns its mask as bool ``[d_vocab]``
    (None when it does not sample, ``ANY_TOKEN`` → None too, with `samples` telling them apart)."""
    b = branch.backtrack
    if not is_int(b) or b < 0:
        raise ValueError(f"{where}: `backtrack` must be an int >= 0 (tokens to remove), got {describe(b)}.")
    if b > generated:
        raise ValueError(
            f"{where}: `backtrack`={b} reaches into the prompt; the row has {generated} generated token(s), "
            "and a controller can only remove generated tokens."
        )
    ff = branch.ff_tokens
    if isinstance(ff, (str, bytes)) or not isinstance(ff, Sequence):
        raise ArgumentTypeError(f"{where}: `ff_tokens` must be a list of token-id lists, got {describe(ff)}.")
    for seq in ff:
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence | Tensor):
            raise ArgumentTypeError(
                f"{where}: `ff_tokens` must be a list of token-id lists (e.g. [[5, 6]]), got an entry {describe(seq)}."
            )
        for t in seq:
            if not is_int(t) or not 0 <= int(t) < d_vocab:
                raise ValueError(
                    f"{where}: `ff_tokens` holds {describe(t)}, outside the vocabulary [0, {d_vocab - 1}]."
                )
    mask = branch.sample_mask
    if mask is None:
        if len(ff) != 1:
            raise ValueError(
                f"{where}: a branch without `sample_mask` appends exactly one `ff_tokens` sequence, got {len(ff)}. "
                "Use `Branch.forced(tokens)`, or give a `sample_mask` (`Branch.sample()` samples freely)."
            )
        if not len(ff[0]) and not b:
            raise ValueError(f"{where}: a branch must change the row: it appends nothing and removes nothing.")
        return None
    if mask is ANY_TOKEN:
        return None
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:
        if mask.shape != (d_vocab,):
            raise ValueError(
                f"{where}: a bool `sample_mask` must have shape [d_vocab]=[{d_vocab}], got {tuple(mask.shape)}."
            )
        allowed = mask
    else:
        ids = mask.tolist() if isinstance(mask, Tensor) else mask
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ArgumentTypeError(
                f"{where}: `sample_mask` must be a bool tensor [d_vocab], a collection of token ids, or ANY_TOKEN; "
                f"got {describe(mask)}."
            )
        ids = list(ids)
        for t in ids:
            if not is_int(t) or not 0 <= int(t) < d_vocab:
                raise ValueError(
                    f"{where}: `sample_mask` holds {describe(t)}, outside the vocabulary [0, {d_vocab - 1}]."
                )
        allowed = torch.zeros(d_vocab, dtype=torch.bool)
        allowed[ids] = True
    if not bool(allowed.any()):
        raise ValueError(f"{where}: `sample_mask` allows no token; return no branch (`[]`) to stop the row instead.")
    return allowed


def _outside(d_vocab: int) -> str:
    return f"outside the vocabulary [0, {d_vocab - 1}]."


def samples(branch: Branch) -> bool:
    return branch.sample_mask is not None
