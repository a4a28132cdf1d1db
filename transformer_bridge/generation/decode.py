"""The KV-cached decode loop: `prefill`, `decode_one_token`, `generate`, and the `return_cache` recompute.

Read it top to bottom. Options are resolved once into a `Plan` (`plan`, which raises every
`ValueError` before any forward runs); the loop then only does tensor work plus one host sync per
step (are all rows done?). The model always gets ``position_ids`` (left padding: ``cumsum(mask) -
1``) and, when the prompt is padded, the attention mask over cached + new positions, exactly as HF's
own ``generate`` builds them, so greedy tokens equal HF's.

Hooks see ``hook.ctx``: ``phase="prefill"`` (step 0, the whole prompt), then ``phase="decode"`` with
``step`` 1, 2, … (one new token per row; ``positions`` its absolute position in its row), and
``phase="recompute"`` for the ``return_cache`` forward. With ``use_cache=False`` each decode step is
a full forward over the sequence so far, so a hook sees every position again at every step.
"""

import math
import numbers
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers import DynamicCache

from ..cache import ActivationCache
from ..hook_points import HookContext
from .outputs import FINISH_REASONS, GenerationOutput
from .processors import ProcessorList, build_processors
from .sampling import sample, validate_sampling_args
from .stopping import MAX_TIME, Stopping

if TYPE_CHECKING:
    from ..bridge import TransformerBridge

SAMPLING_ARGS = ("temperature", "top_k", "top_p", "min_p", "typical_p")
HF_DEFAULT_TOP_K = 50  # HF's GenerationConfig applies top-k 50 when sampling unless told otherwise.


@dataclass
class Plan:
    """Every option of one `generate` call, validated and resolved before the loop."""

    max_new_tokens: int
    greedy: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    typical_p: float | None
    generator: torch.Generator | None
    processors: ProcessorList
    stopping: Stopping
    pad_token_id: int
    eos_token_ids: list[int]
    use_cache: bool
    num_beams: int
    num_return_sequences: int
    length_penalty: float
    early_stopping: bool | str
    record: bool
    top_logprobs: int
    output_logits: bool
    streamer: Any
    verbose: bool


def plan(
    model: "TransformerBridge",
    prompt_width: int,
    *,
    max_new_tokens: int,
    use_cache: bool,
    do_sample: bool | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    typical_p: float | None,
    repetition_penalty: float | None,
    frequency_penalty: float | None,
    presence_penalty: float | None,
    no_repeat_ngram_size: int | None,
    bad_words_ids: Sequence[Sequence[int]] | None,
    logit_bias: Mapping[int, float] | None,
    min_new_tokens: int | None,
    eos_token_id: int | Sequence[int] | None,
    stop_at_eos: bool,
    pad_token_id: int | None,
    stop_strings: str | Sequence[str] | None,
    max_time: float | None,
    stopping_criteria: Sequence[Callable] | None,
    logits_processor: Sequence[Callable] | None,
    num_return_sequences: int,
    num_beams: int,
    length_penalty: float,
    early_stopping: bool | str,
    seed: int | None,
    generator: torch.Generator | None,
    streamer: Any,
    verbose: bool,
    return_dict: bool,
    top_logprobs: int,
    output_logits: bool,
) -> Plan:
    """Validate and resolve `generate`'s options; raises `ValueError` naming the parameter.

    Every option is required here: the defaults live in `generate`'s signature only.
    """
    start = time.perf_counter()
    d_vocab, n_ctx = model.cfg.d_vocab, model.cfg.n_ctx
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"`max_new_tokens` must be an int >= 0, got {max_new_tokens!r}.")
    if n_ctx is not None and prompt_width + max_new_tokens > n_ctx:
        raise ValueError(
            f"`max_new_tokens`={max_new_tokens} with a prompt of {prompt_width} tokens needs "
            f"{prompt_width + max_new_tokens} positions; the model's context is {n_ctx}. Use "
            f"`max_new_tokens` <= {max(n_ctx - prompt_width, 0)} or a shorter prompt."
        )
    values = (temperature, top_k, top_p, min_p, typical_p)
    given = {k: v for k, v in zip(SAMPLING_ARGS, values, strict=True) if v is not None}
    if do_sample is None:
        do_sample = bool(given)
    elif not do_sample and given:
        warnings.warn(
            f"`do_sample=False` decodes greedily, so {sorted(given)} have no effect. Drop `do_sample` (it then "
            "follows from the sampling arguments) or pass `do_sample=True`.",
            stacklevel=4,  # plan ← generate ← torch.no_grad's wrapper ← the caller
        )
    temperature = 1.0 if temperature is None else temperature
    if do_sample and top_k is None:
        top_k = HF_DEFAULT_TOP_K
    validate_sampling_args(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p)
    if not _is_int(num_beams) or num_beams < 1:
        raise ValueError(f"`num_beams` must be an int >= 1, got {num_beams!r}.")
    if not _is_int(num_return_sequences) or num_return_sequences < 1:
        raise ValueError(f"`num_return_sequences` must be an int >= 1, got {num_return_sequences!r}.")
    if num_beams > 1 and num_return_sequences > num_beams:
        raise ValueError(
            f"`num_return_sequences`={num_return_sequences} must be in [1, `num_beams`={num_beams}]: beam search "
            "returns the best beams. Raise `num_beams` or lower `num_return_sequences`."
        )
    if not isinstance(length_penalty, (int, float)) or not math.isfinite(length_penalty):
        raise ValueError(f"`length_penalty` must be a finite float, got {length_penalty!r}.")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"`early_stopping` must be True, False or 'never', got {early_stopping!r}.")
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= d_vocab:
        raise ValueError(f"`top_logprobs` must be an int in [0, {d_vocab}] (d_vocab), got {top_logprobs!r}.")
    if max_time is not None and (not isinstance(max_time, (int, float)) or not max_time > 0):
        raise ValueError(f"`max_time` must be None or a number of seconds > 0, got {max_time!r}.")
    if (top_logprobs or output_logits) and not return_dict:
        raise ValueError("`top_logprobs` and `output_logits` are `GenerationOutput` records: add `return_dict=True`.")
    if num_beams > 1 and (top_logprobs or output_logits or streamer is not None):
        raise ValueError(
            "Beam search records `logprobs` and `sequences_scores` only: `top_logprobs`, `output_logits` and "
            "`streamer` need `num_beams=1`."
        )
    if not isinstance(use_cache, bool):
        raise ValueError(f"`use_cache` must be True or False, got {use_cache!r}.")

    eos = _eos_ids(model, eos_token_id) if stop_at_eos else []
    pad = model.pad_token_id if pad_token_id is None else pad_token_id
    _check_token("pad_token_id", pad, d_vocab)
    pad = int(pad)
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    stop_strings = list(stop_strings or [])
    if stop_strings and (not all(isinstance(s, str) and s for s in stop_strings) or model.tokenizer is None):
        raise ValueError(
            f"`stop_strings` must be non-empty strings and the bridge needs a tokenizer to use them; got "
            f"{stop_strings!r} (tokenizer: {type(model.tokenizer).__name__})."
        )
    criteria = list(stopping_criteria or [])
    if not all(callable(c) for c in criteria):
        raise ValueError("`stopping_criteria` must be a list of callables `(input_ids, scores) -> bool tensor`.")
    processors = build_processors(
        prompt_length=prompt_width,
        d_vocab=d_vocab,
        eos_token_id=eos or None,
        logit_bias=logit_bias,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        bad_words_ids=bad_words_ids,
        min_new_tokens=min_new_tokens,
        logits_processor=logits_processor,
    )
    if seed is not None and generator is not None:
        raise ValueError("Pass either `seed` or `generator`, not both.")
    if seed is not None:
        if not _is_int(seed):
            raise ValueError(f"`seed` must be an int, got {seed!r}.")
        generator = torch.Generator(device=model.device).manual_seed(seed)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"`generator` must be a torch.Generator, got {type(generator).__name__}.")
    stopping = Stopping(eos, prompt_width, stop_strings, model.tokenizer, criteria, max_time, start)
    return Plan(
        max_new_tokens=max_new_tokens,
        greedy=not do_sample or temperature == 0,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        typical_p=typical_p,
        generator=generator,
        processors=processors,
        stopping=stopping,
        pad_token_id=pad,
        eos_token_ids=eos,
        use_cache=use_cache,
        num_beams=num_beams,
        num_return_sequences=num_return_sequences,
        length_penalty=float(length_penalty),
        early_stopping=early_stopping,
        record=return_dict,
        top_logprobs=top_logprobs,
        output_logits=output_logits,
        streamer=streamer,
        verbose=verbose,
    )


def prefill(
    model: "TransformerBridge",
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    positions: Int[Tensor, "batch pos"],
    cache: DynamicCache | None,
    padded: bool,
) -> Float[Tensor, "batch d_vocab"]:
    """Run the prompt (filling ``cache``); return the logits for the first new token."""
    real = mask.bool()
    ctx = HookContext("prefill", 0, positions, ~real, torch.zeros_like(real))
    return _last_logits(model, tokens, mask if padded else None, ctx, cache, positions)


def decode_one_token(
    model: "TransformerBridge",
    token: Int[Tensor, "batch 1"],
    position: Int[Tensor, "batch 1"],
    real: Bool[Tensor, "batch 1"],
    mask: Int[Tensor, "batch key_pos"] | None,
    cache: DynamicCache,
    step: int,
) -> Float[Tensor, "batch d_vocab"]:
    """Feed one token per row through the KV cache; ``mask`` covers cached + new positions."""
    ctx = HookContext("decode", step, position, ~real, real)
    return _last_logits(model, token, mask, ctx, cache, position)


def decode_full(
    model: "TransformerBridge",
    tokens: Int[Tensor, "batch pos"],
    positions: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    prompt_width: int,
    padded: bool,
    step: int,
) -> Float[Tensor, "batch d_vocab"]:
    """``use_cache=False``: recompute the whole sequence so far (the reference for the KV cache)."""
    real = mask.bool()
    generated = real.clone()
    generated[:, :prompt_width] = False
    ctx = HookContext("decode", step, positions, ~real, generated)
    return _last_logits(model, tokens, mask if padded else None, ctx, None, positions)


def next_token(
    logits: Float[Tensor, "batch d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    p: Plan,
) -> tuple[Int[Tensor, " batch"], Float[Tensor, "batch d_vocab"]]:
    """Processors → temperature → top-k → top-p → min-p → typical-p → draw (or argmax)."""
    scores = logits.float()
    if p.processors:
        scores = p.processors(tokens, scores, mask)
    if p.greedy:
        return scores.argmax(-1), scores
    return sample(scores, p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p, p.generator), scores


def generate(
    model: "TransformerBridge", tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"], p: Plan
) -> GenerationOutput:
    """Greedy or sampled decoding of a left-padded batch; finished rows are frozen to the pad token."""
    batch, width = tokens.shape
    total = width + p.max_new_tokens
    seq = tokens.new_full((batch, total), p.pad_token_id)
    seq[:, :width] = tokens
    full_mask = mask.new_zeros((batch, total))
    full_mask[:, :width] = mask
    positions = mask.new_zeros((batch, total))
    positions[:, :width] = (mask.cumsum(-1) - 1).clamp_min(0)
    done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    reason = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    records = _Records(p, batch, model.cfg.d_vocab, tokens.device)
    padded = not bool(mask.all())  # no padding: HF's own mask-free (fastest) attention path
    cache = DynamicCache(config=model.hf_model.config) if p.use_cache else None
    if p.streamer is not None:
        p.streamer.put(tokens.cpu())

    n_new = 0
    if p.max_new_tokens > 0:
        logits = prefill(model, tokens, mask, positions[:, :width], cache, padded)
    with _progress(p) as steps:
        for i in steps:
            cur = width + i
            token, scores = next_token(logits, seq[:, :cur], full_mask[:, :cur], p)
            records.add(i, logits, token)
            token = token.masked_fill(done, p.pad_token_id)
            seq[:, cur] = token
            full_mask[:, cur] = ~done
            positions[:, cur] = positions[:, cur - 1] + (~done).long()
            if p.stopping.per_row:
                code = p.stopping.check(seq[:, : cur + 1], scores)
                newly = (code > 0) & ~done
                reason = torch.where(newly, code, reason)
                done |= newly
            if p.streamer is not None:
                p.streamer.put(token.cpu())
            n_new = i + 1
            if n_new == p.max_new_tokens or (p.stopping.per_row and bool(done.all())):
                break
            if p.stopping.out_of_time():
                reason = reason.masked_fill(~done, MAX_TIME)
                break
            if cache is not None:
                logits = decode_one_token(
                    model, seq[:, cur : cur + 1], positions[:, cur : cur + 1], full_mask[:, cur : cur + 1].bool(),
                    full_mask[:, : cur + 1] if padded else None, cache, step=i + 1,
                )  # fmt: skip
            else:
                end = cur + 1
                logits = decode_full(model, seq[:, :end], positions[:, :end], full_mask[:, :end], width, padded, i + 1)
    if p.streamer is not None:
        p.streamer.end()

    return records.finish(
        GenerationOutput(
            sequences=seq[:, : width + n_new].contiguous(),
            attention_mask=full_mask[:, : width + n_new].contiguous(),
            prompt_lengths=mask.sum(-1),
            prompt_width=width,
            finish_reasons=[FINISH_REASONS[c] for c in reason.tolist()],
        )
    )


def recompute_cache(
    model: "TransformerBridge",
    out: GenerationOutput,
    names: list[str],
    device: torch.device | None,
) -> ActivationCache:
    """One forward over prompt + generated tokens with the active hooks plus caching hooks.

    `TransformerBridge.cache_forward`, the code path of `run_with_cache`, so the cache equals
    ``run_with_cache(out.sequences, attention_mask=out.attention_mask)`` bitwise; only ``hook.ctx``
    differs (``phase="recompute"``, ``is_generated`` marks generated tokens). Only the last position
    is unembedded: the logits are not returned, and every hook point comes before the unembedding.
    """
    tokens, mask = out.sequences, out.attention_mask
    ctx = HookContext.from_mask(mask, "recompute", 0, out.prompt_lengths)
    _, tensors = model.cache_forward(tokens, mask, names, device, ctx=ctx, logits_to_keep=1)
    target = device or mask.device
    lengths = out.prompt_lengths.to(target)
    return ActivationCache(tensors, model, attention_mask=mask.to(target), prompt_lengths=lengths)


def _last_logits(
    model: "TransformerBridge",
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch key_pos"] | None,
    ctx: HookContext,
    cache: DynamicCache | None,
    positions: Int[Tensor, "batch pos"] | None,
) -> Float[Tensor, "batch d_vocab"]:
    """`TransformerBridge.run_model` with ``logits_to_keep=1``, as HF's generate calls the model.

    Unembedding only the last position saves a ``[batch, prompt, d_vocab]`` matmul at the prefill
    (~4% of a 64-token batch-4 SmolLM2 run) and makes the logits bitwise HF's.
    """
    out = model.run_model(tokens, mask, ctx, past_key_values=cache, position_ids=positions, logits_to_keep=1)
    return out.logits[:, -1]


class _Records:
    """Per-step log-probabilities / top-k / logits, allocated only when asked for."""

    def __init__(self, p: Plan, batch: int, d_vocab: int, device: torch.device) -> None:
        n, k = p.max_new_tokens, p.top_logprobs
        self.logprobs = torch.zeros(batch, n, device=device) if p.record else None
        self.top = (torch.zeros(batch, n, k, device=device), torch.zeros(batch, n, k, dtype=torch.long, device=device))
        self.top = self.top if p.record and k else None
        self.logits = torch.zeros(batch, n, d_vocab, device=device) if p.record and p.output_logits else None

    def add(self, i: int, logits: Float[Tensor, "batch d_vocab"], token: Int[Tensor, " batch"]) -> None:
        if self.logprobs is None:
            return
        logprobs = logits.float().log_softmax(-1)
        self.logprobs[:, i] = logprobs.gather(-1, token[:, None])[:, 0]
        if self.top is not None:
            values, ids = logprobs.topk(self.top[0].shape[-1], dim=-1)
            self.top[0][:, i], self.top[1][:, i] = values, ids
        if self.logits is not None:
            self.logits[:, i] = logits

    def finish(self, out: GenerationOutput) -> GenerationOutput:
        """Crop to the steps run and zero the steps after a row finished."""
        if self.logprobs is None:
            return out
        n = out.sequences.shape[1] - out.prompt_width
        real = out.attention_mask[:, out.prompt_width :].bool()
        out.logprobs = self.logprobs[:, :n] * real
        if self.top is not None:
            out.top_logprobs = self.top[0][:, :n] * real[..., None]
            out.top_tokens = self.top[1][:, :n] * real[..., None]
        if self.logits is not None:
            out.logits = self.logits[:, :n] * real[..., None]
        return out


def _progress(p: Plan) -> AbstractContextManager:
    """The decode steps, wrapped in a progress bar with ``verbose`` (closed even when the loop breaks)."""
    steps = range(p.max_new_tokens)
    if not p.verbose:
        return nullcontext(steps)
    from tqdm.auto import tqdm

    return tqdm(steps, desc="generate", leave=False)


def _eos_ids(model: "TransformerBridge", eos_token_id: int | Sequence[int] | None) -> list[int]:
    d_vocab = model.cfg.d_vocab
    if isinstance(eos_token_id, Tensor):
        eos_token_id = eos_token_id.tolist()
    if eos_token_id is not None:
        ids = [eos_token_id] if _is_int(eos_token_id) else list(eos_token_id)
        for t in ids:
            _check_token("eos_token_id", t, d_vocab)
        return [int(t) for t in ids]
    # The model's own choice, as HF's generate makes it; ids past the vocabulary (a tiny test config
    # keeping GPT-2's 50256) can never be produced, so they are dropped rather than rejected.
    for source in (
        getattr(getattr(model.hf_model, "generation_config", None), "eos_token_id", None),
        getattr(model.hf_model.config, "eos_token_id", None),
        getattr(model.tokenizer, "eos_token_id", None),
    ):
        if source is not None:
            ids = [source] if _is_int(source) else list(source)
            return [int(t) for t in ids if _is_int(t) and 0 <= t < d_vocab]
    return []


def _check_token(name: str, token: object, d_vocab: int) -> None:
    if not _is_int(token) or not 0 <= token < d_vocab:
        raise ValueError(f"`{name}` must be a token id in [0, {d_vocab - 1}] (the vocabulary), got {token!r}.")


def _is_int(value: object) -> bool:
    # Integral admits numpy integers; bool is excluded: `True` as a count or token id is a caller bug.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
