"""`generic_activation_patch`: activation-patching sweeps, many patches per forward.

TransformerLens' loop runs one forward (and one host sync) per patch. Here the corrupted batch is repeated
along the batch axis, one copy per patch: copy ``j`` of a forward carries patch ``j``, written by one hook per
hooked point (the cells of that layer) through the user's ``patch_setter`` on that copy's rows; every other
copy passes through untouched. Rows of a batch never interact, so copy ``j``'s logits are those of the
one-patch forward, and the metric is applied to each copy's logits exactly as TransformerLens applies it to
the whole forward's. The number of copies per forward follows a memory budget (`chunk_size`). The unpatched
baseline rides along in the first forward as one more copy. The serial loop is the oracle in the tests
(equal within 1e-5 on several families and SmolLM2).
"""

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..cache.activation_cache import ActivationCache
from ..checks import (
    ArgumentIndexError,
    ArgumentTypeError,
    ArgumentValueError,
    check_int,
    describe,
    suggest_keywords,
)
from ..core import BridgeCore
from ..sites.module_paths import get_module
from .result import PatchingResult, dataframe, index_rows

try:  # optional: a progress bar with `progress=True`
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm comes with huggingface_hub
    tqdm = None

MetricFn = Callable[[Float[Tensor, "batch pos d_vocab"]], Any]
PatchSetter = Callable[[Tensor, Sequence[int], Tensor], Tensor | None]
Reduce = Literal["scalar", "mean", "none"]
REDUCE: tuple[str, ...] = ("scalar", "mean", "none")
AXES: tuple[str, ...] = ("layer", "pos", "head_index", "head", "src_pos", "dest_pos")
KV_POINTS = ("k", "v", "rot_k", "key", "value")
DEFAULT_CPU_BUDGET = 1 << 30
_GEN = torch.Generator().manual_seed(0)  # the last-position check's random values


@overload
def generic_activation_patch(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn,
    patch_setter: PatchSetter, activation_name: str, index_axis_names: Sequence[str] | None = None,
    index_df: Any = None, return_index_df: Literal[False] = False, *, reduce: Literal["scalar", "mean"] = "scalar",
    baseline: Literal[False] = False, **options: Any,
) -> Tensor: ...  # fmt: skip
@overload
def generic_activation_patch(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache, patching_metric: MetricFn,
    patch_setter: PatchSetter, activation_name: str, index_axis_names: Sequence[str] | None, index_df: Any,
    return_index_df: Literal[True], *, reduce: Literal["scalar", "mean"] = "scalar", baseline: Literal[False] = False,
    **options: Any,
) -> tuple[Tensor, Any]: ...  # fmt: skip
@overload
def generic_activation_patch(
    model: BridgeCore, corrupted_tokens: Any, clean_cache: ActivationCache,
    patching_metric: MetricFn | Mapping[str, MetricFn], patch_setter: PatchSetter, activation_name: str,
    index_axis_names: Sequence[str] | None = None, index_df: Any = None, return_index_df: bool = False, *,
    reduce: Reduce = "scalar", baseline: bool = False, **options: Any,
) -> PatchingResult: ...  # fmt: skip
@suggest_keywords
def generic_activation_patch(
    model: BridgeCore,
    corrupted_tokens: Int[Tensor, "batch pos"] | str | list[str],
    clean_cache: ActivationCache,
    patching_metric: MetricFn | Mapping[str, MetricFn],
    patch_setter: PatchSetter,
    activation_name: str,
    index_axis_names: Sequence[str] | None = None,
    index_df: Any = None,
    return_index_df: bool = False,
    *,
    reduce: str = "scalar",
    baseline: bool = False,
    patches_per_forward: int | None = None,
    memory_budget: int | None = None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    progress: bool = False,
    reuse_corrupted: bool = True,
) -> Tensor | tuple[Tensor, Any] | PatchingResult:
    """Patch the clean activation into the corrupted run at every index and measure ``patching_metric``.

    TransformerLens' function, same arguments and results, batched: ``patches_per_forward`` patches run in
    one forward (None: as many as ``memory_budget`` bytes allow, by default 1 GiB on CPU and half the free
    memory on an accelerator; ``1`` is TransformerLens' serial loop). The cells are every combination of
    ``index_axis_names`` (``layer`` first; ``pos``, ``head``/``head_index``, ``src_pos``, ``dest_pos``; heads of
    ``k``/``v`` count key-value heads in grouped-query models, see `get_act_patch_attn_head_k_by_pos`), or the
    rows of ``index_df`` (a DataFrame or a ``[cell, axis]`` int tensor; a flat result, one value per row).
    ``patch_setter(corrupted_activation, index, clean_activation)`` sees the rows of one patch (``[batch, ...]``)
    and the clean activation ``clean_cache[name]``. ``patching_metric(logits)`` gets one patch's logits
    ``[batch, pos, d_vocab]``; it returns a scalar (``reduce="scalar"``) or one value per corrupted example
    (``reduce="mean"`` averages them, ``"none"`` keeps them in a `PatchingResult`); a mapping of named metrics
    evaluates each on every patched forward. ``baseline=True`` adds the unpatched corrupted metric. Returns a
    tensor ``[*axes]`` (``[cell]`` with ``index_df``; ``(tensor, index_df)`` with ``return_index_df``), or a
    `PatchingResult` for ``reduce="none"``, ``baseline=True`` or a mapping of metrics. The model must be in
    eval mode (dropout would make patches differ by more than the patch). ``corrupted_tokens`` may also be text;
    ``attention_mask`` marks padding of token input (without it every token is real).

    ``reuse_corrupted`` (default) skips work every patched copy would repeat, without changing a number: the
    blocks below a patched layer compute the corrupted run, so they run once, on the corrupted batch alone,
    and the copies start at the patched block (patches are grouped by layer; needs no other hook on the
    model); and when the metric reads only the last position's logits (checked on the unpatched logits: its
    value does not move when every other position is overwritten, twice), only that position is unembedded.

    Example:
        >>> _, clean_cache = model.run_with_cache(clean_tokens)
        >>> metric = lambda logits: logits[0, -1, paris] - logits[0, -1, rome]
        >>> scan = generic_activation_patch(model, corrupted_tokens, clean_cache, metric, layer_pos_patch_setter,
        ...                                 "resid_pre", index_axis_names=("layer", "pos"))   # [n_layers, pos]
    """
    _check_model(model)
    if reduce not in REDUCE:
        raise ArgumentValueError(f"`reduce`={reduce!r} is not allowed: reduce must be one of {REDUCE}.")
    metrics = _metrics(patching_metric)
    if not callable(patch_setter):
        raise ArgumentTypeError(f"`patch_setter` must be a function (activation, index, clean) -> activation, got "
                                f"{describe(patch_setter)}.")  # fmt: skip
    if not isinstance(clean_cache, ActivationCache):
        raise ArgumentTypeError(
            f"`clean_cache` must be the ActivationCache of the clean run, got {describe(clean_cache)}."
        )
    want_result = isinstance(patching_metric, Mapping) or reduce == "none" or baseline
    if want_result and return_index_df:
        raise ArgumentValueError("`return_index_df` applies to the tensor return; a PatchingResult carries the index.")
    tokens, mask = model.prepare_input(corrupted_tokens, attention_mask)
    batch, width = tokens.shape
    index, index_names, axis_names, cell_shape = _cells(model, activation_name, index_axis_names, index_df, width)
    points = {layer: model.names.key((activation_name, layer), "activation_name") for layer in index[:, 0].tolist()}
    clean = {name: _clean(clean_cache, name, tokens.shape) for name in dict.fromkeys(points.values())}
    per_example = reduce != "scalar"
    store = torch.zeros((len(metrics), index.shape[0], *((batch,) if per_example else ())), device=model.device)
    evaluate = _evaluator(metrics, per_example, batch, reduce, store)
    skip, keep_last, baseline_values = reuse_corrupted and _may_skip_layers(model), False, None
    if reuse_corrupted or baseline:
        with torch.no_grad():
            unpatched = model.forward_tokens(tokens, mask)
        baseline_values = evaluate(unpatched) if baseline else None
        keep_last = reuse_corrupted and _reads_last_position_only(metrics, unpatched)
        skip = skip and _batch_may_grow(model, tokens, mask, unpatched)
        del unpatched
    size = chunk_size(model, batch, width, patches_per_forward, memory_budget, keep_last)
    chunks = _chunks(index, size, skip)
    if progress and tqdm is not None:
        chunks = tqdm(chunks, desc=f"patching {activation_name}", unit="forward")
    blocks = get_module(model.hf_model, model.adapter.blocks)
    for rows in chunks:
        cells = index[rows].tolist()
        by_point: dict[str, list[tuple[int, list[int]]]] = {}
        for j, cell in enumerate(cells):
            by_point.setdefault(points[cell[0]], []).append((j, cell))
        hooks = [(name, _patch_hook(todo, clean[name], patch_setter, batch)) for name, todo in by_point.items()]
        start = cells[0][0] if skip else 0
        copies = 1 if skip else len(cells)  # with `skip`, the batch is repeated at the patched block
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if skip:
                stack.enter_context(_copies_from(blocks[start:], len(cells), batch))
            stack.enter_context(model.hooks(fwd_hooks=hooks))
            # Two positions, not one: a one-row product takes another kernel (a different summation order).
            logits = model.forward_tokens(tokens.repeat(copies, 1), mask.repeat(copies, 1),
                                          logits_to_keep=2 * keep_last)  # fmt: skip
        if keep_last:  # the metric reads the last position only: the others need no values (see the check)
            logits = logits[:, -1:].expand(-1, width, -1)
        for j, row in enumerate(rows.tolist()):
            store[:, row] = evaluate(logits[j * batch : (j + 1) * batch])
    return _finish(store, metrics, reduce, baseline_values, axis_names, cell_shape, index, index_names,
                   want_result, return_index_df, isinstance(patching_metric, Mapping))  # fmt: skip


def chunk_size(
    model: BridgeCore,
    batch: int,
    width: int,
    patches_per_forward: int | None = None,
    memory_budget: int | None = None,
    last_logits_only: bool = False,
) -> int:
    """How many patched copies of a ``[batch, width]`` corrupted batch run in one forward.

    ``patches_per_forward`` when given; else what fits ``memory_budget`` bytes (default: 1 GiB on CPU, half the
    free memory of an accelerator), estimated per sequence as its logits (one position with
    ``last_logits_only``) plus one layer's activations (no autograd graph is kept, so layers do not accumulate).

    Example:
        >>> chunk_size(model, batch=1, width=9, memory_budget=512 << 20)
        30
    """
    if patches_per_forward is not None:
        return check_int("patches_per_forward", patches_per_forward, minimum=1)
    if memory_budget is None:
        device = model.device
        memory_budget = DEFAULT_CPU_BUDGET
        if device.type == "cuda":
            memory_budget = torch.cuda.mem_get_info(device)[0] // 2
    memory_budget = check_int("memory_budget", memory_budget, minimum=1, hint="It is a number of bytes.")
    c = model.cfg
    elem = torch.finfo(c.dtype).bits // 8 if c.dtype.is_floating_point else 4
    logits = (2 if last_logits_only else width) * c.d_vocab * max(elem, 4)
    per_seq = logits + width * (8 * c.d_model + 3 * (c.d_mlp or 4 * c.d_model)) * elem
    per_seq += 2 * c.n_heads * width * width * elem
    return max(1, memory_budget // (per_seq * batch))


def _chunks(index: Tensor, size: int, by_layer: bool) -> list[Tensor]:
    """Row numbers of ``index`` in forwards of at most ``size`` patches; ``by_layer``: one layer per forward."""
    if not by_layer:
        return list(torch.arange(index.shape[0]).split(size))
    out = []
    for layer in index[:, 0].unique().tolist():
        out += list((index[:, 0] == layer).nonzero().reshape(-1).split(size))
    return out


def _may_skip_layers(model: BridgeCore) -> bool:
    """Whether patched copies may start at the patched block: attention blocks, and no other hook on the model (a
    hook below the patched block would see the corrupted batch once, not once per copy)."""
    hooked = any(point.fwd_hooks or point.bwd_hooks for point in model.hook_dict.values())
    return model.adapter.ssm is None and not hooked


_GROWS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _batch_may_grow(model: BridgeCore, tokens: Tensor, mask: Tensor, logits: Tensor) -> bool:
    """Whether this model's code lets the batch grow between blocks (GPT-BigCode reshapes its output to the input's
    batch, for one): the unpatched forward with its last block's input doubled must give the logits twice. Checked
    once per model."""
    known = _GROWS.get(model.hf_model)
    if known is None:
        last = get_module(model.hf_model, model.adapter.blocks)[model.cfg.n_layers - 1]
        try:
            with torch.no_grad(), _copies_from([last], 2, tokens.shape[0]):
                twice = model.forward_tokens(tokens, mask)
            known = twice.shape[0] == 2 * logits.shape[0] and bool(
                torch.allclose(twice, logits.repeat(2, *([1] * (logits.dim() - 1))), atol=1e-4, rtol=1e-4)
            )
        except (RuntimeError, ValueError, IndexError):
            known = False
        _GROWS[model.hf_model] = known
    return known


@contextlib.contextmanager
def _copies_from(blocks: Iterable[torch.nn.Module], copies: int, batch: int) -> Iterator[None]:
    """Repeat the input of the first of ``blocks`` (and every tensor argument with the batch on axis 0) ``copies``
    times along the batch: the blocks below ran once on the corrupted batch, identical for every copy. The later
    blocks get the model's per-batch arguments (a materialised attention mask, per-row position embeddings)
    repeated likewise; their hidden states already hold the copies."""

    def repeat(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def grow(x: Any) -> Any:
            if isinstance(x, tuple):  # (cos, sin) position embeddings
                return tuple(grow(t) for t in x)
            if isinstance(x, Tensor) and x.dim() > 1 and x.shape[0] == batch:  # [batch, ...]; not cache_position
                return x.repeat(copies, *([1] * (x.dim() - 1)))
            return x

        return tuple(grow(a) for a in args), {k: grow(v) for k, v in kwargs.items()}

    handles = [block.register_forward_pre_hook(repeat, with_kwargs=True, prepend=True) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _reads_last_position_only(metrics: dict[str, MetricFn], logits: Tensor) -> bool:
    """Whether every metric's value on ``logits`` stays bitwise the same when all positions but the last are
    overwritten (with NaN, then with large random values): then it does not read them."""
    if logits.shape[1] < 2:
        return False
    want = [_value(fn(logits)) for fn in metrics.values()]
    for fill in (float("nan"), None):
        probe = logits.clone()
        probe[:, :-1] = fill if fill is not None else 1e4 * torch.randn(probe[:, :-1].shape, generator=_GEN)
        try:
            got = [_value(fn(probe)) for fn in metrics.values()]
        except Exception:  # a metric that fails on odd values reads them
            return False
        if not all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(want, got, strict=True)):
            return False
    return True


def _value(out: Any) -> Tensor | None:
    out = out.detach() if isinstance(out, Tensor) else torch.as_tensor(out)
    return out if bool(torch.isfinite(out).all()) else None


def _patch_hook(todo: list[tuple[int, list[int]]], clean: Tensor, setter: PatchSetter, batch: int) -> Callable:
    """A hook that applies ``setter`` to the rows of each patch ``j`` in ``todo`` (the copy of the batch it owns)."""
    moved: dict[torch.device, Tensor] = {}

    def hook(activation: Tensor, hook: Any) -> Tensor:
        source = moved.get(activation.device)
        if source is None:
            source = moved[activation.device] = clean.to(activation.device)
        for j, cell in todo:
            rows = activation[j * batch : (j + 1) * batch]
            out = setter(rows, cell, source)
            if out is not None and out is not rows:  # a setter that returned a new tensor instead of editing
                rows.copy_(out)
        return activation

    return hook


def _evaluator(
    metrics: dict[str, MetricFn], per_example: bool, batch: int, reduce: str, store: Tensor
) -> Callable[[Tensor], Tensor]:
    """Every metric on one patch's logits: ``[metric]`` (scalars) or ``[metric, batch]``, checked."""

    def evaluate(logits: Tensor) -> Tensor:
        rows = []
        for name, fn in metrics.items():
            out = fn(logits)
            out = out.detach() if isinstance(out, Tensor) else torch.as_tensor(out)
            if per_example and (out.dim() != 1 or out.shape[0] != batch):
                raise ArgumentValueError(
                    f"`patching_metric` {name!r} must return a [batch] tensor, one value per corrupted example "
                    f"(length {batch}) with `reduce`={reduce!r}, got {describe(out)}."
                )
            if not per_example and out.dim() != 0:
                raise ArgumentValueError(
                    f"`patching_metric` {name!r} must return a scalar with reduce='scalar', got {describe(out)}; "
                    "return one value per example and pass reduce='mean' or reduce='none' to keep them."
                )
            rows.append(out.to(store.device, store.dtype))
        return torch.stack(rows)

    return evaluate


def _finish(
    store: Tensor, metrics: dict, reduce: str, baseline: Tensor | None, axis_names: list[str],
    cell_shape: tuple[int, ...], index: Tensor, index_names: list[str], want_result: bool, return_index_df: bool,
    metric_axis: bool,
) -> Tensor | tuple[Tensor, Any] | PatchingResult:  # fmt: skip
    if reduce == "mean":
        store = store.mean(-1)
        baseline = None if baseline is None else baseline.mean(-1)
    values = store.reshape(len(metrics), *cell_shape, *store.shape[2:])
    if not want_result:
        return (values[0], dataframe(index, index_names)) if return_index_df else values[0]
    return PatchingResult(
        values=values if metric_axis else values[0],
        axis_names=axis_names,
        index=index,
        index_names=index_names,
        metric_names=list(metrics),
        reduced=reduce != "none",
        baseline=None if baseline is None else (baseline if metric_axis else baseline[0]),
        has_metric_axis=metric_axis,
    )


def _check_model(model: Any) -> None:
    if not isinstance(model, BridgeCore):
        raise ArgumentTypeError(f"`model` must be a TransformerBridge, got {describe(model)}.")
    training = [name or "<model>" for name, m in model.hf_model.named_modules() if m.training]
    if training:
        raise ArgumentValueError(
            f"Activation patching needs the model in evaluation mode (dropout would change every patched run); "
            f"{training[:3]} {'are' if len(training) > 1 else 'is'} training. Call `model.eval()` first."
        )


def _metrics(metric: Any) -> dict[str, MetricFn]:
    metrics = dict(metric) if isinstance(metric, Mapping) else {"metric": metric}
    if not metrics:
        raise ArgumentValueError("`patching_metric` is an empty mapping; give at least one metric.")
    for name, fn in metrics.items():
        if not callable(fn):
            raise ArgumentTypeError(
                f"`patching_metric` {name!r} must be a function of the logits [batch, pos, d_vocab], got "
                f"{describe(fn)}."
            )
    return metrics


def _clean(cache: ActivationCache, name: str, corrupted: torch.Size) -> Tensor:
    """The clean activation at ``name``, whose [batch, pos] must be the corrupted tokens' (else a patch would write
    the clean run's position i into another prompt's position i, or broadcast one example over others)."""
    if name not in cache:
        raise KeyError(
            f"`clean_cache` lacks {name!r}, which this sweep patches in. Cache it on the clean run: "
            f"`model.run_with_cache(clean_tokens)` (names_filter=None) or a names_filter that includes it."
        )
    clean = cache[name]
    pos_axis = 2 if name.endswith(("hook_pattern", "hook_attn_scores")) else 1  # [batch, head, query_pos, key_pos]
    if clean.dim() > pos_axis and (clean.shape[0], clean.shape[pos_axis]) != tuple(corrupted):
        raise ArgumentValueError(
            f"`corrupted_tokens` has shape {tuple(corrupted)} [batch, pos] but `clean_cache` was made from tokens of "
            f"shape {(clean.shape[0], clean.shape[pos_axis])} (`clean_cache[{name!r}]` is {tuple(clean.shape)}): a "
            "patch copies the clean activation at each position into the same position of the corrupted run, so "
            "both runs need the same batch and length. Tokenize clean and corrupted prompts that have the same "
            "number of tokens (check with `model.to_str_tokens`), or pad them to one length together."
        )
    return clean


def _cells(
    model: BridgeCore, activation_name: str, axis_names: Sequence[str] | None, index_df: Any, width: int
) -> tuple[Tensor, list[str], list[str], tuple[int, ...]]:
    """``(index [cell, axis], index column names, result axis names, result cell shape)``."""
    if not isinstance(activation_name, str):
        raise ArgumentTypeError(
            f"`activation_name` must be a shorthand such as 'resid_pre', got {describe(activation_name)}."
        )
    if index_df is None:
        if axis_names is None:
            raise ArgumentValueError("Give `index_axis_names` (e.g. ('layer', 'pos')) or `index_df`.")
        names = list(axis_names)
        bad = [a for a in names if a not in AXES]
        if bad or not names or names[0] != "layer":
            raise ArgumentValueError(
                f"`index_axis_names` must start with 'layer' and use only {AXES}, got {tuple(names)!r}."
            )
        heads = model.cfg.n_kv_heads if activation_name in KV_POINTS else model.cfg.n_heads
        ranges = {"layer": model.cfg.n_layers, "pos": width, "src_pos": width, "dest_pos": width}
        shape = tuple(ranges.get(a, heads) for a in names)
        return index_rows(shape), names, names, shape
    if axis_names is not None:
        raise ArgumentValueError("Give `index_axis_names` or `index_df`, not both (an index_df names its own axes).")
    if hasattr(index_df, "to_numpy") and hasattr(index_df, "columns"):
        index, names = torch.as_tensor(index_df.to_numpy().astype("int64")), [str(c) for c in index_df.columns]
    else:
        index = torch.as_tensor(index_df)
        names = ["layer", *(f"axis_{i}" for i in range(1, index.shape[-1] if index.dim() == 2 else 1))]
    if index.dim() != 2 or index.shape[0] == 0 or index.is_floating_point():
        raise ArgumentValueError(f"`index_df` must hold rows of int indices (layer first), got {describe(index_df)}.")
    layers = index[:, 0]
    if bool((layers < 0).any() | (layers >= model.cfg.n_layers).any()):
        raise ArgumentIndexError(
            f"`index_df` has layer {int(layers[(layers < 0) | (layers >= model.cfg.n_layers)][0])}; this model has "
            f"{model.cfg.n_layers} layers (0..{model.cfg.n_layers - 1})."
        )
    return index.long(), names, [], (index.shape[0],)
