"""Speculative decoding: draft k tokens cheaply, verify them in one forward of the model, keep what agrees.

Two drafters: `PromptLookup` (``prompt_lookup_num_tokens=k``: the k tokens that followed the latest earlier
occurrence of the row's last n-gram, no second model) and `Assistant` (``assistant_model=draft,
num_assistant_tokens=k``: the draft bridge's greedy continuation, from a KV cache of its own kept across
rounds). Both drafts are single proposals (a
one-hot draft distribution q), so the standard acceptance rule (`Sampler.verify`) is simple and exact:

* greedy: keep a draft token while it equals the model's argmax at its position; the first disagreement
  is replaced by the model's argmax. The tokens are the non-speculative tokens (up to how the verify
  chunk's kernels round: the logits of a k-token chunk are within float rounding of k one-token steps).
* sampling: keep draft ``d`` with probability ``p(d)`` (p: the processed, masked, warped distribution of
  the model at that position); on rejection draw from ``p`` with ``d`` removed, renormalised. Each emitted
  token is distributed exactly as a non-speculative draw.

The loop is the row driver's (`control.generate`): after a row's token is chosen its drafts are appended
as pending tokens of kind ``"verify"`` and fed with the other rows' chunks in one forward; then each row
walks its chunk's logits on its own (per-row acceptance) and rewinds only its own rejected drafts. A verify
chunk is as wide as its widest row and every row pays for every column, so `Widths` (a cost model) cuts the
drafts to the width that pays: expected accepted tokens (an acceptance rate per draft source: the n-gram
length a lookup matched, learned from the generation's own rounds) per cost of the forward (a fixed cost
plus one per position). An assistant is also asked for fewer drafts after a rejection (one more than the
row accepted; twice as many after a full acceptance): its drafts cost a draft forward each.
"""

import math
from dataclasses import dataclass, field
from typing import Any

from ..checks import check_int
from ..core import BridgeCore
from .engine import Engine, Row
from .options import Plan


@dataclass
class PromptLookup:
    """Drafts from the row itself: after the latest earlier occurrence of its last ``n``-gram (``n`` from
    ``max_ngram`` down to 1), the ``k`` tokens that followed it. A copy that reaches the row's end goes on
    copying what it has drafted (an overlapping copy), so a repeating cycle is drafted ``k`` tokens ahead.

    Example:
        >>> PromptLookup(3).propose([[5, 6, 7, 8, 5, 6]], 3)
        [[7, 8, 5]]
        >>> PromptLookup(3).propose([[1, 2, 9, 9, 9]], 4)
        [[9, 9, 9, 9]]
    """

    k: int
    max_ngram: int = 3
    # What each draft of the last `propose` came from: the length of the n-gram it matched (0: no draft).
    sources: list[int] = field(default_factory=list)

    def propose(self, rows: list[list[int]], k: int, ids: list[int] | None = None) -> list[list[int]]:
        found = [self._one(row, k) for row in rows]
        self.sources = [n for _, n in found]
        return [d for d, _ in found]

    def _one(self, row: list[int], k: int) -> tuple[list[int], int]:
        for n in range(min(self.max_ngram, len(row) - 1), 0, -1):
            tail = row[-n:]
            for start in range(len(row) - n - 1, -1, -1):  # latest occurrence first
                if row[start : start + n] == tail:
                    draft = row[start + n : start + n + k]
                    period = len(row) - start - n  # the copy's source runs `period` tokens behind it
                    while len(draft) < k:
                        draft.append(draft[len(draft) - period])
                    return draft, n
        return [], 0


class Assistant:
    """Drafts from a smaller bridge with the same vocabulary: its greedy continuation of each row.

    The draft model keeps its own KV cache across rounds (an `Engine` over it, one draft row per target
    row, keyed by the target row's id): each round a draft row rewinds the tokens the target rejected or
    changed (its common prefix with the target row stays cached), takes the target's new tokens as pending,
    then ``k`` greedy one-token steps run batched over the rows. A round costs the draft ``k`` forwards over
    the new tokens, not a forward over every row's whole sequence. A target row the drafter has not seen (the
    first round, a fork, a row that skipped a round) rebuilds the draft rows from their tokens; rows that are
    not asked for are dropped. Without ``ids`` nothing is kept (each call starts from the tokens).

    Example:
        >>> a = Assistant(draft, k=3)
        >>> a.propose([[1, 5, 7], [1, 9]], 3, ids=[0, 1])     # then [[1, 5, 7, 8, 2], ...] in the next round
    """

    def __init__(self, model: BridgeCore, k: int) -> None:
        self.model, self.k = model, k
        self.pad = model.pad_token_id if model.pad_token_id is not None else 0
        self.engine: Engine | None = None
        self.forwards = 0  # the draft model's forwards (for benchmarks)
        self.sources: list[int] = []  # one kind of draft (see `PromptLookup.sources`): 0 for every row

    def propose(self, rows: list[list[int]], k: int, ids: list[int] | None = None) -> list[list[int]]:
        if ids is None:
            self.engine, ids = None, list(range(len(rows)))
        wanted = dict(zip(ids, rows, strict=True))
        engine = self.engine
        if engine is None or not set(wanted) <= {r.id for r in engine.rows}:
            engine = self.engine = Engine(self.model, [Row(i, -1, list(t), len(t), pending=len(t))
                                                      for i, t in wanted.items()], self.pad)  # fmt: skip
        else:
            for r in engine.rows:
                if r.id not in wanted:
                    r.finish = "dropped"
            engine.retire()
            self._follow(engine, wanted)
        for _ in range(k):
            logits, _ = engine.feed(self.forwards)
            self.forwards += 1
            for r, t in zip(engine.rows, logits.argmax(-1).tolist(), strict=True):
                r.append([t], "sampled", math.nan)
        drafts = {r.id: r.tokens[len(wanted[r.id]) :] for r in engine.rows}
        self.sources = [0] * len(ids)
        return [drafts[i] for i in ids]

    @staticmethod
    def _follow(engine: Engine, wanted: dict[int, list[int]]) -> None:
        """Make each draft row the target row's tokens: drop its unfed draft, rewind what differs (KV too),
        append the target's new tokens as pending (re-feeding the last one when nothing is new)."""
        drops, refeed = [], []
        for r in engine.rows:
            if r.pending:  # the last draft token: appended, never fed
                del r.tokens[len(r.tokens) - r.pending :]
                r.pending = 0
            target = wanted[r.id]
            same = 0
            for a, b in zip(r.tokens, target, strict=False):
                if a != b:
                    break
                same += 1
            drops.append(len(r.tokens) - same)
            refeed.append(same == len(target))
        engine.rewind(drops, refeed)
        for r in engine.rows:
            new = wanted[r.id][len(r.tokens) :]
            if new:
                r.tokens.extend(new)
                r.pending, r.kind = r.pending + len(new), "forced" if len(new) > 1 else "sampled"
            r.logprobs = []
            r.prompt_length = len(r.tokens)


# What a verify forward costs, in chunk positions: a forward of `batch` rows by `width` columns costs about
# ``FORWARD_POSITIONS + batch * width`` positions. On this project's CPU (SmolLM2-135M fp32, one thread) a
# forward costs ~80 ms plus ~3.4 ms per position (batch 8: width 1 108 ms, width 11 401 ms): 24. On a GPU a
# small chunk is bound by reading the weights and launching kernels, so wide chunks are nearly free (256 is
# an estimate, not measured here; `benchmarks/speculative.py --costs` measures a device).
FORWARD_POSITIONS = {"cpu": 24.0}
FORWARD_POSITIONS_ELSEWHERE = 256.0
# Prior rate at which a draft token is accepted, by what it came from (the n-gram length a prompt lookup
# matched; 0: an assistant model), learned further from each generation's own verify rounds. On the
# extraction task of benchmarks/generate.py (SmolLM2) a 3-gram draft's first token was accepted 94% of the
# time, a 1-gram one's 41%.
PRIOR_RATES = {0: 0.7, 1: 0.4, 2: 0.6, 3: 0.9}
PRIOR_WEIGHT = 2.0  # the prior counts as this many rejections (and the matching number of acceptances)


class Widths:
    """How many of its drafts each row feeds in the next verify forward: a cost model.

    A verify chunk is as wide as its widest row, and every row of the batch pays for every column. Each
    draft source (`PromptLookup.sources`) has an acceptance rate ``q`` (a prior, then what this generation's
    verify rounds accepted), so a row with ``d`` drafts fed gains ``q + q² + … + q^d`` tokens on top of the
    one it gets anyway. The chunk width chosen maximises the expected tokens per cost of the forward
    (`FORWARD_POSITIONS` + batch × width); every row's drafts are cut to fit it. The choice only depends
    on the drafts and on what earlier rounds accepted, never on timings: the same call drafts the same way.

    Example:
        >>> w = Widths("cpu")
        >>> w.trim(batch=8, running=8, base=1, rows=[(1, 10, 3)] * 8)   # eight rows with 3-gram drafts (q 0.9)
        [6, 6, 6, 6, 6, 6, 6, 6]
        >>> w.trim(batch=8, running=8, base=1, rows=[(1, 10, 3), (1, 10, 1)])  # two drafting rows of eight
        [0, 0]
        >>> w.trim(batch=1, running=1, base=1, rows=[(1, 10, 3)])   # alone, the row feeds all its drafts
        [10]
    """

    def __init__(self, device_type: str, forward: float | None = None) -> None:
        # The fixed cost of a forward, in positions (`FORWARD_POSITIONS` of the device type unless given).
        self.forward = FORWARD_POSITIONS.get(device_type, FORWARD_POSITIONS_ELSEWHERE) if forward is None else forward
        self.accepted: dict[int, float] = {}
        self.rejected: dict[int, float] = {}

    def rate(self, source: int) -> float:
        """The estimated acceptance rate of a draft token from ``source``."""
        q = PRIOR_RATES.get(source, PRIOR_RATES[max(PRIOR_RATES)])
        accepted = self.accepted.get(source, 0.0) + PRIOR_WEIGHT * q / (1 - q)
        return accepted / (accepted + self.rejected.get(source, 0.0) + PRIOR_WEIGHT)

    def observe(self, source: int, drafted: int, accepted: int) -> None:
        """A verify round's outcome for one row: ``accepted`` of its ``drafted`` drafts kept."""
        self.accepted[source] = self.accepted.get(source, 0.0) + accepted
        self.rejected[source] = self.rejected.get(source, 0.0) + float(accepted < drafted)

    def trim(self, batch: int, running: int, base: int, rows: list[tuple[int, int, int]]) -> list[int]:
        """The drafts to feed for each drafting row, given as ``(pending tokens, drafts, source)``; ``batch``
        rows in the forward, ``running`` of them gaining a token anyway, ``base`` the widest other row's chunk."""
        if not rows:
            return []
        rates = [self.rate(source) for _, _, source in rows]
        narrow = max([base, 1] + [p for p, _, _ in rows])
        best, width = -1.0, narrow
        for w in range(narrow, max(narrow, max(p + d for p, d, _ in rows)) + 1):
            gain = float(running)
            for (p, d, _), q in zip(rows, rates, strict=True):
                gain += sum(q**j for j in range(1, min(d, w - p) + 1))
            value = gain / (self.forward + batch * w)
            if value > best:
                best, width = value, w
        return [min(d, width - p) for p, d, _ in rows]


def drafter(model: BridgeCore, a: dict[str, Any], p: Plan) -> PromptLookup | Assistant | None:
    """The drafter `generate`'s speculative keywords ask for (None: plain decoding); raises naming the keyword."""
    lookup, assistant, n_assist = a["prompt_lookup_num_tokens"], a["assistant_model"], a["num_assistant_tokens"]
    if assistant is None and n_assist is not None:
        raise ValueError(f"`num_assistant_tokens`={n_assist!r} needs an `assistant_model` (the draft bridge).")
    if lookup is None and assistant is None:
        return None
    if lookup is not None and assistant is not None:
        raise ValueError("`prompt_lookup_num_tokens` and `assistant_model` are two drafters: pass one.")
    which = "prompt_lookup_num_tokens" if lookup is not None else "assistant_model"
    clash = [name for name, on in (("num_beams > 1", p.search.num_beams > 1), ("use_cache=False", not p.use_cache),
                                   ("a state-space model", model.adapter.has_mixers)) if on]  # fmt: skip
    if clash:
        raise ValueError(
            f"`{which}` (speculative decoding) cannot be combined with {clash[0]}: it verifies drafts against a "
            "KV cache it rolls back per round. Drop one of them."
        )
    if lookup is not None:
        return PromptLookup(check_int("prompt_lookup_num_tokens", lookup, minimum=1))
    if not isinstance(assistant, BridgeCore):
        raise TypeError(f"`assistant_model` must be a TransformerBridge (the draft model), got {type(assistant)}.")
    if assistant.cfg.d_vocab != model.cfg.d_vocab:
        raise ValueError(
            f"`assistant_model` has a vocabulary of {assistant.cfg.d_vocab} tokens, the model {model.cfg.d_vocab}: "
            "drafts must be the model's tokens."
        )
    k = check_int("num_assistant_tokens", 5 if n_assist is None else n_assist, minimum=1)
    return Assistant(assistant, k)
