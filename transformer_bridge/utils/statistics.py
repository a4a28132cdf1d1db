"""Statistics over a per-example axis, with TransformerLens 4.3's names and seeding: standard error, percentile
bootstrap, sign-flip permutation p-value, and an exact (Clopper-Pearson) interval for a success rate."""

import hashlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from ..checks import ArgumentTypeError, ArgumentValueError, describe

_ALTERNATIVES = ("two-sided", "greater", "less")
_STATISTICS = ("mean", "median")


def derive_generator(seed: int, *labels: object) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``labels`` through SHA-256 (the same stream in every process,
    and the same as TransformerLens derives).

    Example:
        >>> a, b = derive_generator(0, "metric"), derive_generator(0, "metric")
        >>> torch.equal(torch.rand(2, generator=a), torch.rand(2, generator=b))
        True
    """
    key = ":".join([str(seed), *map(str, labels)]).encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)  # torch's int64 range
    return torch.Generator(device="cpu").manual_seed(seed)


def _last(x: Tensor, dim: int, name: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ArgumentTypeError(f"`{name}` must be a floating-point tensor, got {describe(x)}.")
    if x.dim() == 0 or x.shape[dim] == 0:
        raise ArgumentValueError(f"`{name}` needs a non-empty axis `dim`={dim}, got shape {tuple(x.shape)}.")
    return x.movedim(dim, -1)


def standard_error(x: Float[Tensor, "..."], *, dim: int = -1) -> Float[Tensor, "..."]:
    """Standard error of the mean along ``dim`` (unbiased standard deviation / √n), n ≥ 2.

    Example:
        >>> standard_error(torch.tensor([1.0, 3.0]))
        tensor(1.)
    """
    values = _last(x, dim, "x")
    if values.shape[-1] < 2:
        raise ArgumentValueError(f"A standard error needs at least 2 values along `dim`={dim}, got {values.shape[-1]}.")
    return values.std(dim=-1, unbiased=True) / math.sqrt(values.shape[-1])


def bootstrap_ci(
    x: Float[Tensor, "..."],
    *,
    dim: int = -1,
    statistic: str = "mean",
    confidence: float = 0.95,
    n_resamples: int = 1000,
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
) -> tuple[Float[Tensor, "..."], Float[Tensor, "..."]]:
    """Percentile bootstrap interval ``(low, high)`` of the mean or median along ``dim`` (removed), from
    ``n_resamples`` resamples drawn ``chunk_size`` at a time with ``generator`` (``derive_generator(0)``).

    Example:
        >>> low, high = bootstrap_ci(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        >>> bool(1.0 <= low <= 2.5 <= high <= 4.0)
        True
    """
    if statistic not in _STATISTICS:
        raise ArgumentValueError(f"`statistic` must be one of {_STATISTICS}, got {statistic!r}.")
    if not 0.0 < confidence < 1.0:
        raise ArgumentValueError(f"`confidence` must be in (0, 1), got {confidence!r}.")
    if n_resamples < 1 or chunk_size < 1:
        raise ArgumentValueError(f"`n_resamples` and `chunk_size` must be >= 1, got {n_resamples}, {chunk_size}.")
    values = _last(x, dim, "x")
    n = values.shape[-1]
    generator = generator if generator is not None else derive_generator(0)
    draws = []
    for start in range(0, n_resamples, chunk_size):
        picks = torch.randint(0, n, (min(chunk_size, n_resamples - start), n), generator=generator)
        sample = values[..., picks.to(values.device)]  # [..., count, n]
        draws.append(sample.mean(dim=-1) if statistic == "mean" else sample.median(dim=-1).values)
    stats = torch.cat(draws, dim=-1).to(torch.promote_types(x.dtype, torch.float32))
    tail = (1.0 - confidence) / 2.0
    return torch.quantile(stats, tail, dim=-1).to(x.dtype), torch.quantile(stats, 1.0 - tail, dim=-1).to(x.dtype)


def sign_flip_permutation_pvalue(
    effects: Float[Tensor, "..."],
    *,
    dim: int = -1,
    n_permutations: int = 1000,
    generator: torch.Generator | None = None,
    alternative: str = "two-sided",
    exact_max_n: int = 12,
) -> Float[Tensor, "..."]:
    """P-value that the mean effect along ``dim`` (removed) is zero, by flipping signs: all ``2**n`` patterns
    when ``n <= exact_max_n`` (exact), else ``n_permutations`` random ones, ``(hits + 1) / (n_permutations + 1)``.
    A null mean within a relative 100 eps of the observed one counts as a hit (summation-order ties).

    Example:
        >>> float(sign_flip_permutation_pvalue(torch.tensor([1.0, 1.0, 1.0])))  # 2 of 8 patterns reach |mean| 1
        0.25
    """
    if alternative not in _ALTERNATIVES:
        raise ArgumentValueError(f"`alternative` must be one of {_ALTERNATIVES}, got {alternative!r}.")
    if n_permutations < 1:
        raise ArgumentValueError(f"`n_permutations` must be >= 1, got {n_permutations!r}.")
    values = _last(effects, dim, "effects").to(torch.promote_types(effects.dtype, torch.float32))
    n = values.shape[-1]
    observed = values.mean(dim=-1, keepdim=True)
    tolerance = observed.abs() * (100 * torch.finfo(values.dtype).eps)
    hit: Callable[[Tensor], Tensor] = {
        "two-sided": lambda null: null.abs() >= observed.abs() - tolerance,
        "greater": lambda null: null >= observed - tolerance,
        "less": lambda null: null <= observed + tolerance,
    }[alternative]

    def hits(signs: Tensor) -> Tensor:
        return hit((values.unsqueeze(-2) * signs).mean(dim=-1)).sum(dim=-1).to(values.dtype)

    if n <= exact_max_n:
        signs = torch.tensor(list(itertools.product((1.0, -1.0), repeat=n)), dtype=values.dtype, device=values.device)
        return hits(signs) / signs.shape[0]
    generator = generator if generator is not None else derive_generator(0)
    total = torch.zeros(values.shape[:-1], dtype=values.dtype, device=values.device)
    for start in range(0, n_permutations, 256):
        flips = torch.randint(0, 2, (min(256, n_permutations - start), n), generator=generator)
        total = total + hits(flips.to(values.device).to(values.dtype) * 2 - 1)
    return (total + 1.0) / (n_permutations + 1.0)


@dataclass(frozen=True)
class SuccessRateInterval:
    """A success rate with its exact Clopper-Pearson interval and the counts behind it."""

    point_estimate: float
    ci_low: float
    ci_high: float
    n_trials: int
    n_successes: int
    confidence: float


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """``P(X <= k)`` for ``X ~ Binomial(n, p)``, summed in log space (no overflow or underflow at large n)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    logs = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in range(k + 1)
    ]
    top = max(logs)
    return min(1.0, math.exp(top) * math.fsum(math.exp(v - top) for v in logs))


def _bisect(too_low: Callable[[float], bool]) -> float:
    """The point in [0, 1] where ``too_low`` turns from True to False, to float precision."""
    low, high = 0.0, 1.0
    while (mid := (low + high) / 2.0) not in (low, high):
        low, high = (mid, high) if too_low(mid) else (low, mid)
    return (low + high) / 2.0


def success_rate_ci(successes: Sequence[bool], *, confidence: float = 0.95) -> SuccessRateInterval:
    """The share of successes with its exact Clopper-Pearson interval (deterministic: no resampling). Unlike a
    bootstrap, it stays wide for few trials, also when every trial failed.

    Example:
        >>> ci = success_rate_ci([False] * 6)
        >>> ci.point_estimate, ci.ci_low, round(ci.ci_high, 3)
        (0.0, 0.0, 0.459)
    """
    if len(successes) == 0:
        raise ArgumentValueError("`successes` must be a non-empty sequence of bools.")
    n, k = len(successes), sum(1 for s in successes if s)
    tail = (1.0 - confidence) / 2.0
    # Lower bound: P(X >= k | p) = tail; upper bound: P(X <= k | p) = tail.
    low = 0.0 if k == 0 else _bisect(lambda p: 1.0 - _binomial_cdf(k - 1, n, p) <= tail)
    high = 1.0 if k == n else _bisect(lambda p: _binomial_cdf(k, n, p) > tail)
    return SuccessRateInterval(k / n, low, high, n, k, confidence)
