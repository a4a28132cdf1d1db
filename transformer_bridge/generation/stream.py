"""`chunks`: the generator behind `generate_stream`, yielding tokens (or text) as the decode loop picks them.

It iterates `decode.decode_steps`, the loop `generate` runs, so each step runs the same forward with
the same hooks; the next forward runs only when the next chunk is asked for (hooks added or removed
between chunks apply from the next step on). As TransformerLens' ``generate_stream``, the first chunk
starts with the prompt, so the chunks joined (``torch.cat(chunks, 1)``, ``"".join(chunks)``) are what
`generate` returns with the same options.
"""

from collections.abc import Iterator

import torch
from jaxtyping import Int
from torch import Tensor

from ..core import BridgeCore
from .decode import decode_steps
from .resolve import Request

Chunk = Int[Tensor, "batch new"] | str | list[str]


@torch.no_grad()  # a generator function: grad mode is off while it runs, restored at each yield
def chunks(model: BridgeCore, request: Request, every: int) -> Iterator[Chunk]:
    """Yield every ``every`` generated tokens per row (the last chunk holds the rest).

    Tokens: ``[batch, every]`` (the pad token where a row has finished), the first chunk prefixed with
    the prompt tokens. Text: each row's new text (``str`` for one text prompt, else a list), the first
    chunk prefixed with the prompt text (a row's decoded prompt for token input).
    """
    p = request.plan
    tokens, mask = request.tokens, request.mask
    n = p.search.num_return_sequences
    if n > 1:
        tokens = tokens.repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
    text = _Text(model, request, tokens, mask) if request.text_out else None
    pending: list[Tensor] = [tokens]
    for token, real in decode_steps(model, tokens, mask, p):
        pending.append(token[:, None])
        if text is not None:
            text.add(token, real)
        if len(pending) == every + (pending[0] is tokens):
            yield torch.cat(pending, dim=1) if text is None else text.flush(final=False)
            pending = []
    if text is None:
        if pending:
            yield torch.cat(pending, dim=1)
        return
    rest = text.flush(final=True)  # also what an incomplete character held back
    if pending or any([rest] if isinstance(rest, str) else rest):
        yield rest


class _Text:
    """Each row's text so far, and what of it was yielded: a chunk is the difference.

    Decoding the whole row each time (not each chunk alone) keeps SentencePiece's leading spaces and
    multi-token characters right; a row whose text ends in an incomplete character (``"\\ufffd"``)
    waits for the next chunk, as HF's ``TextStreamer`` does.
    """

    def __init__(self, model: BridgeCore, request: Request, tokens: Tensor, mask: Tensor) -> None:
        self.tokenizer = model.tokenizer
        n = request.plan.search.num_return_sequences
        if request.prompts is not None:  # text in: the prompt as given, then the decoded completion
            self.heads = [request.prompts[i // n] for i in range(tokens.shape[0])]
            self.ids: list[list[int]] = [[] for _ in self.heads]
        else:  # tokens in: each row's real tokens decoded, prompt included (what `generate` returns)
            self.heads = [""] * tokens.shape[0]
            self.ids = [[t for t, r in zip(row, keep, strict=True) if r]
                        for row, keep in zip(tokens.tolist(), mask.bool().tolist(), strict=True)]  # fmt: skip
        self.sent = [""] * len(self.heads)
        self.single = request.single and len(self.heads) == 1

    def add(self, token: Int[Tensor, " batch"], real: Int[Tensor, " batch"]) -> None:
        for ids, t, r in zip(self.ids, token.tolist(), real.tolist(), strict=True):
            if r:
                ids.append(t)

    def flush(self, final: bool) -> str | list[str]:
        out = []
        for i, (head, ids) in enumerate(zip(self.heads, self.ids, strict=True)):
            text = head + self.tokenizer.decode(ids, skip_special_tokens=True)
            if text.endswith("\ufffd") and not final:
                out.append("")
                continue
            out.append(text[len(self.sent[i]) :])
            self.sent[i] = text
        return out[0] if self.single else out
