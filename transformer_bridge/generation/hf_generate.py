"""`hf_generate`: HF's own ``generate`` on the wrapped model, with TransformerLens' signature and the bridge's hooks.

The escape hatch for what the bridge's loop does not implement (``output_attentions``, ``output_hidden_states``,
contrastive search, constrained beams …): every HF keyword passes through. Hooks registered on the bridge run
inside HF's loop (the attention points too: the call runs through the bridge's attention implementation), but HF
owns the loop, so ``hook.ctx`` is None there: position-aware steering belongs in `generate`.

Example:
    >>> out = model.hf_generate("Hello", max_new_tokens=5, do_sample=False, output_attentions=True,
    ...                         return_dict_in_generate=True)
    >>> len(out.attentions)        # one tuple of per-layer patterns per step, HF's layout
"""

from typing import Any, Literal

import torch
from torch import Tensor

from ..checks import check_bool, describe
from ..core import BridgeCore
from ..inputs import is_text


@torch.no_grad()
def hf_generate(
    model: BridgeCore,
    input: str | list[str] | Tensor = "",
    max_new_tokens: int = 10,
    stop_at_eos: bool = True,
    eos_token_id: int | None = None,
    do_sample: bool = True,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    use_past_kv_cache: bool = True,
    return_type: Literal["input", "str", "tokens"] | None = "input",
    **generation_kwargs: Any,
) -> Any:
    """TransformerLens' ``hf_generate``: ``model.hf_model.generate`` with TL's defaults (sampling, 10 new tokens)
    and return types, every HF keyword passed on (``output_scores``, ``output_attentions``,
    ``return_dict_in_generate`` …), the bridge's hooks active. Text is tokenized as `to_tokens` does (BOS per
    ``cfg.default_prepend_bos``; a list is left-padded with its mask). With ``return_dict_in_generate=True`` HF's
    output object is returned as HF builds it.

    Example:
        >>> model.hf_generate("The capital of France is", max_new_tokens=8, do_sample=False)
    """
    text = is_text(input)
    for name, value in (
        ("stop_at_eos", stop_at_eos),
        ("do_sample", do_sample),
        ("use_past_kv_cache", use_past_kv_cache),
    ):
        check_bool(name, value)
    if text and model.tokenizer is None:
        model._require_tokenizer()
    if return_type not in ("input", "str", "tokens", None):
        raise ValueError(f"`return_type` must be 'input', 'str', 'tokens' or None, got {describe(return_type)}.")
    tokens, mask = model.prepare_input(input, generation_kwargs.pop("attention_mask", None),
                                       generation_kwargs.pop("prepend_bos", None),
                                       padding_side="left" if text else None)  # fmt: skip
    options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "use_cache": use_past_kv_cache}
    if do_sample:  # TransformerLens passes the temperature, and top-k / top-p only when given
        options["temperature"] = temperature
        options.update({k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None})
    # TransformerLens' rule: an explicit EOS id, else the tokenizer's (HF's config otherwise); `stop_at_eos=False`
    # stops at no EOS, not even the one HF's generation config names (HF takes None as "no EOS").
    eos = eos_token_id if eos_token_id is not None else getattr(model.tokenizer, "eos_token_id", None)
    if not stop_at_eos:
        options["eos_token_id"] = None
    elif eos is not None:
        options["eos_token_id"] = eos
    generation_kwargs.setdefault("pad_token_id", model.pad_token_id)
    with model.bridged(None):
        out = model.hf_model.generate(tokens, attention_mask=mask, **options, **generation_kwargs)
    if not isinstance(out, Tensor):  # HF's output object (return_dict_in_generate=True)
        return out
    if return_type == "str" or (return_type == "input" and text):
        decoded = [model.tokenizer.decode(row, skip_special_tokens=True) for row in out]
        return decoded[0] if isinstance(input, str) else decoded
    return out
