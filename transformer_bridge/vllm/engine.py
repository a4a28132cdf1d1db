"""One call of the engine with the bridge's taps: a plan sent to every worker, requests tagged, captures taken.

`run_requests` is the one place where the driver talks to vLLM's engine: it installs the plan (what to capture,
which functions run where, which points carry interventions) on every worker, submits each request with its tag in
``SamplingParams.extra_args`` (its id, index, phase, whether it is captured, its interventions), runs the engine,
collects each request's captures from rank 0 and always removes the plan, also on error.
"""

import dataclasses
import itertools
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from . import internals, worker
from .internals import EXTRA_KEY

_CALLS = itertools.count()


@dataclasses.dataclass
class Request:
    tokens: list[int]
    interventions: list[dict[str, Any]]


@dataclasses.dataclass
class Finished:
    """One request's result: its generated ids, vLLM's output object, and its captures by hook name."""

    tokens: list[int]
    generated: list[int]
    output: Any
    captured: dict[str, Tensor]


def run_requests(
    llm: Any,
    requests: Sequence[Request],
    fields: dict[str, Any],
    mode: str,
    capture: set[str],
    fns: dict[str, list[Callable]],
) -> list[Finished]:
    """Run ``requests`` through ``llm`` (``mode``: "forward", "generate" or "recompute"), each with
    ``SamplingParams(**fields)``; returns them in order with what ``capture`` asked for."""
    call = f"tb{next(_CALLS)}-{uuid.uuid4().hex[:8]}"
    intervened = sorted({iv["point"] for r in requests for iv in r.interventions})
    edits = bool(fns) or bool(intervened)
    prompts, params, ids = [], [], []
    for i, req in enumerate(requests):
        rid = f"{call}-{i}"
        tag = {"id": rid, "index": i, "mode": mode, "cap": bool(capture), "iv": req.interventions}
        salt = None
        if edits:  # edited KV must never be shared through the prefix cache with unedited requests
            salt = f"{call}-{i}" if req.interventions or fns else None
        # A captured or edited request computes every position itself: none may come from the prefix cache.
        skip = bool(capture) or edits
        prompts.append(internals.prompt(req.tokens, salt))
        params.append(internals.sampling_params(**fields, extra_args={EXTRA_KEY: tag},
                                                skip_reading_prefix_cache=skip))  # fmt: skip
        ids.append(rid)
    try:
        sent: Any = fns
        if fns and not internals.in_process(llm):  # functions cross to worker processes; their effects stay there
            import cloudpickle  # a dependency of vLLM

            sent = cloudpickle.dumps(fns)
        llm.collective_rpc(worker.set_plan, args=(sorted(capture), sent, intervened))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        taken = {}
        if capture:
            per_rank = llm.collective_rpc(worker.take, args=(ids,))
            taken = next(r for r in per_rank if r is not None)
    finally:
        llm.collective_rpc(worker.clear)
    done = []
    for rid, req, out in zip(ids, requests, outputs, strict=True):
        gen = list(out.outputs[0].token_ids) if out.outputs else []
        done.append(Finished(req.tokens, gen, out, taken.get(rid, {})))
    return done
