"""The generation engine: per-row state over one KV cache, fed in chunks of any width.

A `Row` is one output sequence: its tokens (prompt + generated), the ones appended but not yet fed
(``pending``), its parent (forks), and why it finished. The `Engine` holds the active rows in batch
order and the KV cache (`KVRows`, each row right-aligned), and does four things:

* `feed`: one forward over every active row's pending tokens: a prompt, one sampled token, k forced
  tokens, a re-fed token after a backtrack, all in the same chunk (rows with fewer tokens are
  left-padded inside the chunk, then realigned). Returns each row's next-token logits, and when
  asked the logits of every chunk position (the log-probabilities of forced tokens).
* `rewind`: drop a row's last n tokens (its KV entries too), per row, in one gather. A verify round's
  rejected drafts may instead stay in a dynamic cache as masked columns (holes; not with windowed
  attention) until `HOLES` columns could be dropped: the gather moves the whole cache.
* `fork`: copy rows, KV included, into new rows.
* `retire`: drop finished rows from the batch.

Positions are absolute per row (``hook.ctx.positions``): a row's first real token is 0 however it
was padded, rewound or forked, so a position-based hook gives the same result as a fresh run.

The KV cache is dynamic (`kv.KVRows`, the default) or static (`kv.StaticKVRows`: preallocated and
bucketed; ``compile=True`` then runs `fast.compiled_step` for every forward where each row feeds exactly
one token, and eager forwards for prompts, forced and uneven chunks). A static cache keeps its batch
size when rows finish: a finished row's slot stays in the batch as padding (``hook.ctx.rows`` -1,
``row_kinds`` ``"finished"``; it attends to its own padding token only), and a fork fills free slots
first; only a fork with no free slot grows the batch, to the next power of two. Each batch size is
one compiled graph per bucket (made once per process), so a batch of 8 whose rows finish one by one
compiles one graph, and a row that forks until it is 5 rows compiles four (1, 2, 4, 8 rows).
"""

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from ..core import BridgeCore
from ..hooks.points import HookContext
from .fast import compiled_step
from .kv import KVRows, realignment, run_chunk

# Masked columns a verify round may leave in a dynamic cache before it is realigned (`Engine.rewind`).
HOLES = 32


def windowed(config: Any) -> bool:
    """Whether some attention layer of the model sees a window of columns (sliding, local or chunked)."""
    sizes = ("sliding_window", "window_size", "attention_chunk_size", "local_attention", "attention_window")
    if any(getattr(config, name, None) for name in sizes):
        return True
    return any(t != "full_attention" for t in getattr(config, "layer_types", None) or ())


@dataclass
class Row:
    """One output sequence of a controlled `generate`.

    Attributes:
        id: its index in the output (rows of the input first, then forks in the order they were made).
        parent: the row it was forked from (-1 for rows of the input).
        tokens: real tokens, prompt then generated (pending ones included).
        prompt_length: how many of ``tokens`` are the prompt.
        pending: how many of the last ``tokens`` the next forward feeds.
        kind: what the pending tokens are (``"prompt"``, ``"sampled"``, ``"forced"``, ``"refeed"``).
        logprobs: one per generated token (NaN until known: a forced token's is known after its forward).
        branch: the index of the branch that made this row (0 for rows of the input).
        backtracked, appended: what the last branch applied to it did.
        fresh: tokens fed since the controller last looked (what ``view.reads`` covers), from chunk
            column ``column`` of the last forward on.
        controller: this row's controller (its own copy after a fork, when the controller has ``fork``).
        deferred: a branch to apply after the next forward (sampling after a backtrack needs the
            logits of the rewound position).
        finish: why it finished (None while running).
    """

    id: int
    parent: int
    tokens: list[int]
    prompt_length: int
    pending: int
    kind: str = "prompt"
    logprobs: list[float] = field(default_factory=list)
    branch: int = 0
    backtracked: int = 0
    appended: list[int] = field(default_factory=list)
    fresh: int = 0
    column: int = 0
    controller: Any = None
    deferred: Any = None
    finish: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def append(self, tokens: list[int], kind: str, first_logprob: float) -> None:
        self.tokens.extend(tokens)
        self.logprobs.extend([first_logprob] + [math.nan] * (len(tokens) - 1))
        self.pending, self.kind, self.appended = len(tokens), kind, list(tokens)

    def copy(self, id: int, controller: Any) -> "Row":
        return replace(self, id=id, parent=self.id, tokens=list(self.tokens), logprobs=list(self.logprobs),
                       appended=list(self.appended), controller=controller, deferred=None)  # fmt: skip


class Engine:
    """Active rows and their KV cache; see the module docstring.

    Example:
        >>> engine = Engine(model, [Row(0, -1, [1, 5, 7], 3, pending=3)], pad_token_id=0)
        >>> logits, _ = engine.feed(step=0)     # the prompt: [1, d_vocab]
    """

    def __init__(
        self,
        model: BridgeCore,
        rows: list[Row],
        pad_token_id: int,
        use_cache: bool = True,
        kv: KVRows | None = None,
        compile: bool = False,
    ) -> None:
        self.model, self.rows, self.pad, self.use_cache = model, rows, pad_token_id, use_cache
        self.kv = kv if kv is not None else KVRows()
        # The compiled one-token step (static cache only): steps where every row feeds one token.
        self.step = compiled_step(model) if compile and self.kv.static else None
        self.device = model.device
        # Batch row (slot) of each active row. With a static cache a finished row's slot stays in the batch,
        # empty, and a fork takes a free slot before the batch grows (each batch size is a compiled graph).
        self.slots, self.free = list(range(len(rows))), []
        self.real = torch.zeros((len(rows), 0), dtype=torch.bool, device=self.device)  # [slot, key_pos]
        self.forwards = 0
        self.unaligned = False  # padding left inside the cache by `feed(realign=False)`
        # `rewind(compact=False)` may leave the rewound columns in the cache, masked (holes): a dynamic cache
        # without windowed attention only (a window counts columns, and holes would count as tokens).
        self.holes = not self.kv.static and not windowed(model.hf_model.config)

    def feed(
        self, step: int, all_logits: bool = False, realign: bool = True
    ) -> tuple[Float[Tensor, "batch d_vocab"], Float[Tensor, "batch chunk d_vocab"] | None]:
        """One forward over each active row's pending tokens; the next-token logits per row, and with
        ``all_logits`` those of every chunk position (left-padded like the chunk). ``realign=False`` leaves an
        uneven chunk's padding in the cache until the next `rewind` (a verify round rewinds right after: one
        gather of the cache instead of two) or the next operation that needs the rows right-aligned."""
        if self.unaligned:
            self._realign()
        rows = self.rows
        if not self.use_cache:  # the reference: every row from its first token again
            self.kv.clear()
            self.real = self.real[:, :0]
            for r in rows:
                r.fresh, r.pending = r.pending, len(r.tokens)
        width = max(r.pending for r in rows)
        # A row with fewer tokens than the chunk is padded on the right of its tokens when it has cached
        # entries (its tokens must follow them directly, or a sliding window would count the padding), and
        # on the left when it has none (a left-padded prompt, as the plain loop feeds it).
        left = self.kv.length == 0
        batch, slots = len(self.real), self.slots
        chunk = torch.full((batch, width), self.pad, dtype=torch.long)
        new = torch.zeros((batch, width), dtype=torch.bool)
        positions = torch.zeros((batch, width), dtype=torch.long)
        generated = torch.zeros((batch, width), dtype=torch.bool)
        for s, r in zip(slots, rows, strict=True):
            n, total = r.pending, len(r.tokens)
            r.column = width - n if left else 0
            cols = slice(r.column, r.column + n)
            chunk[s, cols] = torch.tensor(r.tokens[total - n :])
            new[s, cols] = True
            positions[s, cols] = torch.arange(total - n, total)
            generated[s, cols] = positions[s, cols] >= r.prompt_length
        attend = new.clone()  # a free slot attends to its own padding only (no row of the batch sees nothing)
        attend[self.free] = True
        chunk, new, positions, generated, attend = (t.to(self.device) for t in (chunk, new, positions, generated,
                                                                                  attend))  # fmt: skip
        kinds = ["finished"] * batch
        ids = [-1] * batch
        for s, r in zip(slots, rows, strict=True):
            kinds[s], ids[s] = "recompute" if not self.use_cache else r.kind, r.id
        live = {kinds[s] for s in slots}
        kind = live.pop() if len(live) == 1 else "mixed"
        phase = "prefill" if kind == "prompt" else "decode"
        ctx = HookContext(phase, step, positions, ~new, generated, kind, tuple(kinds), tuple(ids))
        mask = torch.cat([self.real, attend], dim=1)
        padded = not bool(mask.all())
        last_column = left or all(r.pending == width for r in rows)
        # Unembed only the columns some row ends at (HF takes a tensor of positions): [batch, few, d_vocab].
        ends = torch.tensor([r.column + r.pending - 1 for r in rows])
        columns, which = torch.unique(ends, return_inverse=True)
        keep = 0 if all_logits else 1 if last_column else columns.to(self.device)
        step = self.step if width == 1 and not all_logits else None
        key_mask = mask.long() if padded else None
        chunk_logits = run_chunk(self.model, self.kv, chunk, key_mask, positions, ctx, keep, step)
        self.forwards += 1
        if self.free:
            mask[self.free] = False
            chunk_logits = chunk_logits[torch.tensor(slots, device=self.device)]
        self.real = mask
        if last_column:
            logits = chunk_logits[:, -1]
        else:
            picked = ends if all_logits else which
            logits = chunk_logits[torch.arange(len(rows), device=self.device), picked.to(self.device)]
        for r in rows:
            if self.use_cache:
                r.fresh = r.pending
            r.column += r.pending - r.fresh  # the first fresh token's column
            r.pending = 0
        if padded:
            self.unaligned = True
            if realign:
                self._realign()
        return logits, (chunk_logits if all_logits else None)

    def rewind(self, drops: list[int], refeed: list[bool], compact: bool = True) -> None:
        """Drop the last ``drops[i]`` tokens of batch row ``i`` (tokens, KV entries and records); where
        ``refeed[i]``, also take the last kept token out of the cache and make it pending again, so the
        next forward gives the logits of the rewound position. ``compact=False`` (a verify round's rejected
        drafts) masks the dropped columns and leaves them where the model allows it (`holes`) until
        `HOLES` columns could be dropped: the realignment is a gather of the whole cache."""
        if not any(drops) and not any(refeed):
            if self.unaligned:
                self._realign()
            return
        cut = torch.zeros(len(self.real), dtype=torch.long)
        for s, r, n, again in zip(self.slots, self.rows, drops, refeed, strict=True):
            if n:
                del r.tokens[len(r.tokens) - n :]
                del r.logprobs[max(len(r.tokens) - r.prompt_length, 0) :]
            if again:
                r.pending, r.kind = 1, "refeed"
            cut[s] = n + int(again)
        # A row's newest entries: its last real columns (the last columns when right-aligned; padding of an
        # uneven chunk may follow them when `feed` left it), counted from the right.
        real = self.real
        newest = real.flip(1).cumsum(1).flip(1)  # real columns at or after each column
        self.real = real & (newest > cut.to(real.device)[:, None])
        if not compact and self.holes and self.real.shape[1] - int(self.real.sum(1).max()) < HOLES:
            self.unaligned = False  # the next chunk follows the holes; positions and the mask skip them
            return
        self._realign()

    def fork(self, sources: list[int], rows: list[Row]) -> None:
        """Append ``rows`` to the batch, row ``j`` a copy of batch row ``sources[j]`` (KV included)."""
        if not self.kv.static:
            index = torch.tensor(list(range(len(self.rows))) + sources, device=self.device)
            self.kv.select(index)
            self.real = self.real.index_select(0, index)
            self.slots = list(range(len(index)))
        else:
            missing = len(rows) - len(self.free)
            if missing > 0:  # grow to the next power of two: the slots to spare are free
                batch = len(self.real)
                grown = 1 << (batch + missing - 1).bit_length()
                self.kv.select(torch.tensor(list(range(batch)) + [0] * (grown - batch), device=self.device))
                self.real = torch.cat([self.real, self.real.new_zeros((grown - batch, self.real.shape[1]))])
                self.free += list(range(batch, grown))
            taken, self.free = self.free[: len(rows)], self.free[len(rows) :]
            src = torch.tensor([self.slots[i] for i in sources], device=self.device)
            dst = torch.tensor(taken, device=self.device)
            self.kv.copy_rows(src, dst)
            self.real[dst] = self.real[src]
            self.slots = self.slots + taken
        self.rows = self.rows + rows

    def retire(self) -> list[Row]:
        """Remove finished rows from the batch (a static cache keeps their slots, empty); returns them."""
        done = [r for r in self.rows if r.finish is not None]
        if done:
            keep = [i for i, r in enumerate(self.rows) if r.finish is None]
            if self.kv.static:
                freed = [s for s, r in zip(self.slots, self.rows, strict=True) if r.finish is not None]
                self.real[freed] = False
                self.free = sorted(self.free + freed)
                self.slots = [self.slots[i] for i in keep]
            else:
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                self.kv.select(index)
                self.real = self.real.index_select(0, index)
                self.slots = list(range(len(keep)))
            self.rows = [self.rows[i] for i in keep]
            if self.rows:
                self._realign()
        return done

    def _realign(self) -> None:
        self.unaligned = False
        real = self.real
        if bool((real[:, 1:] >= real[:, :-1]).all()):  # already right-aligned (plain left padding): no gather
            start = real.shape[1] - int(real.sum(1).max()) if real.shape[0] else 0
            if start:
                self.kv.drop_leading(start)
                self.real = real[:, start:]
            return
        order, start = realignment(real)
        self.kv.realign(order, start)
        self.real = real.gather(1, order)[:, start:]
