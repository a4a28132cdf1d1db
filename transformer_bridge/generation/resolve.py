"""HF and TransformerLens habits, resolved once into `generate`'s own options: `prepare`.

`generate` takes HF's ``model.generate`` keywords and TransformerLens' ``HookedTransformer.generate``
keywords with their meaning, then hands `options.plan` one canonical set:

* the prompt: ``input`` (text, token ids, or a tokenizer's output), HF's ``inputs`` / ``input_ids`` /
  ``attention_mask`` / ``token_type_ids`` (``generate(**tokenizer(texts, return_tensors="pt",
  padding=True))``), or nothing (HF starts from BOS). Right-padded rows are moved to left padding
  (`left_aligned`), which gives each row the tokens it gives alone.
* every option a `GenerationConfig` can hold, resolved as HF resolves it: the explicit keyword, else
  the ``generation_config`` argument's field, else ``model.hf_model.generation_config``'s field, else
  `generate`'s default; a field left at ``None`` does not override (`Settings`).
* lengths: HF's ``max_length`` / ``min_length`` count the prompt (its padded width, as in HF);
  ``max_new_tokens`` / ``min_new_tokens`` win over them, with HF's warning.
* aliases: TransformerLens' ``use_past_kv_cache`` (``use_cache``); HF's ``return_dict_in_generate``
  (``return_dict``, with HF's per-step tuples), ``output_scores``.
* generation config fields this loop does not implement (`keywords.UNSUPPORTED`) raise from the
  caller's ``generation_config`` and warn from the model's.

Example:
    >>> enc = tokenizer(["Hi", "Hello there"], return_tensors="pt", padding=True)   # right-padded
    >>> out = model.generate(**enc, max_new_tokens=8, return_dict_in_generate=True, output_scores=True)
    >>> len(out.scores), out.scores[0].shape      # one [batch, d_vocab] per step, as HF's
"""

import warnings
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor
from transformers import GenerationConfig

from ..checks import ArgumentTypeError, ArgumentValueError, check_bool, check_device, check_int, describe, is_int
from ..core import BridgeCore
from ..inputs import hf_generate_mask, left_padding_mask
from . import checks, options
from .declare import BY_NAME, CONFIG_FIELDS
from .keywords import UNSUPPORTED, is_number_or_flag
from .options import HF_DEFAULT_TOP_K, WARPERS, Plan

DEFAULT_MAX_NEW_TOKENS = 20  # HF's default `max_length` of 20 counts new tokens when nothing is set
# Config fields HF's `generate` reads only to pick a cache (Gemma2's config names one); ours is always a
# `DynamicCache`, and the tokens are the same.
_CONFIG_IGNORED = frozenset({"cache_implementation"})


@dataclass
class Request:
    """One `generate` call, resolved: the left-padded prompt, the `Plan`, and what to return."""

    tokens: Int[Tensor, "batch pos"]
    mask: Int[Tensor, "batch pos"]
    prompts: list[str] | None  # the text prompts, when the input was text
    single: bool  # the input was one str
    text_out: bool
    plan: Plan
    return_dict: bool
    hf_layout: bool  # HF's `return_dict_in_generate`: per-step records as tuples
    return_cache: bool
    names: list[str]
    device: torch.device | None
    controller: Any = None  # as given; `control.check_controller` makes one per row
    max_steps: int = 0
    speculation: dict[str, Any] | None = None  # as given; `speculative.drafter` checks them
    cache_implementation: Any = "dynamic"  # as given, with `compile`; `fast.check` checks them
    compile: Any = False
    embeds: Tensor | None = None  # the prompt as embeddings [batch, pos, d_model] (``tokens`` are placeholders)
    return_input_tokens: bool = False


class Settings:
    """An option's value as HF resolves it: keyword, else ``generation_config``'s field, else the model's.

    Example:
        >>> s = Settings(GenerationConfig(top_p=0.9), GenerationConfig(top_p=0.8, temperature=0.6))
        >>> s("top_p", None), s("temperature", None), s("temperature", 1.0), s("top_k", None, 50)
        (0.9, 0.6, 1.0, 50)
    """

    def __init__(self, user: GenerationConfig | None, model: GenerationConfig | None) -> None:
        self.configs = [c for c in (user, model) if c is not None]
        self.user = user

    def __call__(self, name: str, value: Any, default: Any = None) -> Any:
        if value is not None:
            return value
        for config in self.configs:
            field = getattr(config, name, None)
            if field is not None:
                return field
        return default

    def by_user(self, name: str, value: Any) -> bool:
        """Whether the caller set it: the keyword, or the ``generation_config`` they passed."""
        return value is not None or (self.user is not None and getattr(self.user, name, None) is not None)


def prepare(model: BridgeCore, a: Mapping[str, Any]) -> Request:
    """Resolve every argument of `generate` (``a``: its arguments by name, see the module docstring); raises
    before any forward. The defaults live in `generate`'s signature only; the names are `generate`'s."""
    if not isinstance(a["return_type"], str) or a["return_type"] not in ("input", "str", "tokens", "embeds"):
        raise ValueError(
            f"`return_type` must be 'input', 'str', 'tokens' or 'embeds', got {describe(a['return_type'])}."
        )
    for name in ("return_cache", "return_dict", "return_input_tokens"):
        check_bool(name, a[name])
    checks.check_output_form(a)
    if a["prepend_bos"] is not None:
        check_bool("prepend_bos", a["prepend_bos"])
    return_cache = a["return_cache"]
    if not return_cache and (a["names_filter"] is not None or a["device"] is not None):
        raise ValueError("`names_filter` and `device` only apply with `return_cache=True`.")
    if isinstance(a["max_new_tokens"], GenerationConfig):
        raise ArgumentTypeError(
            "`max_new_tokens` (the second positional argument) got a GenerationConfig; HF's `generate` takes "
            "it there, this one by name: `generate(tokens, generation_config=config)`."
        )
    names = model.names_matching(a["names_filter"]) if return_cache else []
    device = check_device(a["device"]) if return_cache else None

    settings = Settings(_user_config(a["generation_config"]), getattr(model.hf_model, "generation_config", None))
    _check_configs(settings)
    given = (a["input"], a["inputs"], a["input_ids"])
    tokens, mask, embeds, prompts, single = _prompt(
        model, settings, given, a["attention_mask"], a["token_type_ids"], a["prepend_bos"], a["padding_side"],
        a["pad_token_id"], a["eos_token_id"],
    )  # fmt: skip
    if embeds is not None:
        _check_embeds_options(a)
    text_out = a["return_type"] == "str" or (a["return_type"] == "input" and prompts is not None)
    if text_out:
        model._require_tokenizer()
    width = tokens.shape[1]
    max_new, min_new = _lengths(settings, width, model.cfg.n_ctx, a)
    do_sample, warpers = _sampling(settings, a)
    if do_sample is False and a["do_sample"] is None and not settings.by_user("do_sample", None):
        checks.warn_greedy(model, settings("num_beams", a["num_beams"], 1))
    if do_sample is True and not settings.by_user("top_k", a["top_k"]):
        checks.warn_default_top_k(model, settings("top_k", None, HF_DEFAULT_TOP_K))
    use_cache, tl_use_cache = a["use_cache"], a["use_past_kv_cache"]
    if use_cache is not None and tl_use_cache is not None and use_cache != tl_use_cache:
        raise ValueError(
            f"`use_cache`={use_cache!r} and `use_past_kv_cache`={tl_use_cache!r} disagree; they are one "
            "option (HF's and TransformerLens' names for it): pass one."
        )
    hf_layout = settings("return_dict_in_generate", a["return_dict_in_generate"], False)
    check_bool("return_dict_in_generate", hf_layout)
    if not (a["return_dict"] or hf_layout) and a["return_dict_in_generate"] is None:
        # TransformerLens 4's rule: `output_logits=True` / `output_scores=True` passed alone return HF's output
        # object (`sequences`, and the records as HF lays them out), what `return_dict_in_generate=True` returns.
        hf_layout = any(a[k] is True for k in ("output_logits", "output_scores"))
    return_dict = a["return_dict"] or hf_layout
    outputs = {k: a[k] for k in ("output_logits", "output_scores")}
    if not return_dict:
        # HF ignores an output flag without `return_dict_in_generate`; one passed here is an error
        # (`plan` names it), one from a generation config is ignored as HF does.
        outputs = {k: v if settings.by_user(k, v) else False for k, v in outputs.items()}
    outputs = {k: settings(k, v, False) for k, v in outputs.items()}

    plan = options.plan(model, width, embeds is not None, ChainMap({  # resolved here, else the argument as given
        **{name: settings(name, a[name], BY_NAME[name].fallback) for name in CONFIG_FIELDS},
        "max_new_tokens": max_new, "min_new_tokens": min_new, "do_sample": do_sample, **warpers,
        "use_cache": settings("use_cache", use_cache if use_cache is not None else tl_use_cache, True),
        "eos_token_id": _user_eos(settings, a["eos_token_id"]),
        "pad_token_id": _pad_token_id(model, settings, a["pad_token_id"]), "return_dict": return_dict, **outputs,
    }, a))  # fmt: skip
    _check_padding(plan, tokens.shape[0])
    steps = _control(a["controller"], a["max_steps"], plan)
    speculation = {name: a[name] for name in ("prompt_lookup_num_tokens", "assistant_model", "num_assistant_tokens")}
    return Request(tokens, mask, prompts, single, text_out, plan, return_dict, hf_layout, return_cache, names, device,
                   a["controller"], steps, speculation, a["cache_implementation"], a["compile"], embeds,
                   a["return_input_tokens"])  # fmt: skip


def _check_padding(plan: Plan, batch: int) -> None:
    """Rows that stop at different steps are filled with a pad id; without one anywhere, refuse rather than fill
    them with token 0 (a real token)."""
    rows = batch * max(plan.search.num_return_sequences, plan.search.num_beams)
    by_row = plan.stopping.stop_strings or plan.stopping.criteria
    if rows > 1 and by_row and not plan.pad_known:
        raise ValueError(
            "Rows of this batch can stop at different steps (`stop_strings` / `stopping_criteria`), and a finished "
            "row is filled with a padding token; this model has none (no `pad_token_id`, no tokenizer pad or EOS "
            "token, none in its config). Pass `pad_token_id=`."
        )


def _user_eos(settings: Settings, eos_token_id: Any) -> Any:
    """The keyword, else the caller's ``generation_config``; the model's own EOS (its generation config,
    then config, then tokenizer) is `plan`'s default."""
    return eos_token_id if eos_token_id is not None else getattr(settings.user, "eos_token_id", None)


def _control(controller: Any, max_steps: int | None, plan: Plan) -> int:
    """The step budget of a controlled generation (default 4 × ``max_new_tokens``); what cannot go with one."""
    if controller is None:
        if max_steps is not None:
            raise ValueError("`max_steps` bounds a controlled generation: it needs a `controller`.")
        return 0
    if plan.streamer is not None:
        raise ValueError(
            "`controller` cannot be combined with `streamer`: a controller may backtrack (rewind) tokens a streamer "
            "has already printed. Use `return_dict=True` for each row's tokens, records, parents and finish reasons."
        )
    if max_steps is None:
        return 4 * plan.max_new_tokens
    return check_int("max_steps", max_steps, minimum=1, hint="It counts forwards after the prompt.")


def _user_config(config: object) -> GenerationConfig | None:
    if config is None or isinstance(config, GenerationConfig):
        return config
    hint = " Build one: `GenerationConfig(**settings)`." if isinstance(config, Mapping) else ""
    raise ArgumentTypeError(
        f"`generation_config` must be a transformers GenerationConfig, got {describe(config)}.{hint}"
    )


def _check_configs(settings: Settings) -> None:
    """Refuse what the caller's ``generation_config`` asks for and this loop lacks; warn for the model's."""
    for config in settings.configs:
        user = config is settings.user
        for name, (neutral, hint) in UNSUPPORTED.items():
            value = getattr(config, name, None)
            if value is None or name in _CONFIG_IGNORED or (is_number_or_flag(value) and value in neutral):
                continue
            if user:
                raise ValueError(f"`generation_config.{name}`={value!r} is not supported by this `generate`: {hint}.")
            warnings.warn(
                f"`model.hf_model.generation_config.{name}`={value!r} is ignored: this `generate` does not "
                f"implement it ({hint}). Set it to None on that config to silence this.",
                stacklevel=6,  # _check_configs ← prepare ← generate ← no_grad's wrapper ← checked_keywords ← caller
            )


def _prompt(
    model: BridgeCore,
    settings: Settings,
    given: tuple[Any, Any, Any],
    attention_mask: Tensor | None,
    token_type_ids: Tensor | None,
    prepend_bos: bool | None,
    padding_side: str | None,
    pad_token_id: Any,
    eos_token_id: Any,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Tensor | None, list[str] | None, bool]:
    """The left-padded prompt from whichever form it came in (with its embeddings when given as such); the text
    prompts; whether it was one str.

    Token ids without a mask get the one HF's ``generate`` builds (`inputs.hf_generate_mask`: pad ids are
    padding when the pad id, as HF resolves it, is not an EOS id), so the output equals HF's on the same ids.
    """
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"`padding_side` must be None, 'left' or 'right', got {describe(padding_side)}.")
    named = [(n, v) for n, v in zip(("input", "inputs", "input_ids"), given, strict=True) if v is not None]
    if len(named) > 1:
        raise ValueError(
            f"The prompt was given {len(named)} times ({', '.join(f'`{n}`' for n, _ in named)}); pass one."
        )
    source = named[0][1] if named else None
    if isinstance(source, Mapping):  # a tokenizer's output passed whole rather than unpacked with **
        source, attention_mask, token_type_ids = _unpack(source, attention_mask, token_type_ids)
    if source is None:
        source = torch.tensor([[_bos(model, settings)]])
    text = isinstance(source, str) or (
        isinstance(source, (list, tuple)) and bool(source) and isinstance(source[0], str)
    )
    if isinstance(source, Tensor) and source.is_floating_point():  # embeddings (HF's inputs_embeds)
        tokens, mask, embeds = _embeddings(model, source, attention_mask)
        return tokens, mask, embeds, None, False
    if not text and attention_mask is None and isinstance(source, Tensor):
        if padding_side == "left":  # TransformerLens' rule: the ids are left-padded with the tokenizer's pad id
            attention_mask = _tl_left_padding(model, source, prepend_bos)
        else:  # HF generate's rule for bare ids, and its warning when they look right-padded
            pad, eos = _hf_pad_and_eos(settings, pad_token_id, eos_token_id)
            attention_mask = hf_generate_mask(source, pad, eos)
            # _prompt ← prepare ← generate ← no_grad's wrapper ← checked_keywords ← the caller
            checks.warn_right_padding(source, pad if pad is not None else next(iter(eos), None), eos, stacklevel=6)
    tokens, mask = model.prepare_input(source, attention_mask, prepend_bos, padding_side="left" if text else None)
    if token_type_ids is not None:
        _check_token_type_ids(token_type_ids, tokens.shape)
    if not text:
        tokens, mask = left_aligned(model, tokens, mask)
    prompts = None if not text else [source] if isinstance(source, str) else list(source)
    return tokens, mask, None, prompts, isinstance(source, str)


def _embeddings(
    model: BridgeCore, embeds: Tensor, attention_mask: Tensor | None
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Tensor]:
    """A prompt given as embeddings ``[batch, pos, d_model]`` (HF's ``inputs_embeds``, TransformerLens' float
    input): placeholder token ids (the pad id; no processor or stopping rule sees them) and the mask."""
    embeds = embeds[None] if embeds.dim() == 2 else embeds
    if embeds.dim() != 3 or embeds.shape[-1] != model.cfg.d_model or 0 in embeds.shape[:2]:
        raise ValueError(
            f"A float `input` is the prompt's embeddings [batch, pos, d_model={model.cfg.d_model}], got shape "
            f"{tuple(embeds.shape)}."
        )
    placeholders = torch.full(embeds.shape[:2], model.pad_token_id, dtype=torch.long)
    _, mask = model.prepare_input(placeholders, attention_mask, left_padded=True)
    device = model.device
    return placeholders.to(device), mask, embeds.to(device=device, dtype=model.cfg.dtype)


# What a prompt given as embeddings cannot go with: these run the prompt's token ids again.
_NOT_WITH_EMBEDS = {"num_beams": 1, "controller": None, "prompt_lookup_num_tokens": None, "assistant_model": None,
                    "return_cache": False, "use_cache": None, "use_past_kv_cache": None}  # fmt: skip


def _check_embeds_options(a: Mapping[str, Any]) -> None:
    for name, neutral in _NOT_WITH_EMBEDS.items():
        value = a[name]
        if value is not None and value != neutral and not (name in ("use_cache", "use_past_kv_cache") and value):
            raise ValueError(
                f"`{name}`={describe(value)} cannot be combined with a prompt given as embeddings: it would run the "
                "prompt's token ids again, which embeddings do not have. Pass token ids, or drop it."
            )


def _tl_left_padding(model: BridgeCore, tokens: Tensor, prepend_bos: bool | None) -> Tensor:
    """``padding_side="left"`` with token ids: leading pad tokens are padding (TransformerLens reads them with
    the tokenizer's pad id; a bridge without one has nothing to read them by, and says so)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(
            "`padding_side='left'` with token ids reads the padding by the tokenizer's pad id, and this bridge has "
            "none (no tokenizer). Pass `attention_mask=` (0 on the padding) instead."
        )
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        raise ValueError(
            "`padding_side='left'` with token ids reads the padding by the tokenizer's pad_token_id, which is None. "
            "Set `tokenizer.pad_token_id`, or pass `attention_mask=` (0 on the padding)."
        )
    bos = model.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
    ids = tokens[None] if tokens.dim() == 1 else tokens
    return left_padding_mask(ids, pad, getattr(tokenizer, "bos_token_id", None), bos)


def _hf_pad_and_eos(settings: Settings, pad_token_id: Any, eos_token_id: Any) -> tuple[int | None, list[int]]:
    """The pad and EOS ids HF's ``generate`` decides padding with: the keyword, else the generation configs
    (the caller's, then the model's); a pad id defaults to the first EOS id (and so infers nothing)."""
    eos = settings("eos_token_id", eos_token_id)
    eos_ids = eos.tolist() if isinstance(eos, Tensor) else [eos] if is_int(eos) else list(eos or [])
    pad = settings("pad_token_id", pad_token_id)
    pad = pad.item() if isinstance(pad, Tensor) else pad
    return (pad if is_int(pad) else None), [int(e) for e in eos_ids if is_int(e)]


def _unpack(
    encoding: Mapping[str, Any], attention_mask: Tensor | None, token_type_ids: Tensor | None
) -> tuple[Any, Any, Any]:
    extra = sorted(set(encoding) - {"input_ids", "attention_mask", "token_type_ids"})
    if "input_ids" not in encoding or extra:
        raise ValueError(
            f"A mapping given as the prompt must hold `input_ids` (and may hold `attention_mask`, "
            f"`token_type_ids`), as a tokenizer's output does; got keys {sorted(encoding)}."
        )
    for name, value in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if value is not None and name in encoding:
            raise ValueError(f"`{name}` was given twice: in the tokenizer output and as a keyword. Pass one.")
    return (encoding["input_ids"], encoding.get("attention_mask", attention_mask),
            encoding.get("token_type_ids", token_type_ids))  # fmt: skip


def _bos(model: BridgeCore, settings: Settings) -> int:
    """HF's prompt when none is given: BOS, batch 1."""
    tokenizer = model.tokenizer
    bos = settings("bos_token_id", None, getattr(tokenizer, "bos_token_id", None))
    bos = bos if bos is not None else getattr(model.hf_model.config, "bos_token_id", None)
    if not is_int(bos) or not 0 <= bos < model.cfg.d_vocab:
        raise ValueError(
            "`generate` got no prompt (`input`, `inputs` or `input_ids`) and the model has no BOS token to start "
            f"from (got {describe(bos)}). Pass a prompt."
        )
    return int(bos)


def _check_token_type_ids(token_type_ids: object, shape: torch.Size) -> None:
    """Accepted only when they change nothing: the supported decoder-only families have no segments."""
    if not isinstance(token_type_ids, Tensor):
        raise ArgumentTypeError(
            f"`token_type_ids` must be None or a tensor [batch, pos], got {describe(token_type_ids)}."
        )
    t = token_type_ids[None] if token_type_ids.dim() == 1 else token_type_ids
    if t.shape != shape:
        raise ValueError(f"`token_type_ids` shape {tuple(t.shape)} must equal the tokens' shape {tuple(shape)}.")
    if bool(t.ne(0).any()):
        raise ValueError(
            "`token_type_ids` holds non-zero segment ids; the supported decoder-only models have no segment "
            "embeddings, so `generate` accepts them only all 0 (and ignores them). Drop them: "
            "`tokenizer(..., return_token_type_ids=False)`."
        )


def left_aligned(
    model: BridgeCore, tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"]
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """The batch with each row's last real token moved to the last column (left padding), as generation needs.

    A right-padded row (a tokenizer's default ``padding_side``) gives, once moved, exactly the tokens
    it gives alone; HF's ``generate`` instead warns and continues from the padding. Masked positions between
    real tokens stay where they are, as in HF (positions count real tokens only).

    Example:
        >>> left_aligned(model, torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]]))
        (tensor([[0, 5, 6]]), tensor([[0, 1, 1]]))
    """
    width = tokens.shape[1]
    real = mask.bool()
    last = width - 1 - real.flip(-1).int().argmax(-1)
    if bool((last == width - 1).all()):
        return tokens, mask
    index = (torch.arange(width, device=tokens.device) - (width - 1 - last)[:, None]) % width
    return tokens.gather(1, index), mask.gather(1, index)


def has_gaps(mask: Int[Tensor, "batch pos"]) -> bool:
    """Whether a left-padded mask has padding between real tokens (a row's mask goes 1 then 0)."""
    return bool((mask.cummax(-1).values > mask).any())


def _lengths(settings: Settings, width: int, n_ctx: int | None, a: Mapping[str, Any]) -> tuple[Any, Any]:
    """``max_new_tokens`` and ``min_new_tokens`` from HF's four length options (``*_length`` count the prompt)."""
    max_new_tokens, max_length = a["max_new_tokens"], a["max_length"]
    min_new_tokens, min_length = a["min_new_tokens"], a["min_length"]
    new, total = settings("max_new_tokens", max_new_tokens), settings("max_length", max_length)
    if new is not None:
        if total is not None and settings.by_user("max_length", max_length):
            _warn_both("max_new_tokens", new, "max_length", total)
        mine = settings.by_user("max_new_tokens", max_new_tokens)
    elif total is not None:
        total = check_int("max_length", total, minimum=1, hint="HF's `max_length` counts the prompt too.")
        if total <= width:
            raise ValueError(
                f"`max_length`={total} counts the prompt (HF's meaning), which is {width} tokens wide: nothing is "
                "left to generate. Use `max_new_tokens` for the number of new tokens."
            )
        new, mine = total - width, settings.by_user("max_length", max_length)
    else:
        new, mine = DEFAULT_MAX_NEW_TOKENS, False  # HF: `max_length` 20 + the prompt, capped at the context
    if not mine and is_int(new) and n_ctx is not None and width < n_ctx:
        new = min(new, n_ctx - width)  # a default or the model's own setting stops at its context
    least, least_total = settings("min_new_tokens", min_new_tokens), settings("min_length", min_length)
    if least is not None:
        if least_total and settings.by_user("min_length", min_length):
            _warn_both("min_new_tokens", least, "min_length", least_total)
    elif least_total is not None:
        least = max(check_int("min_length", least_total, minimum=0) - width, 0)
    if is_int(new) and is_int(least) and least > new:
        raise ArgumentValueError(
            f"`min_new_tokens`={least} is more than `max_new_tokens`={new} (counted as new tokens; HF's "
            "`min_length` / `max_length` count the prompt too): EOS would be banned for longer than the generation "
            "runs. Lower `min_new_tokens` or raise `max_new_tokens`."
        )
    return new, least


def _warn_both(new_name: str, new: Any, total_name: str, total: Any) -> None:
    warnings.warn(
        f"Both `{new_name}` (={new}) and `{total_name}` (={total}) are set; `{new_name}` takes precedence, as in "
        f"HF's `generate`. Pass one.",
        stacklevel=7,  # _warn_both ← _lengths ← prepare ← generate ← no_grad's wrapper ← checked_keywords ← caller
    )


def _sampling(settings: Settings, a: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``do_sample`` and the warpers' values.

    ``do_sample=None``: sampling exactly when a sampling keyword is given, else the configs' ``do_sample``
    (HF's default: greedy). When sampling, the configs' warper values fill the ones not given (HF
    reads them only then too); when greedy, only explicit keywords go on (`plan` warns that they do
    nothing).
    """
    warpers = {name: a[name] for name in WARPERS}
    explicit = a["freq_penalty"] is not None or any(v is not None for v in warpers.values())
    do_sample = a["do_sample"]
    if do_sample is None:
        do_sample = True if explicit else settings("do_sample", None, False)
    if do_sample is True:
        warpers = {name: settings(name, value) for name, value in warpers.items()}
    return do_sample, warpers


def _pad_token_id(model: BridgeCore, settings: Settings, pad_token_id: int | None) -> int | None:
    """The keyword, the caller's config, the model's generation config (if in the vocabulary), else `plan`'s."""
    value = settings("pad_token_id", pad_token_id)
    if settings.by_user("pad_token_id", pad_token_id):
        return value
    return value if is_int(value) and 0 <= value < model.cfg.d_vocab else None
