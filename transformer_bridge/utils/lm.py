"""Language-model helpers with TransformerLens' names and behaviour: next-token loss and accuracy, sampling
from logits, a logits table, and `test_prompt`."""

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .. import optional
from ..checks import ArgumentValueError, describe


def lm_cross_entropy_loss(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | Bool[Tensor, "batch pos"] | None = None,
    per_token: bool = False,
) -> Float[Tensor, ""] | Float[Tensor, "batch pos_minus_1"]:
    """Next-token cross-entropy: logits at position ``p`` predict ``tokens[p + 1]`` (TransformerLens' rule).

    With ``attention_mask``, a prediction counts only when both tokens are real; the mean is over
    those. ``per_token`` returns the ``[batch, pos - 1]`` losses (masked ones are 0).

    Example:
        >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens
        >>> float(lm_cross_entropy_loss(logits, torch.tensor([[0, 1, 2]])))  # log(4)
        1.3862943649291992
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
        >>> logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 0]]), 4).float()  # predicts 1, 2, 0
        >>> float(lm_accuracy(logits, torch.tensor([[0, 1, 3]])))  # 1 is right, 3 is not
        0.5
    """
    hits = logits.argmax(dim=-1)[:, :-1] == tokens[:, 1:]
    return hits if per_token else hits.sum() / hits.numel()


def sample_logits(
    final_logits: Float[Tensor, "batch d_vocab"],
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    freq_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    tokens: Int[Tensor, "batch pos"] | None = None,
) -> Int[Tensor, " batch"]:
    """One sampled token per row, TransformerLens' way: HF's repetition penalty over the ids in ``tokens``
    (positive logits divided by it, negative ones multiplied), then ``temperature`` (0: the argmax, nothing
    else applies), the frequency penalty (each logit minus ``freq_penalty`` × its count in ``tokens``), then
    ``top_k`` (clamped to the vocabulary) or else ``top_p`` (the smallest set whose probability reaches it),
    and a draw from the rest (``torch.distributions.Categorical``, so a seeded run draws what TransformerLens
    draws). ``model.generate`` has the full sampler; this is the one-step function.

    Example:
        >>> sample_logits(torch.tensor([[0.0, 5.0, 1.0]]), temperature=0.0)
        tensor([1])
    """
    if freq_penalty < 0:
        raise ArgumentValueError(f"`freq_penalty` must be >= 0, got {freq_penalty!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ArgumentValueError(f"`top_k` must be an int >= 1 or None, got {describe(top_k)}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ArgumentValueError(f"`top_p` must be in (0, 1], got {top_p!r}.")
    if (freq_penalty > 0 and temperature != 0.0) and (tokens is None or tokens.dim() != 2):
        raise ArgumentValueError(
            f"`freq_penalty` counts the ids in `tokens`, which must be [batch, pos] token ids; got {describe(tokens)}."
        )
    logits = final_logits
    if repetition_penalty != 1.0 and tokens is not None:
        logits = logits.clone()
        for row in range(logits.shape[0]):
            seen = tokens[row].unique()
            score = logits[row, seen]
            logits[row, seen] = torch.where(score > 0, score / repetition_penalty, score * repetition_penalty)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if freq_penalty > 0:
        counts = torch.stack([torch.bincount(row, minlength=logits.shape[-1]) for row in tokens])
        logits = logits - freq_penalty * counts
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    elif top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        past = sorted_logits.softmax(dim=-1).cumsum(dim=-1) > top_p
        past = torch.cat([torch.zeros_like(past[..., :1]), past[..., :-1]], dim=-1)  # keep the token that crosses p
        logits = logits.masked_fill(past.scatter(-1, order, past), -float("inf"))
    return torch.distributions.Categorical(logits=logits.float()).sample()


def logits_to_df(logits: Float[Tensor, " d_vocab"], tokenizer: Any | None = None, top_k: int | None = None) -> Any:
    """A pandas DataFrame of one position's logits, most probable first: ``token_index``, ``token_string``
    (with a ``tokenizer``), ``logit``, ``log_prob``, ``probability``; ``top_k`` keeps the first rows.

    Example:
        >>> logits_to_df(torch.tensor([0.0, 2.0, 1.0]), top_k=2)["token_index"].tolist()
        [1, 2]
    """
    log_probs = logits.float().log_softmax(dim=-1)
    order = log_probs.exp().argsort(descending=True)
    order = order if top_k is None else order[:top_k]
    data: dict[str, list] = {"token_index": order.tolist()}
    if tokenizer is not None:
        data["token_string"] = [tokenizer.decode([i]) for i in data["token_index"]]
    data["logit"] = logits[order].detach().cpu().tolist()
    data["log_prob"] = log_probs[order].detach().cpu().tolist()
    data["probability"] = log_probs[order].exp().detach().cpu().tolist()
    return optional.pandas("`logits_to_df`").DataFrame(data)


def test_prompt(
    prompt: str,
    answer: str | list[str],
    model: Any,
    prepend_space_to_answer: bool = True,
    print_details: bool = True,
    prepend_bos: bool | None = None,
    top_k: int = 10,
) -> None:
    """Print how ``model`` ranks the answer after ``prompt``, in TransformerLens' format (exploration helper).

    One answer: each of its tokens in turn (the answer is tokenized on its own and appended to the prompt), its
    rank, logit and probability, then the ``top_k`` tokens at that position. A list of answers: their first
    tokens only, one rank line per answer, then the ``top_k`` tokens. Ends with ``Ranks of the answer tokens:``
    and the ``(token, rank)`` pairs (a list per position with several answers). ``prepend_space_to_answer``
    adds a leading space to an answer that has none. Prints, returns None.

    Example:
        >>> test_prompt("The capital of France is", [" Paris", " London"], model)  # doctest: +SKIP
    """
    answers = [answer] if isinstance(answer, str) else list(answer) if isinstance(answer, (list, tuple)) else []
    if not answers or not all(isinstance(a, str) for a in answers):
        raise ArgumentValueError(f"`answer` must be a string or a non-empty list of strings, got {describe(answer)}.")
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    several = len(answers) > 1
    prompt_tokens = model.to_tokens(prompt, prepend_bos=prepend_bos)
    answer_str_tokens = [model.to_str_tokens(a, prepend_bos=False) for a in answers]
    if several:  # one token per answer: the first
        answer_tokens = torch.cat([model.to_tokens(a, prepend_bos=False)[:, :1] for a in answers])
    else:
        answer_tokens = model.to_tokens(answers[0], prepend_bos=False)
    tokens = torch.cat([prompt_tokens.expand(len(answer_tokens), -1), answer_tokens.to(prompt_tokens.device)], 1)
    prompt_length = prompt_tokens.shape[1]
    if print_details:
        print("Tokenized prompt:", model.to_str_tokens(prompt, prepend_bos=prepend_bos))
        print("Tokenized answers:" if several else "Tokenized answer:", answer_str_tokens if several else
              answer_str_tokens[0])  # fmt: skip
    logits = model(tokens)
    probs = logits.softmax(dim=-1)
    ranks = []
    for index in range(prompt_length, tokens.shape[1]):
        targets = tokens[:, index]
        at = index - 1  # the position predicting this token
        sorted_probs, order = probs[:, at].sort(dim=-1, descending=True)
        rank = order.argsort(dim=-1).gather(-1, targets[:, None])[:, 0].tolist()
        strings = [s[index - prompt_length] for s in answer_str_tokens]
        ranks.append(list(zip(strings, rank, strict=True)))
        if print_details:
            print(f"Performance on answer token{'s' if several else ''}:")
            for row, (text, r) in enumerate(zip(strings, rank, strict=True)):
                target = int(targets[row])
                line = _logit_prob(logits[row, at, target], probs[row, at, target])
                print(f"Rank: {r: <8} {line} Token: |{text}|")
            for i in range(top_k):
                line = _logit_prob(logits[0, at, order[0, i]], sorted_probs[0, i])
                print(f"Top {i}th token. {line} Token: |{model.to_string([int(order[0, i])])}|")
    print(f"Ranks of the answer tokens: {ranks if several else [r[0] for r in ranks]}")


def _logit_prob(logit: Tensor, prob: Tensor) -> str:
    return f"Logit: {logit.item():5.2f} Prob: {prob.item():6.2%}"


test_prompt.__test__ = False  # a helper, not a test: keep pytest from collecting it where it is imported
