"""The one protocol every relevance method follows: a `Request` in, a `MethodOutput` out.

A method is registered as a `Method`: its function, a one-line summary, its options declared once
(`Option`: name, type, default, valid range, doc) and, for cache methods, the hook points it reads.
Everything about options reads that declaration: validation and its error messages, the
"did you mean" for a misspelt name, `method_options`, `relevance_hooks`. A method function never
checks its own options; it receives them validated (and converted, e.g. numpy ints to ints) in
``request.options``.

Example:
    >>> import torch
    >>> def first_token(request: Request) -> MethodOutput:
    ...     scores = torch.zeros(len(request.explained), request.tokens.shape[1])
    ...     scores[:, 0] = request.options["weight"]
    ...     return MethodOutput(scores)
    >>> method = Method("first_token", first_token, "all weight on column 0",
    ...                 options=(Option("weight", int, 1, "the score given", minimum=0),))
    >>> method.resolve({"weight": 3})
    {'weight': 3}
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from jaxtyping import Int
from torch import Tensor

from ..cache.activation_cache import ActivationCache
from ..checks import ArgumentTypeError, check_bool, check_int, describe, did_you_mean
from ..core import BridgeCore
from .result import MethodOutput
from .targets import ExplainedToken, Target

# check(value, model, tokens) -> the validated value; ``tokens`` is None when no sequences are known yet
# (`relevance_hooks`), so a check that compares with them must accept None.
Check = Callable[[Any, BridgeCore | None, Tensor | None], Any]


@dataclass(frozen=True)
class Option:
    """One keyword option of a method, declared once.

    Attributes:
        name: the keyword.
        type: ``int``, ``bool`` or ``str`` (checked here, with ``minimum``/``maximum`` or ``choices``), or any
            other type whose values ``check`` validates.
        default: the value when the option is not given.
        doc: one line saying what it does (the docs' methods table names every option; a test checks).
        minimum, maximum: the valid range of an ``int`` option.
        choices: the valid values of a ``str`` option.
        optional: ``None`` is also accepted (it means "the default behaviour", e.g. no chunking).
        required: the method cannot run without it; the error quotes ``doc``.
        hint: a sentence appended to a range error (why the range is what it is).
        check: ``check(value, model, tokens)`` for values that need the model or the sequences; returns the
            value to use (converted, moved to the device).
    """

    name: str
    type: type
    default: Any
    doc: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    optional: bool = False
    required: bool = False
    hint: str = ""
    check: Check | None = None

    def validate(self, method: str, value: Any, model: BridgeCore | None, tokens: Tensor | None) -> Any:
        """``value`` checked against this declaration (and converted), or an error naming the option."""
        if value is None and (self.optional or self.required):
            if self.required and tokens is not None:
                raise ValueError(f"Method {method!r} needs `{self.name}`: {self.doc}")
            return None
        if self.type is bool:
            return check_bool(self.name, value)
        if self.type is int:
            return check_int(self.name, value, minimum=self.minimum, maximum=self.maximum, hint=self.hint)
        if self.choices and (not isinstance(value, str) or value not in self.choices):
            raise ValueError(
                f"`{self.name}`={describe(value)} is not valid for method {method!r}; use one of {self.choices}."
            )
        if self.type is str and not isinstance(value, str):
            raise ArgumentTypeError(f"`{self.name}` must be a string ({self.doc}), got {describe(value)}.")
        return value if self.check is None or model is None else self.check(value, model, tokens)


@dataclass(frozen=True)
class Method:
    """A registered method: its function, summary, declared options, and the cache hook points it reads.

    ``reads(model, options)`` lists the hook points a cache method reads for validated ``options``;
    ``None`` for methods that recompute a forward instead (they read nothing from the cache).
    """

    name: str
    fn: Callable[["Request"], MethodOutput]
    summary: str
    options: tuple[Option, ...] = ()
    reads: Callable[[BridgeCore, Mapping[str, Any]], list[str]] | None = None
    option_names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "option_names", tuple(o.name for o in self.options))

    def hook_points(self, model: BridgeCore, options: Mapping[str, Any]) -> list[str]:
        """The hook points this method reads for validated ``options`` (``[]`` for forward methods); a
        `ValueError` when the model's family has not got them all (e.g. no ``hook_pattern`` where the HF
        module computes attention itself), since no cache could then hold them."""
        names = [] if self.reads is None else self.reads(model, options)
        absent = [name for name in names if name not in model.hook_dict]
        if absent:
            shown = absent if len(absent) <= 4 else [*absent[:4], f"… ({len(absent)} in all)"]
            raise ValueError(
                f"Method {self.name!r} reads hook points that this {model.cfg.model_type!r} model does not have: "
                f"{shown} (`model.hook_dict` lists the ones it has). Use a method that recomputes a forward "
                "instead (e.g. 'grad_x_input' or 'integrated_gradients', which run on every family)."
            )
        return names

    def check_names(self, given: Mapping[str, Any]) -> None:
        """`TypeError` naming the first unknown option and the closest declared one, if any is unknown."""
        unknown = [k for k in given if k not in self.option_names]
        if unknown:
            names = ", ".join(f"`{k}`" for k in unknown)
            accepts = f"It accepts {list(self.option_names)}." if self.options else "It accepts no options."
            raise TypeError(
                f"Method {self.name!r} got unknown option(s) {names}.{did_you_mean(unknown[0], self.option_names)} "
                f"{accepts}"
            )

    def resolve(
        self, given: Mapping[str, Any], model: BridgeCore | None = None, tokens: Tensor | None = None
    ) -> dict[str, Any]:
        """Every declared option with its validated value (the default where not given).

        Unknown names raise `TypeError` with the closest declared one. Values are checked in declaration
        order; checks that need the model run only when it is given, required options only with ``tokens``.
        """
        self.check_names(given)
        return {o.name: o.validate(self.name, given.get(o.name, o.default), model, tokens) for o in self.options}


@dataclass(frozen=True)
class Request:
    """Everything a method is asked: the sequences, the tokens to explain, the target, the cache, the options.

    Built by `explain` after every check: ``tokens`` and ``attention_mask`` are on the model's device
    (the mask a 0/1 long tensor), ``explained`` is non-empty and in range, ``target`` is parsed, and
    ``options`` holds every declared option of the method, validated (read-only).
    """

    model: BridgeCore
    tokens: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    explained: tuple[ExplainedToken, ...]
    target: Target
    cache: ActivationCache | None = None
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not isinstance(self.options, MappingProxyType):
            object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
