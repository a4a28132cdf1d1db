"""The one token chooser: `Sampler` = processors → the controller's mask → warpers → argmax or draw.

Built once per `generate` call (`build_sampler`, from the options `declare.OPTIONS` declares) and called by
every loop: the tensor driver's eager and compiled steps and `generate_stream` (`choose`), the row driver's
controllers and forced tokens (`process`, `pick`, `warp`), speculative verification for prompt lookup and the
assistant (`verify`), and beam search (`process`, `warp`, `continuations`). A new processor or warper is a
declaration and its implementation; no loop changes.

Example:
    >>> sampler = build_sampler(prompt_width=3, max_new_tokens=8, eos_token_ids=[2], d_vocab=99,
    ...                         device=torch.device("cpu"), options={"repetition_penalty": 1.3})
    >>> token, scores = sampler.choose(logits, tokens, mask)        # greedy: the argmax of the processed scores
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..checks import check_bool
from .builders import BUILDERS, Context
from .declare import PROCESSORS
from .processors import ProcessorList, check_prompt_length, eos_list
from .sampling import draw, warp_logits

Warpers = dict[str, Any]  # `warp_logits`' keyword arguments


@dataclass(frozen=True)
class Sampler:
    """How a token is chosen: processors → mask → warpers (when sampling) → argmax or draw; see the module docstring.

    Attributes:
        greedy: argmax instead of a draw (the warpers are then skipped, as in HF).
        processors: the logits processors, in HF's order.
        warpers: `sampling.warp_logits`' arguments (temperature, top-k, top-p, min-p, typical-p, epsilon, eta).
        generator: the random source of the draws (None: the global RNG, as HF).
        renormalize: HF's ``renormalize_logits``: the final scores are log-softmaxed.
    """

    greedy: bool
    processors: ProcessorList
    warpers: Warpers = field(default_factory=dict)
    generator: torch.Generator | None = None
    renormalize: bool = False

    def process(
        self, tokens: Int[Tensor, "batch pos"], logits: Float[Tensor, "batch d_vocab"], mask: Int[Tensor, "batch pos"]
    ) -> Float[Tensor, "batch d_vocab"]:
        """The processed scores (float32): penalties, bans, biases, the user's processors."""
        scores = logits.float()
        return self.processors(tokens, scores, mask) if self.processors else scores

    def warp(self, scores: Float[Tensor, "batch d_vocab"], keep: int = 1) -> Float[Tensor, "batch d_vocab"]:
        """The scores a draw is made from: the warpers when sampling (``keep``: HF's ``min_tokens_to_keep``),
        then HF's renormalisation if asked. Greedy: the scores as they are (renormalised if asked)."""
        if not self.greedy:
            scores = warp_logits(scores, **self.warpers, keep=keep)
        return scores.log_softmax(-1) if self.renormalize else scores

    def pick(
        self, scores: Float[Tensor, "batch d_vocab"], allowed: Bool[Tensor, "batch d_vocab"] | None = None
    ) -> tuple[Int[Tensor, " batch"], Float[Tensor, "batch d_vocab"]]:
        """`choose` after the processors: mask → warpers → argmax or draw; returns the token and HF's ``scores``."""
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -math.inf)
        scores = self.warp(scores)
        return (scores.argmax(-1) if self.greedy else draw(scores, self.generator)), scores

    def choose(
        self, logits: Float[Tensor, "batch d_vocab"], tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"],
        allowed: Bool[Tensor, "batch d_vocab"] | None = None,
    ) -> tuple[Int[Tensor, " batch"], Float[Tensor, "batch d_vocab"]]:  # fmt: skip
        """The token of each row and the scores it was chosen from (processed, masked to ``allowed``, warped).

        Example:
            >>> token, scores = sampler.choose(logits, tokens, mask)
        """
        return self.pick(self.process(tokens, logits, mask), allowed)

    def verify(
        self, scores: Float[Tensor, " d_vocab"], draft: int | None, allowed: Bool[Tensor, " d_vocab"] | None = None
    ) -> tuple[int, Float[Tensor, " d_vocab"], bool]:
        """The token at one position of a speculative verify chunk, its scores, and whether it is ``draft``.

        ``scores`` are processed. Greedy: the argmax, accepted when it is the draft. Sampling: the draft with
        probability ``p(draft)``, else a draw from ``p`` without it (the standard acceptance rule, which keeps
        the distribution); with no draft (the bonus position after every draft passed) a plain draw.

        Example:
            >>> token, scores, accepted = sampler.verify(processed, draft=17)
        """
        if allowed is not None:
            scores = scores.masked_fill(~allowed.to(scores.device), -torch.inf)
        scores = self.warp(scores[None])[0]
        if self.greedy:
            token = int(scores.argmax(-1))
            return token, scores, token == draft
        if draft is None:
            return int(draw(scores[None], self.generator)[0]), scores, False
        probs = torch.softmax(scores, dim=-1)
        u = torch.rand(1, device=probs.device, generator=self.generator)
        if bool(u < probs[draft]):
            return draft, scores, True
        residual = probs.clone()
        residual[draft] = 0.0
        if not bool(residual.sum() > 0):  # p is one-hot on the draft (u fell on 1.0's rounding): keep it
            return draft, scores, True
        return int(torch.multinomial(residual, 1, generator=self.generator)[0]), scores, False

    def continuations(
        self, scores: Float[Tensor, "batch beams_vocab"], k: int, ranked: bool
    ) -> tuple[Float[Tensor, "batch k"], Int[Tensor, "batch k"]]:
        """Beam search's choice: the ``k`` best continuations over all beams of a prompt (greedy), or ``k`` drawn
        without replacement from their softmax (sampling; ``ranked``: then sorted best first, as HF does from
        transformers 5.24). Returns their scores and flat indices (beam × vocabulary)."""
        if self.greedy:
            return torch.topk(scores, k=k)
        index = torch.multinomial(scores.softmax(-1), k, generator=self.generator)
        top = scores.gather(1, index)
        if ranked:
            top, order = top.sort(dim=-1, descending=True)
            index = index.gather(1, order)
        return top, index


def build_processors(
    *,
    prompt_length: int,
    d_vocab: int | None = None,
    eos_token_id: int | list[int] | None = None,
    max_new_tokens: int = 1 << 30,
    temperature: float = 1.0,
    greedy: bool = True,
    device: torch.device | None = None,
    **options: Any,
) -> ProcessorList:
    """The processors ``options`` (`generate`'s names) ask for, in HF's order; neutral values add nothing.

    ``prompt_length``: the padded prompt width (columns ``>= prompt_length`` are generated). Invalid values raise
    naming the option. `generate` calls this through `build_sampler`.

    Example:
        >>> procs = build_processors(prompt_length=2, eos_token_id=0, min_new_tokens=1, bad_words_ids=[[2]])
        >>> [type(p).__name__ for p in procs]
        ['BadWords', 'MinNewTokens']
    """
    unknown = sorted(set(options) - {o.name for o in PROCESSORS})
    if unknown:
        names = [o.name for o in PROCESSORS]
        raise TypeError(f"build_processors() got {unknown}; it takes the processor options {names}.")
    check_prompt_length(prompt_length)
    if d_vocab is not None and (not isinstance(d_vocab, int) or d_vocab <= 0):
        raise ValueError(f"`d_vocab` must be None or an int > 0 (the logits width), got {d_vocab!r}.")
    eos = [] if eos_token_id is None else eos_list(eos_token_id, d_vocab)
    context = Context(
        prompt_width=prompt_length, max_new_tokens=max_new_tokens, eos_token_ids=eos,
        d_vocab=d_vocab, forced_bos_token_id=options.get("forced_bos_token_id"),
        temperature=temperature, greedy=greedy, device=device or torch.device("cpu"),
    )  # fmt: skip
    processors = ProcessorList()
    for option in PROCESSORS:
        value = options.get(option.name)
        if value is not None:
            processor = BUILDERS[option.name](value, context)
            if processor is not None:
                processors.append(processor)
    return processors


def build_sampler(
    *,
    prompt_width: int,
    max_new_tokens: int,
    eos_token_ids: list[int],
    d_vocab: int,
    device: torch.device,
    options: Mapping[str, Any],
    greedy: bool = True,
    warpers: Warpers | None = None,
    generator: torch.Generator | None = None,
) -> Sampler:
    """The `Sampler` of one `generate` call, from its resolved options (by `generate`'s names).

    Example:
        >>> sampler = build_sampler(prompt_width=3, max_new_tokens=8, eos_token_ids=[2], d_vocab=99,
        ...                         device=torch.device("cpu"), options={"suppress_tokens": [5]})
    """
    warpers = dict(warpers or {})
    processors = build_processors(
        prompt_length=prompt_width, d_vocab=d_vocab, eos_token_id=eos_token_ids, max_new_tokens=max_new_tokens,
        temperature=warpers.get("temperature", 1.0), greedy=greedy, device=device,
        **{o.name: options.get(o.name) for o in PROCESSORS},
    )  # fmt: skip
    renormalize = options.get("renormalize_logits")
    renormalize = False if renormalize is None else check_bool("renormalize_logits", renormalize)
    return Sampler(greedy, processors, warpers, generator, renormalize)


__all__ = ["Sampler", "build_processors", "build_sampler"]
