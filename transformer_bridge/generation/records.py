"""`RowRecords`: the per-token records of the row driver (`control.generate`), kept per row.

The plain loop records one column per step for the whole batch (`decode._Records`). The row driver
cannot: rows backtrack, fork, take forced tokens in one forward and accept several drafts in one
verify forward. So each row keeps one entry per generated token, indexed by the token's place in the
row: writing entry ``g`` drops every entry after it, so the records of backtracked or rejected
tokens go with them, and a fork starts from a copy of its parent's. At the end the entries are laid
out as the plain loop lays out its columns (``[batch, new, ...]``, 0 after a row's last token).

What an entry holds, for a token at generated index ``g``: the ``k`` best log-probabilities of the raw
logits that predicted it (``top_logprobs=k``), those raw logits (``output_logits``), and the scores it
was chosen from (``output_scores``; HF's: processed, masked by the controller, warped when sampling).
A forced token was not chosen from scores: its scores are what the loop would have drawn from at its
position without the controller's mask (processed, warped when sampling). A forced token the
generation ended before feeding has no logits yet: its entry is NaN (``top_tokens`` -1), as its
``logprobs`` entry is.
"""

import math

import torch
from jaxtyping import Float
from torch import Tensor

from .options import Plan
from .outputs import GenerationOutput

_Entry = tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]  # top values, top ids, logits, scores


class RowRecords:
    """Per-row, per-token ``top_logprobs`` / ``logits`` / ``scores`` (``on`` when any is asked for).

    Example:
        >>> rec = RowRecords(plan)
        >>> rec.put(row_id=0, index=0, logits=logits[0], scores=scores[0])
        >>> out = rec.finish(out, rows)
    """

    def __init__(self, p: Plan) -> None:
        r = p.records
        self.k = r.top_logprobs if r.on else 0
        self.keep_logits = r.on and r.output_logits
        self.keep_scores = r.on and r.output_scores
        self.on = bool(self.k or self.keep_logits or self.keep_scores)
        self.rows: dict[int, list[_Entry | None]] = {}

    def put(
        self, row_id: int, index: int, logits: Float[Tensor, " d_vocab"], scores: Float[Tensor, " d_vocab"] | None
    ) -> None:
        """The entry of generated token ``index`` of row ``row_id`` (entries after it are dropped)."""
        if not self.on:
            return
        entries = self.rows.setdefault(row_id, [])
        del entries[index:]
        entries.extend([None] * (index - len(entries)))
        raw = logits.float()
        values = ids = None
        if self.k:
            values, ids = raw.log_softmax(-1).topk(self.k)
        entries.append((values, ids, raw if self.keep_logits else None, scores if self.keep_scores else None))

    def fork(self, parent: int, child: int) -> None:
        if self.on:
            self.rows[child] = list(self.rows.get(parent, []))

    def finish(self, out: GenerationOutput, row_ids: list[int], lengths: list[int]) -> GenerationOutput:
        """Lay the entries out as the plain loop does: ``[batch, new, ...]``, 0 after each row's ``lengths``."""
        if not self.on:
            return out
        new = out.sequences.shape[1] - out.prompt_width
        batch, d_vocab = len(row_ids), None
        for entries in self.rows.values():
            for e in entries:
                if e is not None and (e[2] is not None or e[3] is not None):
                    d_vocab = (e[2] if e[2] is not None else e[3]).shape[-1]
        top_v = torch.zeros((batch, new, self.k))
        top_i = torch.zeros((batch, new, self.k), dtype=torch.long)
        logits = torch.zeros((batch, new, d_vocab or 0)) if self.keep_logits else None
        scores = torch.zeros((batch, new, d_vocab or 0)) if self.keep_scores else None
        for b, (row_id, n) in enumerate(zip(row_ids, lengths, strict=True)):
            entries = self.rows.get(row_id, [])
            for g in range(n):
                e = entries[g] if g < len(entries) else None
                if e is None:  # a forced token never fed
                    top_v[b, g], top_i[b, g] = math.nan, -1
                    for t in (logits, scores):
                        if t is not None:
                            t[b, g] = math.nan
                    continue
                if self.k:
                    top_v[b, g], top_i[b, g] = e[0].cpu(), e[1].cpu()
                if logits is not None:
                    logits[b, g] = e[2].cpu()
                if scores is not None:
                    scores[b, g] = e[3].cpu()
        device = out.sequences.device
        if self.k:
            out.top_logprobs, out.top_tokens = top_v.to(device), top_i.to(device)
        if logits is not None:
            out.logits = logits.to(device)
        if scores is not None:
            out.scores = tuple(scores.to(device).unbind(1))  # HF's layout: one per step
        return out
