"""Speculative decoding: draft k tokens cheaply, verify them in one forward of the model, keep the agreed prefix.

Two drafters: `PromptLookup` (``prompt_lookup_num_tokens=k``: the k tokens that followed the latest earlier
occurrence of the row's last n-gram, no second model) and `Assistant` (``assistant_model=draft,
num_assistant_tokens=k``: the draft bridge's greedy continuation). Both drafts are single proposals (a
one-hot draft distribution q), so the standard acceptance rule is simple and exact:

* greedy: keep a draft token while it equals the model's argmax at its position; the first disagreement
  is replaced by the model's argmax. The tokens are the non-speculative tokens (up to how the verify
  chunk's kernels round: the logits of a k-token chunk are within float rounding of k one-token steps).
* sampling: keep draft ``d`` with probability ``p(d)`` (p: the processed, warped distribution of the
  model at that position); on rejection draw from ``p`` with ``d`` removed, renormalised. Each emitted
  token is distributed exactly as a non-speculative draw.

The verify forward feeds each row's last token plus its drafts; hooks see it with ``phase="decode"``,
``kind="verify"``. Rows accept different numbers of drafts; the batch keeps the shortest accepted prefix
over unfinished rows (each row's extra accepted tokens are model tokens, so they are simply verified
again in the next round), then drops the rejected positions from the KV cache: a rejected token never
reaches the output or the cache, so position-based steering gives the tokens it gives without
speculation. Logits processors, stop conditions, records and the streamer see each emitted token as
in the plain loop.
"""

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers import DynamicCache

from ..checks import check_int
from ..core import BridgeCore
from ..hook_points import HookContext
from .decode import _Records, prefill
from .options import Plan
from .outputs import FINISH_REASONS, GenerationOutput
from .sampling import warp_logits
from .stopping import MAX_TIME


@dataclass
class PromptLookup:
    """Drafts from the row itself: after the latest earlier occurrence of its last ``n``-gram (``n`` from
    ``max_ngram`` down to 1), the ``k`` tokens that followed it.

    Example:
        >>> PromptLookup(3).propose([[5, 6, 7, 8, 5, 6]], 3)
        [[7, 8, 5]]
    """

    k: int
    max_ngram: int = 3

    def propose(self, rows: list[list[int]], k: int) -> list[list[int]]:
        return [self._one(row, k) for row in rows]

    def _one(self, row: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(row) - 1), 0, -1):
            tail = row[-n:]
            for start in range(len(row) - n - 1, -1, -1):  # latest occurrence first
                if row[start : start + n] == tail:
                    return row[start + n : start + n + k]
        return []


@dataclass
class Assistant:
    """Drafts from a smaller bridge with the same vocabulary: its greedy continuation of each row."""

    model: BridgeCore
    k: int

    def propose(self, rows: list[list[int]], k: int) -> list[list[int]]:
        width = max(len(r) for r in rows)
        pad = self.model.pad_token_id if self.model.pad_token_id is not None else 0
        tokens = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.model.device)
        out = self.model.generate(tokens, attention_mask=mask, max_new_tokens=k, do_sample=False,
                                  stop_at_eos=False, pad_token_id=pad, return_type="tokens")  # fmt: skip
        return out[:, width:].tolist()


def drafter(model: BridgeCore, a: dict[str, Any], p: Plan, controller: Any) -> PromptLookup | Assistant | None:
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
                                   ("controller", controller is not None),
                                   ("a state-space model", model.adapter.ssm is not None)) if on]  # fmt: skip
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


def generate(
    model: BridgeCore, tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"], p: Plan, drafts: Any
) -> GenerationOutput:
    """`decode.generate` with drafts verified k at a time; see the module docstring."""
    steps = decode_steps(model, tokens, mask, p, drafts)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def decode_steps(
    model: BridgeCore, tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"], p: Plan, drafts: Any
) -> Generator[Int[Tensor, " batch"], None, GenerationOutput]:
    """The speculative loop: yields every emitted token column, returns the output."""
    batch, width = tokens.shape
    device = tokens.device
    total = width + p.max_new_tokens
    seq = tokens.new_full((batch, total), p.pad_token_id)
    seq[:, :width] = tokens
    full_mask = mask.new_zeros((batch, total))
    full_mask[:, :width] = mask
    positions = mask.new_zeros((batch, total))
    positions[:, :width] = (mask.cumsum(-1) - 1).clamp_min(0)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    reason = torch.zeros(batch, dtype=torch.long, device=device)
    records = _Records(p)
    padded = not bool(mask.all())
    cache = DynamicCache()  # no sliding-window layers: a rollback may need entries a window would drop
    if p.streamer is not None:
        p.streamer.put(tokens.cpu())

    state = _State(seq, full_mask, positions, done, reason)
    logits = prefill(model, tokens, mask, positions[:, :width], cache, padded)[:, None]
    cur, n_new, step, proposal = width, 0, 0, torch.zeros((batch, 0), dtype=torch.long, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    while True:
        # Emit tokens column by column while every unfinished row accepted the previous column's draft.
        used = 0
        for j in range(logits.shape[1]):
            scores = p.sampling.processors(seq[:, : cur + j], logits[:, j].float(), full_mask[:, : cur + j]) \
                if p.sampling.processors else logits[:, j].float()  # fmt: skip
            has = (j < lengths) & ~done
            draft = proposal[:, j] if j < proposal.shape[1] else torch.zeros_like(done, dtype=torch.long)
            token, scores, accepted = _verify(scores, draft, has, p)
            records.add(logits[:, j], scores, token)
            token = state.emit(token, scores, cur + j, p)
            used, n_new = j + 1, n_new + 1
            if p.streamer is not None:
                p.streamer.put(token.cpu())
            yield token
            if n_new == p.max_new_tokens or bool(done.all()) or not bool((accepted | done).all()):
                break
        # Drop the KV entries of the rejected drafts (the last chunk fed ``logits.shape[1]`` tokens).
        if logits.shape[1] > used:
            cache.crop(used - logits.shape[1])
        cur += used
        if n_new == p.max_new_tokens or bool(done.all()):
            break
        if p.stopping.out_of_time():
            reason.masked_fill_(~done, MAX_TIME)
            break
        # Draft, then verify: feed each row's last token + its drafts in one forward.
        k = min(drafts.k, p.max_new_tokens - n_new - 1)
        rows = [s[m.bool()].tolist() for s, m in zip(seq[:, :cur].cpu(), full_mask[:, :cur].cpu(), strict=True)]
        proposed = drafts.propose(rows, k) if k > 0 else [[] for _ in rows]
        k = max((len(d) for d in proposed), default=0)
        lengths = torch.tensor([len(d) for d in proposed], device=device).masked_fill(done, 0)
        proposal = torch.tensor([d + [p.pad_token_id] * (k - len(d)) for d in proposed], dtype=torch.long,
                                device=device).reshape(batch, k)  # fmt: skip
        chunk = torch.cat([seq[:, cur - 1 : cur], proposal], dim=1)
        live = (~done).long()
        chunk_real = torch.cat([full_mask[:, cur - 1 : cur], live[:, None].expand(-1, k)], dim=1)
        chunk_pos = positions[:, cur - 1 : cur] + live[:, None] * torch.arange(k + 1, device=device)
        step += 1
        ctx = HookContext("decode", step, chunk_pos, ~chunk_real.bool(), chunk_real.bool(), "verify")
        attn = torch.cat([full_mask[:, :cur], chunk_real[:, 1:]], dim=1) if padded else None
        out = model.run_model(chunk, attn, ctx, past_key_values=cache, position_ids=chunk_pos, logits_to_keep=0)
        logits = out.logits
    if p.streamer is not None:
        p.streamer.end()
    return records.finish(
        GenerationOutput(
            sequences=seq[:, : width + n_new].contiguous(),
            attention_mask=full_mask[:, : width + n_new].contiguous(),
            prompt_lengths=mask.sum(-1),
            prompt_width=width,
            finish_reasons=[FINISH_REASONS[c] for c in reason.tolist()],
        )
    )


def _verify(
    scores: Float[Tensor, "batch d_vocab"], draft: Int[Tensor, " batch"], has: Tensor, p: Plan
) -> tuple[Int[Tensor, " batch"], Float[Tensor, "batch d_vocab"], Tensor]:
    """Each row's token at this position, the scores it came from, and whether its draft was accepted."""
    s = p.sampling
    if s.greedy:
        token = scores.argmax(-1)
        return token, scores, has & (token == draft)
    scores = warp_logits(scores, s.temperature, s.top_k, s.top_p, s.min_p, s.typical_p)
    probs = torch.softmax(scores, dim=-1)
    u = torch.rand(probs.shape[0], device=probs.device, generator=s.generator)
    accepted = has & (u < probs.gather(-1, draft[:, None])[:, 0])
    residual = probs.scatter(-1, draft[:, None], 0.0).where(has[:, None], probs)
    empty = residual.sum(-1, keepdim=True) <= 0  # p was one-hot on the draft: the draft is always accepted
    residual = residual.where(~empty, probs)
    fresh = torch.multinomial(residual, 1, generator=s.generator)[:, 0]
    return torch.where(accepted, draft, fresh), scores, accepted


class _State:
    """The output tensors of the loop, and how one emitted column updates them (as `decode.decode_steps`)."""

    def __init__(self, seq: Tensor, mask: Tensor, positions: Tensor, done: Tensor, reason: Tensor) -> None:
        self.seq, self.mask, self.positions, self.done, self.reason = seq, mask, positions, done, reason

    def emit(
        self, token: Int[Tensor, " batch"], scores: Float[Tensor, "batch d_vocab"], cur: int, p: Plan
    ) -> Int[Tensor, " batch"]:
        """Write the token of column ``cur`` (the pad token in finished rows) and check the stop conditions."""
        done = self.done
        token = token.masked_fill(done, p.pad_token_id)
        self.seq[:, cur] = token
        self.mask[:, cur] = (~done).long()
        self.positions[:, cur] = self.positions[:, cur - 1] + (~done).long()
        if p.stopping.per_row:
            code = p.stopping.check(self.seq[:, : cur + 1], scores)
            newly = (code > 0) & ~done
            self.reason.copy_(torch.where(newly, code, self.reason))
            done |= newly
        return token
