"""Pure logits → token functions: the sampling warpers and the final draw.

Everything here is a function of a ``[batch, d_vocab]`` logits tensor; there is no model, no state and no
use of the global RNG. The warpers follow HuggingFace's (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``, ``TypicalLogitsWarper``, ``EpsilonLogitsWarper``,
``EtaLogitsWarper``; ``min_tokens_to_keep`` is ``keep``: 1, or HF's EOS count + 1 in beam sampling) value for
value, and run in the order HF's ``_get_logits_processor`` builds them::

    temperature → top-k → top-p → min-p → typical-p → epsilon → eta → softmax → torch.multinomial

Logits processors (penalties, bans, biases; see ``processors.py``) run *before* all of these. Arguments are
checked once, before the decode loop, by :func:`validate_sampling_args`; :func:`sample` does not re-check them
so a decode step stays a handful of tensor ops.

Example::

    >>> import torch
    >>> from transformer_bridge.generation.sampling import sample, validate_sampling_args
    >>> logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    >>> validate_sampling_args(temperature=0.7, top_k=3, top_p=0.9)
    >>> g = torch.Generator().manual_seed(0)
    >>> sample(logits, temperature=0.7, top_k=3, top_p=0.9, generator=g).shape
    torch.Size([1])
    >>> sample(logits, temperature=0.0).tolist()
    [0]
"""

import math
from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..checks import ArgumentTypeError, check_int, describe, is_real

__all__ = ["draw", "greedy", "sample", "validate_sampling_args", "warp_logits"]

_FILTER_VALUE = -math.inf


def validate_sampling_args(
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    typical_p: float | None = None,
    epsilon_cutoff: float | None = None,
    eta_cutoff: float | None = None,
) -> None:
    """Raise ``ValueError`` naming the first invalid sampling argument; return ``None`` when all are valid.

    A wrong type raises `ArgumentTypeError` (a ``TypeError`` that is also a ``ValueError``).

    Call it once before the decode loop: :func:`sample` and :func:`warp_logits` trust their arguments.

    Valid values: ``temperature`` finite and ``>= 0`` (0 means greedy); ``top_k`` ``None`` or an int ``>= 0``
    (0 and ``None`` disable it); ``top_p`` ``None`` or in ``(0, 1]``; ``min_p`` ``None`` or in ``[0, 1]``;
    ``typical_p`` ``None`` or in ``(0, 1]`` (1 disables top-p and typical-p); ``epsilon_cutoff`` and
    ``eta_cutoff`` ``None`` or in ``[0, 1)`` (0 disables them, as in HF).

    Example::

        >>> validate_sampling_args(temperature=0.8, top_p=0.95)
        >>> validate_sampling_args(top_p=0.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `top_p` must be a float in (0, 1], got 0.0. ...
    """
    _check_real("temperature", temperature, "a finite float >= 0", lambda t: math.isfinite(t) and t >= 0,
                "Use `temperature=0` for greedy decoding and 1.0 to leave the logits unscaled.")  # fmt: skip
    if top_k is not None:
        check_int("top_k", top_k, minimum=0, hint="Use `top_k=None` (or 0) to disable top-k.")
    if top_p is not None:
        _check_real("top_p", top_p, "a float in (0, 1]", lambda p: 0 < p <= 1,
                    "Use `top_p=None` (or 1.0) to disable nucleus sampling.")  # fmt: skip
    if min_p is not None:
        _check_real("min_p", min_p, "a float in [0, 1]", lambda p: 0 <= p <= 1,
                    "Use `min_p=None` (or 0.0) to disable min-p.")  # fmt: skip
    if typical_p is not None:
        _check_real("typical_p", typical_p, "a float in (0, 1]", lambda p: 0 < p <= 1,
                    "Use `typical_p=None` (or 1.0) to disable typical sampling.")  # fmt: skip
    for name, value in (("epsilon_cutoff", epsilon_cutoff), ("eta_cutoff", eta_cutoff)):
        if value is not None:
            _check_real(name, value, "a float in [0, 1)", lambda p: 0 <= p < 1,
                        f"Typical values are 3e-4 to 2e-3; `{name}=None` (or 0.0) disables it.")  # fmt: skip


def _check_real(name: str, value: object, allowed: str, valid: Callable[[float], bool], hint: str) -> None:
    """`ArgumentTypeError` for a non-number, `ValueError` for a number outside ``allowed`` (NaN included)."""
    if not is_real(value):
        raise ArgumentTypeError(f"`{name}` must be {allowed}, got {describe(value)}. {hint}")
    if not valid(float(value)):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}. {hint}")


def warp_logits(
    logits: Float[Tensor, "batch d_vocab"],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    typical_p: float | None = None,
    epsilon_cutoff: float | None = None,
    eta_cutoff: float | None = None,
    keep: int = 1,
) -> Float[Tensor, "batch d_vocab"]:
    """Apply the sampling warpers and return the scores ``sample`` draws from (removed tokens are ``-inf``).

    ``softmax`` of the result is the distribution :func:`sample` draws from. Order and semantics are HF's:

    * ``temperature``: divide by it; ``0`` keeps only the first argmax (a one-hot distribution), 1 is a no-op.
    * ``top_k``: remove tokens scoring strictly below the k-th highest score, so ties with the k-th are kept.
    * ``top_p``: sort ascending, remove tokens whose inclusive cumulative probability is ``<= 1 - top_p``; the
      kept set is the smallest set of most likely tokens with mass ``>= top_p`` (the top token always stays).
    * ``min_p``: remove tokens with probability ``< min_p * max_prob`` (probabilities after the steps above).
    * ``typical_p``: keep the tokens whose surprisal is closest to the entropy until their mass reaches
      ``typical_p`` (HF applies it after min-p, and so do we).
    * ``epsilon_cutoff``: remove tokens with probability ``< epsilon_cutoff`` (truncation sampling).
    * ``eta_cutoff``: remove tokens with probability ``< min(eta, sqrt(eta) * exp(-entropy))``.

    Each filter keeps at least ``keep`` tokens (HF's ``min_tokens_to_keep``: 1, or its EOS count + 1 when
    sampling beams). Half-precision logits are upcast to float32 first, as HF's ``generate`` does, so the
    thresholds do not suffer bf16 rounding. The input is never modified.

    Example::

        >>> import torch
        >>> warp_logits(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), top_k=2)
        tensor([[3., 2., -inf, -inf]])
    """
    scores = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature == 0:
        keep_mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.argmax(-1, keepdim=True), True)
        return scores.masked_fill(~keep_mask, _FILTER_VALUE)
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:  # None and 0 both mean "off", as in HF
        scores = _top_k(scores, max(top_k, keep))
    if top_p is not None and top_p < 1.0:
        scores = _top_p(scores, top_p, keep)
    if min_p:  # min_p=0 removes nothing, so skipping it is exact
        scores = _min_p(scores, min_p, keep)
    if typical_p is not None and typical_p < 1.0:
        scores = _typical(scores, typical_p, keep)
    if epsilon_cutoff:
        scores = _epsilon(scores, epsilon_cutoff, keep)
    if eta_cutoff:
        scores = _eta(scores, eta_cutoff, keep)
    return scores


def greedy(logits: Float[Tensor, "batch d_vocab"]) -> Int[Tensor, " batch"]:
    """Return the highest-scoring token per row (the first one on ties, like ``torch.argmax``).

    Example::

        >>> import torch
        >>> greedy(torch.tensor([[0.1, 2.0, -1.0], [5.0, 0.0, 5.0]])).tolist()
        [1, 0]
    """
    return logits.argmax(dim=-1)


def sample(
    logits: Float[Tensor, "batch d_vocab"],
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    typical_p: float | None = None,
    generator: torch.Generator | None = None,
    *,
    epsilon_cutoff: float | None = None,
    eta_cutoff: float | None = None,
) -> Int[Tensor, " batch"]:
    """Draw one token per row from the warped distribution (see :func:`warp_logits` for order and semantics).

    ``temperature == 0`` short-circuits to :func:`greedy` and consumes no randomness. Otherwise the draw is
    ``torch.multinomial(softmax(warp_logits(...)), 1, generator=generator)``, exactly HF's sampling step, so
    with ``generator`` the global RNG state is left untouched and the same seed gives the same tokens. The
    generator must live on the logits' device. Arguments are not validated here; call
    :func:`validate_sampling_args` once before the loop.

    Example::

        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> sample(torch.tensor([[0.0, 9.0, 0.0]]), top_k=1, generator=g).tolist()
        [1]
    """
    if temperature == 0:
        return greedy(logits)
    return draw(warp_logits(logits, temperature, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff), generator)


def draw(scores: Float[Tensor, "batch d_vocab"], generator: torch.Generator | None = None) -> Int[Tensor, " batch"]:
    """Draw one token per row from ``softmax(scores)``: HF's draw (``torch.multinomial``, one sample).

    The decode loop calls ``draw(warp_logits(...))``, which is :func:`sample` keeping the warped scores
    (HF's ``output_scores``). ``generator=None`` uses the global RNG exactly as HF's ``generate`` does.

    Example::

        >>> import torch
        >>> draw(torch.tensor([[0.0, -math.inf, -math.inf]])).tolist()
        [0]
    """
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(-1)


def _top_k(scores: Float[Tensor, "batch d_vocab"], top_k: int) -> Float[Tensor, "batch d_vocab"]:
    if top_k >= scores.shape[-1]:
        return scores
    kth_best = torch.topk(scores, top_k).values[..., -1:]
    return scores.masked_fill(scores < kth_best, _FILTER_VALUE)


def _top_p(scores: Float[Tensor, "batch d_vocab"], top_p: float, keep: int = 1) -> Float[Tensor, "batch d_vocab"]:
    # Same ops as HF (ascending sort, ``<= 1 - top_p``): which of several tied tokens at the nucleus edge is
    # dropped depends on the sort order, so anything else would disagree with HF on ties.
    sorted_scores, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative <= (1 - top_p)
    sorted_remove[..., -keep:] = False
    remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, _FILTER_VALUE)


def _min_p(scores: Float[Tensor, "batch d_vocab"], min_p: float, keep: int = 1) -> Float[Tensor, "batch d_vocab"]:
    probs = torch.softmax(scores, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    if keep > 1:  # min_p <= 1 always keeps the top token (x * min_p <= x in floating point too)
        remove.scatter_(-1, torch.topk(probs, min(keep, probs.shape[-1]), dim=-1).indices, False)
    return scores.masked_fill(remove, _FILTER_VALUE)


def _typical(scores: Float[Tensor, "batch d_vocab"], mass: float, keep: int = 1) -> Float[Tensor, "batch d_vocab"]:
    log_probs = torch.log_softmax(scores, dim=-1)
    # nansum: removed tokens contribute -inf * 0 = nan, which must count as zero entropy.
    entropy = -(log_probs * log_probs.exp()).nansum(-1, keepdim=True)
    surprise_gap = (-log_probs - entropy).abs()
    sorted_gap, sorted_indices = torch.sort(surprise_gap, descending=False)
    cumulative = scores.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
    last_kept = (cumulative < mass).sum(dim=-1, keepdim=True).clamp_(max=scores.shape[-1] - 1)
    sorted_remove = sorted_gap > sorted_gap.gather(-1, last_kept)
    sorted_remove[..., :keep] = False
    remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, _FILTER_VALUE)


def _keep_top(scores: Float[Tensor, "batch d_vocab"], remove: Tensor, keep: int) -> Float[Tensor, "batch d_vocab"]:
    """``remove`` spares the ``keep`` best scores (and their ties), as HF's epsilon and eta warpers do."""
    kth_best = torch.topk(scores, min(keep, scores.shape[-1])).values[..., -1:]
    return scores.masked_fill(remove & (scores < kth_best), _FILTER_VALUE)


def _epsilon(scores: Float[Tensor, "batch d_vocab"], epsilon: float, keep: int = 1) -> Float[Tensor, "batch d_vocab"]:
    return _keep_top(scores, scores.softmax(dim=-1) < epsilon, keep)


def _eta(scores: Float[Tensor, "batch d_vocab"], eta: float, keep: int = 1) -> Float[Tensor, "batch d_vocab"]:
    epsilon = torch.tensor(eta, device=scores.device)  # HF's float32 threshold, computed the same way
    entropy = torch.distributions.Categorical(logits=scores).entropy()
    threshold = torch.min(epsilon, torch.sqrt(epsilon) * torch.exp(-entropy))[..., None]
    return _keep_top(scores, scores.softmax(dim=-1) < threshold, keep)
