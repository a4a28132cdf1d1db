"""What TransformerLens users import from ``transformer_lens.utils``, with the same names and behaviour.

`get_act_name` (TransformerLens' shorthand, aliases and compact forms such as ``"k6"``, resolved by
the bridge's one name grammar), `to_numpy`, `lm_cross_entropy_loss`, `lm_accuracy`,
`remove_batch_dim`, `test_prompt`, the padding helpers `get_attention_mask` and
`get_offset_position_ids`, and `Slice`.
"""

import re
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from . import names
from .checks import ArgumentTypeError, ArgumentValueError, describe

__all__ = [
    "Slice",
    "get_act_name",
    "get_attention_mask",
    "get_offset_position_ids",
    "lm_accuracy",
    "lm_cross_entropy_loss",
    "remove_batch_dim",
    "test_prompt",
    "to_numpy",
    "transpose",
]

_NAME_ALIAS = {
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_post": "post",
}
_TYPE_ALIAS = {
    "a": "attn",
    "attention": "attn",
    "attn": "attn",
    "m": "mlp",
    "mlp": "mlp",
    "b": "",
    "block": "",
    "blocks": "",
}
_COMPACT = re.compile(r"([a-z]+)(\d+)([a-z]?.*)")


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """Canonical hook name from TransformerLens shorthand, as ``transformer_lens.utils.get_act_name``.

    Accepts full names (returned as they are), shorthand with a layer, TransformerLens' aliases
    (``"key"``, ``"query"``, ``"value"``, ``"attn_logits"``, ``"mlp_pre"``, ``"mlp_post"``; ``layer_type``
    ``"a"`` / ``"m"`` / ``"b"``) and compact forms (``"k6"``, ``"scale4ln1"``). Unknown shorthand raises
    `KeyError` with close matches. The layer is not checked against a model here (no model is known):
    negative layers raise, since only a model can resolve them; use ``cache["resid_pre", -1]``.

    Example:
        >>> get_act_name("k", 6, "a"), get_act_name("scale4ln1"), get_act_name("normalized")
        ('blocks.6.attn.hook_k', 'blocks.4.ln1.hook_scale', 'ln_final.hook_normalized')
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(f"`name` must be a str such as 'resid_post', got {describe(name)}.")
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    match = _COMPACT.fullmatch(name) if layer is None and layer_type is None else None
    if match is not None:
        name, layer, layer_type = match.group(1), int(match.group(2)), match.group(3) or None
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, (int, np.integer))):
        raise ArgumentTypeError(f"`layer` must be an int or None, got {describe(layer)}.")
    if layer is not None and layer < 0:
        raise ValueError(
            f"`layer`={layer}: get_act_name knows no model, so it cannot count layers from the end. Give "
            f"model.cfg.n_layers + {layer}, or index the cache: cache[{name!r}, {layer}]."
        )
    name = _NAME_ALIAS.get(name, name)
    kind = _TYPE_ALIAS.get(layer_type, layer_type) if layer_type is not None else None
    norm = kind if kind not in ("", "attn", "mlp") else None
    full = names.get_act_name(name, None if layer is None else int(layer), norm)
    if kind in ("attn", "mlp") and f".{kind}." not in full:
        raise ValueError(f"`layer_type`={layer_type!r} does not fit {name!r}, which is {full!r}; leave it out.")
    return full


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array of a tensor (detached, on the CPU; bfloat16 as float32), list, tuple, number or array.

    Example:
        >>> to_numpy(torch.tensor([1.0, 2.0]))
        array([1., 2.], dtype=float32)
    """
    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, (list, tuple)):
        return np.array(tensor)
    if isinstance(tensor, Tensor):
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    if isinstance(tensor, (int, float, bool, str)):
        return np.array(tensor)
    raise ArgumentTypeError(
        f"`tensor` must be a tensor, numpy array, list, tuple or scalar, got {type(tensor).__name__}."
    )


def lm_cross_entropy_loss(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    per_token: bool = False,
) -> Float[Tensor, ""] | Float[Tensor, "batch pos_minus_1"]:
    """Next-token cross-entropy: logits at position ``p`` predict ``tokens[p + 1]`` (TransformerLens' rule).

    With ``attention_mask``, a prediction counts only when both tokens are real; the mean is over
    those. ``per_token`` returns the ``[batch, pos - 1]`` losses (masked ones are 0).

    Example:
        >>> loss = lm_cross_entropy_loss(model(tokens), tokens)
    """
    log_probs = F.log_softmax(logits, dim=-1)
    predicted = log_probs[..., :-1, :].gather(dim=-1, index=tokens[..., 1:, None])[..., 0]
    if attention_mask is not None:
        if attention_mask.shape != tokens.shape:
            raise ArgumentValueError(
                f"`attention_mask` must have the tokens' shape {tuple(tokens.shape)}, got "
                f"{tuple(attention_mask.shape)}."
            )
        keep = torch.logical_and(attention_mask[:, :-1], attention_mask[:, 1:])
        predicted = torch.where(keep, predicted, predicted.new_zeros(()))  # a masked NaN stays out of the sum
        n_tokens = keep.sum()
    else:
        n_tokens = predicted.numel()
    return -predicted if per_token else -predicted.sum() / n_tokens


def lm_accuracy(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], per_token: bool = False
) -> Float[Tensor, ""] | Bool[Tensor, "batch pos_minus_1"]:
    """Share of positions whose top logit is the next token (``per_token``: the ``[batch, pos - 1]`` hits).

    Example:
        >>> acc = lm_accuracy(model(tokens), tokens)
    """
    hits = logits.argmax(dim=-1)[:, :-1] == tokens[:, 1:]
    return hits if per_token else hits.sum() / hits.numel()


def transpose(tensor: Float[Tensor, "... a b"]) -> Float[Tensor, "... b a"]:
    """The last two axes swapped (TransformerLens' ``utils.transpose``).

    Example:
        >>> transpose(torch.zeros(2, 3, 5)).shape
        torch.Size([2, 5, 3])
    """
    return tensor.transpose(-2, -1)


def remove_batch_dim(tensor: Tensor) -> Tensor:
    """``tensor[0]`` if its first axis has size 1, else ``tensor`` unchanged.

    Example:
        >>> remove_batch_dim(torch.zeros(1, 5, 3)).shape
        torch.Size([5, 3])
    """
    return tensor.squeeze(0) if tensor.shape[0] == 1 else tensor


def test_prompt(
    prompt: str,
    answer: str,
    model: Any,
    prepend_space_to_answer: bool = True,
    print_details: bool = True,
    prepend_bos: bool | None = None,
    top_k: int = 10,
) -> list[tuple[str, int]]:
    """Print how ``model`` ranks each token of ``answer`` after ``prompt`` (exploration helper).

    Returns ``[(answer_token, rank), ...]``; with ``print_details`` also prints each answer token's
    logit and probability and the ``top_k`` tokens at its position.

    Example:
        >>> test_prompt("The capital of France is", "Paris", model)
    """
    if prepend_space_to_answer and not answer.startswith(" "):
        answer = " " + answer
    tokens = model.to_tokens(prompt + answer, prepend_bos=prepend_bos)
    prompt_length = len(model.to_str_tokens(prompt, prepend_bos=prepend_bos))
    answer_tokens = tokens[0, prompt_length:]
    answer_strs = [model.to_string(t[None]) for t in answer_tokens]
    if print_details:
        print("Tokenized prompt:", model.to_str_tokens(prompt, prepend_bos=prepend_bos))
        print("Tokenized answer:", answer_strs)
    logits = remove_batch_dim(model(tokens))
    probs = logits.softmax(dim=-1)
    ranks = []
    for i, (token, text) in enumerate(zip(answer_tokens.tolist(), answer_strs, strict=True)):
        at = prompt_length + i - 1  # the position predicting this answer token
        order = probs[at].argsort(descending=True)
        rank = int((order == token).nonzero()[0, 0])
        ranks.append((text, rank))
        if print_details:
            print(f"Rank: {rank:<8} {_logit_prob(logits[at], probs[at], token)} Token: |{text}|")
            for j, t in enumerate(order[:top_k].tolist()):
                print(f"Top {j}th token. {_logit_prob(logits[at], probs[at], t)} Token: |{model.to_string([t])}|")
    print(f"Ranks of the answer tokens: {ranks}")
    return ranks


def _logit_prob(logits: Float[Tensor, "d_vocab"], probs: Float[Tensor, "d_vocab"], token: int) -> str:
    return f"Logit: {logits[token].item():5.2f} Prob: {probs[token].item():6.2%}"


test_prompt.__test__ = False  # a helper, not a test: keep pytest from collecting it where it is imported


def get_attention_mask(
    tokenizer: Any, tokens: Int[Tensor, "batch pos"], prepend_bos: bool, padding_side: str | None = None
) -> Int[Tensor, "batch pos"]:
    """TransformerLens' mask for padded token ids: 1 for real tokens, 0 for the pad tokens at the padded end
    (``padding_side``, default the tokenizer's). Only the run of pad ids at that end counts as padding; with
    left padding and ``prepend_bos`` where BOS is the pad token, the BOS just before the text is kept.

    Example:
        >>> get_attention_mask(model.tokenizer, model.to_tokens(["Hi", "Hello there"]), prepend_bos=True)
    """
    mask = torch.ones_like(tokens)
    if tokenizer is None or tokenizer.pad_token_id is None:
        return mask
    side = padding_side or tokenizer.padding_side
    if side not in ("left", "right"):
        raise ValueError(f"`padding_side` must be 'left' or 'right', got {side!r}.")
    real = tokens.ne(tokenizer.pad_token_id).long()
    if side == "right":
        mask[real.flip(-1).cumsum(-1).flip(-1) == 0] = 0
        return mask
    leading = real.cumsum(-1) == 0
    mask[leading] = 0
    if prepend_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        n_leading = leading.sum(-1)
        keep = n_leading > 0
        mask[rows[keep], n_leading[keep] - 1] = 1
    return mask


def get_offset_position_ids(
    past_kv_pos_offset: int, attention_mask: Int[Tensor, "batch pos"]
) -> Int[Tensor, "batch new_pos"]:
    """Each token's position counted from its row's first real token (0 there and on the padding before
    it), from column ``past_kv_pos_offset`` on: TransformerLens' positions for left-padded rows.

    Example:
        >>> get_offset_position_ids(0, torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        tensor([[0, 0, 0, 1],
                [0, 1, 2, 3]])
    """
    positions = attention_mask.long().cumsum(1) - 1
    return positions.clamp_min(0)[:, past_kv_pos_offset:]


class Slice:
    """TransformerLens' position / batch / neuron selection: an int (that index, its axis dropped), a tuple
    (``slice(*tuple)``), a slice, a list or 1-d tensor of indices, or None (everything). Accepted wherever
    the bridge takes a ``pos_slice``, ``batch_slice`` or ``neuron_slice``.

    Example:
        >>> Slice(-1).apply(torch.arange(6).reshape(2, 3), dim=1)
        tensor([2, 5])
        >>> Slice((1, 3)).indices(5)
        array([1, 2])
    """

    def __init__(self, input_slice: Any = None) -> None:
        if isinstance(input_slice, Slice):
            input_slice = input_slice.slice
        if isinstance(input_slice, tuple):
            input_slice = slice(*input_slice)
        if input_slice is None:
            self.slice, self.mode = slice(None), "empty"
        elif isinstance(input_slice, bool):
            raise ArgumentTypeError(f"`input_slice` must be an int, a tuple, a slice or indices, got {input_slice!r}.")
        elif isinstance(input_slice, slice):
            self.slice, self.mode = input_slice, "slice"
        elif isinstance(input_slice, (list, range, np.ndarray, Tensor)):
            self.slice, self.mode = torch.as_tensor(np.asarray(input_slice) if not isinstance(input_slice, Tensor)
                                                    else input_slice, dtype=torch.long), "array"  # fmt: skip
        elif hasattr(input_slice, "__index__"):
            self.slice, self.mode = int(input_slice), "int"
        else:
            raise ArgumentTypeError(
                f"`input_slice` must be an int, a tuple, a slice or indices, got {describe(input_slice)}."
            )

    def apply(self, tensor: Tensor, dim: int = 0) -> Tensor:
        """``tensor`` with this selection applied along ``dim`` (an int drops the axis)."""
        if self.mode == "int":
            return tensor.select(dim, self.slice)
        if self.mode == "array":
            return tensor.index_select(dim, self.slice.to(tensor.device))
        return tensor[(slice(None),) * (dim % tensor.dim()) + (self.slice,)]

    def indices(self, max_ctx: int | None = None) -> np.ndarray:
        """The selected indices as an array (``max_ctx``: the axis length, needed for slices and negatives)."""
        if self.mode == "int":
            return np.array([self.slice % max_ctx if max_ctx else self.slice])
        if self.mode == "array":
            return self.slice.cpu().numpy()
        if max_ctx is None:
            raise ValueError("`max_ctx` is needed to list the indices of a slice.")
        return np.arange(max_ctx)[self.slice]

    def __repr__(self) -> str:
        return f"Slice({self.slice!r}, mode={self.mode!r})"
