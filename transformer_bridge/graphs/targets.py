"""What a graph explains: logit targets at any positions (tokens, the most probable ones, or directions), and the
sequence attributed (tokens, text, or what ``generate(..., return_cache=True)`` returned)."""

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor


@dataclass(frozen=True)
class Target:
    """One target node: the logit of ``token`` at ``pos`` (demeaned over the vocabulary, as circuit-tracer does), or
    a ``direction`` over the vocabulary (``[d_vocab]`` weights, e.g. +1 / -1 for a logit difference). ``weight``
    is its weight in influence (default: the token's probability; 1 for a direction).

    Example:
        >>> Target(pos=5, token=42), Target(pos=5, direction=torch.eye(99)[3] - torch.eye(99)[7], label="3 - 7")
    """

    pos: int
    token: int | None = None
    direction: Tensor | None = None
    label: str | None = None
    weight: float | None = None

    def __post_init__(self):
        if (self.token is None) == (self.direction is None):
            raise ValueError(f"a `Target` has exactly one of `token` and `direction` (pos={self.pos})")


@dataclass
class Sequence:
    """The tokens attributed and, for a generation, where the generated part starts."""

    tokens: Tensor
    prompt_length: int | None = None


def as_sequence(model, input) -> Sequence:
    """Tokens (``[pos]`` or ``[1, pos]``), a list of ids, text (tokenized as the bridge does), or the
    ``(output, cache)`` pair of ``generate(..., return_cache=True)`` for one row."""
    if isinstance(input, tuple) and len(input) == 2 and hasattr(input[1], "prompt_lengths"):
        out, cache = input
        seq = out.sequences if hasattr(out, "sequences") else out
        if not isinstance(seq, Tensor):
            raise TypeError("attribute a generation with `return_type='tokens'` (or `return_dict=True`), not text")
        if seq.shape[0] != 1:
            raise ValueError(f"`input`: a graph explains one sequence; the generation has {seq.shape[0]} rows")
        mask = getattr(cache, "attention_mask", None)
        start = 0 if mask is None else int((mask[0] == 0).cumprod(0).sum())  # left padding
        prompt = int(cache.prompt_lengths[0]) if cache.prompt_lengths is not None else None
        return Sequence(seq[0, start:].cpu(), prompt)
    if isinstance(input, str):
        return Sequence(model.to_tokens(input)[0].cpu())
    tokens = torch.as_tensor(input)
    if tokens.ndim == 2 and tokens.shape[0] == 1:
        tokens = tokens[0]
    if tokens.ndim != 1 or tokens.dtype not in (torch.int64, torch.int32) or len(tokens) == 0:
        raise ValueError(f"`input` must be text, token ids [pos] / [1, pos] or a generation; got shape "
                         f"{tuple(tokens.shape)}, dtype {tokens.dtype}")  # fmt: skip
    return Sequence(tokens.long().cpu())


def resolve_targets(
    seq: Sequence, logits: Float[Tensor, "pos d_vocab"], targets, positions, max_n_logits: int,
    desired_logit_prob: float, tokenizer=None,
) -> list[Target]:  # fmt: skip
    """The target list from the caller's ``targets`` / ``positions`` (see `attribute`)."""
    n_pos = len(seq.tokens)
    probs = logits.float().softmax(-1)
    if positions is None:
        if targets is None and seq.prompt_length is not None:
            if seq.prompt_length >= n_pos:
                raise ValueError("the generation has no generated token to explain")
            # each generated token, read where it was predicted
            return [Target(p - 1, int(seq.tokens[p]), label=token_label(tokenizer, int(seq.tokens[p])),
                           weight=float(probs[p - 1, seq.tokens[p]]))
                    for p in range(seq.prompt_length, n_pos)]  # fmt: skip
        positions = [n_pos - 1]
    positions = [p + n_pos if p < 0 else p for p in ([positions] if isinstance(positions, int) else positions)]
    if any(not 0 <= p < n_pos for p in positions):
        raise ValueError(f"`positions` must be in -{n_pos}..{n_pos - 1}, got {positions}")
    if targets is None:
        out = []
        for p in positions:
            top_p, top_i = probs[p].topk(min(max_n_logits, probs.shape[-1]))
            keep = int(torch.searchsorted(top_p.cumsum(0), torch.tensor(desired_logit_prob))) + 1
            out += [Target(p, int(t), label=token_label(tokenizer, int(t)), weight=float(w))
                    for t, w in zip(top_i[:keep], top_p[:keep], strict=False)]  # fmt: skip
        return out
    if isinstance(targets, (Tensor, list)) and all(not isinstance(t, Target) for t in targets):
        ids = torch.as_tensor(targets).reshape(-1).tolist()
        if any(not 0 <= t < probs.shape[-1] for t in ids):
            raise ValueError(f"`targets` token ids must be in 0..{probs.shape[-1] - 1}, got {ids}")
        return [
            Target(p, t, label=token_label(tokenizer, t), weight=float(probs[p, t])) for p in positions for t in ids
        ]
    out = list(targets)
    if any(not isinstance(t, Target) for t in out):
        raise TypeError("`targets` must be None, token ids, or a list of `Target`")
    return out


def token_label(tokenizer, token: int) -> str:
    """A token's text (its id without a tokenizer)."""
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


def target_vectors(targets: list[Target], unembed: Float[Tensor, "d_vocab d_model"]) -> Float[Tensor, "target d_model"]:
    """Each target's direction at the unembedding's input: ``W_U[t] - mean(W_U)`` for a token, ``d @ W_U`` for a
    vocabulary direction ``d`` (the frozen final norm makes the logit linear in the residual stream)."""
    mean = unembed.mean(0)
    rows = []
    for t in targets:
        if t.token is not None:
            rows.append(unembed[t.token] - mean)
        else:
            if t.direction.shape != (unembed.shape[0],):
                raise ValueError(f"a target's `direction` must be [d_vocab] = [{unembed.shape[0]}], got "
                                 f"{tuple(t.direction.shape)}")  # fmt: skip
            rows.append(t.direction.to(unembed) @ unembed)
    return torch.stack(rows)
