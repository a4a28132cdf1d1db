"""Grammar controllers through llguidance: `json_schema`, `regex`, `lark`, `choice`.

Each returns a `Grammar`, a controller (`generate(..., controller=g)`) that keeps every row inside the
grammar: tokens the grammar forces become ``ff_tokens`` (one forward for all of them), otherwise the
sampling is masked to the tokens the grammar allows; a row stops (finish reason ``"controller"``) when
the grammar is complete, or at EOS where the grammar allows it. A backtrack (by another controller, or
by the engine's view of the row) rolls the matcher back: the matcher always follows the row's tokens.
Each row gets its own matcher (``fork()`` deep-copies it); a list of grammars gives each prompt its own.

The mask of the next step is computed while the next forward runs: llguidance releases the GIL, so a
worker thread fills it as soon as the engine appends the row's token (`Grammar.appended`).

llguidance is an optional dependency: ``pip install 'transformer-bridge[grammar]'``.

Example:
    >>> g = grammar.json_schema({"type": "object", "properties": {"city": {"type": "string"}},
    ...                          "required": ["city"]})
    >>> model.generate("Answer in JSON: ", max_new_tokens=30, controller=g)
"""

import functools
import json
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..checks import ArgumentTypeError, describe
from .branch import Branch, View

try:
    import llguidance
    import llguidance.hf
except ImportError:  # pragma: no cover - exercised by the "not installed" test through `_require`
    llguidance = None

_TOKENIZERS: dict[int, tuple[Any, Any]] = {}  # id(hf tokenizer) → (the tokenizer, its LLTokenizer)


class GrammarError(ValueError):
    """An invalid grammar, regex or JSON schema (the message is llguidance's, with the parameter named)."""


class Grammar:
    """A controller that keeps a row inside an llguidance grammar (see the module docstring).

    Build one with `json_schema`, `regex`, `lark` or `choice`. ``bind(model)`` (called by `generate`)
    attaches the model's tokenizer; ``fork()`` copies the matcher for another row. With
    ``fast_forward=False`` forced tokens are sampled one per forward under the mask instead (the
    baseline the benchmark compares with).
    """

    def __init__(self, grammar: str, source: str, fast_forward: bool = True) -> None:
        self.grammar, self.source, self.fast_forward = grammar, source, fast_forward
        self.matcher: Any = None
        self.tokens: list[int] = []  # what the matcher has consumed: the row's generated tokens
        self.d_vocab = 0
        self.pending: Future | None = None
        # Seconds spent deciding (forced tokens or mask, in the worker or not) and blocking the loop
        # (`appended` + `mid_process`); shared by every copy bound or forked from this grammar.
        self.stats = {"decide_s": 0.0, "blocking_s": 0.0, "steps": 0}

    def __repr__(self) -> str:
        return f"Grammar({self.source})"

    def bind(self, model: Any) -> "Grammar":
        """A copy with a fresh matcher over ``model``'s tokenizer."""
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise ValueError("A grammar needs the model's tokenizer, and this bridge has none.")
        out = Grammar(self.grammar, self.source, self.fast_forward)
        out.stats = self.stats
        out.matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer), self.grammar, log_level=0)
        if out.matcher.is_error():
            raise GrammarError(f"{self.source} is not a valid grammar: {out.matcher.get_error()}")
        out.d_vocab = model.cfg.d_vocab
        return out

    def fork(self) -> "Grammar":
        self._join()  # the matcher must not be copied while the worker reads it
        out = Grammar(self.grammar, self.source, self.fast_forward)
        out.stats = self.stats
        out.matcher = None if self.matcher is None else self.matcher.deep_copy()
        out.tokens, out.d_vocab = list(self.tokens), self.d_vocab
        return out

    def appended(self, generated: list[int]) -> None:
        """The engine appended tokens to the row: follow them, and start the next step's decision (forced
        tokens or mask) in a worker thread while the forward runs."""
        start = time.perf_counter()
        self._join()
        self._follow(generated)
        self.pending = _worker().submit(self._next)
        self.stats["blocking_s"] += time.perf_counter() - start

    def mid_process(self, view: View) -> list[Branch]:
        if self.matcher is None:
            raise ValueError("This grammar is not bound to a model: pass it to `generate(..., controller=g)`.")
        start = time.perf_counter()
        decided = self._join()
        if self._follow(view.generated) or decided is None:
            decided = self._next()
        forced, mask = decided
        self.stats["blocking_s"] += time.perf_counter() - start
        self.stats["steps"] += 1
        if self.matcher.is_error():
            raise GrammarError(f"The row left the grammar ({self.source}): {self.matcher.get_error()}")
        if forced is None and mask is None:
            return []  # the grammar is complete
        return [Branch.forced(forced)] if forced else [Branch.sample(mask)]

    def _join(self) -> tuple[list[int] | None, Tensor | None] | None:
        pending, self.pending = self.pending, None
        return None if pending is None else pending.result()

    def _next(self) -> tuple[list[int] | None, Tensor | None]:
        """(forced tokens, None), (None, allowed mask), or (None, None) once the grammar is complete."""
        start = time.perf_counter()
        m = self.matcher
        if m.is_stopped() or m.is_error():
            return None, None
        forced = m.compute_ff_tokens() if self.fast_forward else None
        decided = (forced, None) if forced else (None, self._mask())
        self.stats["decide_s"] += time.perf_counter() - start
        return decided

    def _follow(self, generated: list[int]) -> bool:
        """Roll back / consume so the matcher has consumed exactly ``generated``; whether it changed."""
        if generated == self.tokens:
            return False
        common = 0
        for a, b in zip(self.tokens, generated, strict=False):
            if a != b:
                break
            common += 1
        if common < len(self.tokens):
            self.matcher.rollback(len(self.tokens) - common)
        new = generated[common:]
        if new:
            self.matcher.consume_tokens(new)
        self.tokens = list(generated)
        return True

    def _mask(self) -> Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(self.d_vocab, dtype=torch.bool)
        n = min(len(bits), self.d_vocab)
        allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        return allowed


def json_schema(schema: Mapping[str, Any] | str, fast_forward: bool = True) -> Grammar:
    """Output one JSON value that validates against ``schema`` (a dict or its JSON text).

    Example:
        >>> g = json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    """
    _require()
    if not isinstance(schema, (Mapping, str)):
        raise ArgumentTypeError(f"`schema` must be a JSON schema (a dict or its JSON text), got {describe(schema)}.")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if isinstance(schema, str) else json.dumps(schema),
            defaults={"whitespace_flexible": False},
        )
    except ValueError as e:
        raise GrammarError(f"`schema` is not valid JSON: {e}") from e
    return _checked(grammar, "json_schema", "schema", fast_forward)


def regex(pattern: str, fast_forward: bool = True) -> Grammar:
    """Output text matching ``pattern`` (whole).

    Example:
        >>> g = regex(r"[0-9]{3}-[0-9]{4}")
    """
    _require()
    if not isinstance(pattern, str):
        raise ArgumentTypeError(f"`pattern` must be a str, got {describe(pattern)}.")
    return _checked(llguidance.LLMatcher.grammar_from_regex(pattern), f"regex({pattern!r})", "pattern", fast_forward)


def lark(text: str, fast_forward: bool = True) -> Grammar:
    """Output text of a Lark grammar (llguidance's dialect; the start rule is ``start``).

    Example:
        >>> g = lark('start: "yes" | "no"')
    """
    _require()
    if not isinstance(text, str):
        raise ArgumentTypeError(f"`text` must be a Lark grammar as a str, got {describe(text)}.")
    return _checked(llguidance.LLMatcher.grammar_from_lark(text), "lark(...)", "text", fast_forward)


def choice(options: Sequence[str], fast_forward: bool = True) -> Grammar:
    """Output exactly one of ``options``.

    Example:
        >>> g = choice(["positive", "negative", "neutral"])
    """
    _require()
    if isinstance(options, str) or not isinstance(options, Sequence) or not all(isinstance(o, str) for o in options):
        raise ArgumentTypeError(f"`options` must be a list of str, got {describe(options)}.")
    if not options or not all(options):
        raise ValueError(f"`options` must be a non-empty list of non-empty strings, got {list(options)!r}.")
    pattern = "|".join(re.escape(o) for o in options)
    source = f"choice({list(options)!r})"
    return _checked(llguidance.LLMatcher.grammar_from_regex(f"({pattern})"), source, "options", fast_forward)


def _checked(grammar: str, source: str, param: str, fast_forward: bool) -> Grammar:
    if not isinstance(fast_forward, bool):
        raise ArgumentTypeError(f"`fast_forward` must be True or False, got {describe(fast_forward)}.")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"`{param}` is not a valid grammar ({source}): {error.strip()}")
    return Grammar(grammar, source, fast_forward)


@functools.cache
def _worker() -> ThreadPoolExecutor:
    """One thread for every grammar: masks are computed there while the forward runs (made on first use)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")


def _require() -> None:
    if llguidance is None:
        raise ImportError(
            "Grammars need llguidance, which is not installed: `pip install 'transformer-bridge[grammar]'` "
            "(or `pip install llguidance`)."
        )


def _ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of an HF tokenizer (built once per tokenizer: ~1 s for a 49k vocabulary)."""
    known = _TOKENIZERS.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    try:
        ll = llguidance.hf.from_tokenizer(tokenizer)
    except ValueError:  # a decoder llguidance cannot read (e.g. a character-level WordLevel tokenizer)
        ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByTokens(tokenizer)))
    _TOKENIZERS[id(tokenizer)] = (tokenizer, ll)
    return ll


class _ByTokens:
    """A tokenizer described to llguidance token by token (each id's decoded bytes)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        special = set(self.special_token_ids)
        self.tokens = [b"" if i in special else tokenizer.decode([i]).encode() for i in range(len(tokenizer))]

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
