"""What `generate(..., return_dict=True)` (or HF's ``return_dict_in_generate=True``) returns: the sequences and,
when asked, per-step records."""

from dataclasses import dataclass
from typing import Literal

from jaxtyping import Float, Int
from torch import Tensor

from ..convertible import Convertible

FinishReason = Literal["length", "eos", "stop_string", "max_time", "stopping_criteria", "controller", "max_steps"]
# Index = the code the decode loop keeps per row on the device; 0 ("length") is "still running at the end".
FINISH_REASONS: tuple[FinishReason, ...] = (
    "length", "eos", "stop_string", "max_time", "stopping_criteria", "controller", "max_steps",
)  # fmt: skip


@dataclass
class GenerationOutput(Convertible):
    """Result of `generate(..., return_dict=True)` or `generate(..., return_dict_in_generate=True)`.

    Rows are the prompts (times ``num_return_sequences``). ``sequences`` is the left-padded prompt
    (``prompt_width`` columns) followed by the generated tokens; a row that finished early is filled
    with the pad token, and ``attention_mask`` is 0 there and on the left padding. Per-step records
    have one column per generated position (``new`` = ``sequences.shape[1] - prompt_width``) and are
    0 where the row had already finished.

    Attributes:
        sequences: ``[batch, pos]`` prompt + generated tokens.
        attention_mask: ``[batch, pos]`` 1 for real tokens (prompt and generated), 0 for padding.
        prompt_lengths: ``[batch]`` real (unpadded) prompt tokens per row.
        prompt_width: padded prompt width: generated tokens are ``sequences[:, prompt_width:]``.
        finish_reasons: per row ``"eos"``, ``"length"``, ``"stop_string"``, ``"max_time"`` or
            ``"stopping_criteria"``; with a controller also ``"controller"`` (it returned no branch)
            and ``"max_steps"`` (the step budget ran out).
        logprobs: ``[batch, new]`` log-probability of each chosen token under the model's own
            distribution (log-softmax of the raw logits, before penalties, temperature and
            truncation). With ``return_dict=True``.
        top_logprobs: ``[batch, new, k]`` the ``k`` best log-probabilities at each step, with
            ``top_tokens`` their token ids (``top_logprobs=k``).
        logits: ``[batch, new, d_vocab]`` raw logits of each step (``output_logits=True``). With HF's
            ``return_dict_in_generate=True``, HF's layout instead: a tuple of ``[batch, d_vocab]``, one
            per step.
        scores: HF's ``output_scores=True``: a tuple of ``[batch, d_vocab]``, one per step, the scores
            the token was chosen from (after the processors and, when sampling, the warpers; ``-inf``
            where a token was removed), as HF's ``GenerateDecoderOnlyOutput.scores``.
        sequences_scores: ``[batch]`` beam search: the length-penalised score of each returned beam.
        text: the decoded strings when the input was text (what the default return gives).
        parents: with a controller, the row each row was forked from (-1: a row of the input). Forked
            rows come after the input's rows, in the order they were made. ``logprobs`` of a forced
            token is NaN when the generation ended before the forward that would score it.

    Example:
        >>> out = model.generate("Hello", max_new_tokens=5, return_dict=True, top_logprobs=3)
        >>> out.new_tokens.shape, out.logprobs.shape, out.top_tokens.shape
        (torch.Size([1, 5]), torch.Size([1, 5]), torch.Size([1, 5, 3]))
    """

    sequences: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    prompt_lengths: Int[Tensor, " batch"]
    prompt_width: int
    finish_reasons: list[FinishReason]
    logprobs: Float[Tensor, "batch new"] | None = None
    top_logprobs: Float[Tensor, "batch new k"] | None = None
    top_tokens: Int[Tensor, "batch new k"] | None = None
    logits: Float[Tensor, "batch new d_vocab"] | tuple[Float[Tensor, "batch d_vocab"], ...] | None = None
    scores: tuple[Float[Tensor, "batch d_vocab"], ...] | None = None
    sequences_scores: Float[Tensor, " batch"] | None = None
    text: list[str] | None = None
    parents: list[int] | None = None

    @property
    def new_tokens(self) -> Int[Tensor, "batch new"]:
        """The generated columns (pad tokens where a row had finished)."""
        return self.sequences[:, self.prompt_width :]

    @property
    def new_lengths(self) -> Int[Tensor, " batch"]:
        """Real generated tokens per row (the EOS that ended a row counts)."""
        return self.attention_mask[:, self.prompt_width :].sum(-1)

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def as_tensor(self) -> Tensor:
        """``sequences``: what ``torch.as_tensor(out)`` and ``np.asarray(out)`` give."""
        return self.sequences
