"""Declared points on a compiled engine: taps traced into vLLM's compiled code, their work done at run time.

vLLM compiles its model when the engine starts, and a torch hook registered afterwards never fires. So the points a
compiled engine serves are declared when it is built (``VLLMBridge.from_pretrained(path, compiled_points=[...])``):
right after the model is loaded, before vLLM compiles it (`internals.on_model_load`), each declared point gets a
torch hook that reads the point (`sites`) and calls the opaque custom op ``transformer_bridge::vllm_tap``. The
compiler traces the hook and keeps the op as a call; at run time the op does what the eager taps do for that point
(the batch's requests, their declared interventions, the captures asked for: `worker.Taps`), so changing which
requests are steered, by which vectors, or what is captured, never recompiles. Python hook functions cannot run
there (they would have to be traced); they stay an eager engine's.
"""

import base64
import os
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
from torch import Tensor, nn

from . import internals
from .naming import NameFilter, ServedNames, needed_for
from .worker import _TAPS, Taps

_POINTS: list[tuple[Taps, str]] = []  # the op's ``point`` argument indexes this list (one entry per traced call)


@torch.library.custom_op("transformer_bridge::vllm_tap", mutates_args=("sink",))
def vllm_tap(t: Tensor, sink: Tensor, point: int) -> tuple[Tensor, Tensor]:
    """At run time: point ``point``'s interventions and capture on ``t`` (flat ``[tokens, ...]``); returns the
    (maybe edited) tensor and which rows were edited. ``sink`` is declared written so that no compiler drops a call
    whose result only feeds a capture."""
    taps, name = _POINTS[point]
    out, edited = taps._run_point(name, t, True)
    if edited is None:
        edited = torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
    return (out.clone() if out is t else out), edited


@vllm_tap.register_fake
def _(t: Tensor, sink: Tensor, point: int) -> tuple[Tensor, Tensor]:
    return torch.empty_like(t), torch.empty(t.shape[0], dtype=torch.bool, device=t.device)


def install(runner: Any, model: nn.Module, names_filter: NameFilter) -> None:
    """Called by the model runner after loading ``model`` (`internals.on_model_load`): the taps of the declared
    points, registered before vLLM compiles it."""
    taps = Taps(model, runner)
    _TAPS[id(model)] = taps
    served = ServedNames(list(taps.points), taps.n_layers)
    declared = needed_for(served.matching(names_filter, "compiled_points"))
    taps.declared = declared
    sink = torch.zeros(1, device=next(model.parameters()).device)
    model.register_buffer("_bridge_tap_sink", sink, persistent=False)
    model.register_forward_pre_hook(taps._begin, with_kwargs=True)  # the outer model runs eagerly: the batch's rows
    for site in taps.sites:
        points = [p for p in site.points if p.name in declared]
        if not points:
            continue
        if site.kind == "attn":
            raise internals.VLLMInternalsError(
                f"{[p.name for p in points]}: the Transformers backend's rotated queries and keys are read through "
                "HF's attention registry, which a compiled engine does not call at run time; use `enforce_eager=True`."
            )
        ids = []
        for p in points:
            _POINTS.append((taps, p.name))
            ids.append(len(_POINTS) - 1)
        apply = _applier(points, ids, sink)
        if site.kind == "pre":
            site.module.register_forward_pre_hook(lambda m, args, kwargs, f=apply: f((args, kwargs)), with_kwargs=True)
        else:
            site.module.register_forward_hook(lambda m, args, out, f=apply: f(out))


def _applier(points: list, ids: list[int], sink: Tensor) -> Callable[[Any], Any]:
    def apply(x: Any) -> Any:
        for point, i in zip(points, ids, strict=True):
            new, rows = torch.ops.transformer_bridge.vllm_tap(point.get(x), sink, i)
            if point.put is not None:
                x = point.put(x, new, rows)
        return x

    return apply


class WorkerSetup:
    """vLLM's worker extension for compiled engines whose workers are other processes (tensor or pipeline
    parallelism; spawned, so a patch made in the driver does not reach them). vLLM imports this module in
    each worker before the worker loads its model (`internals.on_model_load`), and the import installs the declared
    taps there, from the names the driver put in the environment. It adds no method to the worker."""


def worker_setup(names_filter: NameFilter) -> tuple[str, str]:
    """``(WorkerSetup's qualified name, the payload a worker installs from)`` for `internals.on_model_load`."""
    payload = base64.b64encode(cloudpickle.dumps(names_filter)).decode("ascii")
    return f"{WorkerSetup.__module__}.{WorkerSetup.__qualname__}", payload


def _setup_this_worker() -> None:
    """In a worker process started for a compiled engine (the payload in its environment): its model runner installs
    the declared taps right after loading the model. Elsewhere, nothing."""
    payload = os.environ.get(internals.WORKER_SETUP_ENV)
    if payload:
        names_filter = cloudpickle.loads(base64.b64decode(payload))
        internals.patch_load_model(lambda runner, model: install(runner, model, names_filter))


_setup_this_worker()
