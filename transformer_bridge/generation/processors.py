"""Logits processors: penalties, bans and biases applied to the next-token scores before the sampling warpers.

Each processor is a small object called as ``processor(input_ids, scores, mask=None) -> scores`` where
``input_ids`` is the whole ``[batch, pos]`` token tensor so far (padded prompt, then generated tokens) and
``mask`` is the attention mask the decode loop feeds the model (1/True for real tokens, 0/False for padding).
Positions where ``mask`` is 0 are invisible to every processor here, so left padding is never penalised,
banned or counted. ``mask=None`` means every position is real, which is HF's behaviour. Processors never
modify their inputs in place.

:func:`sampler.build_processors` turns ``generate`` keyword arguments into a :class:`ProcessorList` in HF's
order (``_get_logits_processor``, declared in `declare.OPTIONS`); HF's own processor classes serve the options
they name (``hf_processors.py``). The warpers of ``sampling.py`` come after the whole list.

Example::

    >>> import torch
    >>> from transformer_bridge.generation.sampler import build_processors
    >>> processors = build_processors(prompt_length=3, repetition_penalty=2.0, logit_bias={4: -1.0})
    >>> input_ids = torch.tensor([[0, 1, 2], [0, 2, 3]])   # row 1 is left-padded with token 0
    >>> mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    >>> processors(input_ids, torch.ones(2, 5), mask)   # the pad's token 0 is not penalised
    tensor([[0.5000, 0.5000, 0.5000, 1.0000, 0.0000],
            [1.0000, 1.0000, 0.5000, 0.5000, 0.0000]])
"""

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..checks import ArgumentTypeError, describe, is_int, is_real

__all__ = [
    "BadWords",
    "FrequencyPresencePenalty",
    "HFProcessor",
    "LogitBias",
    "MinNewTokens",
    "NoRepeatNGram",
    "Processor",
    "ProcessorList",
    "RepetitionPenalty",
]

Mask = Bool[Tensor, "batch pos"] | Int[Tensor, "batch pos"]
# ``processor(input_ids, scores, mask=None) -> scores``
Processor = Callable[..., Tensor]


class RepetitionPenalty:
    """HF's repetition penalty: for every token present in the sequence (prompt included), divide a positive
    score by ``penalty`` and multiply a negative one by it. Applied once per token, however often it occurs.

    Example::

        >>> import torch
        >>> RepetitionPenalty(2.0)(torch.tensor([[1]]), torch.tensor([[1.0, 1.0, -1.0]]))
        tensor([[ 1.0000,  0.5000, -1.0000]])
    """

    def __init__(self, penalty: float):
        if not is_real(penalty) or not math.isfinite(penalty) or penalty <= 0:
            error = ValueError if is_real(penalty) else ArgumentTypeError
            raise error(
                f"`repetition_penalty` must be a finite float > 0, got {describe(penalty)}. "
                "1.0 means no penalty, > 1 discourages repetition, < 1 encourages it."
            )
        self.penalty = float(penalty)

    def __call__(
        self,
        input_ids: Int[Tensor, "batch pos"],
        scores: Float[Tensor, "batch d_vocab"],
        mask: Mask | None = None,
    ) -> Float[Tensor, "batch d_vocab"]:
        present = _token_counts(input_ids, mask, scores.shape[-1], torch.bool)
        penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(present, penalised, scores)


class FrequencyPresencePenalty:
    """OpenAI's penalties: ``score - frequency_penalty * count - presence_penalty * (count > 0)``.

    ``count`` is how often the token occurs among the *generated* tokens (positions ``>= prompt_length``), as
    in the OpenAI API and vLLM; the prompt is not counted (use :class:`RepetitionPenalty` to include it).

    Example::

        >>> import torch
        >>> p = FrequencyPresencePenalty(frequency_penalty=0.5, presence_penalty=1.0, prompt_length=1)
        >>> p(torch.tensor([[2, 1, 1]]), torch.zeros(1, 3))
        tensor([[ 0., -2.,  0.]])
    """

    def __init__(self, frequency_penalty: float, presence_penalty: float, prompt_length: int):
        for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            if not is_real(value) or not math.isfinite(value):
                error = ValueError if is_real(value) else ArgumentTypeError
                raise error(
                    f"`{name}` must be a finite float, got {describe(value)}. 0 disables it; OpenAI accepts [-2, 2]."
                )
        check_prompt_length(prompt_length)
        self.frequency_penalty = float(frequency_penalty)
        self.presence_penalty = float(presence_penalty)
        self.prompt_length = prompt_length

    def __call__(
        self,
        input_ids: Int[Tensor, "batch pos"],
        scores: Float[Tensor, "batch d_vocab"],
        mask: Mask | None = None,
    ) -> Float[Tensor, "batch d_vocab"]:
        generated = input_ids[:, self.prompt_length :]
        if generated.shape[1] == 0:
            return scores
        generated_mask = None if mask is None else mask[:, self.prompt_length :]
        counts = _token_counts(generated, generated_mask, scores.shape[-1], scores.dtype)
        if self.frequency_penalty:
            scores = scores - self.frequency_penalty * counts
        if self.presence_penalty:
            scores = scores - self.presence_penalty * (counts > 0).to(scores.dtype)
        return scores


class NoRepeatNGram:
    """HF's no-repeat n-gram rule: ban every token that would complete an n-gram already present in the
    sequence (prompt included). N-grams touching a masked position do not count.

    Example::

        >>> import torch
        >>> NoRepeatNGram(2)(torch.tensor([[1, 2, 1]]), torch.zeros(1, 3))
        tensor([[0., 0., -inf]])
    """

    def __init__(self, ngram_size: int):
        if not is_int(ngram_size) or ngram_size <= 0:
            error = ValueError if is_int(ngram_size) else ArgumentTypeError
            raise error(
                f"`no_repeat_ngram_size` must be an int > 0, got {describe(ngram_size)}. "
                "Use `no_repeat_ngram_size=0` (or None) in `build_processors` to disable it."
            )
        self.ngram_size = ngram_size

    def __call__(
        self,
        input_ids: Int[Tensor, "batch pos"],
        scores: Float[Tensor, "batch d_vocab"],
        mask: Mask | None = None,
    ) -> Float[Tensor, "batch d_vocab"]:
        n, pos = self.ngram_size, input_ids.shape[1]
        if pos < n:
            return scores
        # Only n-grams starting with the current (n-1)-token suffix can be completed by the next token: match
        # that suffix against every window and ban the window's last token (HF's vectorised formulation).
        suffix = input_ids[:, pos + 1 - n :]
        windows = input_ids.unfold(1, n, 1)
        matches = (windows[..., :-1] == suffix.unsqueeze(1)).all(dim=-1)
        if mask is not None:
            real = mask.bool()
            matches &= real.unfold(1, n, 1).all(dim=-1) & real[:, pos + 1 - n :].all(dim=-1, keepdim=True)
        d_vocab = scores.shape[-1]
        # Non-matching windows (and ids past the logits, possible when the embedding is larger) write to a
        # spare column that is dropped.
        targets = torch.where(matches, windows[..., -1].clamp(max=d_vocab), d_vocab)
        banned = scores.new_zeros((scores.shape[0], d_vocab + 1), dtype=torch.bool).scatter_(1, targets, True)
        return scores.masked_fill(banned[:, :d_vocab], -math.inf)


class BadWords:
    """HF's ``bad_words_ids``: a single-token entry is always banned; a multi-token entry bans its last token
    when the sequence ends with the rest of it (all of those positions real). Unlike HF's ``generate``, an
    entry that is exactly an EOS id is banned too: we do what was asked.

    Example::

        >>> import torch
        >>> BadWords([[0], [1, 2]])(torch.tensor([[1], [2]]), torch.zeros(2, 3))
        tensor([[-inf, 0., -inf],
                [-inf, 0., 0.]])
    """

    def __init__(self, bad_words_ids: Sequence[Sequence[int]], d_vocab: int | None = None):
        if isinstance(bad_words_ids, (str, bytes)) or not isinstance(bad_words_ids, Sequence):
            raise ArgumentTypeError(
                f"`bad_words_ids` must be a list of token-id lists, got {describe(bad_words_ids)}. "
                "Example: `bad_words_ids=[[42], [7, 9]]` bans token 42 and token 9 right after token 7."
            )
        for word in bad_words_ids:
            if isinstance(word, (str, bytes)) or not isinstance(word, Sequence) or len(word) == 0:
                is_list = isinstance(word, Sequence) and not isinstance(word, (str, bytes))
                raise (ValueError if is_list else ArgumentTypeError)(
                    f"`bad_words_ids` must be a list of non-empty token-id lists, got the entry {describe(word)}. "
                    "Tokenize banned words with `tokenizer(words, add_special_tokens=False).input_ids`."
                )
            for token in word:
                _check_token_id("bad_words_ids", token, d_vocab)
        words = {tuple(int(t) for t in word) for word in bad_words_ids}
        self._single = sorted(word[0] for word in words if len(word) == 1)
        by_prefix_length: dict[int, list[tuple[int, ...]]] = {}
        for word in sorted(w for w in words if len(w) > 1):
            by_prefix_length.setdefault(len(word) - 1, []).append(word)
        self._multi = sorted(by_prefix_length.items())
        self._cache: dict[tuple[torch.device, int], tuple[Tensor, list[tuple[Tensor, Tensor]]]] = {}

    def __call__(
        self,
        input_ids: Int[Tensor, "batch pos"],
        scores: Float[Tensor, "batch d_vocab"],
        mask: Mask | None = None,
    ) -> Float[Tensor, "batch d_vocab"]:
        d_vocab = scores.shape[-1]
        single, multi = self._tensors(scores.device, d_vocab)
        banned = single.expand(scores.shape[0], d_vocab + 1)
        real = None if mask is None else mask.bool()
        for prefixes, last_tokens in multi:
            length = prefixes.shape[1]
            if length > input_ids.shape[1]:
                continue
            matches = (input_ids[:, None, -length:] == prefixes).all(dim=-1)
            if real is not None:
                matches &= real[:, -length:].all(dim=-1, keepdim=True)
            targets = torch.where(matches, last_tokens, d_vocab)
            banned = banned.scatter(1, targets, True)
        return scores.masked_fill(banned[:, :d_vocab], -math.inf)

    def _tensors(self, device: torch.device, d_vocab: int) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        # Built once per device so a decode step does no host-to-device copies.
        key = (device, d_vocab)
        if key not in self._cache:
            for token in self._single + [t for _, words in self._multi for w in words for t in w]:
                _check_token_id("bad_words_ids", token, d_vocab)
            single = torch.zeros(d_vocab + 1, dtype=torch.bool, device=device)
            single[self._single] = True
            multi = [
                (
                    torch.tensor([w[:-1] for w in words], device=device),
                    torch.tensor([w[-1] for w in words], device=device),
                )
                for _, words in self._multi
            ]
            self._cache[key] = (single, multi)
        return self._cache[key]


class LogitBias:
    """OpenAI-style ``logit_bias``: add ``bias[token]`` to that token's score at every step.

    This is HF's ``SequenceBiasLogitsProcessor`` restricted to single tokens. ``-inf`` bans a token; ``+inf``
    and NaN are rejected.

    Example::

        >>> import torch
        >>> LogitBias({0: 2.0, 2: -1.0})(torch.tensor([[1]]), torch.zeros(1, 3))
        tensor([[ 2.,  0., -1.]])
    """

    def __init__(self, logit_bias: Mapping[int, float], d_vocab: int | None = None):
        if not isinstance(logit_bias, Mapping):
            raise ArgumentTypeError(
                f"`logit_bias` must be a dict mapping token id to bias, got {describe(logit_bias)}. "
                "Example: `logit_bias={50256: -100.0}`."
            )
        for token, bias in logit_bias.items():
            _check_token_id("logit_bias", token, d_vocab)
            if not is_real(bias) or math.isnan(bias) or bias == math.inf:
                error = ValueError if is_real(bias) else ArgumentTypeError
                raise error(
                    f"`logit_bias` values must be floats (finite or -inf), got {describe(bias)} for token {token}."
                )
        self.logit_bias = {int(t): float(b) for t, b in logit_bias.items()}
        self._cache: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}

    def __call__(
        self,
        input_ids: Int[Tensor, "batch pos"],
        scores: Float[Tensor, "batch d_vocab"],
        mask: Mask | None = None,
    ) -> Float[Tensor, "batch d_vocab"]:
        key = (scores.device, scores.dtype, scores.shape[-1])
        if key not in self._cache:
            for token in self.logit_bias:
                _check_token_id("logit_bias", token, scores.shape[-1])
            bias = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
            values = torch.tensor(list(self.logit_bias.values()), dtype=scores.dtype, device=scores.device)
            bias[list(self.logit_bias)] = values
            self._cache[key] = bias
        return scores + self._cache[key]


class MinNewTokens:
    """Forbid EOS (score ``-inf``) until ``min_new_tokens`` tokens were generated after the prompt.

    The step count is ``input_ids.shape[1] - prompt_length``, as in HF's
    ``MinNewTokensLengthLogitsProcessor``; ``prompt_length`` is the padded prompt width, the same for every
    row.

    Example::

        >>> import torch
        >>> MinNewTokens(2, eos_token_id=0, prompt_length=1)(torch.tensor([[5, 3]]), torch.zeros(1, 3))
        tensor([[-inf, 0., 0.]])
    """

    def __init__(self, min_new_tokens: int, eos_token_id: int | Sequence[int], prompt_length: int):
        if not is_int(min_new_tokens) or min_new_tokens < 0:
            error = ValueError if is_int(min_new_tokens) else ArgumentTypeError
            raise error(f"`min_new_tokens` must be an int >= 0, got {describe(min_new_tokens)}.")
        check_prompt_length(prompt_length)
        self.min_new_tokens = min_new_tokens
        self.eos_token_ids = eos_list(eos_token_id, None)
        self.prompt_length = prompt_length
        self._cache: dict[tuple[torch.device, int], Tensor] = {}

    def __call__(
        self,
        input_ids: Int[Tensor, "batch pos"],
        scores: Float[Tensor, "batch d_vocab"],
        mask: Mask | None = None,
    ) -> Float[Tensor, "batch d_vocab"]:
        if input_ids.shape[1] - self.prompt_length >= self.min_new_tokens:
            return scores
        key = (scores.device, scores.shape[-1])
        if key not in self._cache:
            # EOS ids past the logits cannot be generated anyway (HF ignores them the same way).
            is_eos = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
            is_eos[[t for t in self.eos_token_ids if t < scores.shape[-1]]] = True
            self._cache[key] = is_eos
        return scores.masked_fill(self._cache[key], -math.inf)


class HFProcessor:
    """Adapter for a user's HuggingFace ``LogitsProcessor`` (or any ``f(input_ids, scores) -> scores``).

    HF processors know nothing of ``mask``: they see the padded ``input_ids``, pad tokens included, exactly as
    inside HF's ``generate``.

    Example::

        >>> import torch
        >>> from transformers import SuppressTokensLogitsProcessor
        >>> HFProcessor(SuppressTokensLogitsProcessor([1]))(torch.tensor([[0]]), torch.zeros(1, 3))
        tensor([[0., -inf, 0.]])
    """

    def __init__(self, processor: Callable[[Tensor, Tensor], Tensor], index: int = 0, name: str | None = None):
        self.name = name or f"`logits_processor`[{index}]"
        if not callable(processor):
            raise ArgumentTypeError(
                f"{self.name} must be a callable `(input_ids, scores) -> scores`, got {describe(processor)}."
            )
        self.processor = processor

    def __call__(
        self,
        input_ids: Int[Tensor, "batch pos"],
        scores: Float[Tensor, "batch d_vocab"],
        mask: Mask | None = None,
    ) -> Float[Tensor, "batch d_vocab"]:
        out = self.processor(input_ids, scores)
        # Metadata only (no device sync): a wrong answer fails here, naming the processor, not deep in torch.
        if not isinstance(out, Tensor) or not out.is_floating_point() or out.device != scores.device:
            raise ArgumentTypeError(
                f"{self.name} ({_name(self.processor)}) must return the scores as a float tensor on "
                f"{scores.device} shaped like its input {tuple(scores.shape)}, got {describe(out)}"
                f"{'' if not isinstance(out, Tensor) else f' on {out.device}'}. Return the modified `scores`."
            )
        if out.shape != scores.shape:
            raise ValueError(
                f"{self.name} ({_name(self.processor)}) must return scores of shape {tuple(scores.shape)} "
                f"[batch, d_vocab], got {describe(out)}. Mask tokens with -inf rather than dropping them."
            )
        return out


class ProcessorList(list):
    """An ordered list of processors, itself a processor: each one gets the previous one's scores.

    Example::

        >>> import torch
        >>> processors = ProcessorList([LogitBias({0: 1.0}), RepetitionPenalty(2.0)])
        >>> processors(torch.tensor([[0]]), torch.zeros(1, 2))
        tensor([[0.5000, 0.0000]])
    """

    def __call__(
        self,
        input_ids: Int[Tensor, "batch pos"],
        scores: Float[Tensor, "batch d_vocab"],
        mask: Mask | None = None,
    ) -> Float[Tensor, "batch d_vocab"]:
        for processor in self:
            scores = processor(input_ids, scores, mask)
        return scores


class HFProcessors(ProcessorList):
    """The user's ``logits_processor`` list (HF ``LogitsProcessor`` objects or callables), each checked per step."""

    @classmethod
    def of(cls, logits_processor: object) -> "HFProcessors | None":
        """The list's processors, or None for an empty or absent list; raises naming ``logits_processor``."""
        if logits_processor is None:
            return None
        if not isinstance(logits_processor, Sequence):
            wrap = " Wrap a single processor in a list: `[processor]`." if callable(logits_processor) else ""
            raise ArgumentTypeError(
                f"`logits_processor` must be a list (or HF `LogitsProcessorList`) of processors, "
                f"got {describe(logits_processor)}.{wrap}"
            )
        return cls(HFProcessor(p, i) for i, p in enumerate(logits_processor)) or None


def _token_counts(
    input_ids: Int[Tensor, "batch pos"], mask: Mask | None, d_vocab: int, dtype: torch.dtype
) -> Float[Tensor, "batch d_vocab"]:
    # Masked positions and ids past the logits (the embedding can be larger than the unembedding) are sent to
    # a spare column that is dropped, so they are never counted.
    ids = input_ids.clamp(max=d_vocab)
    if mask is not None:
        ids = ids.masked_fill(~mask.bool(), d_vocab)
    counts = torch.zeros((ids.shape[0], d_vocab + 1), dtype=dtype, device=ids.device)
    if dtype == torch.bool:
        counts.scatter_(1, ids, True)
    else:
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))
    return counts[:, :d_vocab]


def _name(fn: object) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _check_token_id(name: str, token: object, d_vocab: int | None) -> None:
    if not is_int(token) or token < 0 or (d_vocab is not None and token >= d_vocab):
        allowed = "an int >= 0" if d_vocab is None else f"an int in [0, {d_vocab})"
        error = ValueError if is_int(token) else ArgumentTypeError
        raise error(f"`{name}` token ids must be {allowed}, got {describe(token)}.")


def check_prompt_length(prompt_length: object) -> None:
    if not is_int(prompt_length) or prompt_length < 0:
        raise ValueError(f"`prompt_length` must be an int >= 0 (the padded prompt width), got {prompt_length!r}.")


def eos_list(eos_token_id: int | Sequence[int], d_vocab: int | None) -> list[int]:
    ids = [eos_token_id] if is_int(eos_token_id) else eos_token_id
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ArgumentTypeError(f"`eos_token_id` must be an int or a list of ints, got {describe(eos_token_id)}.")
    for token in ids:
        _check_token_id("eos_token_id", token, d_vocab)
    return [int(t) for t in ids]
