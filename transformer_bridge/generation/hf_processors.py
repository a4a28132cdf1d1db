"""HF's own logits processors behind `generate`'s options of the same names.

``sequence_bias``, ``forced_bos_token_id``, ``forced_eos_token_id``, ``remove_invalid_values``,
``exponential_decay_length_penalty``, ``suppress_tokens`` and ``begin_suppress_tokens`` are transformers' public
processor classes, built here with the arguments HF's ``generate`` gives them (the padded prompt width, HF's
``max_length`` = prompt width + ``max_new_tokens``, the EOS ids), so each gives HF's scores by construction. They
see the padded ``input_ids`` as inside HF's ``generate``. Their arguments are checked here first, so a bad value
raises naming the option before any forward (`declare.OPTIONS` lists them; `sampler.build_sampler` calls these).

Example:
    >>> from transformer_bridge.generation.builders import Context
    >>> c = Context(prompt_width=3, max_new_tokens=4, eos_token_ids=[2], d_vocab=99, forced_bos_token_id=None,
    ...             temperature=1.0, greedy=True, device=torch.device("cpu"))
    >>> suppress([5, 6], c)(torch.tensor([[1, 2, 3]]), torch.zeros(1, 99))[0, 5]
    tensor(-inf)
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import (
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from ..checks import ArgumentTypeError, check_bool, describe, is_int, is_real
from .processors import HFProcessor, Processor


def check_size(name: str, value: Any) -> bool:
    """An int >= 0 option where 0 (and None) disable it; True when it is on."""
    if value is None:
        return False
    if not is_int(value) or value < 0:
        error = ValueError if is_int(value) else ArgumentTypeError
        raise error(f"`{name}` must be None or an int >= 0, got {describe(value)} (0 disables it).")
    return value > 0


def _token_ids(name: str, value: Any, d_vocab: int | None, allow_single: bool = True) -> list[int]:
    ids = [value] if allow_single and is_int(value) else value
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence | torch.Tensor):
        raise ArgumentTypeError(f"`{name}` must be a list of token ids, got {describe(value)}.")
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    for token in ids:
        if not is_int(token) or token < 0 or (d_vocab is not None and token >= d_vocab):
            error = ValueError if is_int(token) else ArgumentTypeError
            allowed = "ints >= 0" if d_vocab is None else f"ints in [0, {d_vocab})"
            raise error(f"`{name}` token ids must be {allowed}, got {describe(token)}.")
    return [int(t) for t in ids]


def _wrapped(name: str, processor: Any) -> Processor:
    return HFProcessor(processor, name=f"`{name}` ({type(processor).__name__})")


def sequence_bias(value: Any, c: Any) -> Processor | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        entries = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        entries = [tuple(e) if isinstance(e, Sequence) and len(e) == 2 else (e, None) for e in value]
    else:
        raise ArgumentTypeError(
            f"`sequence_bias` must be a dict {{(token, ...): bias}} or a list [[[tokens], bias], ...], got "
            f"{describe(value)}."
        )
    if not entries:
        return None
    clean = {}
    for tokens, bias in entries:
        ids = _token_ids("sequence_bias", list(tokens) if isinstance(tokens, (tuple, list)) else tokens, c.d_vocab,
                         allow_single=False)  # fmt: skip
        if not ids or not is_real(bias) or bias != bias:
            raise ValueError(
                f"`sequence_bias` entries are (non-empty token sequence, float bias), got ({tokens!r}, {bias!r})."
            )
        clean[tuple(ids)] = float(bias)
    pairs = [[list(ids), bias] for ids, bias in clean.items()]  # HF's list form, accepted by every 5.x release
    return _wrapped("sequence_bias", SequenceBiasLogitsProcessor(sequence_bias=pairs))


def forced_bos(value: Any, c: Any) -> Processor | None:
    if value is None:
        return None
    (token,) = _token_ids("forced_bos_token_id", value, c.d_vocab)
    return _wrapped("forced_bos_token_id", ForcedBOSTokenLogitsProcessor(token))


def forced_eos(value: Any, c: Any) -> Processor | None:
    if value is None:
        return None
    ids = _token_ids("forced_eos_token_id", value, c.d_vocab)
    max_length = c.prompt_width + c.max_new_tokens  # HF's `max_length` once `max_new_tokens` is resolved
    return _wrapped("forced_eos_token_id", ForcedEOSTokenLogitsProcessor(max_length, ids, device=c.device))


def remove_invalid(value: Any, c: Any) -> Processor | None:
    if value is None:
        return None
    return (
        _wrapped("remove_invalid_values", InfNanRemoveLogitsProcessor())
        if check_bool("remove_invalid_values", value)
        else None
    )


def exponential_decay(value: Any, c: Any) -> Processor | None:
    if value is None:
        return None
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or len(value) != 2
        or not is_int(value[0])
        or value[0] < 0
        or not is_real(value[1])
        or not value[1] > 0
    ):
        raise ValueError(
            f"`exponential_decay_length_penalty` must be (start_index: int >= 0, decay_factor: float > 0), got "
            f"{describe(value)}. Example: (10, 1.05) favours EOS more with every token after the tenth."
        )
    if not c.eos_token_ids:
        return None  # no EOS to favour
    eos = torch.tensor(c.eos_token_ids, device=c.device)
    processor = ExponentialDecayLengthPenalty((int(value[0]), float(value[1])), eos, c.prompt_width)
    return _wrapped("exponential_decay_length_penalty", processor)


def suppress(value: Any, c: Any) -> Processor | None:
    if value is None:
        return None
    ids = _token_ids("suppress_tokens", value, c.d_vocab)
    return _wrapped("suppress_tokens", SuppressTokensLogitsProcessor(ids, device=c.device)) if ids else None


def begin_suppress(value: Any, c: Any) -> Processor | None:
    if value is None:
        return None
    ids = _token_ids("begin_suppress_tokens", value, c.d_vocab)
    # HF: the first generated position, one later when a one-token prompt gets a forced BOS first.
    begin = c.prompt_width if (c.prompt_width > 1 or c.forced_bos_token_id is None) else c.prompt_width + 1
    if not ids:
        return None
    return _wrapped("begin_suppress_tokens", SuppressTokensAtBeginLogitsProcessor(ids, begin, device=c.device))
