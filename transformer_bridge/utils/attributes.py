"""Attributes by dotted path, defaults overridden for a block (`LocallyOverridenDefaults`), a parameter swapped
for a block (`temporarily_swap_parameter`), and where to run (`get_device`, `is_library_available`)."""

import copy
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..checks import ArgumentTypeError, ArgumentValueError, describe

USE_DEFAULT_VALUE = None
"""The value that means "use the model's default" (None), for `override_or_use_default_value`."""

# What `LocallyOverridenDefaults` may override: the bridge's defaults that a call reads when the argument is
# not given (TransformerLens keeps the padding side on its tokenizer; the bridge keeps it in `cfg`).
_DEFAULTS = {
    "prepend_bos": ("cfg.default_prepend_bos", (USE_DEFAULT_VALUE, True, False)),
    "padding_side": ("cfg.default_padding_side", (USE_DEFAULT_VALUE, "left", "right")),
}


def get_nested_attr(obj: Any, attr_str: str) -> Any:
    """``obj.a.b.c`` for ``attr_str="a.b.c"``.

    Example:
        >>> get_nested_attr(model, "cfg.n_layers")  # doctest: +SKIP
        30
    """
    for name in attr_str.split("."):
        obj = getattr(obj, name)
    return obj


def set_nested_attr(obj: Any, attr_str: str, value: Any) -> None:
    """Set ``obj.a.b.c = value`` for ``attr_str="a.b.c"``.

    Example:
        >>> set_nested_attr(model, "cfg.default_prepend_bos", False)  # doctest: +SKIP
    """
    *path, last = attr_str.split(".")
    setattr(get_nested_attr(obj, ".".join(path)) if path else obj, last, value)


def override_or_use_default_value(default_flag: Any, override: Any | None = None) -> Any:
    """``override`` unless it is None, else ``default_flag``.

    Example:
        >>> override_or_use_default_value(True, None), override_or_use_default_value(True, False)
        (True, False)
    """
    return override if override is not None else default_flag


class LocallyOverridenDefaults:
    """Inside the block, the model's defaults take the given values (None keeps a default); on exit they are
    restored. ``prepend_bos`` sets ``model.cfg.default_prepend_bos`` and ``padding_side`` sets
    ``model.cfg.default_padding_side``, the defaults the bridge's ``to_tokens``, forward and ``generate`` read
    (so ``padding_side="left"`` also marks bare token ids as left-padded, the bridge's opt-in).

    Example:
        >>> with LocallyOverridenDefaults(model, prepend_bos=False):  # doctest: +SKIP
        ...     tokens = model.to_tokens("Hi")  # no BOS
    """

    def __init__(self, model: Any, **overrides: Any) -> None:
        for name, value in overrides.items():
            if name not in _DEFAULTS:
                raise ArgumentValueError(
                    f"{name!r} is not a default that can be overridden; valid: {sorted(_DEFAULTS)}."
                )
            if value not in _DEFAULTS[name][1]:
                raise ArgumentValueError(f"`{name}` must be one of {list(_DEFAULTS[name][1])}, got {value!r}.")
        self.model, self.overrides = model, overrides
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "LocallyOverridenDefaults":
        for name, value in self.overrides.items():
            where = _DEFAULTS[name][0]
            self._saved[name] = copy.deepcopy(get_nested_attr(self.model, where))
            set_nested_attr(self.model, where, override_or_use_default_value(self._saved[name], value))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, value in self._saved.items():
            set_nested_attr(self.model, _DEFAULTS[name][0], value)
        self._saved.clear()


@contextmanager
def temporarily_swap_parameter(parameter: Any, new_value: Any) -> Iterator[torch.nn.Parameter]:
    """Copy ``new_value`` into ``parameter`` for the block and copy the original back afterwards, also on an
    error. The parameter object stays the same (tied weights, hooks, optimizers keep it); shapes and dtypes must
    match (``new_value`` may be on another device).

    Example:
        >>> with temporarily_swap_parameter(model.hf_model.lm_head.weight, torch.zeros_like(W)):  # doctest: +SKIP
        ...     ablated = model(tokens)
    """
    if not isinstance(parameter, torch.nn.Parameter):
        raise ArgumentTypeError(f"`parameter` must be a torch.nn.Parameter, got {describe(parameter)}.")
    if isinstance(new_value, torch.nn.Parameter) or not isinstance(new_value, torch.Tensor):
        raise ArgumentTypeError(f"`new_value` must be a plain tensor, got {describe(new_value)}.")
    if new_value.shape != parameter.shape or new_value.dtype != parameter.dtype:
        raise ArgumentValueError(
            f"`new_value` ({tuple(new_value.shape)}, {new_value.dtype}) must have the parameter's shape and dtype "
            f"({tuple(parameter.shape)}, {parameter.dtype})."
        )
    original = parameter.detach().clone()
    try:
        with torch.no_grad():
            parameter.copy_(new_value)
        yield parameter
    finally:
        with torch.no_grad():
            parameter.copy_(original)


def get_device() -> str:
    """``"cuda"`` when available, else ``"mps"`` only with ``TRANSFORMERLENS_ALLOW_MPS=1`` set (TransformerLens'
    opt-in, for MPS's known correctness problems), else ``"cpu"``.

    Example:
        >>> get_device() in ("cuda", "mps", "cpu")
        True
    """
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available() and torch.backends.mps.is_built():
        if os.environ.get("TRANSFORMERLENS_ALLOW_MPS", "") == "1":
            return "mps"
        logging.getLogger(__name__).info("MPS is available but not chosen; set TRANSFORMERLENS_ALLOW_MPS=1 to use it.")
    return "cpu"


def is_library_available(name: str) -> bool:
    """Whether the package ``name`` is imported or importable, without importing it.

    Example:
        >>> is_library_available("torch"), is_library_available("no_such_package_here")
        (True, False)
    """
    return name in sys.modules or importlib.util.find_spec(name) is not None
