"""When a row stops: EOS, stop strings, the user's stopping criteria, and the time limit.

`Stopping.check` is called once per step with the sequences so far (the newest token last) and
returns a reason code per row (an index into `outputs.FINISH_REASONS`, 0 = keep going). The decode
loop turns codes into finished rows; the time limit is global (`Stopping.out_of_time`).
"""

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..checks import ArgumentTypeError, describe
from .outputs import FINISH_REASONS

EOS, STOP_STRING, MAX_TIME, CRITERIA = (
    FINISH_REASONS.index(r) for r in ("eos", "stop_string", "max_time", "stopping_criteria")
)
Criterion = Callable[[Tensor, Tensor], Any]


class Stopping:
    """The per-row stop conditions of one `generate` call, resolved once before the loop.

    ``eos_token_ids``: a row stops when it produces one of them. ``stop_strings``: a row stops when
    its generated text (the prompt is not searched) contains one of them; the token that completes
    the string is kept, nothing is cut. ``criteria``: HF ``StoppingCriteria`` objects or any
    ``f(input_ids, scores) -> bool | BoolTensor[batch]``, called with the padded sequences so far
    and the scores of the step (HF's: processed, and warped when sampling). ``max_time``: seconds
    from ``start`` after which every running row stops (checked between steps).

    Example:
        >>> stop = Stopping(eos_token_ids=[0], prompt_width=1)
        >>> stop.check(torch.tensor([[5, 0], [5, 3]]), None).tolist()
        [1, 0]
    """

    def __init__(
        self,
        eos_token_ids: Sequence[int] = (),
        prompt_width: int = 0,
        stop_strings: Sequence[str] = (),
        tokenizer: Any = None,
        criteria: Sequence[Criterion] = (),
        max_time: float | None = None,
        start: float | None = None,
    ) -> None:
        self.eos = torch.tensor(list(eos_token_ids), dtype=torch.long) if eos_token_ids else None
        self.prompt_width = prompt_width
        self.stop_strings = list(stop_strings)
        self.tokenizer = tokenizer
        # Each char is at most 4 byte-fallback tokens: a window this long holds any stop string that
        # the newest token completed.
        self.window = 4 * max((len(s) for s in self.stop_strings), default=0) + 2
        self.criteria = list(criteria)
        self.deadline = math.inf if max_time is None else (start or time.perf_counter()) + max_time

    @property
    def per_row(self) -> bool:
        """Whether `check` can stop a row (otherwise only the length and time limits end rows)."""
        return self.eos is not None or bool(self.stop_strings) or bool(self.criteria)

    def check(
        self, sequences: Int[Tensor, "batch pos"], scores: Float[Tensor, "batch d_vocab"] | None
    ) -> Int[Tensor, " batch"]:
        """Reason code of each row for its newest token (``sequences[:, -1]``); 0 means not stopped."""
        code = torch.zeros(sequences.shape[0], dtype=torch.long, device=sequences.device)
        # Assigned lowest priority first, so EOS wins when several conditions hit at once.
        for i, criterion in enumerate(self.criteria):
            code.masked_fill_(_as_rows(criterion(sequences, scores), code, i, criterion), CRITERIA)
        if self.stop_strings:
            code.masked_fill_(self._stop_strings(sequences), STOP_STRING)
        if self.eos is not None:
            if self.eos.device != sequences.device:
                self.eos = self.eos.to(sequences.device)
            code.masked_fill_(torch.isin(sequences[:, -1], self.eos), EOS)
        return code

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline

    def _stop_strings(self, sequences: Int[Tensor, "batch pos"]) -> torch.Tensor:
        start = max(self.prompt_width, sequences.shape[1] - self.window)
        tails = sequences[:, start:].tolist()
        hits = [any(s in self.tokenizer.decode(tail) for s in self.stop_strings) for tail in tails]
        return torch.tensor(hits, dtype=torch.bool, device=sequences.device)


def _as_rows(result: Any, like: Tensor, index: int, criterion: Criterion) -> Tensor:
    """A criterion's answer (bool, or a bool tensor of shape [], [1] or [batch]) as a [batch] bool tensor.

    Checked by type and shape only (no device sync), so a wrong answer fails here, naming the criterion.
    """
    if isinstance(result, bool):
        return torch.full_like(like, result, dtype=torch.bool)
    if not isinstance(result, Tensor) or result.dtype != torch.bool:
        raise ArgumentTypeError(
            f"{_label(index, criterion)} must return a bool or a bool tensor [batch] (True: stop that row), "
            f"got {describe(result)}. Compare instead of returning numbers, e.g. `input_ids[:, -1] == stop_id`."
        )
    if result.shape not in ((), (1,), like.shape):
        raise ValueError(
            f"{_label(index, criterion)} must return one bool per row (a per-row bool tensor): shape [], [1] or "
            f"[{like.shape[0]}] (batch), got {describe(result)}."
        )
    return result.to(like.device).expand(like.shape)


def _label(index: int, criterion: Criterion) -> str:
    return f"`stopping_criteria`[{index}] ({getattr(criterion, '__name__', type(criterion).__name__)})"
