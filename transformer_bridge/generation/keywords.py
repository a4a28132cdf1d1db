"""Which keywords `generate` takes: unknown ones name the closest valid one, HF's it lacks say what to use.

`checked_keywords` wraps `generate` and `generate_stream`. `UNSUPPORTED` lists HF's ``generate`` keywords
(and ``GenerationConfig`` fields) this loop does not implement: the values that change nothing, which are
accepted (HF code often passes ``output_attentions=False``), and what to do instead; `resolve` checks
generation configs against the same table.

Example:
    >>> model.generate(tokens, max_lenght=5)
    Traceback (most recent call last):
    ...
    TypeError: generate() got unknown keyword argument(s) ['max_lenght']. Did you mean 'max_length'?
"""

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from ..checks import describe, unknown_keywords_error

F = TypeVar("F", bound=Callable[..., Any])

_PROCESSOR = "pass transformers' `{}` in `logits_processor`"
# HF `generate` keywords (and `GenerationConfig` fields) this loop does not implement: the values that
# change nothing, and what to do instead.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "output_attentions": ((False,), "use `return_cache=True, names_filter=lambda n: n.endswith('hook_pattern')`: "
                          "every layer's attention pattern over prompt and generated tokens"),
    "output_hidden_states": ((False,), "use `return_cache=True, names_filter=lambda n: "
                             "n.endswith('hook_resid_post')`: every layer's residual stream"),
    "past_key_values": ((), "`generate` builds its own KV cache per call"),
    "inputs_embeds": ((), "pass token ids; a hook on `hook_embed` can replace their embeddings"),
    "prefix_allowed_tokens_fn": ((), _PROCESSOR.format("PrefixConstrainedLogitsProcessor(fn, num_beams)")),
    "synced_gpus": ((False,), "synchronised multi-GPU decoding is not implemented"),
    "negative_prompt_ids": ((), "classifier-free guidance is not implemented"),
    "negative_prompt_attention_mask": ((), "classifier-free guidance is not implemented"),
    "guidance_scale": ((1, 1.0), "classifier-free guidance is not implemented"),
    "penalty_alpha": ((0, 0.0), "contrastive search is not implemented"),
    "num_beam_groups": ((1,), "diverse (group) beam search is not implemented"),
    "diversity_penalty": ((0, 0.0), "diverse (group) beam search is not implemented"),
    "constraints": ((), "constrained beam search is not implemented"),
    "force_words_ids": ((), "constrained beam search is not implemented"),
    "dola_layers": ((), "DoLa decoding is not implemented"),
    "top_h": ((), "top-H sampling is not implemented"),
    "watermarking_config": ((), "watermarking is not implemented"),
    "token_healing": ((False,), "token healing is not implemented"),
    "custom_generate": ((), "custom generation code does not run here"),
    "trust_remote_code": ((False,), "custom generation code does not run here"),
}  # fmt: skip


def checked_keywords(
    valid: Iterable[str] | None = None, elsewhere: Mapping[str, str] | None = None
) -> Callable[[F], F]:
    """Make unknown keywords of the decorated function raise `TypeError` naming the closest valid one.

    ``valid`` defaults to the function's own parameters. HF keywords in `UNSUPPORTED` are dropped at
    a neutral value (``output_attentions=False``) and refused with what to do instead otherwise;
    ``elsewhere`` maps a keyword another function takes to the message saying so. A call with only
    valid keywords costs one set comparison.
    """

    def decorate(fn: F) -> F:
        names = list(valid) if valid is not None else _parameters(fn)
        accepted = frozenset(names)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not accepted.issuperset(kwargs):
                kwargs = _screen(f"{fn.__name__}()", kwargs, accepted, names, elsewhere or {})
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def _parameters(fn: Callable) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds and n != "model"]


def _screen(
    where: str, kwargs: dict[str, Any], accepted: frozenset[str], valid: list[str], elsewhere: Mapping[str, str]
) -> dict[str, Any]:
    kept = {}
    for name, value in kwargs.items():
        if name in accepted:
            kept[name] = value
        elif name in elsewhere:
            raise TypeError(f"{where} does not take `{name}`: {elsewhere[name]}")
        elif name in UNSUPPORTED:
            neutral, hint = UNSUPPORTED[name]
            if value is not None and not (is_number_or_flag(value) and value in neutral):
                raise ValueError(f"`{name}`={describe(value)} is not supported by {where}: {hint}.")
        else:
            unknown = [k for k in kwargs if k not in accepted and k not in UNSUPPORTED and k not in elsewhere]
            raise unknown_keywords_error(where, unknown, valid)
    return kept


def is_number_or_flag(value: object) -> bool:
    """Compared by value with the neutral ones (a tensor compared with `in` would be ambiguous)."""
    return isinstance(value, (bool, int, float, str)) and not (isinstance(value, float) and math.isnan(value))
