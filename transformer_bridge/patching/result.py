"""`PatchingResult`: per-example (or per-metric) patching values with the statistics researchers report.

TransformerLens 4.3's result type, same fields and methods: ``values`` laid out ``[metric?, *axes | cell,
batch?]``, ``mean``, ``stderr``, ``effect`` (patched − unpatched corrupted), ``normalized`` (recovery between
the corrupted and clean runs), a seeded percentile ``bootstrap_ci``, a sign-flip ``permutation_pvalue``, and
``to_dataframe`` (pandas, optional). ``index`` holds the swept cells as a ``[cell, axis]`` tensor, so nothing
here needs pandas until a DataFrame is asked for (``index_df``, ``make_df_from_ranges``).
"""

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import optional
from ..checks import ArgumentValueError, check_int
from ..convertible import Convertible
from ..utils.statistics import derive_generator

ALTERNATIVES = ("two-sided", "greater", "less")
STATISTICS = ("mean", "median")


def index_rows(ranges: Sequence[int]) -> Int[Tensor, "cell axis"]:
    """Every combination of ``range(r)`` for each axis, the last axis fastest (TransformerLens' order).

    Example:
        >>> index_rows([2, 3]).tolist()[:4]
        [[0, 0], [0, 1], [0, 2], [1, 0]]
    """
    rows = list(itertools.product(*(range(int(r)) for r in ranges)))
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), len(ranges))


def dataframe(index: Int[Tensor, "cell axis"], names: Sequence[str]) -> Any:
    """``index`` as a pandas DataFrame with ``names`` as columns (pandas is needed here, and only here)."""
    return optional.pandas("A DataFrame of patch indices").DataFrame(index.tolist(), columns=list(names))


def make_df_from_ranges(column_max_ranges: Sequence[int], column_names: Sequence[str]) -> Any:
    """A DataFrame of every combination of ``range(max)`` per column, the last column fastest (TransformerLens).

    Example:
        >>> make_df_from_ranges([2, 3], ["layer", "pos"]).shape
        (6, 2)
    """
    return dataframe(index_rows(column_max_ranges), column_names)


def standard_error(x: Float[Tensor, "... n"]) -> Float[Tensor, "..."]:
    """Standard error of the mean over the last axis (unbiased standard deviation ÷ √n), n ≥ 2."""
    if x.shape[-1] < 2:
        raise ValueError(f"A standard error needs at least 2 examples, got {x.shape[-1]}.")
    return x.std(-1, unbiased=True) / math.sqrt(x.shape[-1])


def bootstrap_ci(
    x: Float[Tensor, "... n"],
    statistic: str = "mean",
    confidence: float = 0.95,
    n_resamples: int = 1000,
    generator: torch.Generator | None = None,
    chunk: int = 256,
) -> tuple[Float[Tensor, "..."], Float[Tensor, "..."]]:
    """Percentile bootstrap interval of ``statistic`` over the last axis, ``chunk`` resamples at a time."""
    if statistic not in STATISTICS:
        raise ArgumentValueError(f"`statistic` must be one of {STATISTICS}, got {statistic!r}.")
    if not 0.0 < confidence < 1.0:
        raise ArgumentValueError(f"`confidence` must be in (0, 1), got {confidence!r}.")
    n_resamples = check_int("n_resamples", n_resamples, minimum=1)
    n = x.shape[-1]
    generator = generator if generator is not None else derive_generator(0)
    draws = []
    for start in range(0, n_resamples, chunk):
        picks = torch.randint(0, n, (min(chunk, n_resamples - start), n), generator=generator).to(x.device)
        sample = x[..., picks]  # [..., count, n]
        draws.append(sample.mean(-1) if statistic == "mean" else sample.median(-1).values)
    stats = torch.cat(draws, -1).float()
    tail = (1.0 - confidence) / 2
    return torch.quantile(stats, tail, dim=-1).to(x.dtype), torch.quantile(stats, 1 - tail, dim=-1).to(x.dtype)


def sign_flip_pvalue(
    effects: Float[Tensor, "... n"],
    n_permutations: int = 1000,
    generator: torch.Generator | None = None,
    alternative: str = "two-sided",
    exact_max_n: int = 12,
) -> Float[Tensor, "..."]:
    """P-value that the mean effect is zero, by flipping signs: every pattern when ``n ≤ exact_max_n`` (exact),
    else ``n_permutations`` random ones (``(hits + 1) / (n_permutations + 1)``)."""
    if alternative not in ALTERNATIVES:
        raise ArgumentValueError(f"`alternative` must be one of {ALTERNATIVES}, got {alternative!r}.")
    n_permutations = check_int("n_permutations", n_permutations, minimum=1)
    x = effects.float()
    n = x.shape[-1]
    observed = x.mean(-1, keepdim=True)
    tolerance = observed.abs() * 100 * torch.finfo(x.dtype).eps  # summation-order ties count as hits

    def hits(signs: Tensor) -> Tensor:
        null = (x[..., None, :] * signs).mean(-1)
        if alternative == "two-sided":
            return (null.abs() >= observed.abs() - tolerance).sum(-1).float()
        if alternative == "greater":
            return (null >= observed - tolerance).sum(-1).float()
        return (null <= observed + tolerance).sum(-1).float()

    if n <= exact_max_n:
        signs = torch.tensor(list(itertools.product((1.0, -1.0), repeat=n)), device=x.device)
        return hits(signs) / signs.shape[0]
    generator = generator if generator is not None else derive_generator(0)
    total = torch.zeros(x.shape[:-1], device=x.device)
    for start in range(0, n_permutations, 256):
        count = min(256, n_permutations - start)
        total += hits((torch.randint(0, 2, (count, n), generator=generator).float() * 2 - 1).to(x.device))
    return (total + 1.0) / (n_permutations + 1.0)


@dataclass
class PatchingResult(Convertible):
    """Patched metric values per cell, per example (``reduced`` False) or averaged, with statistics on top.

    Returned by `generic_activation_patch` and every ``get_act_patch_*`` function when ``reduce="none"``,
    ``baseline=True`` or a mapping of metrics is given. ``values``: ``[metric?, *axis_names, batch?]`` (one flat
    cell axis when an ``index_df`` was given; the metric axis only for a mapping of metrics, the batch axis only
    when not ``reduced``). ``index``: the cells in the order they were swept, ``[cell, axis]``. ``baseline``:
    the unpatched corrupted run's metric, ``[metric?, batch?]``.

    Example:
        >>> result = get_act_patch_resid_pre(model, corrupted, clean_cache, per_prompt_metric, reduce="none",
        ...                                  baseline=True)
        >>> result.mean(), result.stderr(), result.effect().mean(-1), result.permutation_pvalue()
    """

    values: Tensor
    axis_names: list[str]
    index: Int[Tensor, "cell axis"]
    index_names: list[str]
    metric_names: list[str]
    reduced: bool
    baseline: Tensor | None = None
    has_metric_axis: bool = False
    patch_type_names: list[str] | None = None

    def as_tensor(self) -> Tensor:
        """``values``: what ``torch.as_tensor(result)`` and ``np.asarray(result)`` give."""
        return self.values

    @property
    def index_df(self) -> Any:
        """The swept cells as a pandas DataFrame (TransformerLens' ``index_df``); needs pandas."""
        return dataframe(self.index, self.index_names)

    def __getitem__(self, metric_name: str) -> "PatchingResult":
        """One metric's result, without the metric axis."""
        if metric_name not in self.metric_names:
            raise KeyError(f"Unknown metric {metric_name!r}; the metrics you have here are {self.metric_names}.")
        if not self.has_metric_axis:
            return self
        i = self.metric_names.index(metric_name)
        return PatchingResult(
            self.values[i], list(self.axis_names), self.index, list(self.index_names), [metric_name], self.reduced,
            None if self.baseline is None else self.baseline[i], False, self.patch_type_names,
        )  # fmt: skip

    def _per_example(self, what: str) -> None:
        if self.reduced:
            raise ValueError(f"`{what}` needs per-example values: run the sweep with reduce='none'.")

    def mean(self) -> Tensor:
        """The batch mean per cell (``values`` when already reduced)."""
        return self.values if self.reduced else self.values.mean(-1)

    def stderr(self) -> Tensor:
        """The standard error of the batch mean per cell (needs ``reduce="none"`` and 2+ examples)."""
        self._per_example("stderr")
        return standard_error(self.values)

    def _baseline_like_values(self) -> Tensor:
        if self.baseline is None:
            raise ValueError("`effect` needs the unpatched corrupted metric: run the sweep with baseline=True.")
        lead = 1 if self.has_metric_axis else 0
        middle = self.values.dim() - lead - (0 if self.reduced else 1)
        b = self.baseline
        return b.reshape(*b.shape[:lead], *([1] * middle), *b.shape[lead:])

    def effect(self) -> Tensor:
        """``values − baseline``: what each patch changed in the corrupted run (per example when not reduced)."""
        return self.values - self._baseline_like_values()

    def normalized(self, clean_baseline: Tensor) -> Tensor:
        """``(values − corrupted) / (clean − corrupted)``: 0 = the patch did nothing, 1 = it restored the clean
        metric. ``clean_baseline`` is the metric on the clean run, shaped like ``baseline``."""
        corrupted = self._baseline_like_values()
        clean = torch.as_tensor(clean_baseline, dtype=self.values.dtype, device=self.values.device)
        if self.baseline is None or clean.shape != self.baseline.shape:
            want = None if self.baseline is None else tuple(self.baseline.shape)
            raise ValueError(f"`clean_baseline` must match baseline shape {want}, got {tuple(clean.shape)}.")
        return (self.values - corrupted) / (clean.reshape(corrupted.shape) - corrupted)

    def bootstrap_ci(
        self,
        *,
        confidence: float = 0.95,
        n_resamples: int = 1000,
        seed: int = 0,
        statistic: str = "mean",
        of_effect: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Percentile bootstrap interval of the batch ``statistic`` per cell (of ``effect()`` with ``of_effect``),
        reproducible per ``seed``."""
        self._per_example("bootstrap_ci")
        data = self.effect() if of_effect else self.values
        generator = derive_generator(seed, "bootstrap", statistic)
        return bootstrap_ci(data, statistic, confidence, n_resamples, generator)

    def permutation_pvalue(
        self, *, n_permutations: int = 1000, seed: int = 0, alternative: str = "two-sided"
    ) -> Tensor:
        """Sign-flip permutation p-value that each cell's mean ``effect()`` is zero (needs ``baseline=True``); exact
        for 12 examples or fewer."""
        self._per_example("permutation_pvalue")
        return sign_flip_pvalue(self.effect(), n_permutations, derive_generator(seed, "permutation"), alternative)

    def to_dataframe(self) -> Any:
        """One row per (metric, cell, example) with its value, as a pandas DataFrame."""
        values = self.values if self.has_metric_axis else self.values[None]
        flat = values.reshape(len(self.metric_names), self.index.shape[0], -1).detach().cpu()
        rows = []
        for m, name in enumerate(self.metric_names):
            for c, cell in enumerate(self.index.tolist()):
                for b in range(flat.shape[-1]):
                    row: dict[str, Any] = {"metric": name, **dict(zip(self.index_names, cell, strict=True))}
                    if self.patch_type_names is not None and "patch_type" in row:
                        row["patch_type_name"] = self.patch_type_names[row["patch_type"]]
                    if not self.reduced:
                        row["example"] = b
                    row["value"] = float(flat[m, c, b])
                    rows.append(row)
        return optional.pandas("`PatchingResult.to_dataframe`").DataFrame(rows)
