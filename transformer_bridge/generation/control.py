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

Speculative decoding runs here too (``drafts``, with or without a controller): after a row's tokens are
appended, its drafter proposes up to k more, fed with them in the same forward (kind ``"verify"``).
The row then walks the chunk's logits position by position exactly as if each were a one-token step
(processors, the controller's view and mask, the choice), accepting while the choice is the draft; at
the first disagreement it rewinds its own rejected drafts and appends the chosen token. Tokens the
controller forces that the drafts already hold cost nothing; others are appended as forced tokens.

Records (``return_dict=True``: ``logprobs``, ``top_logprobs``, ``output_logits``, ``output_scores``) are
kept per generated token and cut with the row (`records.RowRecords`).

Example:
    >>> def no_e(view):                      # never sample "e"
    ...     return Branch.sample(banned_e)
    >>> model.generate("Hello", max_new_tokens=8, controller=no_e)
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ..checks import ArgumentTypeError, describe
from ..core import BridgeCore
from .branch import Branch, View, as_branches, check_branch, samples
from .engine import Engine, Row
from .finish import Stream, as_plain_row, cut, output, stop, stops_at
from .kv import KVRows
from .options import Plan
from .outputs import GenerationOutput
from .records import RowRecords
from .speculative import Assistant, PromptLookup, Widths

_QUERY_AXIS_2 = ("hook_pattern", "hook_attn_scores")  # [batch, head, query_pos, key_pos]


class ControllerError(RuntimeError):
    """A controller raised; the message names the row and the step, the cause is chained."""


def check_controller(controller: Any, batch: int, model: BridgeCore) -> list[Any]:
    """The controller of each input row (see the module docstring); raises naming `controller`.

    A controller with ``bind(model)`` (a grammar: it needs the tokenizer) is replaced by what that returns.
    """
    if model.adapter.has_mixers:  # Mamba; hybrids' state-space and convolution layers
        raise ValueError(
            f"`controller` cannot drive a state-space model ({model.cfg.model_type}): the controlled engine keeps "
            "each row's past as KV entries it rewinds, copies and realigns per row, and a recurrent state has none. "
            "Generate without a controller (logits processors still apply)."
        )
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


_FREE = Branch.sample()  # what a row without a controller does at every position


def generate(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    p: Plan,
    controllers: list[Any],
    max_steps: int | None,
    kv: KVRows | None = None,
    compile: bool = False,
    drafts: PromptLookup | Assistant | None = None,
) -> GenerationOutput:
    """Run the row driver over a left-padded batch: one controller per row (None: sample freely, as the
    plain loop), speculative with ``drafts``; ``max_steps`` (None: no bound) counts forwards after the prompt.
    ``kv`` and ``compile``: the engine's KV cache (default dynamic) and compiled one-token step (`Engine`)."""
    rows = [Row(i, -1, [t for t, m in zip(ts, ms, strict=True) if m], int(sum(ms)), pending=int(sum(ms)),
                controller=c)
            for i, (ts, ms, c) in enumerate(zip(tokens.tolist(), mask.tolist(), controllers, strict=True))]  # fmt: skip
    everyone = list(rows)
    engine = Engine(model, rows, p.pad_token_id, p.use_cache, kv, compile)
    names = list(dict.fromkeys(n for c in controllers if c is not None for n in getattr(c, "reads", ())))
    captured: dict[str, Tensor] = {}
    hooks = [(n, _capture(captured, n)) for n in names]
    driver = _Driver(engine, p, drafts, captured)
    stream = Stream(p.streamer, tokens, p.pad_token_id) if p.streamer is not None else None
    with model.hooks(fwd_hooks=hooks, read_only=True):
        while engine.rows:
            everyone += driver.round(len(everyone))
            if p.stopping.out_of_time():
                driver.finish_all("max_time")
            elif max_steps is not None and driver.step > max_steps:
                driver.finish_all("max_steps")
            if stream is not None:
                stream.flush(everyone, driver.drafted)
            engine.retire()
    if stream is not None:
        stream.flush(everyone, driver.drafted, final=True)
    controlled = any(c is not None for c in controllers)
    return output(everyone, tokens.shape[1], p, tokens.device, driver.records, controlled)


class _Append:
    """What a verify walk appends once its row's rejected drafts are rewound: the chosen token (or the
    forced tokens the drafts did not hold), with the logits and scores of the position it takes."""

    def __init__(self, tokens: list[int], logits: Tensor, scores: Tensor | None) -> None:
        self.tokens, self.logits, self.scores = tokens, logits, scores


class _Driver:
    """The rounds of one generation: feed every row's pending tokens, decide each row (walking its verify
    chunk when it has drafts), apply the decisions, draft."""

    def __init__(self, engine: Engine, p: Plan, drafts: Any, captured: dict[str, Tensor]) -> None:
        self.engine, self.p, self.drafts, self.captured = engine, p, drafts, captured
        self.records = RowRecords(p)
        self.drafted: dict[int, int] = {}  # row id → drafts at the end of its tokens, fed but not yet verified
        # row id → how many drafts it asks an assistant for next (drafting costs the assistant a forward per
        # token): after a rejection, one more than it accepted; after a full acceptance, twice as many (up to k).
        self.ask: dict[int, int] = {}
        # How many of its drafts each row feeds (a verify chunk is as wide as its widest row): a cost model
        # with acceptance rates per draft source; row id → the source of the drafts it fed.
        self.widths = Widths(engine.device.type)
        self.sources: dict[int, int] = {}
        self.step = 0

    def round(self, next_id: int) -> list[Row]:
        """One forward and what follows it; returns the rows forked in it."""
        engine, p = self.engine, self.p
        rows = engine.rows
        chunk_needed = any(r.kind == "verify" for r in rows) or (
            p.records.on and any(r.kind == "forced" and r.pending > 1 for r in rows)
        )
        # The rewind below realigns the cache once for the uneven chunk and the rejected drafts together.
        logits, chunk = engine.feed(self.step, chunk_needed, realign=False)
        if chunk is not None and p.records.on:
            self._forced_records(chunk)
        decisions: list[list[Branch] | None] = []
        drops, at, appends = [0] * len(rows), {}, []
        for i, r in enumerate(rows):
            m = self.drafted.pop(r.id, 0)
            if not m:
                decisions.append(self._decide(r, i, logits))
                continue
            drops[i], outcome = self._walk(r, i, chunk, m)
            kept = m - drops[i] if r.finish is None else m
            self.ask[r.id] = min(self.drafts.k, 2 * m) if kept == m else kept + 1
            self.widths.observe(self.sources.pop(r.id, 0), m, kept)
            if isinstance(outcome, tuple):  # a decision the walk does not take itself: `_apply` at that position
                decisions.append(outcome[0])
                at[i] = outcome[1]
                continue
            decisions.append(None)
            if outcome is not None:
                appends.append((r, outcome))
        engine.rewind(drops, [False] * len(rows), compact=False)
        for r, a in appends:
            first = _logprob(a.logits, a.tokens[0]) if p.records.on else math.nan
            self.records.put(r.id, len(r.generated), a.logits, a.scores)
            r.append(a.tokens, "sampled" if len(a.tokens) == 1 else "forced", first)
            stop(r, p, (a.scores if a.scores is not None else a.logits.float())[None])
            _appended(r)
        if at:
            logits = logits.clone()
            for i, row_logits in at.items():
                logits[i] = row_logits
        forks = self._apply(decisions, logits, next_id)
        self._propose()
        self.step += 1
        return forks

    def finish_all(self, reason: str) -> None:
        for r in self.engine.rows:
            if r.finish is None:
                r.finish = reason
                m = self.drafted.pop(r.id, 0)
                if m:  # drafts fed but never verified leave no trace
                    cut(r, len(r.tokens) - m)

    # -- deciding ----------------------------------------------------------------------------------------
    def _decide(self, row: Row, i: int, logits: Tensor) -> list[Branch]:
        if row.deferred is not None:
            branch, row.deferred = row.deferred, None
            return [branch]
        if row.controller is None:
            return [_FREE]
        slot = self.engine.slots[i]  # hooks see the batch by slot (a static cache keeps finished rows' slots)
        reads = {name: _newest(t[slot], name, row.column, row.fresh) for name, t in self.captured.items()}
        view = View(row.id, self.step, list(row.tokens), row.prompt_length, row.branch, row.parent, row.backtracked,
                    list(row.appended), logits[i], reads)  # fmt: skip
        return _ask(row, view)

    def _walk(self, r: Row, i: int, chunk: Tensor, m: int) -> tuple[int, Any]:
        """Verify row ``r``'s ``m`` drafts: each position as a one-token step would see it. Returns the drafts to
        rewind and then an `_Append`, ``(branches, logits)`` for `_apply`, or None (the row finished)."""
        p = self.p
        first, fed = len(r.tokens) - m, len(r.tokens) - r.fresh
        drafts = r.tokens[first:]
        j, appended, backtracked = 0, list(r.appended), r.backtracked
        while True:
            pos = first + j  # this step chooses the token at index `pos`; the logits of index pos - 1 predict it
            lg = chunk[i, r.column + pos - fed - 1]
            if r.controller is None:
                branches = [_FREE]
            else:
                reads = {name: _newest(t[self.engine.slots[i]], name, r.column + pos - len(appended) - fed,
                                       len(appended)) for name, t in self.captured.items()}  # fmt: skip
                view = View(r.id, self.step, r.tokens[:pos], r.prompt_length, r.branch, r.parent, backtracked,
                            list(appended), lg, reads)  # fmt: skip
                branches = _ask(r, view)
            b = branches[0] if len(branches) == 1 else None
            if b is None or b.backtrack or (samples(b) and len(b.ff_tokens)):
                return m - j, (branches, lg)  # stop, fork, backtrack: as without drafts, at this position
            where = f"The controller's branch for row {r.id} at step {self.step}"
            allowed = check_branch(b, pos - r.prompt_length, lg.shape[-1], where)
            if samples(b):
                scores = self._processed(r.tokens[:pos], r.prompt_length, lg)
                token, scores, accepted = p.sampler.verify(scores, drafts[j] if j < m else None, allowed)
                if not accepted:
                    return m - j, _Append([token], lg, scores)
                if self._accept(r, pos, lg, scores):
                    return 0, None
                j, appended, backtracked = j + 1, [token], 0
                continue
            forced = [int(t) for t in b.ff_tokens[0]]
            same = 0  # forced tokens the drafts already hold: fed and verified for free
            while same < len(forced) and j + same < m and drafts[j + same] == forced[same]:
                same += 1
            for t in range(same + 1):
                lg = chunk[i, r.column + pos + t - fed - 1]
                scores = self._free_scores(r.tokens[: pos + t], r.prompt_length, lg) if self.records.on else None
                if t == same:
                    break
                if self._accept(r, pos + t, lg, scores):
                    return 0, None
            if same < len(forced):
                return m - j - same, _Append(forced[same:], lg, scores)
            j, appended, backtracked = j + same, forced, 0

    def _accept(self, r: Row, pos: int, logits: Tensor, scores: Tensor | None) -> bool:
        """Token ``pos`` of ``r`` (a draft) is kept: record it; whether the row stops there."""
        g = pos - r.prompt_length
        if self.p.records.on:
            r.logprobs[g] = _logprob(logits, r.tokens[pos])
        self.records.put(r.id, g, logits, scores)
        reason = stops_at(r, self.p, pos + 1, scores if scores is not None else logits.float())
        if reason is not None:
            cut(r, pos + 1)
            r.finish = reason
            return True
        return False

    def _processed(self, tokens: list[int], prompt_length: int, logits: Tensor) -> Tensor:
        """The processors see the row as the plain loop would (`as_plain_row`)."""
        if not self.p.sampler.processors:
            return logits.float()
        ids, mask = as_plain_row(tokens, prompt_length, self.p)
        return self.p.sampler.process(ids.to(logits.device), logits[None], mask.to(logits.device))[0]

    def _free_scores(self, tokens: list[int], prompt_length: int, logits: Tensor) -> Tensor:
        """What the loop would draw from at this position without a mask: a forced token's ``scores``."""
        return self.p.sampler.warp(self._processed(tokens, prompt_length, logits)[None])[0]

    def _forced_records(self, chunk: Float[Tensor, "batch chunk d_vocab"]) -> None:
        """Records of forced tokens after the first, from the forward that fed them (logits at t predict t + 1)."""
        for i, r in enumerate(self.engine.rows):
            a = len(r.appended)
            if r.kind not in ("forced", "verify") or not a:
                continue
            fed, end = len(r.tokens) - r.fresh, len(r.tokens) - self.drafted.get(r.id, 0)
            for t in range(max(end - a, fed + 1, r.prompt_length), end):  # the first: only after a re-fed token
                lg = chunk[i, r.column + t - fed - 1]
                g = t - r.prompt_length
                r.logprobs[g] = _logprob(lg, r.tokens[t])
                if self.records.on:
                    scores = self._free_scores(r.tokens[:t], r.prompt_length, lg) if self.records.keep_scores else None
                    self.records.put(r.id, g, lg, scores)

    # -- applying ----------------------------------------------------------------------------------------
    def _apply(self, decisions: list[list[Branch] | None], logits: Tensor, next_id: int) -> list[Row]:
        """Apply each row's branches (None: the walk already did): stop, fork, rewind, then sample or append.
        Returns the new (forked) rows."""
        engine, p = self.engine, self.p
        d_vocab = logits.shape[-1]
        masks: list[list[Tensor | None]] = []
        for r, branches in zip(engine.rows, decisions, strict=True):
            where = f"The controller's branch for row {r.id} at step {self.step}"
            masks.append([check_branch(b, len(r.generated), d_vocab, where) for b in branches or ()])
        sources, forks, plan = [], [], []  # plan: (batch row, branch, mask) for every row that continues
        for i, (r, branches) in enumerate(zip(engine.rows, decisions, strict=True)):
            if branches is None:
                continue
            if not branches:
                r.finish = "controller"
                continue
            plan.append((i, branches[0], masks[i][0]))
            for j, b in enumerate(branches[1:], start=1):
                child = r.copy(next_id + len(forks), own_copy(r.controller))
                child.branch = j
                self.records.fork(r.id, child.id)
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
            # After a backtrack the logits of the rewound position are unknown: the last kept token is fed again
            # (before sampling; with forced tokens, in their chunk when their records are kept).
            refeed[i] = b.backtrack > 0 and (samples(b) or not b.ff_tokens[0] or p.records.on)
            drops[i] = b.backtrack
            rows[i].backtracked = b.backtrack
            if samples(b) or not b.ff_tokens[0]:
                if refeed[i]:
                    rows[i].appended = []
                    if samples(b):
                        rows[i].deferred = Branch(0, b.sample_mask, b.ff_tokens)
                else:
                    to_sample.append((i, b, mask))
            else:
                forced.append((i, [int(t) for t in b.ff_tokens[0]]))
        engine.rewind(drops, refeed)
        for i, tokens in forced:
            r = rows[i]
            if refeed[i]:  # the forward that feeds them scores the first one too (`_forced_records`)
                first = math.nan
            else:
                first = _logprob(logits[i], tokens[0]) if p.records.on else math.nan
                if self.records.on:
                    scores = (
                        self._free_scores(r.tokens, r.prompt_length, logits[i]) if self.records.keep_scores else None
                    )
                    self.records.put(r.id, len(r.generated), logits[i], scores)
            r.append(tokens, "forced" if len(tokens) > 1 or refeed[i] else "sampled", first)
            stop(r, p, logits[i : i + 1].float())
            if refeed[i] and r.finish is None:
                r.pending += 1  # the re-fed token goes first in the chunk
            _appended(r)
        if to_sample:
            self._sample(to_sample, logits)
        return forks

    def _sample(self, plan: list[tuple[int, Branch, Tensor | None]], logits: Tensor) -> None:
        """Sample the rows of ``plan`` in one batch: processors → mask → warpers → draw."""
        p, rows = self.p, self.engine.rows
        index = [i for i, _, _ in plan]
        raw = logits[index]
        scores = raw.float()
        if p.sampler.processors:
            scores = torch.stack([self._processed(rows[i].tokens, rows[i].prompt_length, s)
                                  for i, s in zip(index, scores, strict=True)])  # fmt: skip
        masks, full = [m for _, _, m in plan], None
        if any(m is not None for m in masks):
            full = torch.ones_like(scores, dtype=torch.bool)
            for k, m in enumerate(masks):
                if m is not None:
                    full[k] = m.to(full.device)
        chosen, scores = p.sampler.pick(scores, full)
        logprobs = raw.float().log_softmax(-1) if p.records.on else None
        for k, ((i, b, _), t) in enumerate(zip(plan, chosen.tolist(), strict=True)):
            r = rows[i]
            follow = next((list(s) for s in b.ff_tokens if len(s) and int(s[0]) == t), [t])
            first = float(logprobs[k, t]) if logprobs is not None else math.nan
            self.records.put(r.id, len(r.generated), raw[k], scores[k])
            r.append([int(x) for x in follow], "sampled" if len(follow) == 1 else "forced", first)
            stop(r, p, scores[k : k + 1])
            _appended(r)

    def _propose(self) -> None:
        """Draft after every row that just had tokens appended (up to its room under ``max_new_tokens``)."""
        if self.drafts is None:
            return
        room = {r.id: self.p.max_new_tokens - len(r.generated) for r in self.engine.rows}
        rows = [r for r in self.engine.rows if r.finish is None and r.deferred is None and r.pending
                and r.kind in ("sampled", "forced") and room[r.id] > 0]  # fmt: skip
        if not rows:
            return
        asks = isinstance(self.drafts, Assistant)  # a lookup's drafts are free: it always proposes k
        want = {r.id: min(room[r.id], self.ask.get(r.id, self.drafts.k) if asks else self.drafts.k) for r in rows}
        k = max(want.values())
        found = self.drafts.propose([r.tokens for r in rows], k, [r.id for r in rows])
        drafts = [[int(t) for t in d[: want[r.id]]] for r, d in zip(rows, found, strict=True)]
        # Trim to the chunk width that pays off: every row of the forward pays for the widest row's columns.
        engine = self.engine
        running = [r for r in engine.rows if r.finish is None]
        drafting = [(r, d, s) for r, d, s in zip(rows, drafts, self.drafts.sources, strict=True) if d]
        ids = {r.id for r, _, _ in drafting}
        base = max((r.pending for r in running if r.id not in ids), default=1)
        batch = len(engine.real) if engine.kv.static else len(running)
        counts = self.widths.trim(batch, len(running), base, [(r.pending, len(d), s) for r, d, s in drafting])
        for (r, d, s), n in zip(drafting, counts, strict=True):
            if n:
                r.tokens.extend(d[:n])
                r.logprobs.extend([math.nan] * n)
                r.pending, r.kind = r.pending + n, "verify"
                self.drafted[r.id], self.sources[r.id] = n, s


def _ask(row: Row, view: View) -> list[Branch]:
    c = row.controller
    fn: Callable = getattr(c, "mid_process", None) or c
    try:
        result = fn(view)
    except Exception as e:
        raise ControllerError(
            f"The controller raised at row {row.id}, step {view.step}: {type(e).__name__}: {e}. The generation "
            "stopped; every hook it added was removed."
        ) from e
    return as_branches(result, f"The controller (row {row.id}, step {view.step})")


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
