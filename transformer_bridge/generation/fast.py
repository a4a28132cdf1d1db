"""What the static-cache (fast) path shares: cache buckets, the compiled one-token step, and the option checks.

``generate(..., cache_implementation="static")`` decodes over a preallocated KV cache
(`kv.StaticKVRows`); ``generate(..., compile=True)`` also compiles the one-token decode step with
``torch.compile`` (on CUDA with CUDA graphs: mode ``"reduce-overhead"``). Both drivers take it: the
plain loop (`decode.decode_steps`) and the controlled engine (`engine.Engine`, ``controller=``), which
runs the compiled step when every row feeds one token and eager forwards otherwise (prompt, forced or
uneven chunks). Shapes are fixed per *bucket*: the batch size and the cache length (prompt +
``max_new_tokens``, rounded up to a multiple of `BUCKET`), so one compiled step serves every call of
that bucket in the process; the cache of a bucket is kept and reset between calls.

What makes the step static: HF's `StaticCache` written at ``cache_position``, an attention mask over the
whole bucket (padding and not-yet-written slots are 0), ``position_ids`` per row (left padding: a row's
first real token is 0), and one token per row. Hooks run inside the compiled step (dynamo traces them;
`Steering` interventions keep their tensors, so `Steering.update` does not retrace); ``hook.ctx`` is as
in the eager loop. The prefill and the ``return_cache`` recompute stay eager.

No host sync per step in the plain loop: finished rows and stop conditions live on the device, and
the host asks whether every row is done only every `SYNC_EVERY` steps on an accelerator (every step
on the CPU, where the look is free and a step past the end is not, and with a streamer).
Steps run after every row finished append padding only, and the output is cut to the last real token,
so the sequences equal the dynamic loop's.
"""

import logging
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import StaticCache

from ..core import BridgeCore
from ..hooks.points import HookContext
from . import packed
from .compiled import compile_options
from .options import Plan

logger = logging.getLogger(__name__)

BUCKET = 64  # cache lengths are rounded up to a multiple of this
SYNC_EVERY = 8  # decode steps between two looks of the host at the finished rows, on an accelerator
# On the CPU nothing runs ahead of the host, so a look costs nothing, and a step run past the end costs a
# whole forward: the host looks every step there.
SYNC_EVERY_CPU = 1
# One compiled step serves every model of the process: each (model, bucket, set of hooks) is one of its
# graphs. Dynamo's default limit (8) would silently send the ninth back to eager code.
RECOMPILE_LIMIT = 256

# Per model (by id, checked through a weak reference): its compiled step (its static caches: `kv.static_cache`).
_STATE: dict[int, dict[str, Any]] = {}
# (batch, bucket) -> seconds of the latest call that compiled the step (a new bucket, or a new set of hooks);
# each compile is also logged (logger `transformer_bridge.generation.kv`, level INFO).
COMPILE_SECONDS: dict[tuple[int, int], float] = {}


def bucket_length(n: int) -> int:
    """The cache length of a generation needing ``n`` positions.

    Example:
        >>> bucket_length(70), bucket_length(64)
        (128, 64)
    """
    return -(-n // BUCKET) * BUCKET


def _step(
    model: BridgeCore,
    token: Int[Tensor, "batch 1"],
    position: Int[Tensor, "batch 1"],
    mask: Int[Tensor, "batch bucket"] | None,
    cache: StaticCache,
    cache_position: Int[Tensor, " 1"],
    ctx: HookContext,
) -> Float[Tensor, "batch d_vocab"]:
    # checked=False: the caller checks that every hooked site ran (`BridgeCore.sites_checked`), outside the
    # compiled code, so the step is one graph (one CUDA graph) with no break.
    out = model.run_model(token, mask, ctx, past_key_values=cache, position_ids=position, logits_to_keep=1,
                          cache_position=cache_position, checked=False)  # fmt: skip
    return out.logits[:, -1]


def _state(model: BridgeCore) -> dict[str, Any]:
    state = _STATE.get(id(model))
    if state is None or state["model"]() is not model:
        state = {"model": weakref.ref(model), "compiled": None}
        _STATE[id(model)] = state
    return state


def compiled_step(model: BridgeCore) -> Callable:
    """The model's compiled one-token step (made once per model; dynamo keeps one graph per bucket).

    Called once per generation: weights packed for the step (`packed`) and edited since are re-packed here.
    """
    packed.revalidate()
    state = _state(model)
    if state["compiled"] is None:
        # A copy of `_step` with its own code object per model: dynamo keeps its graphs per code object, so one
        # model's graphs are never tried (nor counted against the recompile limit) for another, and a graph
        # traced for a freed model cannot serve a new one that happens to reuse its objects' addresses.
        state["step"] = types.FunctionType(_step.__code__.replace(), _step.__globals__, _step.__name__)
        # fullgraph: a step dynamo cannot trace whole raises at its first call instead of running in pieces;
        # `refuse` then tells a hook that cannot be traced (warned; eager) from model code that cannot (pieces).
        state["compiled"] = torch.compile(state["step"], dynamic=False, fullgraph=True,
                                          **compile_options(model.device))  # fmt: skip
        state["call"] = lambda *args: state["compiled"](*args)
    return state["call"]


def hook_set(model: BridgeCore) -> frozenset:
    """The hooks now attached, as (point, code) pairs: a new closure of the same function is the same hook."""
    return frozenset((point.name, _code(entry.fn)) for site in model._live for point in site.points.values()
                     for entry in point.fwd_hooks)  # fmt: skip


def _code(fn: Any) -> Any:
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    if not hasattr(fn, "__code__"):
        fn = type(fn).__call__  # a callable object (`Steering`): its class's __call__
    return getattr(fn, "__code__", None) or type(fn)


def refused(model: BridgeCore) -> bool:
    """Whether the hooks now attached could not be traced into the compiled step (see `refuse`)."""
    untraceable = _state(model).get("untraceable")
    return bool(untraceable) and hook_set(model) in untraceable


def refuse(model: BridgeCore, error: Exception) -> bool:
    """After dynamo could not trace the step whole: True when the model's own code stopped it (an MoE
    router's data-dependent loop, say): the step is then compiled in pieces, as torch.compile does by
    default, every hook still inside, and the caller runs it again. False when a hook stopped it: that set of
    hooks runs eagerly from now on, said once in a warning."""
    state = _state(model)
    frames = {(frame.filename, frame.name) for frame in getattr(error, "real_stack", None) or ()}
    hooks = hook_set(model)
    blamed = sorted({point for point, code in hooks
                     if isinstance(code, types.CodeType) and (code.co_filename, code.co_name) in frames})  # fmt: skip
    if not blamed:
        state["compiled"] = torch.compile(state["step"], dynamic=False, **compile_options(model.device))
        logger.info("%s: the decode step is compiled in pieces (dynamo cannot trace the model's code whole)",
                    type(model.hf_model).__name__)  # fmt: skip
        return True
    state.setdefault("untraceable", set()).add(hooks)
    reason = "\n".join(str(error).strip().splitlines()[:6])
    warnings.warn(
        f"`compile=True`: the hook on {', '.join(blamed)} cannot be traced into the compiled decode step (dynamo "
        "stopped at a graph break or a branch on tensor data), so this generation and later ones with the same "
        "hooks decode eagerly (same tokens, not compiled). Make the hook traceable (no .item(), .tolist(), "
        f"data-dependent Python branches or untraceable calls) or use `model.steer(...)`. Dynamo said:\n{reason}",
        stacklevel=4,
    )
    return False


def check(model: BridgeCore, cache_implementation: Any, compile: Any, p: Plan) -> bool:
    """Whether `generate` decodes over a static cache; raises, naming the keyword, for what cannot go with it.

    A controller and speculative decoding go with it: the row driver has a static cache too.
    """
    if not isinstance(compile, bool):
        raise TypeError(f"`compile` must be True or False, got {compile!r}.")
    if cache_implementation not in ("dynamic", "static"):
        raise ValueError(f"`cache_implementation` must be 'dynamic' or 'static', got {cache_implementation!r}.")
    if cache_implementation == "dynamic" and not compile:
        return False
    which = "compile=True" if compile else "cache_implementation='static'"
    clash = [name for name, on in (("num_beams > 1", p.search.num_beams > 1), ("use_cache=False", not p.use_cache),
                                   ("a state-space model", model.adapter.has_mixers)) if on]  # fmt: skip
    if clash:
        raise ValueError(f"`{which}` (a static KV cache) cannot be combined with {clash[0]}; drop one of them.")
    kind = type(model.hf_model).__name__
    if getattr(model.hf_model, "_can_compile_fullgraph", True) is False:
        # GPT-Neo: its attention slices its own causal mask by the key length, which a static cache fixes.
        if kind not in _WARNED:
            _WARNED.add(kind)
            warnings.warn(f"{kind} does not support a static KV cache (HF marks it so): `{which}` runs the "
                          "dynamic cache for it (same tokens, not compiled).", stacklevel=3)  # fmt: skip
        return False
    return True


_WARNED: set[str] = set()
