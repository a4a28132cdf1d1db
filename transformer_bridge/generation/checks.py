"""Arguments of `generate` that contradict each other, or that say something other than what the caller likely
means: refused by name, or warned about (the output forms, right-padded ids without a mask). `resolve.prepare`
calls these before any forward.
"""

import warnings
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from jaxtyping import Int
from torch import Tensor

from ..checks import ArgumentValueError, warn_difference_once


def check_output_form(a: Mapping[str, Any]) -> None:
    """``return_dict`` (or HF's ``return_dict_in_generate``) returns a `GenerationOutput`; a ``return_type``
    other than ``"input"`` asks for a plain form at the same time: refused, naming both.

    Example:
        >>> check_output_form({"return_dict": True, "return_dict_in_generate": None, "return_type": "input"})
    """
    given = [name for name in ("return_dict", "return_dict_in_generate") if a[name] is True]
    if given and a["return_type"] != "input":
        raise ArgumentValueError(
            f"`{given[0]}=True` returns a GenerationOutput (`.sequences` the token ids, `.text` the text of text "
            f"input), and `return_type`={a['return_type']!r} asks for a plain {a['return_type']} output: pass one "
            "of them."
        )


def warn_right_padding(
    tokens: Int[Tensor, "batch pos"], pad_token_id: int | None, eos_token_ids: Sequence[int], stacklevel: int
) -> None:
    """HF ``generate``'s warning for right-padded ids given without a mask, in the bridge's words: some rows (not
    all: a batch of chat prompts may all end in an end-of-turn id) end in the pad id. What the ids mean does not
    change: HF's rule for bare ids applies (pad ids are padding unless the pad id is an EOS id).

    Example:
        >>> warn_right_padding(torch.tensor([[5, 6, 7], [5, 0, 0]]), 0, [2], stacklevel=2)   # warns
    """
    if pad_token_id is None or tokens.dim() != 2 or tokens.shape[0] < 2:
        return
    ends = (tokens[:, -1] == pad_token_id).tolist()
    if not any(ends) or all(ends):
        return
    rows = [i for i, end in enumerate(ends) if end]
    if pad_token_id in eos_token_ids:
        meaning = (
            "As the pad id is also an EOS id, HF's `generate` reads every id without a mask as a real token (this "
            "bridge too): those rows continue after their padding"
        )
    else:
        meaning = "HF's `generate` reads pad ids without a mask as padding (this bridge too, moving it to the left)"
    warnings.warn(
        f"Rows {rows} of the token ids end in the pad id {pad_token_id}, and no `attention_mask` was given: right "
        f"padding, as `model.to_tokens(texts)` and tokenizers lay out a batch. {meaning}. A decoder-only model "
        "generates from left padding: pass the mask (`tokens, mask = model.to_tokens_and_mask(texts)`, then "
        "`generate(tokens, attention_mask=mask)`, or `generate(**tokenizer(texts, return_tensors='pt', "
        "padding=True))`), or the texts themselves (`generate(texts)` pads them on the left).",
        stacklevel=stacklevel + 1,
    )


# Set by the bridge's own callers of `generate` that TransformerLens has no counterpart of (`forward_pass`).
QUIET_GREEDY: ContextVar[bool] = ContextVar("QUIET_GREEDY", default=False)


def warn_default_top_k(model: Any, top_k: Any) -> None:
    """Once per model: sampling from the generation config's top-k (HF's 50 unless the model's config says
    otherwise), which the caller did not ask for, where TransformerLens samples from the whole distribution."""
    if isinstance(top_k, int) and 0 < top_k < model.cfg.d_vocab:
        warn_difference_once(model, "_warned_top_k", (
            f"generate() samples from the {top_k} most likely tokens at each step: `top_k` was not given, so the "
            f"generation config's top_k={top_k} applies (HF's rule). TransformerLens samples from the whole "
            "distribution: pass top_k=0 for that (HookedTransformer does so by default), or top_k=50 to keep HF's "
            "default without this warning."
        ))  # fmt: skip


def warn_greedy(model: Any, num_beams: Any) -> None:
    """Once per model: greedy decoding by default (HF's rule), where TransformerLens' ``generate`` samples. Not for
    beam search (TransformerLens has none), nor when the caller said ``do_sample`` in a keyword or config."""
    if num_beams == 1 and not QUIET_GREEDY.get():
        warn_difference_once(model, "_warned_greedy", (
            "generate() decodes greedily: no sampling argument was given and the generation config does not sample "
            "(HF's default). TransformerLens' generate samples by default (do_sample=True over the whole "
            "distribution): pass do_sample=True, top_k=0 for that (HookedTransformer does so by default), or "
            "do_sample=False to decode greedily without this warning."
        ))  # fmt: skip
