"""The fast decode loop: a preallocated (static) KV cache, a one-token step that can be compiled, no host sync per step.

``generate(..., cache_implementation="static")`` runs this loop eagerly; ``generate(..., compile=True)``
also compiles its one-token decode step with ``torch.compile`` (on CUDA with CUDA graphs: mode
``"reduce-overhead"``). Shapes are fixed per *bucket*: the batch size and the cache length (prompt +
``max_new_tokens``, rounded up to a multiple of `BUCKET`), so one compiled step serves every call of
that bucket in the process; the cache of a bucket is kept and reset between calls.

What makes the step static: HF's `StaticCache` written at ``cache_position``, an attention mask over the
whole bucket (padding and not-yet-written slots are 0), ``position_ids`` per row (left padding: a row's
first real token is 0), and one token per row. Hooks run inside the compiled step (dynamo traces them;
`Steering` interventions keep their tensors, so `Steering.update` does not retrace); ``hook.ctx`` is as
in the plain loop. The prefill and the ``return_cache`` recompute stay eager.

No host sync per step: finished rows and stop conditions live on the device, and the host asks
whether every row is done only every `SYNC_EVERY` steps (every step with a streamer). Steps run after
every row finished append padding only, and the output is cut to the last real token, so the
sequences equal the plain loop's.
"""

import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from ..core import BridgeCore
from ..hook_points import HookContext
from .decode import _progress, _Records
from .options import Plan
from .outputs import FINISH_REASONS, GenerationOutput
from .stopping import MAX_TIME

BUCKET = 64  # cache lengths are rounded up to a multiple of this
SYNC_EVERY = 8  # decode steps between two looks of the host at the finished rows
# One compiled step serves every model of the process: each (model, bucket, set of hooks) is one of its
# graphs. Dynamo's default limit (8) would silently send the ninth back to eager code.
RECOMPILE_LIMIT = 256

# Per model (by id, checked through a weak reference): its compiled step and its static caches by
# (batch, length).
_STATE: dict[int, dict[str, Any]] = {}
COMPILE_SECONDS: dict[tuple[int, int], float] = {}  # (batch, bucket) -> seconds of the first compiled call


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
    out = model.run_model(token, mask, ctx, past_key_values=cache, position_ids=position, logits_to_keep=1,
                          cache_position=cache_position)  # fmt: skip
    return out.logits[:, -1]


def _state(model: BridgeCore) -> dict[str, Any]:
    state = _STATE.get(id(model))
    if state is None or state["model"]() is not model:
        state = {"model": weakref.ref(model), "caches": {}, "compiled": None}
        _STATE[id(model)] = state
    return state


def _cache(model: BridgeCore, batch: int, length: int) -> StaticCache:
    caches = _state(model)["caches"]
    cache = caches.get((batch, length))
    if cache is None:
        cache = StaticCache(config=model.hf_model.config, max_cache_len=length)
        # Sliding-window layers as full ones (the mask applies the window): HF's sliding static layer keeps
        # its length as a Python int, which a compiled step would be re-traced for at every step.
        cache.layers = [StaticLayer(max_cache_len=length) if getattr(layer, "is_sliding", False) else layer
                        for layer in cache.layers]  # fmt: skip
        caches[(batch, length)] = cache
    else:
        cache.reset()
    return cache


def compiled_step(model: BridgeCore) -> Callable:
    """The model's compiled one-token step (made once per model; dynamo keeps one graph per bucket)."""
    state = _state(model)
    if state["compiled"] is None:
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        state["compiled"] = torch.compile(_step, mode=mode, dynamic=False)
    return state["compiled"]


def generate(
    model: BridgeCore, tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"], p: Plan, compile: bool
) -> GenerationOutput:
    """Greedy or sampled decoding of a left-padded batch over a static cache; see the module docstring."""
    batch, width = tokens.shape
    device = tokens.device
    total = width + p.max_new_tokens
    length = bucket_length(total)
    # Buffers of the bucket's length, so that the step's inputs (slices of them) have the bucket's strides.
    seq = tokens.new_full((batch, length), p.pad_token_id)
    seq[:, :width] = tokens
    full_mask = mask.new_zeros((batch, length))
    full_mask[:, :width] = mask
    positions = mask.new_zeros((batch, length))
    positions[:, :width] = (mask.cumsum(-1) - 1).clamp_min(0)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    reason = torch.zeros(batch, dtype=torch.long, device=device)
    records = _Records(p)
    padded = not bool(mask.all())
    cache = _cache(model, batch, length)
    step_fn = compiled_step(model) if compile else _step
    every = 1 if p.streamer is not None else SYNC_EVERY
    if p.streamer is not None:
        p.streamer.put(tokens.cpu())

    real = mask.bool()
    ctx = HookContext("prefill", 0, positions[:, :width], ~real, torch.zeros_like(real), "prompt")
    out = model.run_model(tokens, full_mask if padded else None, ctx, past_key_values=cache,
                          position_ids=positions[:, :width], logits_to_keep=1,
                          cache_position=torch.arange(width, device=device))  # fmt: skip
    logits = out.logits[:, -1]
    n_new = 0
    with _progress(p) as steps:
        for i in steps:
            cur = width + i
            token, scores = p.sampling.choose(logits, seq[:, :cur], full_mask[:, :cur])
            records.add(logits, scores, token)
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
            if n_new == p.max_new_tokens or (p.stopping.per_row and n_new % every == 0 and bool(done.all())):
                break
            if p.stopping.out_of_time():
                reason = reason.masked_fill(~done, MAX_TIME)
                break
            real = full_mask[:, cur : cur + 1].bool()
            ctx = HookContext("decode", i + 1, positions[:, cur : cur + 1], ~real, real, "sampled")
            where = torch.tensor([cur], device=device)
            start = time.perf_counter()
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                logits = step_fn(model, seq[:, cur : cur + 1], positions[:, cur : cur + 1],
                                 full_mask if padded else None, cache, where, ctx)  # fmt: skip
            if compile and i == 0 and (batch, length) not in COMPILE_SECONDS:
                COMPILE_SECONDS[(batch, length)] = time.perf_counter() - start
    if p.streamer is not None:
        p.streamer.end()
    # Steps after every row finished (between two looks of the host) appended padding only: cut them.
    if p.stopping.per_row and n_new > 1:
        generated = full_mask[:, width : width + n_new]
        n_new = int(generated.any(0).nonzero().max()) + 1 if bool(generated.any()) else n_new
        records.keep(n_new)
    return records.finish(
        GenerationOutput(
            sequences=seq[:, : width + n_new].contiguous(),
            attention_mask=full_mask[:, : width + n_new].contiguous(),
            prompt_lengths=mask.sum(-1),
            prompt_width=width,
            finish_reasons=[FINISH_REASONS[c] for c in reason.tolist()],
        )
    )


def check(model: BridgeCore, cache_implementation: Any, compile: Any, p: Plan, controller: Any, drafts: Any) -> bool:
    """Whether `generate` takes this loop; raises, naming the keyword, for what cannot go with it."""
    if not isinstance(compile, bool):
        raise TypeError(f"`compile` must be True or False, got {compile!r}.")
    if cache_implementation not in ("dynamic", "static"):
        raise ValueError(f"`cache_implementation` must be 'dynamic' or 'static', got {cache_implementation!r}.")
    if cache_implementation == "dynamic" and not compile:
        return False
    which = "compile=True" if compile else "cache_implementation='static'"
    clash = [name for name, on in (("num_beams > 1", p.search.num_beams > 1), ("use_cache=False", not p.use_cache),
                                   ("controller", controller is not None), ("speculative decoding", drafts is not None),
                                   ("a state-space model", model.adapter.ssm is not None)) if on]  # fmt: skip
    if clash:
        raise ValueError(f"`{which}` (the static-cache loop) cannot be combined with {clash[0]}; drop one of them.")
    kind = type(model.hf_model).__name__
    if getattr(model.hf_model, "_can_compile_fullgraph", True) is False:
        # GPT-Neo: its attention slices its own causal mask by the key length, which a static cache fixes.
        if kind not in _WARNED:
            _WARNED.add(kind)
            warnings.warn(f"{kind} does not support a static KV cache (HF marks it so): `{which}` runs the "
                          "dynamic-cache loop for it (same tokens, not compiled).", stacklevel=3)  # fmt: skip
        return False
    return True


_WARNED: set[str] = set()
