"""Speculative decoding: draft k tokens cheaply, verify them in one forward of the model, keep what agrees.

Two drafters: `PromptLookup` (``prompt_lookup_num_tokens=k``: the k tokens that followed the latest earlier
occurrence of the row's last n-gram, no second model) and `Assistant` (``assistant_model=draft,
num_assistant_tokens=k``: the draft bridge's greedy continuation). Both drafts are single proposals (a
one-hot draft distribution q), so the standard acceptance rule (`verify`) is simple and exact:

* greedy: keep a draft token while it equals the model's argmax at its position; the first disagreement
  is replaced by the model's argmax. The tokens are the non-speculative tokens (up to how the verify
  chunk's kernels round: the logits of a k-token chunk are within float rounding of k one-token steps).
* sampling: keep draft ``d`` with probability ``p(d)`` (p: the processed, masked, warped distribution of
  the model at that position); on rejection draw from ``p`` with ``d`` removed, renormalised. Each emitted
  token is distributed exactly as a non-speculative draw.

The loop is the row driver's (`control.generate`): after a row's token is chosen its drafts are appended
as pending tokens of kind ``"verify"`` and fed with the other rows' chunks in one forward; then each row
walks its chunk's logits on its own (per-row acceptance) and rewinds only its own rejected drafts. A row
asks for up to k drafts at first, then one more than it accepted after a rejection and twice as many after
a full acceptance: a verify chunk is as wide as its widest row, so rows whose drafts fail keep it narrow.
"""

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ..checks import check_int
from ..core import BridgeCore
from .options import Plan, Sampling
from .sampling import draw, warp_logits


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

    def propose(self, rows: list[list[int]], k: int) -> list[list[int]]:
        return [self._one(row, k) for row in rows]

    def _one(self, row: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(row) - 1), 0, -1):
            tail = row[-n:]
            for start in range(len(row) - n - 1, -1, -1):  # latest occurrence first
                if row[start : start + n] == tail:
                    draft = row[start + n : start + n + k]
                    period = len(row) - start - n  # the copy's source runs `period` tokens behind it
                    while len(draft) < k:
                        draft.append(draft[len(draft) - period])
                    return draft
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


def verify(
    scores: Float[Tensor, " d_vocab"], draft: int | None, allowed: Bool[Tensor, " d_vocab"] | None, s: Sampling
) -> tuple[int, Float[Tensor, " d_vocab"], bool]:
    """The token at one position of a verify chunk, the scores it came from, and whether it is ``draft``.

    ``scores`` are processed (penalties, bans); ``allowed`` is the controller's mask. Greedy: the argmax,
    accepted when it is the draft. Sampling: the draft with probability ``p(draft)``, else a draw from ``p``
    without it; with no draft (the bonus position after every draft passed) a plain draw.

    Example:
        >>> token, scores, accepted = verify(logits.float(), draft=17, allowed=None, s=plan.sampling)
    """
    if allowed is not None:
        scores = scores.masked_fill(~allowed.to(scores.device), -torch.inf)
    if s.greedy:
        token = int(scores.argmax(-1))
        return token, scores, token == draft
    scores = warp_logits(scores[None], s.temperature, s.top_k, s.top_p, s.min_p, s.typical_p)[0]
    if draft is None:
        return int(draw(scores[None], s.generator)[0]), scores, False
    probs = torch.softmax(scores, dim=-1)
    u = torch.rand(1, device=probs.device, generator=s.generator)
    if bool(u < probs[draft]):
        return draft, scores, True
    residual = probs.clone()
    residual[draft] = 0.0
    if not bool(residual.sum() > 0):  # p is one-hot on the draft (u fell on 1.0's rounding): keep it
        return draft, scores, True
    return int(torch.multinomial(residual, 1, generator=s.generator)[0]), scores, False
