"""The bridge's `generate` options as vLLM's sampling parameters; an option vLLM cannot honour is refused by name.

Each option is declared once here: its name in the bridge's `generate`, the `SamplingParams` field it becomes, and
how its value converts. Anything else that the HF bridge's `generate` takes (beam search, controllers, speculative
drafts, static caches ...) raises `UnsupportedOptionError` naming it.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any


class UnsupportedOptionError(ValueError):
    """A `generate` option that vLLM's engine cannot honour."""


def _stop(v: str | Sequence[str]) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


def _ids(v: int | Sequence[int]) -> list[int]:
    return [int(v)] if isinstance(v, int) else [int(i) for i in v]


def _top_k(v: int) -> int:
    return -1 if v in (None, 0) else int(v)


# bridge option -> (vLLM field, conversion)
OPTIONS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "max_new_tokens": ("max_tokens", int),
    "min_new_tokens": ("min_tokens", int),
    "temperature": ("temperature", float),
    "top_k": ("top_k", _top_k),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "seed": ("seed", int),
    "stop_strings": ("stop", _stop),
    "eos_token_id": ("stop_token_ids", _ids),
    "top_logprobs": ("logprobs", int),
    "repetition_penalty": ("repetition_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "logit_bias": ("logit_bias", lambda v: {int(k): float(x) for k, x in dict(v).items()}),
    "num_return_sequences": ("n", int),
}
ACCEPTED = (*OPTIONS, "do_sample", "stop_at_eos", "verbose")
# The HF bridge's options that vLLM's engine has no counterpart for (listed so that the refusal can say so).
REFUSED = (
    "num_beams", "length_penalty", "early_stopping", "controller", "max_steps", "assistant_model",
    "prompt_lookup_num_tokens", "num_assistant_tokens", "cache_implementation", "compile", "streamer",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "sequence_bias", "bad_words_ids",
    "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "logits_processor", "stopping_criteria", "max_time", "generator", "output_logits",
    "output_scores", "renormalize_logits", "remove_invalid_values", "generation_config", "use_cache",
    "use_past_kv_cache", "max_length", "min_length", "padding_side", "attention_mask", "token_type_ids",
)  # fmt: skip


def sampling_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM `SamplingParams` fields for the bridge's options (greedy unless ``do_sample=True`` or a temperature).

    Example:
        >>> sampling_fields({"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 0})
    """
    for name, value in options.items():
        if name in REFUSED and value is not None and not (name == "num_beams" and value == 1):
            raise UnsupportedOptionError(
                f"`{name}`={value!r}: vLLM's engine cannot honour it on the vLLM bridge. Options it maps: "
                f"{sorted(ACCEPTED)}; use the HF bridge (TransformerBridge.generate) for `{name}`."
            )
        if name not in ACCEPTED and name not in REFUSED:
            raise TypeError(f"generate() got an unexpected keyword argument `{name}`. Accepted: {sorted(ACCEPTED)}.")
    fields: dict[str, Any] = {"max_tokens": 16}
    for name, (field, convert) in OPTIONS.items():
        value = options.get(name)
        if value is not None:
            fields[field] = convert(value)
    do_sample = options.get("do_sample")
    if do_sample is False or (do_sample is None and options.get("temperature") is None):
        fields["temperature"] = 0.0
    elif "temperature" not in fields:
        fields["temperature"] = 1.0
    if fields.get("temperature") == 0.0:
        for name in ("top_k", "top_p", "min_p"):
            if options.get(name) is not None and do_sample is not True:
                raise ValueError(f"`{name}` is a sampling option; give `do_sample=True` (or a `temperature` > 0).")
    if options.get("stop_at_eos") is False:
        fields["ignore_eos"] = True
    if fields["max_tokens"] < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1 on vLLM, got {fields['max_tokens']}.")
    return fields
