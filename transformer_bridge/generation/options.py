"""`plan`: every option of one `generate` call, validated and resolved once into a `Plan`.

Everything a user can get wrong is rejected here, before any forward runs, with an error that
names the parameter, the value received and what is valid (see `checks`). The decode loop then
trusts the `Plan`; only the outputs of the user's own processors and stopping criteria are checked
per step (`processors.HFProcessor`, `stopping.Stopping`), by shape and dtype, without a device sync.
"""

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import ArgumentTypeError, ArgumentValueError, check_bool, check_int, describe, is_int, is_real
from ..core import BridgeCore
from .sampler import Sampler, build_sampler
from .sampling import validate_sampling_args
from .stopping import Stopping

WARPERS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
SAMPLING_ARGS = (*WARPERS, "freq_penalty")
HF_DEFAULT_TOP_K = 50  # HF's GenerationConfig applies top-k 50 when sampling unless told otherwise.
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes a uint64


@dataclass(frozen=True)
class Search:
    """Rows per prompt and beam search."""

    num_beams: int
    num_return_sequences: int
    length_penalty: float
    early_stopping: bool | str


@dataclass(frozen=True)
class Records:
    """What `GenerationOutput` records per step (``on``: ``return_dict``)."""

    on: bool
    top_logprobs: int
    output_logits: bool
    output_scores: bool


@dataclass(frozen=True)
class Plan:
    """Every option of one `generate` call, validated and resolved before the loop, in small typed groups."""

    max_new_tokens: int
    use_cache: bool
    pad_token_id: int
    eos_token_ids: list[int]
    sampler: Sampler
    stopping: Stopping
    search: Search
    records: Records
    streamer: Any
    verbose: bool
    pad_known: bool = True  # False: no pad id anywhere (`pad_token_id` is a placeholder 0)


def plan(model: BridgeCore, prompt_width: int, from_embeds: bool, o: Mapping[str, Any]) -> Plan:
    """Validate and resolve `generate`'s options (``o``, by `generate`'s names); raises naming the parameter.

    ``from_embeds``: the prompt came as embeddings, so processors and stopping rules see the generated tokens
    only (as in HF's ``generate(inputs_embeds=...)``).

    The options arrive resolved (`resolve.prepare`: HF's generation configs, the HF / TransformerLens
    spellings and `generate`'s defaults): ``do_sample`` is a bool, the lengths are counts of new tokens.
    """
    start = time.perf_counter()
    d_vocab = model.cfg.d_vocab
    for name in ("use_cache", "verbose", "return_dict", "output_logits", "output_scores"):
        check_bool(name, o[name])
    if o["stop_at_eos"] is not None:
        check_bool("stop_at_eos", o["stop_at_eos"])
    max_new_tokens = _max_new_tokens(o["max_new_tokens"], prompt_width, model.cfg.n_ctx)
    greedy, warpers, freq_penalty = _sampling(o)
    num_beams = check_int("num_beams", o["num_beams"], minimum=1)
    num_return_sequences = _num_return_sequences(o["num_return_sequences"], num_beams, greedy)
    length_penalty, early_stopping = o["length_penalty"], o["early_stopping"]
    if not is_real(length_penalty) or not math.isfinite(length_penalty):
        error = ValueError if is_real(length_penalty) else ArgumentTypeError
        raise error(f"`length_penalty` must be a finite float, got {describe(length_penalty)}. 1.0 is neutral.")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise ValueError(f"`early_stopping` must be True, False or 'never', got {describe(early_stopping)}.")
    hint = "0 records none."
    records = Records(o["return_dict"], check_int("top_logprobs", o["top_logprobs"], minimum=0, maximum=d_vocab,
                                                  hint=hint), o["output_logits"], o["output_scores"])  # fmt: skip
    if (records.top_logprobs or records.output_logits or records.output_scores) and not records.on:
        raise ValueError(
            "`top_logprobs`, `output_logits` and `output_scores` are `GenerationOutput` records: add "
            "`return_dict=True` (or HF's `return_dict_in_generate=True`)."
        )
    streamer = o["streamer"]
    _check_streamer(streamer)
    if num_beams > 1 and (records.top_logprobs or records.output_logits or records.output_scores or streamer):
        raise ValueError(
            "Beam search records `logprobs` and `sequences_scores` only: `top_logprobs`, `output_logits`, "
            "`output_scores` and `streamer` need `num_beams=1`."
        )

    all_eos = _eos_ids(model, o["eos_token_id"])  # checked even when unused
    if o["stop_at_eos"] is True and not all_eos and not _eos_named(model, o["eos_token_id"]):
        raise ArgumentValueError(
            "`stop_at_eos=True` needs an EOS id, and none is known: `eos_token_id` was not given and the model's "
            "generation config, config and tokenizer (`cfg.eos_token_id`) have none. Give `eos_token_id=`, or "
            "leave `stop_at_eos` unset."
        )
    eos = [] if o["stop_at_eos"] is False else all_eos
    pad, pad_known = _pad(model, o["pad_token_id"], all_eos)
    tokenizer = model.tokenizer if o["tokenizer"] is None else o["tokenizer"]
    stop_strings = _stop_strings(o["stop_strings"], tokenizer)
    criteria = _criteria(o["stopping_criteria"])
    shown = 0 if from_embeds else prompt_width  # the width of the prompt processors and stopping rules see
    stopping = Stopping(eos, shown, stop_strings, tokenizer, criteria, _max_time(o["max_time"]), start)
    generator = _generator(o["seed"], o["generator"], model.device)
    sampler = build_sampler(
        prompt_width=shown, max_new_tokens=max_new_tokens, eos_token_ids=eos, d_vocab=d_vocab,
        device=model.device, options={**o, "freq_penalty": freq_penalty}, greedy=greedy, warpers=warpers,
        generator=generator,
    )  # fmt: skip
    return Plan(
        max_new_tokens=max_new_tokens,
        use_cache=o["use_cache"],
        pad_token_id=pad,
        eos_token_ids=eos,
        sampler=sampler,
        stopping=stopping,
        search=Search(num_beams, num_return_sequences, float(length_penalty), early_stopping),
        records=records,
        streamer=streamer,
        verbose=o["verbose"],
        pad_known=pad_known,
    )


def _pad(model: BridgeCore, pad_token_id: object, eos: list[int]) -> tuple[int, bool]:
    """The id finished rows are filled with and whether one is known: the keyword, the tokenizer's pad or EOS, the
    config's pad, else the first EOS id (HF's rule); else a placeholder 0 (`resolve` refuses it where rows can
    finish at different steps)."""
    d_vocab = model.cfg.d_vocab
    if pad_token_id is not None:
        return _token("pad_token_id", pad_token_id, d_vocab), True
    known = model._known_pad_id()
    if known is None and eos:
        known = eos[0]
    return (0, False) if known is None else (_token("pad_token_id", known, d_vocab), True)


def _max_new_tokens(max_new_tokens: object, prompt_width: int, n_ctx: int | None) -> int:
    max_new_tokens = check_int(
        "max_new_tokens", max_new_tokens, minimum=1, hint="To score a prompt without generating, call `model(tokens)`."
    )
    if n_ctx is not None and prompt_width + max_new_tokens > n_ctx:
        raise ValueError(
            f"`max_new_tokens`={max_new_tokens} with a prompt of {prompt_width} tokens needs "
            f"{prompt_width + max_new_tokens} positions; the model's context is {n_ctx}. Use "
            f"`max_new_tokens` <= {max(n_ctx - prompt_width, 0)} or a shorter prompt."
        )
    return max_new_tokens


def _sampling(o: Mapping[str, Any]) -> tuple[bool, dict[str, Any], float]:
    """Whether decoding is greedy, the warpers' values (HF's defaults filled in), and TL's ``freq_penalty``."""
    do_sample = o["do_sample"]
    check_bool("do_sample", do_sample)
    given = {k: o[k] for k in SAMPLING_ARGS if o[k] is not None}
    temperature, top_k, freq_penalty = o["temperature"], o["top_k"], o["freq_penalty"]
    if not do_sample and given:
        warnings.warn(
            f"`do_sample=False` decodes greedily, so {sorted(given)} have no effect. Drop `do_sample` (it then "
            "follows from the sampling arguments) or pass `do_sample=True`.",
            # _sampling ← plan ← resolve.prepare ← generate ← torch.no_grad's wrapper ← the keyword check ← the caller
            stacklevel=7,
        )
    if freq_penalty is not None and (not is_real(freq_penalty) or not 0 <= freq_penalty < math.inf):
        error = ValueError if is_real(freq_penalty) else ArgumentTypeError
        raise error(
            f"`freq_penalty` must be a finite float >= 0 (TransformerLens' penalty: `freq_penalty * count` off "
            f"each token's logit, prompt included), got {describe(freq_penalty)}. 0 disables it; for OpenAI's "
            "signed penalty over generated tokens use `frequency_penalty`."
        )
    temperature = 1.0 if temperature is None else temperature
    if do_sample and top_k is None:
        top_k = HF_DEFAULT_TOP_K
    values = {**{k: o[k] for k in WARPERS}, "temperature": temperature, "top_k": top_k}
    validate_sampling_args(**values)
    kinds = {"temperature": float, "top_k": int}
    warpers = {k: None if v is None else kinds.get(k, float)(v) for k, v in values.items()}
    greedy = not do_sample or temperature == 0
    return greedy, warpers, 0.0 if greedy or freq_penalty is None else float(freq_penalty)


def _num_return_sequences(n: object, num_beams: int, greedy: bool) -> int:
    n = check_int("num_return_sequences", n, minimum=1)
    if num_beams > 1 and n > num_beams:
        raise ValueError(
            f"`num_return_sequences`={n} must be in [1, `num_beams`={num_beams}]: beam search "
            "returns the best beams. Raise `num_beams` or lower `num_return_sequences`."
        )
    if num_beams == 1 and greedy and n > 1:
        raise ValueError(
            f"`num_return_sequences`={n} with greedy decoding would give {n} identical rows. Sample "
            "(`do_sample=True` or a sampling argument such as `temperature`), or use beam search "
            f"(`num_beams` >= {n})."
        )
    return n


def _check_streamer(streamer: Any) -> None:
    if streamer is None:
        return
    missing = [m for m in ("put", "end") if not callable(getattr(streamer, m, None))]
    if missing:
        raise ArgumentTypeError(
            f"`streamer` must have `put(token_ids)` and `end()` methods (e.g. transformers' `TextStreamer`); "
            f"got {describe(streamer)}, which lacks {missing}."
        )


def _max_time(max_time: object) -> float | None:
    if max_time is None:
        return None
    if not is_real(max_time) or not max_time > 0:  # `not >` also rejects NaN
        error = ValueError if is_real(max_time) else ArgumentTypeError
        raise error(f"`max_time` must be None or a number of seconds > 0, got {describe(max_time)}.")
    return float(max_time)


def _stop_strings(stop_strings: object, tokenizer: Any) -> list[str]:
    if stop_strings is None:
        return []
    strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(strings, Sequence) or not all(isinstance(s, str) for s in strings):
        raise ArgumentTypeError(
            f"`stop_strings` must be a str or a list of str, got {describe(stop_strings)}. "
            "Example: `stop_strings=['\\n\\n', 'User:']`."
        )
    if not all(strings):
        raise ValueError(f"`stop_strings` must be non-empty strings, got {list(strings)!r}.")
    if strings and tokenizer is None:
        raise ValueError("`stop_strings` need the bridge's tokenizer to decode the output, and this bridge has none.")
    return list(strings)


def _criteria(stopping_criteria: object) -> list[Callable]:
    """A list of criteria, HF's ``StoppingCriteriaList``, or one criterion alone (TransformerLens takes that)."""
    if stopping_criteria is None:
        return []
    if callable(stopping_criteria) and not isinstance(stopping_criteria, Sequence):
        stopping_criteria = [stopping_criteria]
    if not isinstance(stopping_criteria, Sequence):
        raise ArgumentTypeError(
            "`stopping_criteria` must be a StoppingCriteria (any callable `(input_ids, scores) -> bool tensor "
            f"[batch]`), a list of them or a StoppingCriteriaList, got {describe(stopping_criteria)}."
        )
    for i, c in enumerate(stopping_criteria):
        if not callable(c):
            raise ArgumentTypeError(
                f"`stopping_criteria`[{i}] must be a StoppingCriteria (any callable `(input_ids, scores) -> bool "
                f"tensor [batch]`), got {describe(c)}."
            )
    return list(stopping_criteria)


def _generator(seed: object, generator: object, device: torch.device) -> torch.Generator | None:
    if seed is not None and generator is not None:
        raise ValueError("Pass either `seed` or `generator`, not both.")
    if seed is not None:
        seed = check_int("seed", seed, minimum=0, maximum=MAX_SEED, hint="torch seeds are unsigned 64-bit.")
        return torch.Generator(device=device).manual_seed(seed)
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise ArgumentTypeError(f"`generator` must be a torch.Generator, got {describe(generator)}.")
    if generator.device.type != device.type:
        raise ValueError(
            f"`generator` lives on {generator.device} but the model on {device}; create it there: "
            f"`torch.Generator(device={str(device)!r})`, or pass `seed=`."
        )
    return generator


def _eos_named(model: BridgeCore, eos_token_id: Any) -> bool:
    """Whether the call or the model names an EOS id at all (one past the vocabulary included: HF accepts it)."""
    sources = (
        eos_token_id,
        getattr(getattr(model.hf_model, "generation_config", None), "eos_token_id", None),
        getattr(model.hf_model.config, "eos_token_id", None),
        getattr(model.tokenizer, "eos_token_id", None),
    )
    for source in sources:
        if isinstance(source, Tensor):
            source = source.tolist()
        if source is not None:  # the first source that says something decides, as in `_eos_ids`
            return is_int(source) or len(source) > 0
    return False


def _eos_ids(model: BridgeCore, eos_token_id: int | Sequence[int] | Tensor | None) -> list[int]:
    d_vocab = model.cfg.d_vocab
    if isinstance(eos_token_id, Tensor):
        eos_token_id = eos_token_id.tolist()
    if eos_token_id is not None:
        if not is_int(eos_token_id) and (isinstance(eos_token_id, str) or not isinstance(eos_token_id, Sequence)):
            raise ArgumentTypeError(
                f"`eos_token_id` must be a token id or a list of them, got {describe(eos_token_id)}. "
                "For a string, use `model.to_single_token(text)`."
            )
        ids = [eos_token_id] if is_int(eos_token_id) else list(eos_token_id)
        # An id past the vocabulary (GPT-2's 50256 on a smaller model) is accepted, as by HF: it is never produced.
        ids = [check_int("eos_token_id", t, minimum=0, hint="Token ids are >= 0.") for t in ids]
        return [t for t in ids if t < d_vocab]
    # The model's own choice, as HF's generate makes it; ids past the vocabulary (a tiny test config
    # keeping GPT-2's 50256) can never be produced, so they are dropped rather than rejected.
    for source in (
        getattr(getattr(model.hf_model, "generation_config", None), "eos_token_id", None),
        getattr(model.hf_model.config, "eos_token_id", None),
        getattr(model.tokenizer, "eos_token_id", None),
    ):
        if source is not None:
            ids = [source] if is_int(source) else list(source)
            return [int(t) for t in ids if is_int(t) and 0 <= t < d_vocab]
    return []


def _token(name: str, token: object, d_vocab: int) -> int:
    hint = f"Token ids index the vocabulary (d_vocab={d_vocab})."
    return check_int(name, token, minimum=0, maximum=d_vocab - 1, hint=hint)
