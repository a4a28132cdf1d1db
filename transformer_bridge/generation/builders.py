"""The logits processor each declared processor option builds (`declare.OPTIONS` lists the options, with their place
in HF's order; `sampler.build_sampler` calls these): ``BUILDERS[name](value, context)`` returns the processor, or
None at a neutral value. Kept apart from the table so that the table is read without torch (the command line's
flags).

Example:
    >>> BUILDERS["repetition_penalty"](1.0, context) is None   # neutral: adds nothing
    True
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import hf_processors as hfp
from .processors import (
    BadWords,
    FrequencyPresencePenalty,
    HFProcessors,
    LogitBias,
    MinNewTokens,
    NoRepeatNGram,
    Processor,
    RepetitionPenalty,
)


@dataclass(frozen=True)
class Context:
    """What a processor's builder may read besides its own value."""

    prompt_width: int
    max_new_tokens: int
    eos_token_ids: list[int]
    d_vocab: int | None
    forced_bos_token_id: int | None
    temperature: float
    greedy: bool
    device: torch.device


Build = Callable[[Any, Context], Processor | None]


# -- processor builders: the option's value → its processor (None: neutral, adds nothing) -----------------------
def _logit_bias(value: Any, c: Context) -> Processor | None:
    return LogitBias(value, c.d_vocab) if value else None


def _repetition(value: Any, c: Context) -> Processor | None:
    penalty = RepetitionPenalty(value)
    return penalty if penalty.penalty != 1.0 else None


def _frequency(value: Any, c: Context) -> Processor | None:
    penalty = FrequencyPresencePenalty(value, 0.0, c.prompt_width)
    return penalty if penalty.frequency_penalty else None


def _presence(value: Any, c: Context) -> Processor | None:
    penalty = FrequencyPresencePenalty(0.0, value, c.prompt_width)
    return penalty if penalty.presence_penalty else None


def _no_repeat(value: Any, c: Context) -> Processor | None:
    return NoRepeatNGram(value) if hfp.check_size("no_repeat_ngram_size", value) else None


def _bad_words(value: Any, c: Context) -> Processor | None:
    return BadWords(value, c.d_vocab) if not (isinstance(value, Sequence) and len(value) == 0) else None


def _min_new(value: Any, c: Context) -> Processor | None:
    steps = MinNewTokens(value, c.eos_token_ids, c.prompt_width)
    return steps if steps.min_new_tokens > 0 and c.eos_token_ids else None


def _user_processors(value: Any, c: Context) -> Processor | None:
    return HFProcessors.of(value)


def _tl_freq_penalty(value: Any, c: Context) -> Processor | None:
    # TransformerLens subtracts `freq_penalty * count` after dividing by the temperature; subtracting
    # `freq_penalty * temperature * count` before it is the same, and keeps the warpers pure.
    if c.greedy or not value:
        return None
    return FrequencyPresencePenalty(value * c.temperature, 0.0, prompt_length=0)


BUILDERS: dict[str, Build] = {
    "min_new_tokens": _min_new,
    "logit_bias": _logit_bias,
    "sequence_bias": hfp.sequence_bias,
    "repetition_penalty": _repetition,
    "frequency_penalty": _frequency,
    "presence_penalty": _presence,
    "no_repeat_ngram_size": _no_repeat,
    "bad_words_ids": _bad_words,
    "forced_bos_token_id": hfp.forced_bos,
    "forced_eos_token_id": hfp.forced_eos,
    "remove_invalid_values": hfp.remove_invalid,
    "exponential_decay_length_penalty": hfp.exponential_decay,
    "suppress_tokens": hfp.suppress,
    "begin_suppress_tokens": hfp.begin_suppress,
    "logits_processor": _user_processors,
    "freq_penalty": _tl_freq_penalty,
}

__all__ = ["BUILDERS", "Build", "Context"]
