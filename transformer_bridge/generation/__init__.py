"""Generation: `generate(model, ...)`, a KV-cached loop over the HF model with hooks that know where they are.

Modules: ``sampling.py`` (pure logits → token functions), ``processors.py`` (penalties, bans, biases),
``options.py`` (every option validated once into a `Plan`), ``checks.py`` (argument errors that name
the parameter), ``decode.py`` (prefill, decode steps, the loop, the ``return_cache`` recompute),
``beams.py`` (beam search), ``stopping.py`` (EOS, stop strings, criteria, time), ``outputs.py``
(`GenerationOutput`).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

from ..cache import ActivationCache
from ..checks import check_bool, check_device, describe, suggest_keywords
from ..core import BridgeCore, Input, NamesFilter
from . import beams, decode, options
from .outputs import FINISH_REASONS, FinishReason, GenerationOutput
from .sampling import sample, warp_logits

__all__ = ["FINISH_REASONS", "FinishReason", "GenerationOutput", "generate", "sample", "warp_logits"]

Text = str | list[str]


@overload
def generate(
    model,
    input: Input,
    max_new_tokens: int = ...,
    *,
    return_dict: Literal[False] = ...,
    return_cache: Literal[False] = ...,
    **kwargs: Any,
) -> Text | Tensor: ...
@overload
def generate(
    model,
    input: Input,
    max_new_tokens: int = ...,
    *,
    return_dict: Literal[True],
    return_cache: Literal[False] = ...,
    **kwargs: Any,
) -> GenerationOutput: ...
@overload
def generate(
    model,
    input: Input,
    max_new_tokens: int = ...,
    *,
    return_dict: Literal[False] = ...,
    return_cache: Literal[True],
    **kwargs: Any,
) -> tuple[Text | Tensor, ActivationCache]: ...
@overload
def generate(
    model, input: Input, max_new_tokens: int = ..., *, return_dict: Literal[True],
    return_cache: Literal[True], **kwargs: Any,
) -> tuple[GenerationOutput, ActivationCache]: ...  # fmt: skip


@suggest_keywords
@torch.no_grad()
def generate(
    model: BridgeCore,
    input: Input,
    max_new_tokens: int = 20,
    *,
    attention_mask: Tensor | None = None,
    use_cache: bool = True,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    typical_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    bad_words_ids: Sequence[Sequence[int]] | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_new_tokens: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_at_eos: bool = True,
    pad_token_id: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    max_time: float | None = None,
    stopping_criteria: Sequence[Callable] | None = None,
    logits_processor: Sequence[Callable] | None = None,
    num_return_sequences: int = 1,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    streamer: Any = None,
    verbose: bool = False,
    return_type: Literal["input", "str", "tokens"] = "input",
    return_dict: bool = False,
    top_logprobs: int = 0,
    output_logits: bool = False,
    return_cache: bool = False,
    names_filter: NamesFilter = None,
    device: str | torch.device | None = None,
    prepend_bos: bool | None = None,
) -> Any:
    """Generate up to ``max_new_tokens`` tokens per row with the model's KV cache.

    Hooks registered with ``with model.hooks(...)`` run at the prefill and at every decode step;
    ``hook.ctx`` says where they are (phase, step, absolute positions per row, padding, generated).
    Batches are left-padded; every row gives the tokens it would give alone. A row stops at EOS
    (or a stop string / criterion); it is then frozen to the pad token, and the loop ends when
    every row has stopped.

    Args:
        input: text, a list of texts (left-padded for you), or token ids ``[batch, pos]``.
        max_new_tokens: tokens to generate per row at most (prompt + this must fit the context).
        attention_mask: ``[batch, pos]`` with token input: 0 marks left padding.
        use_cache: ``False`` recomputes the whole sequence at each step (a slow reference).
        do_sample: sample instead of taking the argmax. ``None`` (default): sample exactly when a
            sampling argument (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``) is
            given. ``temperature=0`` is always greedy.
        temperature, top_k, top_p, min_p, typical_p: the warpers, applied in this order after the
            processors (HF's defaults: temperature 1, and top-k 50 when sampling unless
            ``top_k`` is given; ``top_k=0`` disables it). See `sample`.
        repetition_penalty, frequency_penalty, presence_penalty, no_repeat_ngram_size,
        bad_words_ids, logit_bias, min_new_tokens: logits processors (HF semantics; left padding
            is never penalised). ``logits_processor``: HF ``LogitsProcessor`` objects (or any
            ``f(input_ids, scores) -> scores``), run after them.
        eos_token_id: int or list; default: the model's (generation config, config, tokenizer).
            ``stop_at_eos=False`` ignores EOS.
        pad_token_id: fills finished rows; default ``model.pad_token_id``.
        stop_strings: stop a row once its generated text contains one of them.
        max_time: seconds; rows still running then stop (``finish_reason`` ``"max_time"``).
        stopping_criteria: HF ``StoppingCriteria`` objects or ``f(input_ids, scores) -> bool[batch]``.
        num_return_sequences: rows per prompt (beam search: the best beams, at most ``num_beams``).
        num_beams, length_penalty, early_stopping: beam search, as HF's (``early_stopping`` True,
            False or ``"never"``).
        seed, generator: a per-call random source; the global RNG is untouched with either.
        streamer: an HF streamer (``TextStreamer``): gets the prompt, then each step's tokens.
        verbose: show a progress bar over decode steps.
        return_type: ``"input"`` (default): text in → text out (prompt + completion), tokens in →
            tokens out ``[batch, pos]`` (prompt + generated); or force ``"str"`` / ``"tokens"``.
        return_dict: return a `GenerationOutput` (sequences, mask, prompt lengths, finish reasons,
            per-step log-probabilities). ``top_logprobs=k`` adds the ``k`` best alternatives per
            step, ``output_logits=True`` the raw logits.
        return_cache: also return an `ActivationCache` of prompt + generated tokens: one extra
            forward under the active hooks, equal bitwise to ``run_with_cache`` on the output.
            ``names_filter`` / ``device`` as in `run_with_cache`.
        prepend_bos: for text input, as in `to_tokens`.

    Returns:
        The output (see ``return_type`` / ``return_dict``), or ``(output, cache)`` with
        ``return_cache=True``.

    Raises:
        TypeError, ValueError: before any forward, for any invalid option; the message names the
            parameter, the value and what is valid (an unknown keyword names the closest valid one).
            Wrong types raise `ArgumentTypeError`, which is both. A ``logits_processor`` or
            ``stopping_criteria`` entry whose output has the wrong type or shape raises at that step.

    Example:
        >>> text = model.generate("The capital of France is", max_new_tokens=8)
        >>> out = model.generate(tokens, max_new_tokens=8, temperature=0.7, top_p=0.9, seed=0,
        ...                      return_dict=True, top_logprobs=5)
        >>> out.finish_reasons, out.logprobs.shape
        >>> with model.hooks(fwd_hooks=[("blocks.3.hook_resid_post", steer)]):
        ...     tokens, cache = model.generate(tokens, max_new_tokens=8, return_cache=True,
        ...                                    names_filter=["blocks.3.hook_resid_post"])
    """
    if not isinstance(return_type, str) or return_type not in ("input", "str", "tokens"):
        raise ValueError(f"`return_type` must be 'input', 'str' or 'tokens', got {describe(return_type)}.")
    check_bool("return_cache", return_cache)
    if prepend_bos is not None:
        check_bool("prepend_bos", prepend_bos)
    if not return_cache and (names_filter is not None or device is not None):
        raise ValueError("`names_filter` and `device` only apply with `return_cache=True`.")
    names: list[str] = []
    if return_cache:
        device = check_device(device)
        names = model.names_matching(names_filter)
    text_in = isinstance(input, str) or (isinstance(input, (list, tuple)) and bool(input) and
                                         isinstance(input[0], str))  # fmt: skip
    tokens, mask = model.prepare_input(input, attention_mask, prepend_bos, left_padded=True)
    if return_type == "str" or (return_type == "input" and text_in):
        model._require_tokenizer()
    p = options.plan(
        model, tokens.shape[1], max_new_tokens=max_new_tokens, use_cache=use_cache, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
        repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
        bad_words_ids=bad_words_ids, logit_bias=logit_bias, min_new_tokens=min_new_tokens,
        eos_token_id=eos_token_id, stop_at_eos=stop_at_eos, pad_token_id=pad_token_id,
        stop_strings=stop_strings, max_time=max_time, stopping_criteria=stopping_criteria,
        logits_processor=logits_processor, num_return_sequences=num_return_sequences, num_beams=num_beams,
        length_penalty=length_penalty, early_stopping=early_stopping, seed=seed, generator=generator,
        streamer=streamer, verbose=verbose, return_dict=return_dict, top_logprobs=top_logprobs,
        output_logits=output_logits,
    )  # fmt: skip

    if p.num_beams > 1:
        out = beams.beam_search(model, tokens, mask, p)
    else:
        if p.num_return_sequences > 1:
            tokens = tokens.repeat_interleave(p.num_return_sequences, dim=0)
            mask = mask.repeat_interleave(p.num_return_sequences, dim=0)
        out = decode.generate(model, tokens, mask, p)

    cache = decode.recompute_cache(model, out, names, device) if return_cache else None
    if return_type == "str" or (return_type == "input" and text_in):
        out.text = _texts(model, input if text_in else None, out, p.num_return_sequences)
    if return_dict:
        result: Any = out
    elif out.text is not None:
        result = out.text[0] if isinstance(input, str) and len(out.text) == 1 else out.text
    else:
        result = out.sequences
    return (result, cache) if return_cache else result


def _texts(model: BridgeCore, prompts: Input | None, out: GenerationOutput, n: int) -> list[str]:
    """Prompt text as given + decoded completion per row; without prompt text, each row's real tokens decoded."""
    start = 0 if prompts is None else out.prompt_width
    rows = out.sequences[:, start:].tolist()
    real = out.attention_mask[:, start:].bool().tolist()
    decoded = [model.tokenizer.decode([t for t, r in zip(row, keep, strict=True) if r], skip_special_tokens=True)
               for row, keep in zip(rows, real, strict=True)]  # fmt: skip
    if prompts is None:
        return decoded
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    return [texts[i // n] + completion for i, completion in enumerate(decoded)]
