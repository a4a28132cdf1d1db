"""How a row of the row driver (`control.generate`) ends, and the output: the stop conditions of appended
or verified tokens (EOS, ``max_new_tokens``, stop strings, criteria, as the plain loop checks them), cutting a
row, an HF streamer fed as the plain loop feeds it, and the `GenerationOutput` layout."""

from typing import Any

import torch
from torch import Tensor

from .engine import Row
from .options import Plan
from .outputs import FINISH_REASONS, GenerationOutput
from .records import RowRecords


def as_plain_row(tokens: list[int], prompt_length: int, p: Plan) -> tuple[Tensor, Tensor]:
    """A row's ``tokens`` as the plain loop lays them out: the prompt left-padded to the prompt width, then the
    generated tokens (so ``min_new_tokens``, the penalties and stop strings count as there)."""
    pad = p.stopping.prompt_width - prompt_length
    ids = torch.tensor([[p.pad_token_id] * pad + tokens])
    mask = torch.tensor([[0] * pad + [1] * len(tokens)])
    return ids, mask


def stop(row: Row, p: Plan, scores: Tensor) -> None:
    """EOS among the appended tokens, the length limit, stop strings and criteria."""
    eos = set(p.eos_token_ids)
    start = len(row.tokens) - row.pending
    for k in range(start, len(row.tokens)):
        if row.tokens[k] in eos and k >= row.prompt_length:
            cut(row, k + 1)
            row.finish = "eos"
            return
    limit = row.prompt_length + p.max_new_tokens
    cut(row, limit)
    if p.stopping.stop_strings or p.stopping.criteria:  # before the length limit, as in the plain loop
        tokens, _ = as_plain_row(row.tokens, row.prompt_length, p)
        code = int(p.stopping.check(tokens.to(scores.device), scores)[0])
        if code:
            row.finish = FINISH_REASONS[code]
            return
    if len(row.tokens) >= limit:
        row.finish = "length"


def stops_at(row: Row, p: Plan, end: int, scores: Tensor) -> str | None:
    """Why the row stops at its token ``end - 1`` (one verified draft), or None: as `stop` for one token."""
    if row.tokens[end - 1] in p.eos_token_ids:
        return "eos"
    if p.stopping.stop_strings or p.stopping.criteria:
        tokens, _ = as_plain_row(row.tokens[:end], row.prompt_length, p)
        code = int(p.stopping.check(tokens.to(scores.device), scores[None])[0])
        if code:
            return FINISH_REASONS[code]
    return "length" if end - row.prompt_length >= p.max_new_tokens else None


def cut(row: Row, length: int) -> None:
    extra = len(row.tokens) - length
    if extra > 0:
        del row.tokens[length:]
        del row.logprobs[length - row.prompt_length :]
        row.pending = max(row.pending - extra, 0)


class Stream:
    """An HF streamer fed as the plain loop feeds it: the prompt, then one ``[batch]`` column per generated
    position once every running row has it (finished rows give the pad token). Only without a controller:
    a controller may rewind tokens a streamer has already printed."""

    def __init__(self, streamer: Any, tokens: Tensor, pad: int) -> None:
        self.streamer, self.pad, self.done = streamer, pad, 0
        streamer.put(tokens.cpu())

    def flush(self, rows: list[Row], drafted: dict[int, int], final: bool = False) -> None:
        lengths = [len(r.generated) - drafted.get(r.id, 0) for r in rows]
        running = [n for r, n in zip(rows, lengths, strict=True) if r.finish is None]
        ready = max(lengths) if final or not running else min(running)
        for col in range(self.done, ready):
            self.streamer.put(torch.tensor([r.generated[col] if col < n else self.pad
                                            for r, n in zip(rows, lengths, strict=True)]))  # fmt: skip
        self.done = max(self.done, ready)
        if final:
            self.streamer.end()


def output(
    rows: list[Row], prompt_width: int, p: Plan, device: torch.device, records: RowRecords, controlled: bool
) -> GenerationOutput:
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
    out = GenerationOutput(
        sequences=seq.to(device),
        attention_mask=mask.to(device),
        prompt_lengths=torch.tensor([r.prompt_length for r in rows], device=device),
        prompt_width=prompt_width,
        finish_reasons=[r.finish or "length" for r in rows],
        logprobs=logprobs.to(device) if p.records.on else None,
        parents=[r.parent for r in rows] if controlled else None,
    )
    return records.finish(out, [r.id for r in rows], [len(r.generated) for r in rows])
