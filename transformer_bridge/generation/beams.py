"""Beam search: HF's vectorised algorithm (transformers 5.x ``_beam_search``) step for step, over the shared KV cache.

The cache is the plain loop's (`kv.make_kv`, forwards through `kv.run_chunk`); reordering the beams is
`KVRows.select`. The choice is the request's `Sampler`: its processors and warpers, and `Sampler.continuations`
for the top continuations over all beams.

Each prompt is expanded to ``num_beams`` rows before the prefill, as HF does, so the logits and
therefore the beams equal HF's. Per step: log-softmax → processors (→ warpers when sampling) → add
the running beam scores → keep the top ``K = max(2, 1 + n_eos) * num_beams`` continuations over
all beams (so ``num_beams`` of them are still running even if the best all end) → mark those that
stop → the best ``num_beams`` running ones continue (the KV cache is reordered to them) → the
finished ones compete, length-penalised, for the ``num_beams`` best finished slots. The loop ends
when no running beam can beat the finished ones (``early_stopping``), or at ``max_new_tokens``.

With a controller (`beam_control.BeamControl`) each beam's continuations are masked to the tokens its
controller allows (after the processors, before the warpers), and a beam whose controller stops is
finished as it stands.
"""

from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..core import BridgeCore
from ..hooks.points import HookContext
from ..versions import BEAM_SAMPLES_SORTED
from .beam_control import BeamControl
from .control import own_copy
from .decode import Plan, decode_full, prefill
from .kv import make_kv, run_chunk
from .outputs import FINISH_REASONS, GenerationOutput
from .stopping import MAX_TIME

NEG = -1.0e9  # HF's "impossible" score: large and finite, so sums stay ordered
CONTROLLER = FINISH_REASONS.index("controller")


def beam_search(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    p: Plan,
    controllers: list[Any] | None = None,
) -> GenerationOutput:
    """Beam search over a left-padded batch; returns ``num_return_sequences`` best beams per prompt.

    ``controllers`` (one per prompt) mask, force and stop each prompt's beams (see `beam_control`).
    """
    if controllers is None:
        return _search(model, tokens, mask, p, None)
    nb = p.search.num_beams
    control = BeamControl([c if j == 0 else own_copy(c) for c in controllers for j in range(nb)])
    with model.hooks(fwd_hooks=control.hooks, read_only=True):  # what the controllers read
        return _search(model, tokens, mask, p, control)


def _search(
    model: BridgeCore,
    tokens: Int[Tensor, "batch pos"],
    mask: Int[Tensor, "batch pos"],
    p: Plan,
    control: BeamControl | None,
) -> GenerationOutput:
    batch, width = tokens.shape
    nb, max_len, dev = p.search.num_beams, width + p.max_new_tokens, tokens.device
    keep = max(2, 1 + len(p.eos_token_ids)) * nb
    is_top = torch.arange(keep, device=dev) < nb
    flat_tokens, flat_mask = tokens.repeat_interleave(nb, 0), mask.repeat_interleave(nb, 0)
    prompt_pos = (flat_mask.cumsum(-1) - 1).clamp_min(0)
    full_mask = torch.cat([flat_mask, flat_mask.new_ones(batch * nb, p.max_new_tokens)], dim=1)
    positions = torch.cat([prompt_pos, prompt_pos[:, -1:] + torch.arange(1, p.max_new_tokens + 1, device=dev)], 1)
    padded = not bool(mask.all())

    # Running beams and the finished slots, [batch, beam, ...]; HF's names and layout.
    running = flat_tokens.new_full((batch, nb, max_len), p.pad_token_id)
    running[:, :, :width] = flat_tokens.view(batch, nb, width)
    finished = running.clone()
    running_scores = torch.zeros(batch, nb, device=dev)
    running_scores[:, 1:] = NEG  # only the first beam's tokens count at step 0: no duplicate beams
    finished_scores = torch.full((batch, nb), NEG, device=dev)
    is_finished = torch.zeros(batch, nb, dtype=torch.bool, device=dev)
    improvable = torch.ones(batch, 1, dtype=torch.bool, device=dev)
    running_origin = torch.full((batch, nb, p.max_new_tokens), -1, dtype=torch.long, device=dev)
    finished_origin = running_origin.clone()
    running_lp = torch.zeros(batch, nb, p.max_new_tokens, device=dev)  # raw log-prob of each chosen token
    finished_lp = running_lp.clone()
    finished_reason = torch.zeros(batch, nb, dtype=torch.long, device=dev)

    kv = make_kv(model, batch * nb, max_len, static=False) if p.use_cache else None  # the plain loop's cache
    sampler = p.sampler
    keep_when_sampling = 1 + max(len(p.eos_token_ids), 1)  # HF's `min_tokens_to_keep` for beam sampling
    real = flat_mask.bool()
    ctx = HookContext("prefill", 0, prompt_pos, ~real, torch.zeros_like(real), "prompt")
    if kv is not None:
        logits = run_chunk(model, kv, flat_tokens, flat_mask if padded else None, prompt_pos, ctx, 1)[:, -1]
    else:
        logits = prefill(model, flat_tokens, flat_mask, prompt_pos, None, padded)
    cur = width
    while True:
        t = cur - width
        raw = logits.float().log_softmax(-1)
        flat_running = running[:, :, :cur].reshape(batch * nb, cur)
        log_probs = sampler.process(flat_running, raw, full_mask[:, :cur])
        if control is not None:
            alive = running_scores.view(-1) > float("-inf")
            allowed, stop = control.allowed(logits, flat_running, full_mask[:, :cur], width, t, alive)
            log_probs = log_probs.masked_fill(~allowed | stop[:, None], float("-inf"))
            stopped = _stopped(stop.view(batch, nb), running, running_scores, running_origin, running_lp,
                               cur - width, p)  # fmt: skip
        log_probs = sampler.warp(log_probs, keep=keep_when_sampling)
        vocab = log_probs.shape[-1]
        scores = (log_probs.view(batch, nb, vocab) + running_scores[:, :, None]).view(batch, nb * vocab)

        # Top-K continuations over all beams of a prompt (ranked as HF's beam sampling ranks them on this release).
        top_scores, top_index = sampler.continuations(scores, keep, ranked=BEAM_SAMPLES_SORTED)
        parent, token = top_index // vocab, top_index % vocab
        top_seq = _gather(running, parent)
        top_seq[:, :, cur] = token
        top_origin = _gather(running_origin, parent)
        top_origin[:, :, t] = parent + torch.arange(batch, device=dev)[:, None] * nb
        top_lp = _gather(running_lp, parent)
        top_lp[:, :, t] = raw.view(batch, nb * vocab).gather(1, top_index)

        # Which continuations stop here, and why.
        code = p.stopping.check(top_seq[:, :, : cur + 1].reshape(batch * keep, cur + 1), None).view(batch, keep)
        if p.stopping.out_of_time():
            code = code.masked_fill(code == 0, MAX_TIME)
        stops = (code > 0) | (cur + 1 >= max_len)

        # The best num_beams continuations that go on.
        go_on = top_scores + stops.float() * NEG
        best = torch.topk(go_on, k=nb)[1]
        running, running_scores = _gather(top_seq, best), _gather(go_on, best)
        running_origin, running_lp = _gather(top_origin, best), _gather(top_lp, best)

        # Finished continuations (among the top num_beams) compete for the finished slots.
        just_finished = stops & is_top[None, :]
        final = top_scores / ((cur + 1 - width) ** p.search.length_penalty)
        final += (torch.all(is_finished, dim=-1, keepdim=True) & (p.search.early_stopping is True)).float() * NEG
        final += (~improvable).float() * NEG
        final += (~just_finished) * NEG
        # Candidates for the finished slots: the slots, this step's finished continuations, the stopped beams.
        pools = [(finished, finished_scores, finished_origin, finished_lp, finished_reason, is_finished),
                 (top_seq, final, top_origin, top_lp, code, just_finished)]  # fmt: skip
        if control is not None:
            seq, score, origin, lp, is_stop = stopped
            score += (torch.all(is_finished, dim=-1, keepdim=True) & (p.search.early_stopping is True)).float() * NEG
            score += (~improvable).float() * NEG
            pools.append((seq, score, origin, lp, torch.full_like(code[:, :nb], CONTROLLER), is_stop))
        merged = torch.topk(torch.cat([pool[1] for pool in pools], 1), k=nb)[1]
        finished, finished_scores, finished_origin, finished_lp, finished_reason, is_finished = (
            _gather(torch.cat([pool[i] for pool in pools], 1), merged) for i in range(6)
        )

        cur += 1
        improvable = _improvable(improvable, running_scores, finished_scores, is_finished, cur, max_len, width, p)
        all_full = torch.all(is_finished) & (p.search.early_stopping is True)
        if not bool(torch.any(improvable) & ~all_full & ~torch.all(stops)):
            break

        beam_idx = running_origin[:, :, t].reshape(-1)
        flat_running = running[:, :, :cur].reshape(batch * nb, cur)
        if control is not None:
            control.reorder(beam_idx, flat_running[:, -1])
        if kv is not None:
            kv.select(beam_idx)  # the beams that go on, in their new order
            key_mask = full_mask[:, :cur] if padded else None
            real = torch.ones(batch * nb, 1, dtype=torch.bool, device=dev)
            ctx = HookContext("decode", t + 1, positions[:, cur - 1 : cur], ~real, real, "sampled")
            logits = run_chunk(model, kv, flat_running[:, -1:], key_mask, positions[:, cur - 1 : cur], ctx, 1)[:, -1]
        else:
            logits = decode_full(model, flat_running, positions[:, :cur], full_mask[:, :cur], width, padded, t + 1)

    n = p.search.num_return_sequences
    origin = finished_origin[:, :n].reshape(batch * n, -1)
    new_len = (origin >= 0).sum(-1)
    n_new = int(new_len.max())
    generated = (torch.arange(n_new, device=dev)[None, :] < new_len[:, None]).long()
    prompt_mask = mask.repeat_interleave(n, 0)
    sequences = finished[:, :n].reshape(batch * n, -1)[:, : width + n_new]
    sequences = torch.cat([sequences[:, :width], sequences[:, width:].masked_fill(generated == 0, p.pad_token_id)], 1)
    out = GenerationOutput(
        sequences=sequences,
        attention_mask=torch.cat([prompt_mask, generated], 1),
        prompt_lengths=prompt_mask.sum(-1),
        prompt_width=width,
        finish_reasons=[FINISH_REASONS[c] for c in finished_reason[:, :n].reshape(-1).tolist()],
        sequences_scores=finished_scores[:, :n].reshape(-1),
    )
    if p.records.on:
        out.logprobs = finished_lp[:, :n].reshape(batch * n, -1)[:, :n_new] * generated
    return out


def _stopped(
    stop: Tensor, running: Tensor, scores: Tensor, origin: Tensor, lp: Tensor, n_new: int, p: Plan
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The beams a controller stopped, as candidates for the finished slots: as they stand, length-penalised.

    Only real beams count (at step 0 every beam but the first is a copy scored `NEG`)."""
    is_stop = stop & (scores > NEG / 2)
    final = torch.where(is_stop, scores / (max(n_new, 1) ** p.search.length_penalty), NEG)
    return running.clone(), final, origin, lp, is_stop


def _gather(t: Tensor, index: Int[Tensor, "batch k"]) -> Tensor:
    """``t[b, index[b, j], ...]``: pick beams along dim 1."""
    while index.dim() < t.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(t, index, dim=1)


def _improvable(
    improvable: Tensor,
    running_scores: Tensor,
    finished_scores: Tensor,
    is_finished: Tensor,
    cur: int,
    max_len: int,
    width: int,
    p: Plan,
) -> Tensor:
    """HF's early-stop heuristic: can the best running beam still beat the worst finished one?"""
    # A positive length penalty favours longer beams: with "never", assume the longest possible one.
    best_len = max_len - width if p.search.early_stopping == "never" and p.search.length_penalty > 0.0 else cur - width
    best_running = running_scores[:, :1] / (best_len**p.search.length_penalty)
    worst_finished = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True)[0], NEG)
    return improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)
