"""Controlled generation: `generate(..., controller=c)`, a controller between forwards.

After every forward each running row is shown to its controller as a `View` (its tokens, the
next-token logits, the activations the controller ``reads`` from that same forward) and the
controller answers with branches (`Branch`): mask the sampling, append forced tokens (all of them in
one forward), backtrack, fork, or stop. A controller is an object with ``mid_process(view)`` or a
plain callable ``c(view)``; it may declare ``reads = ["blocks.3.hook_resid_post", ...]``. Optional
methods: ``bind(model)`` (called once, returns the controller to use: a grammar binds the tokenizer)
and ``appended(generated)`` (called when tokens are appended to its row, before the forward that feeds
them: a grammar starts computing its next mask there, in parallel with the forward).

Per-row state: when the controller has a ``fork()`` method, every row gets its own copy
(``c.fork()`` for each input row, ``row_controller.fork()`` when a row forks) and the object passed
to `generate` is left untouched; without one, every row shares the object (key state by
``view.row``). A list of controllers gives one per prompt.

Counting: ``max_new_tokens`` bounds each row's generated tokens *as they stand* (a backtracked token
no longer counts; forced tokens count); ``max_steps`` bounds the forwards after the prompt, so a
controller that keeps backtracking ends (finish reason ``"max_steps"``).

Example:
    >>> def no_e(view):                      # never sample "e"
    ...     return Branch.sample(banned_e)
    >>> model.generate("Hello", max_new_tokens=8, controller=no_e)
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..checks import ArgumentTypeError, describe
from ..core import BridgeCore
from .branch import Branch, View, as_branches, check_branch, samples
from .engine import Engine, Row, fill_forced_logprobs
from .kv import KVRows
from .options import Plan
from .outputs import FINISH_REASONS, GenerationOutput

_QUERY_AXIS_2 = ("hook_pattern", "hook_attn_scores")  # [batch, head, query_pos, key_pos]


class ControllerError(RuntimeError):
    """A controller raised; the message names the row and the step, the cause is chained."""


def check_controller(controller: Any, batch: int, model: BridgeCore) -> list[Any]:
    """The controller of each input row (see the module docstring); raises naming `controller`.

    A controller with ``bind(model)`` (a grammar: it needs the tokenizer) is replaced by what that returns.
    """
    given = list(controller) if isinstance(controller, (list, tuple)) else None
    if given is not None and len(given) != batch:
        raise ValueError(f"`controller` is a list of {len(given)}; give one per prompt ({batch}) or a single one.")
    for c in given or [controller]:
        if not callable(getattr(c, "mid_process", None)) and not callable(c):
            raise ArgumentTypeError(
                f"`controller` must have a `mid_process(view)` method or be a callable `f(view)`, got {describe(c)}."
            )
        reads = getattr(c, "reads", ())
        if isinstance(reads, str) or not all(isinstance(n, str) for n in reads):
            raise ArgumentTypeError(f"`controller.reads` must be a list of hook names, got {describe(reads)}.")
    bound = [c.bind(model) if callable(getattr(c, "bind", None)) else c for c in given or [controller]]
    return [own_copy(c) for c in (bound if given else bound * batch)]


def generate(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    p: Plan,
    controllers: list[Any],
    max_steps: int,
    kv: KVRows | None = None,
    compile: bool = False,
) -> GenerationOutput:
    """Run the controlled loop over a left-padded batch (one controller per row); ``kv`` / ``compile``: the
    engine's cache (default dynamic) and compiled one-token step (`engine.Engine`)."""
    rows = [Row(i, -1, [t for t, m in zip(ts, ms, strict=True) if m], int(sum(ms)), pending=int(sum(ms)),
                controller=c)
            for i, (ts, ms, c) in enumerate(zip(tokens.tolist(), mask.tolist(), controllers, strict=True))]  # fmt: skip
    everyone = list(rows)
    engine = Engine(model, rows, p.pad_token_id, p.use_cache, kv, compile)
    names = list(dict.fromkeys(n for c in controllers for n in getattr(c, "reads", ())))
    captured: dict[str, Tensor] = {}
    hooks = [(n, _capture(captured, n)) for n in names]
    step = 0
    with model.hooks(fwd_hooks=hooks, read_only=True):
        while engine.rows:
            all_logits = p.records.on and any(r.kind == "forced" and r.pending > 1 for r in engine.rows)
            logits, chunk_logits = engine.feed(step, all_logits)
            if chunk_logits is not None:
                fill_forced_logprobs(engine.rows, chunk_logits)
            decisions = [_decide(r, i, step, logits, captured) for i, r in enumerate(engine.rows)]
            everyone += _apply(engine, decisions, logits, p, step, len(everyone))
            step += 1
            if p.stopping.out_of_time():
                _finish_all(engine.rows, "max_time")
            elif step > max_steps:
                _finish_all(engine.rows, "max_steps")
            engine.retire()
    return _output(everyone, tokens.shape[1], p, tokens.device)


def _decide(row: Row, i: int, step: int, logits: Tensor, captured: dict[str, Tensor]) -> list[Branch]:
    if row.deferred is not None:
        branch, row.deferred = row.deferred, None
        return [branch]
    reads = {name: _newest(t[i], name, row.column, row.fresh) for name, t in captured.items()}
    view = View(row.id, step, list(row.tokens), row.prompt_length, row.branch, row.parent, row.backtracked,
                list(row.appended), logits[i], reads)  # fmt: skip
    c = row.controller
    fn: Callable = getattr(c, "mid_process", None) or c
    try:
        result = fn(view)
    except Exception as e:
        raise ControllerError(
            f"The controller raised at row {row.id}, step {step}: {type(e).__name__}: {e}. The generation stopped; "
            "every hook it added was removed."
        ) from e
    return as_branches(result, f"The controller (row {row.id}, step {step})")


def _apply(
    engine: Engine, decisions: list[list[Branch]], logits: Tensor, p: Plan, step: int, next_id: int
) -> list[Row]:
    """Apply each row's branches: stop, fork, rewind, then sample or append. Returns the new (forked) rows."""
    d_vocab = logits.shape[-1]
    masks: list[list[Tensor | None]] = []
    for r, branches in zip(engine.rows, decisions, strict=True):
        where = f"The controller's branch for row {r.id} at step {step}"
        masks.append([check_branch(b, len(r.generated), d_vocab, where) for b in branches])
    sources, forks, plan = [], [], []  # plan: (batch row, branch, mask) for every row that continues
    for i, (r, branches) in enumerate(zip(engine.rows, decisions, strict=True)):
        if not branches:
            r.finish = "controller"
            continue
        plan.append((i, branches[0], masks[i][0]))
        for j, b in enumerate(branches[1:], start=1):
            child = r.copy(next_id + len(forks), own_copy(r.controller))
            child.branch = j
            plan.append((len(engine.rows) + len(forks), b, masks[i][j]))
            sources.append(i)
            forks.append(child)
    if forks:
        engine.fork(sources, forks)
        logits = torch.cat([logits, logits[sources]])
    rows = engine.rows
    drops, refeed = [0] * len(rows), [False] * len(rows)
    to_sample, forced = [], []
    for i, b, mask in plan:
        refeed[i] = b.backtrack > 0 and (samples(b) or not b.ff_tokens[0])
        drops[i] = b.backtrack
        rows[i].backtracked = b.backtrack
        if refeed[i]:
            rows[i].appended = []
            if samples(b):
                rows[i].deferred = Branch(0, b.sample_mask, b.ff_tokens)
        elif samples(b):
            to_sample.append((i, b, mask))
        else:
            forced.append((i, list(b.ff_tokens[0])))
    engine.rewind(drops, refeed)
    for i, tokens in forced:
        first = _logprob(logits[i], tokens[0]) if p.records.on else math.nan
        rows[i].append([int(t) for t in tokens], "forced" if len(tokens) > 1 else "sampled", first)
        _stop(rows[i], p, logits[i : i + 1].float())
        _appended(rows[i])
    if to_sample:
        _sample(rows, to_sample, logits, p)
    return forks


def _sample(rows: list[Row], plan: list[tuple[int, Branch, Tensor | None]], logits: Tensor, p: Plan) -> None:
    """Sample the rows of ``plan`` in one batch: processors → mask → warpers → draw."""
    index = [i for i, _, _ in plan]
    raw = logits[index]
    scores = raw.float()
    if p.sampling.processors:
        scores = torch.cat([_processed(rows[i], s[None], p) for i, s in zip(index, scores, strict=True)])
    masks, full = [m for _, _, m in plan], None
    if any(m is not None for m in masks):
        full = torch.ones_like(scores, dtype=torch.bool)
        for k, m in enumerate(masks):
            if m is not None:
                full[k] = m.to(full.device)
    chosen, scores = p.sampling.pick(scores, full)
    logprobs = raw.float().log_softmax(-1) if p.records.on else None
    for k, ((i, b, _), t) in enumerate(zip(plan, chosen.tolist(), strict=True)):
        follow = next((list(s) for s in b.ff_tokens if len(s) and int(s[0]) == t), [t])
        first = float(logprobs[k, t]) if logprobs is not None else math.nan
        rows[i].append([int(x) for x in follow], "sampled" if len(follow) == 1 else "forced", first)
        _stop(rows[i], p, scores[k : k + 1])
        _appended(rows[i])


def _processed(row: Row, scores: Tensor, p: Plan) -> Tensor:
    """The processors see the row as the plain loop would (`_as_plain_row`)."""
    tokens, mask = _as_plain_row(row, p)
    return p.sampling.processors(tokens.to(scores.device), scores, mask.to(scores.device))


def _as_plain_row(row: Row, p: Plan) -> tuple[Tensor, Tensor]:
    """The row as the plain loop lays it out: its prompt left-padded to the prompt width, then its generated
    tokens (so ``min_new_tokens``, the penalties and stop strings count as there)."""
    prompt = row.tokens[: row.prompt_length]
    pad = p.stopping.prompt_width - len(prompt)
    tokens = torch.tensor([[p.pad_token_id] * pad + row.tokens])
    mask = torch.tensor([[0] * pad + [1] * len(row.tokens)])
    return tokens, mask


def _stop(row: Row, p: Plan, scores: Tensor) -> None:
    """EOS among the appended tokens, the length limit, stop strings and criteria."""
    eos = set(p.eos_token_ids)
    start = len(row.tokens) - row.pending
    for k in range(start, len(row.tokens)):
        if row.tokens[k] in eos and k >= row.prompt_length:
            _cut(row, k + 1)
            row.finish = "eos"
            return
    limit = row.prompt_length + p.max_new_tokens
    _cut(row, limit)
    if p.stopping.stop_strings or p.stopping.criteria:  # before the length limit, as in the plain loop
        tokens, _ = _as_plain_row(row, p)
        code = int(p.stopping.check(tokens.to(scores.device), scores)[0])
        if code:
            row.finish = FINISH_REASONS[code]
            return
    if len(row.tokens) >= limit:
        row.finish = "length"


def _cut(row: Row, length: int) -> None:
    extra = len(row.tokens) - length
    if extra > 0:
        del row.tokens[length:]
        del row.logprobs[length - row.prompt_length :]
        row.pending = max(row.pending - extra, 0)


def _finish_all(rows: list[Row], reason: str) -> None:
    for r in rows:
        if r.finish is None:
            r.finish = reason


def _output(rows: list[Row], prompt_width: int, p: Plan, device: torch.device) -> GenerationOutput:
    """Left-padded prompts (``prompt_width``) then generated tokens, right-padded to the longest row."""
    new = max(len(r.generated) for r in rows)
    seq = torch.full((len(rows), prompt_width + new), p.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(seq)
    logprobs = torch.zeros((len(rows), new))
    for i, r in enumerate(rows):
        prompt, gen = r.tokens[: r.prompt_length], r.generated
        seq[i, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt, dtype=torch.long)
        mask[i, prompt_width - len(prompt) : prompt_width] = 1
        if gen:
            seq[i, prompt_width : prompt_width + len(gen)] = torch.tensor(gen)
            mask[i, prompt_width : prompt_width + len(gen)] = 1
            logprobs[i, : len(gen)] = torch.tensor(r.logprobs[: len(gen)])
    return GenerationOutput(
        sequences=seq.to(device),
        attention_mask=mask.to(device),
        prompt_lengths=torch.tensor([r.prompt_length for r in rows], device=device),
        prompt_width=prompt_width,
        finish_reasons=[r.finish or "length" for r in rows],
        logprobs=logprobs.to(device) if p.records.on else None,
        parents=[r.parent for r in rows],
    )


def _appended(row: Row) -> None:
    """Tell the row's controller what was appended, before the forward (a grammar starts its next mask)."""
    notify = getattr(row.controller, "appended", None)
    if row.finish is None and callable(notify):
        notify(row.generated)


def own_copy(controller: Any) -> Any:
    fork = getattr(controller, "fork", None)
    return fork() if callable(fork) else controller


def _capture(store: dict[str, Tensor], name: str) -> Callable:
    def hook(tensor: Tensor, hook: Any) -> None:
        store[name] = tensor.detach()

    return hook


def _newest(tensor: Tensor, name: str, start: int, n: int) -> Tensor:
    return tensor.narrow(1 if name.endswith(_QUERY_AXIS_2) else 0, start, n)


def _logprob(logits: Tensor, token: int) -> float:
    return float(logits.float().log_softmax(-1)[token])
