"""`generate` and `generate_stream`: the options resolved once (`resolve`), then the loop that serves them (the
tensor driver `decode`, the row driver `control`, beam search `beams`), the cache recomputed, the output shaped.
The package's `__init__` hands these names out on first use, so that reading the option table (`declare`, the
command line's flags) imports no torch."""

import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any, Literal, overload

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..cache.activation_cache import ActivationCache
from ..checks import check_int
from ..core import BridgeCore
from . import beams, control, declare, decode, fast, keywords, resolve, signature, speculative, stream
from . import kv as kvrows
from .branch import ANY_TOKEN, Branch, View
from .control import ControllerError
from .outputs import FINISH_REASONS, FinishReason, GenerationOutput
from .sampling import draw, sample, warp_logits
from .signature import GenerateOptions, Prompt

__all__ = [
    "ANY_TOKEN",
    "FINISH_REASONS",
    "Branch",
    "ControllerError",
    "FinishReason",
    "GenerationOutput",
    "View",
    "draw",
    "generate",
    "generate_stream",
    "sample",
    "warp_logits",
]

Text = str | list[str]


@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, return_dict: Literal[False] = ...,
    return_dict_in_generate: Literal[False] | None = ..., return_cache: Literal[False] = ..., **kwargs: Any,
) -> Text | Tensor: ...  # fmt: skip
@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, return_dict: Literal[True],
    return_cache: Literal[False] = ..., **kwargs: Any,
) -> GenerationOutput: ...  # fmt: skip
@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, return_dict_in_generate: Literal[True],
    return_cache: Literal[False] = ..., **kwargs: Any,
) -> GenerationOutput: ...  # fmt: skip
@overload
def generate(  # TransformerLens 4: `output_logits=True` / `output_scores=True` alone return the output object
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, output_logits: Literal[True],
    return_cache: Literal[False] = ..., **kwargs: Any,
) -> GenerationOutput: ...  # fmt: skip
@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, output_scores: Literal[True],
    return_cache: Literal[False] = ..., **kwargs: Any,
) -> GenerationOutput: ...  # fmt: skip
@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, output_logits: Literal[True],
    return_cache: Literal[True], **kwargs: Any,
) -> tuple[GenerationOutput, ActivationCache]: ...  # fmt: skip
@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, output_scores: Literal[True],
    return_cache: Literal[True], **kwargs: Any,
) -> tuple[GenerationOutput, ActivationCache]: ...  # fmt: skip
@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, return_dict: Literal[False] = ...,
    return_dict_in_generate: Literal[False] | None = ..., return_cache: Literal[True], **kwargs: Any,
) -> tuple[Text | Tensor, ActivationCache]: ...  # fmt: skip
@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, return_dict: Literal[True],
    return_cache: Literal[True], **kwargs: Any,
) -> tuple[GenerationOutput, ActivationCache]: ...  # fmt: skip
@overload
def generate(
    model, input: Prompt = ..., max_new_tokens: int | None = ..., *, return_dict_in_generate: Literal[True],
    return_cache: Literal[True], **kwargs: Any,
) -> tuple[GenerationOutput, ActivationCache]: ...  # fmt: skip


@keywords.checked_keywords([o.name for o in declare.OPTIONS])
@torch.no_grad()
def generate(
    model: BridgeCore,
    input: Prompt = None,
    max_new_tokens: int | None = None,
    **options: Unpack[GenerateOptions],
) -> Any:
    # The docstring is `_GENERATE_DOC` with the Args of `declare.OPTIONS` (below the function).
    args = signature.arguments(input, max_new_tokens, options)  # every option by name, defaults from the table
    request = resolve.prepare(model, args)
    p, tokens, mask = request.plan, request.tokens, request.mask
    n = p.search.num_return_sequences
    drafts = speculative.drafter(model, request.speculation, p)
    static = fast.check(model, request.cache_implementation, request.compile, p)
    if p.search.num_beams > 1:
        controllers = None
        if request.controller is not None:  # masks, forced tokens and stops, per beam (`beam_control`)
            controllers = control.check_controller(request.controller, request.tokens.shape[0], model)
        out = beams.beam_search(model, tokens, mask, p, controllers)
    else:
        if n > 1:
            tokens = tokens.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
        if request.controller is None and drafts is None:
            embeds = None if request.embeds is None else request.embeds.repeat_interleave(n, dim=0)
            out = decode.generate(model, tokens, mask, p, static, static and request.compile, embeds)
        else:  # the row driver: a controller, speculative decoding (`drafts`), or both
            if resolve.has_gaps(mask):
                raise ValueError(
                    "`attention_mask` has padding between real tokens; a controller or speculative decoding needs "
                    "each row's real tokens contiguous (plain decoding and beam search take such masks, as HF)."
                )
            controllers = [None] * len(tokens)
            if request.controller is not None:
                controllers = control.check_controller(request.controller, request.tokens.shape[0], model)
                controllers = [c for c in controllers for _ in range(n)]
                if n > 1:
                    controllers = [control.own_copy(c) for c in controllers]
            length = tokens.shape[1] + p.max_new_tokens  # a static cache: prompt + new tokens
            kv = kvrows.StaticKVRows(model, len(tokens), length) if static else None
            steps = request.max_steps if request.controller is not None else None
            out = control.generate(model, tokens, mask, p, controllers, steps, kv, static and request.compile, drafts)

    if request.embeds is not None:  # the placeholder prompt is no output: generated tokens only, as HF
        out = dataclasses.replace(out, sequences=out.sequences[:, out.prompt_width :],
                                  attention_mask=out.attention_mask[:, out.prompt_width :], prompt_width=0,
                                  prompt_lengths=torch.zeros_like(out.prompt_lengths))  # fmt: skip
    cache = decode.recompute_cache(model, out, request.names, request.device) if request.return_cache else None
    if request.text_out:
        out.text = _texts(model, request.prompts, out, n)
    if request.hf_layout and isinstance(out.logits, Tensor):
        out.logits = tuple(out.logits.unbind(1))
    kind = args["return_type"] if args["return_type"] != "input" or request.embeds is None else "embeds"
    if request.return_dict:
        result: Any = out
    elif kind == "embeds":
        result = _embeddings(model, request, out, n)
    elif out.text is not None:
        result = out.text[0] if request.single and len(out.text) == 1 else out.text
    else:
        result = out.sequences
    extras = (cache,) if request.return_cache else ()
    if request.return_input_tokens:
        extras += (request.tokens if request.embeds is None else request.embeds,)
    return (result, *extras) if extras else result


def _embeddings(model: BridgeCore, request: resolve.Request, out: GenerationOutput, n: int) -> Tensor:
    """``return_type="embeds"``: the output as embeddings ``[batch, pos, d_model]`` (the model's input embeddings of
    its tokens, HF's ``inputs_embeds`` convention, so they can be fed back as a prompt); a prompt given as
    embeddings is kept as it was given."""
    embed = model.hf_model.get_input_embeddings()
    new = embed(out.sequences)
    if request.embeds is None:
        return new
    return torch.cat([request.embeds.repeat_interleave(n, dim=0), new.to(request.embeds.dtype)], dim=1)


_GENERATE_DOC = """Generate up to ``max_new_tokens`` tokens per row with the model's KV cache.

Hooks registered with ``with model.hooks(...)`` run at the prefill and at every decode step; ``hook.ctx`` says
where they are (phase, step, absolute positions per row, padding, generated). Batches are left-padded; every row
gives the tokens it would give alone. A row stops at EOS (or a stop string / criterion); it is then frozen to the
pad token, and the loop ends when every row has stopped.

HF's and TransformerLens' habits work unchanged: ``generate(**tokenizer(texts, return_tensors="pt",
padding=True), max_length=30)``, ``generation_config=GenerationConfig(...)``, ``output_scores``,
``return_dict_in_generate``, ``use_past_kv_cache``, ``freq_penalty``. Every option a ``GenerationConfig`` holds is
resolved as HF resolves it: the keyword, else ``generation_config``'s field, else
``model.hf_model.generation_config``'s, else the default (a field left at ``None`` does not override). Decoding is
greedy unless asked otherwise (HF's default, not TransformerLens' ``do_sample=True``). The logits processors run
in HF's order, then the warpers when sampling; one chooser serves every loop (docs/generation.md has the table
of options, their sources and the loops that honour them).

Args:
{args}

Returns:
    The output (see ``return_type`` / ``return_dict``), or ``(output, cache)`` with ``return_cache=True``.

Raises:
    TypeError, ValueError: before any forward, for any invalid option; the message names the parameter, the
        value and what is valid (an unknown keyword names the closest valid one; an HF keyword this loop lacks
        says what to use instead). Wrong types raise `ArgumentTypeError`, which is both. A ``logits_processor``
        or ``stopping_criteria`` entry whose output has the wrong type or shape raises at that step.

Example:
    >>> text = model.generate("The capital of France is", max_new_tokens=8)
    >>> out = model.generate(tokens, max_new_tokens=8, temperature=0.7, top_p=0.9, seed=0,
    ...                      return_dict=True, top_logprobs=5)
    >>> out.finish_reasons, out.logprobs.shape
    >>> out = model.generate(**tokenizer(texts, return_tensors="pt", padding=True), max_new_tokens=8,
    ...                      return_dict_in_generate=True, output_scores=True)
    >>> with model.hooks(fwd_hooks=[("blocks.3.hook_resid_post", steer)]):
    ...     tokens, cache = model.generate(tokens, max_new_tokens=8, return_cache=True,
    ...                                    names_filter=["blocks.3.hook_resid_post"])
"""
generate.__doc__ = _GENERATE_DOC.format(args=declare.render_args())
# help(), IDEs that read it and `inspect.signature` see every option, with the table's defaults.
generate.__signature__ = signature.signature()  # type: ignore[attr-defined]
# What `generate_stream` refuses, and what to do instead: the options whose declared paths lack "stream".
_NOT_STREAMED = declare.not_streamed()
_SIGNATURE = inspect.signature(generate).parameters
_STREAM_DEFAULTS = {
    name: param.default
    for name, param in _SIGNATURE.items()
    if param.kind is inspect.Parameter.KEYWORD_ONLY and name not in _NOT_STREAMED
}
_STREAM_FIXED = {name: _SIGNATURE[name].default for name in _NOT_STREAMED}


@keywords.checked_keywords(["input", "max_new_tokens", "max_tokens_per_yield", *_STREAM_DEFAULTS], _NOT_STREAMED)
@torch.no_grad()
def generate_stream(
    model: BridgeCore,
    input: Prompt = None,
    max_new_tokens: int | None = None,
    *,
    max_tokens_per_yield: int = 1,
    **options: Any,
) -> Iterator[Tensor | str | list[str]]:
    """`generate`, yielding the tokens (or text) as they are chosen: TransformerLens' ``generate_stream``.

    Takes `generate`'s decoding options (not its records, cache or beam search). Every option is
    checked when this is called, before any forward; each chunk is then decoded when asked for, with
    the hooks active at that moment. A chunk holds ``max_tokens_per_yield`` new tokens per row (the
    last one the rest): token ids ``[batch, k]`` for token input (the pad token where a row has
    finished), else each row's new text (a str for one text prompt, else a list). As in
    TransformerLens, the first chunk starts with the prompt, so the chunks joined are `generate`'s
    output: ``torch.cat(list(chunks), 1)`` for tokens, ``"".join(chunks)`` for one text.

    Example:
        >>> for piece in model.generate_stream("Once upon a time", max_new_tokens=32):
        ...     print(piece, end="", flush=True)
    """
    every = check_int("max_tokens_per_yield", max_tokens_per_yield, minimum=1)
    given = {"input": input, "max_new_tokens": max_new_tokens, **_STREAM_DEFAULTS, **options, **_STREAM_FIXED}
    request = resolve.prepare(model, given)
    if request.embeds is not None:
        raise ValueError("`generate_stream` takes token ids or text; for a prompt given as embeddings call `generate`.")
    if request.plan.search.num_beams > 1:
        raise ValueError(
            f"`generate_stream` decodes one token per row and step, but the generation config sets "
            f"`num_beams`={request.plan.search.num_beams}: {_NOT_STREAMED['num_beams']}"
        )
    return stream.chunks(model, request, every)


def _texts(model: BridgeCore, prompts: list[str] | None, out: GenerationOutput, n: int) -> list[str]:
    """Prompt text as given + decoded completion per row; without prompt text, each row's real tokens decoded."""
    start = 0 if prompts is None else out.prompt_width
    rows = out.sequences[:, start:].tolist()
    real = out.attention_mask[:, start:].bool().tolist()
    decoded = [model.tokenizer.decode([t for t, r in zip(row, keep, strict=True) if r], skip_special_tokens=True)
               for row, keep in zip(rows, real, strict=True)]  # fmt: skip
    if prompts is None:
        return decoded
    origin = list(range(len(decoded)))
    for i, parent in enumerate(out.parents or []):
        if parent >= 0:
            origin[i] = origin[parent]  # forks come after their parent: the row whose prompt they continue
    return [prompts[origin[i] // n] + completion for i, completion in enumerate(decoded)]
