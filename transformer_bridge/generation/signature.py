"""`generate`'s keyword options in two forms derived from one table (`declare.OPTIONS`): `GenerateOptions`, the
`TypedDict` that types ``generate(..., **options: Unpack[GenerateOptions])`` for editors and type checkers, and the
`inspect.Signature` that ``help(model.generate)`` and `inspect.signature` show (names, order and defaults from the
table, types from `GenerateOptions`). `arguments` gives `resolve.prepare` every option by name, defaults filled in
from the table. `tests/generation/test_declared_options.py` keeps the table and the `TypedDict` equal.
"""

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict

import torch
from torch import Tensor
from transformers import GenerationConfig

from ..core import BridgeCore, Input, NamesFilter
from .declare import OPTIONS

Prompt = Input | Mapping[str, Tensor] | None

# The two options `generate` also takes by position; every other one is keyword-only.
POSITIONAL = ("input", "max_new_tokens")
DEFAULTS: dict[str, Any] = {o.name: o.default for o in OPTIONS}


class GenerateOptions(TypedDict, total=False):
    """`generate`'s keyword-only options and their types (their defaults and docs are in `declare.OPTIONS`)."""

    inputs: Prompt
    input_ids: Tensor | None
    attention_mask: Tensor | None
    token_type_ids: Tensor | None
    generation_config: GenerationConfig | None
    max_length: int | None
    min_new_tokens: int | None
    min_length: int | None
    use_cache: bool | None
    use_past_kv_cache: bool | None
    logit_bias: Mapping[int, float] | None
    sequence_bias: Mapping[tuple[int, ...], float] | Sequence | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    no_repeat_ngram_size: int | None
    bad_words_ids: Sequence[Sequence[int]] | None
    forced_bos_token_id: int | None
    forced_eos_token_id: int | Sequence[int] | None
    remove_invalid_values: bool | None
    exponential_decay_length_penalty: tuple[int, float] | None
    suppress_tokens: Sequence[int] | None
    begin_suppress_tokens: Sequence[int] | None
    logits_processor: Sequence[Callable] | None
    freq_penalty: float | None
    renormalize_logits: bool | None
    do_sample: bool | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    typical_p: float | None
    epsilon_cutoff: float | None
    eta_cutoff: float | None
    seed: int | None
    generator: torch.Generator | None
    eos_token_id: int | Sequence[int] | None
    stop_at_eos: bool | None
    pad_token_id: int | None
    stop_strings: str | Sequence[str] | None
    tokenizer: Any
    max_time: float | None
    stopping_criteria: Sequence[Callable] | None
    num_return_sequences: int | None
    num_beams: int | None
    length_penalty: float | None
    early_stopping: bool | str | None
    streamer: Any
    verbose: bool
    return_type: Literal["input", "str", "tokens"]
    return_dict: bool
    return_dict_in_generate: bool | None
    top_logprobs: int
    output_logits: bool | None
    output_scores: bool | None
    return_input_tokens: bool
    return_cache: bool
    names_filter: NamesFilter
    device: str | torch.device | None
    prepend_bos: bool | None
    padding_side: Literal["left", "right"] | None
    controller: Any
    max_steps: int | None
    prompt_lookup_num_tokens: int | None
    assistant_model: BridgeCore | None
    num_assistant_tokens: int | None
    cache_implementation: Literal["dynamic", "static"]
    compile: bool


def arguments(input: Prompt, max_new_tokens: int | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of `generate` by name: the table's defaults, then what the call gave."""
    return {**DEFAULTS, "input": input, "max_new_tokens": max_new_tokens, **options}


def signature() -> inspect.Signature:
    """`generate`'s full signature from the table: ``(model, input=None, max_new_tokens=None, *, ...)``."""
    types = {"input": Prompt, "max_new_tokens": int | None, **GenerateOptions.__annotations__}
    params = [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=BridgeCore)]
    for o in OPTIONS:
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if o.name in POSITIONAL else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(o.name, kind, default=o.default, annotation=types[o.name]))
    return inspect.Signature(params, return_annotation=Any)


__all__ = ["DEFAULTS", "POSITIONAL", "GenerateOptions", "Prompt", "arguments", "signature"]
