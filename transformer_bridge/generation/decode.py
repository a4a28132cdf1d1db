"""The tensor driver: `decode_steps` (the plain decode loop, a generator that `generate` drains and
`generate_stream` iterates), its pieces `prefill` / `decode_full`, and the
`return_cache` recompute.

Read it top to bottom. Options are resolved once into a `Plan` (`options.plan`, which raises every
argument error before any forward runs); the loop then only does tensor work. The model always gets
``position_ids`` (left padding: ``cumsum(mask) - 1``) and, when the prompt is padded, the attention mask
over cached + new positions, exactly as HF's own ``generate`` builds them, so greedy tokens equal HF's.

The KV cache is dynamic (HF's `DynamicCache`; the host looks at the finished rows after every step) or
static (``cache_implementation="static"`` / ``compile=True``: `kv.StaticKVRows`, preallocated for
prompt + ``max_new_tokens`` rounded up to a bucket; finished rows and stop conditions stay on the device
and the host looks every `fast.SYNC_EVERY` steps on an accelerator, every step on the CPU or with a
streamer). With ``compile=True`` the
one-token step is `fast.compiled_step`. Every forward goes through `kv.run_chunk`, as the controlled
engine's do.

Hooks see ``hook.ctx``: ``phase="prefill"`` (step 0, the whole prompt), then ``phase="decode"`` with
``step`` 1, 2, … (one new token per row; ``positions`` its absolute position in its row), and
``phase="recompute"`` for the ``return_cache`` forward. With ``use_cache=False`` each decode step is
a full forward over the sequence so far, so a hook sees every position again at every step.
"""

from collections.abc import Generator
from contextlib import AbstractContextManager, nullcontext

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformers import DynamicCache

from ..cache.activation_cache import ActivationCache
from ..core import BridgeCore
from ..hooks.points import HookContext
from ..hooks.recorded import active_forward_hooks
from . import fast
from .kv import make_kv, run_chunk
from .options import Plan
from .outputs import FINISH_REASONS, GenerationOutput
from .stopping import MAX_TIME


def prefill(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    positions: Int[Tensor, "batch pos"],
    cache: DynamicCache | None,
    padded: bool,
) -> Float[Tensor, "batch d_vocab"]:
    """Run the prompt (filling ``cache``; None: HF generate's ``use_cache=False``); the logits for the first new
    token."""
    real = mask.bool()
    ctx = HookContext("prefill", 0, positions, ~real, torch.zeros_like(real), "prompt")
    return _last_logits(model, tokens, mask if padded else None, ctx, cache, positions)


def decode_full(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    positions: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    prompt_width: int,
    padded: bool,
    step: int,
) -> Float[Tensor, "batch d_vocab"]:
    """``use_cache=False``: recompute the whole sequence so far (the reference for the KV cache)."""
    real = mask.bool()
    generated = real.clone()
    generated[:, :prompt_width] = False
    ctx = HookContext("decode", step, positions, ~real, generated, "recompute")
    return _last_logits(model, tokens, mask if padded else None, ctx, None, positions)


def next_token(
    logits: Float[Tensor, "batch d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    p: Plan,
) -> tuple[Int[Tensor, " batch"], Float[Tensor, "batch d_vocab"]]:
    """Processors → temperature → top-k → top-p → min-p → typical-p → draw (or argmax).

    Returns the token and the scores it was chosen from (HF's ``scores``: processed, and warped when
    sampling), which the stopping criteria and ``output_scores`` see.
    """
    return p.sampler.choose(logits, tokens, mask)


def generate(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    p: Plan,
    static: bool = False,
    compile: bool = False,
    embeds: Float[Tensor, "batch pos d_model"] | None = None,
) -> GenerationOutput:
    """Greedy or sampled decoding of a left-padded batch: `decode_steps` run to the end."""
    steps = decode_steps(model, tokens, mask, p, static, compile, embeds)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def decode_steps(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    p: Plan,
    static: bool = False,
    compile: bool = False,
    embeds: Float[Tensor, "batch pos d_model"] | None = None,
) -> Generator[tuple[Int[Tensor, " batch"], Int[Tensor, " batch"]], None, GenerationOutput]:
    """The decode loop as a generator: yields each step's tokens as soon as they are chosen, returns the output.

    Each yield is ``(token [batch], real [batch])``: a finished row gets the pad token and ``real`` 0
    (a view of the output's attention mask). Finished rows are frozen to the pad token; the loop ends
    when every row has stopped (seen by the host every step with a dynamic cache, every
    `fast.SYNC_EVERY` steps with a static one on an accelerator: the steps between append padding only and
    are cut).
    `generate_stream` iterates it: the next forward runs only when the next token is asked for.
    ``static`` / ``compile``: the static cache and the compiled one-token step (see the module docstring).
    ``embeds``: the prompt as embeddings (``tokens`` are placeholders): the prefill feeds them, and processors and
    stopping rules see the generated tokens only, as in HF's ``generate(inputs_embeds=...)``.
    """
    batch, width = tokens.shape
    total = width + p.max_new_tokens
    kv = make_kv(model, batch, total, static) if p.use_cache else None
    # Static: buffers of the bucket's length, so the mask a step reads spans the whole cache.
    length = kv.capacity if static else total
    seq = tokens.new_full((batch, length), p.pad_token_id)
    seq[:, :width] = tokens
    full_mask = mask.new_zeros((batch, length))
    full_mask[:, :width] = mask
    positions = mask.new_zeros((batch, length))
    positions[:, :width] = (mask.cumsum(-1) - 1).clamp_min(0)
    done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    reason = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    records = _Records(p)
    padded = not bool(mask.all())  # no padding: HF's own mask-free (fastest) attention path
    step_fn = fast.compiled_step(model) if compile else None
    every = fast.SYNC_EVERY_CPU if tokens.device.type == "cpu" else fast.SYNC_EVERY
    every = every if static and p.streamer is None else 1
    if p.streamer is not None:
        p.streamer.put(tokens.cpu())

    n_new = 0
    shown = 0 if embeds is None else width  # the columns processors and stopping rules see start here
    real = mask.bool()
    ctx = HookContext("prefill", 0, positions[:, :width], ~real, torch.zeros_like(real), "prompt")
    if kv is not None:
        logits = run_chunk(model, kv, tokens, mask if padded else None, positions[:, :width], ctx, 1, None, embeds)
        logits = logits[:, -1]
    else:
        logits = _last_logits(model, tokens, mask if padded else None, ctx, None, positions[:, :width])
    with _progress(p) as steps:
        for i in steps:
            cur = width + i
            token, scores = next_token(logits, seq[:, shown:cur], full_mask[:, shown:cur], p)
            records.add(logits, scores, token)
            token = token.masked_fill(done, p.pad_token_id)
            seq[:, cur] = token
            full_mask[:, cur] = ~done
            positions[:, cur] = positions[:, cur - 1] + (~done).long()
            if p.stopping.per_row:
                code = p.stopping.check(seq[:, shown : cur + 1], scores)
                newly = (code > 0) & ~done
                reason = torch.where(newly, code, reason)
                done |= newly
            if p.streamer is not None:
                p.streamer.put(token.cpu())
            yield token, full_mask[:, cur]
            n_new = i + 1
            if n_new == p.max_new_tokens or (p.stopping.per_row and n_new % every == 0 and bool(done.all())):
                break
            if p.stopping.out_of_time():
                reason = reason.masked_fill(~done, MAX_TIME)
                break
            now = cur + 1
            if kv is not None:
                real = full_mask[:, cur:now].bool()
                ctx = HookContext("decode", i + 1, positions[:, cur:now], ~real, real, "sampled")
                key_mask = (full_mask if static else full_mask[:, :now]) if padded else None
                logits = run_chunk(model, kv, seq[:, cur:now], key_mask, positions[:, cur:now], ctx, 1, step_fn)[:, -1]
            else:
                logits = decode_full(model, seq[:, :now], positions[:, :now], full_mask[:, :now], width, padded, i + 1)
    if p.streamer is not None:
        p.streamer.end()
    # Steps run after every row finished (between two looks of the host) appended padding only: cut them.
    if every > 1 and p.stopping.per_row and n_new > 1:
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


def recompute_cache(
    model: BridgeCore,
    out: GenerationOutput,
    names: list[str],
    device: torch.device | None,
) -> ActivationCache:
    """One forward over prompt + generated tokens with the active hooks plus caching hooks.

    `TransformerBridge.cache_forward`, the code path of `run_with_cache`, so the cache equals
    ``run_with_cache(out.sequences, attention_mask=out.attention_mask)`` bitwise; only ``hook.ctx``
    differs (``phase="recompute"``, ``is_generated`` marks generated tokens). Only the last position
    is unembedded: the logits are not returned, and every hook point comes before the unembedding.
    ``cache.generation_hooks`` records the forward hooks it ran under (the caching ones excepted), so that
    relevance methods that recompute a forward explain this run (`hooks.recorded.only`).
    """
    recorded = active_forward_hooks(model)
    tokens, mask = out.sequences, out.attention_mask
    ctx = HookContext.from_mask(mask, "recompute", 0, out.prompt_lengths)
    _, tensors = model.cache_forward(tokens, mask, names, device, ctx=ctx, logits_to_keep=1)
    target = device or mask.device
    lengths = out.prompt_lengths.to(target)
    cache = ActivationCache(tensors, model, attention_mask=mask.to(target), prompt_lengths=lengths)
    cache.generation_hooks = recorded
    return cache


def _last_logits(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch key_pos"] | None,
    ctx: HookContext,
    cache: DynamicCache | None,
    positions: Int[Tensor, "batch pos"] | None,
) -> Float[Tensor, "batch d_vocab"]:
    """`TransformerBridge.run_model` with ``logits_to_keep=1``, as HF's generate calls the model.

    Unembedding only the last position saves a ``[batch, prompt, d_vocab]`` matmul at the prefill
    (~4% of a 64-token batch-4 SmolLM2 run) and makes the logits bitwise HF's.
    """
    out = model.run_model(tokens, mask, ctx, past_key_values=cache, position_ids=positions, logits_to_keep=1,
                          use_cache=cache is not None)  # fmt: skip
    return out.logits[:, -1]


class _Records:
    """Per-step log-probabilities / top-k / logits / scores, kept only when asked for.

    One entry per step actually run, stacked at the end: a batch whose rows all stop at step 3 of
    ``max_new_tokens=8000`` holds 3 steps of logits, not 8000 preallocated ones.
    """

    def __init__(self, p: Plan) -> None:
        r = p.records
        self.on, self.k = r.on, r.top_logprobs
        self.keep_logits, self.keep_scores = r.on and r.output_logits, r.on and r.output_scores
        self.logprobs: list[Tensor] = []
        self.top_values: list[Tensor] = []
        self.top_ids: list[Tensor] = []
        self.logits: list[Tensor] = []
        self.scores: list[Tensor] = []

    def add(
        self,
        logits: Float[Tensor, "batch d_vocab"],
        scores: Float[Tensor, "batch d_vocab"],
        token: Int[Tensor, " batch"],
    ) -> None:
        if not self.on:
            return
        logprobs = logits.float().log_softmax(-1)
        self.logprobs.append(logprobs.gather(-1, token[:, None])[:, 0])
        if self.k:
            values, ids = logprobs.topk(self.k, dim=-1)
            self.top_values.append(values)
            self.top_ids.append(ids)
        if self.keep_logits:
            self.logits.append(logits.float())
        if self.keep_scores:
            self.scores.append(scores)

    def keep(self, n: int) -> None:
        """Forget the steps after the first ``n`` (a static-cache loop runs a few steps past the end)."""
        for steps in (self.logprobs, self.top_values, self.top_ids, self.logits, self.scores):
            del steps[n:]

    def finish(self, out: GenerationOutput) -> GenerationOutput:
        """Stack the steps run and zero the steps after a row finished."""
        if not self.on:
            return out
        real = out.attention_mask[:, out.prompt_width :].bool()
        out.logprobs = _stacked(self.logprobs, real)
        if self.k:
            out.top_logprobs = _stacked(self.top_values, real[..., None])
            out.top_tokens = _stacked(self.top_ids, real[..., None])
        if self.keep_logits:
            out.logits = _stacked(self.logits, real[..., None])
        if self.keep_scores:
            out.scores = tuple(_stacked(self.scores, real[..., None]).unbind(1))  # HF's layout: one per step
        return out


def _stacked(steps: list[Tensor], real: Bool[Tensor, "batch new ..."]) -> Tensor:
    """``[batch, new, ...]`` from one tensor per step, zero where ``real`` is False; frees the list."""
    out = torch.stack(steps, dim=1)
    steps.clear()
    return out.masked_fill_(~real, 0)  # not a product: scores hold -inf, and -inf * 0 is nan


def _progress(p: Plan) -> AbstractContextManager:
    """The decode steps, wrapped in a progress bar with ``verbose`` (closed even when the loop breaks)."""
    steps = range(p.max_new_tokens)
    if not p.verbose:
        return nullcontext(steps)
    from tqdm.auto import tqdm

    return tqdm(steps, desc="generate", leave=False)
