"""Running part of the model: stop before a block (the rest is never computed) or start at one.

`stop_before` raises out of the HF forward from a forward-pre hook on the first module not to run
(block ``layer``, or the final norm for ``layer == n_layers``) and hands back its input, the residual
stream. `start_at` feeds a given residual stream into block ``layer``; the blocks before it run on a
zero input (HF has no entry point between blocks) with every hook point there silenced, so they cost
time but cannot be seen.
"""

from collections.abc import Iterator
from contextlib import contextmanager

from jaxtyping import Float
from torch import Tensor, nn

from .checks import as_index


class StopForward(Exception):  # noqa: N818 (control flow, not an error)
    """Carries the residual stream out of a forward stopped by `stop_before`."""

    def __init__(self, residual: Tensor) -> None:
        super().__init__("forward stopped early")
        self.residual = residual


def check_layer(value: object, n_layers: int, param: str) -> int:
    """A layer index in ``0..n_layers`` (negative counts from the end), as TransformerLens takes it."""
    index = as_index(value)
    if index is None:
        raise TypeError(f"`{param}` must be an int layer index, got {value!r} ({type(value).__name__}).")
    value = index
    if not -n_layers <= value <= n_layers:
        raise IndexError(f"`{param}`={value} is out of range: this model has {n_layers} layers (use 0..{n_layers}).")
    return value + n_layers if value < 0 else value


def _hidden(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def stop_before(module: nn.Module, skip: int = 0) -> Iterator[None]:
    """Stop any forward at ``module``'s input, before the hooks already on it run; ``skip``: let that many calls
    of it pass first (NanoChat's final norm is also its embedding norm)."""
    calls = [0]

    def stop(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        calls[0] += 1
        if calls[0] > skip:
            raise StopForward(_hidden(args, kwargs))

    handle = module.register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def start_at(module: nn.Module, residual: Float[Tensor, "batch pos d_model"]) -> Iterator[None]:
    """Replace ``module``'s input (a block's residual stream) by ``residual``, before its hook points see it."""

    def replace(mod: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (residual.to(args[0].dtype), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": residual.to(kwargs["hidden_states"].dtype)}

    handle = module.register_forward_pre_hook(replace, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()
