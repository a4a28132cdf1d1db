"""Declarative interventions: ``model.steer(point, add=v | scale=s | ablate_heads=[...] | set=t, positions=...)``.

A `Steering` is an ordinary hook (it runs wherever hooks run: forwards, `generate`, speculative
verification, ``return_cache``) whose behaviour is data, not code: one operation and the tensors it
uses. `Steering.update` changes those tensors in place, so code traced with the intervention (a
compiled decode step) stays valid when the vector or scale changes between calls; only adding or
removing an intervention changes the set of hooks.

Operations (exactly one per intervention), on the activation ``x`` at ``point``:

* ``add=v``: ``x + v`` (``v`` broadcasts against ``x``: a ``[d_model]`` direction for the residual stream).
* ``scale=s``: ``x * s``.
* ``set=t``: ``t`` broadcast to ``x``'s shape (e.g. a mean activation).
* ``ablate_heads=[h, ...]``: zero those heads (per-head points: ``hook_q/k/v/z/result``, ``hook_pattern``,
  ``hook_attn_scores``).

``positions`` (an int or a list of ints) limits it to those absolute positions of each row
(``hook.ctx.positions``: left padding does not count), so a generation steers the same tokens however
it is batched or chunked.

Values live on the model's device. A removed intervention is kept by the model and reused by the
next ``steer`` of the same point, operation and shapes, which copies its values into the same tensors:
``with model.steer(...)`` in a loop then meets the compiled step's graph again instead of re-tracing it
(the graph reads those tensors, and a graph whose tensors were freed is dropped by torch). A `Steering`
object is therefore not to be read after its `remove`.
"""

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from .points import HookPoint, HookRegistry

_HEAD_AXIS_2 = ("hook_q", "hook_k", "hook_v", "hook_z", "hook_result", "hook_rot_q", "hook_rot_k")
_HEAD_AXIS_1 = ("hook_pattern", "hook_attn_scores")
OPERATIONS = ("add", "scale", "set", "ablate_heads")


class Steering:
    """One declarative intervention, registered as a hook; a context manager that removes it on exit.

    Example:
        >>> direction = torch.randn(model.cfg.d_model)
        >>> with model.steer("blocks.1.hook_resid_post", add=3 * direction, positions=[2, 3]) as s:
        ...     steered = model.generate("Hello", max_new_tokens=4)
        ...     s.update(add=-3 * direction)       # same hook, new values: nothing is re-traced
        ...     opposite = model.generate("Hello", max_new_tokens=4)
    """

    def __init__(self, model: HookRegistry, point: str, operation: str, value: Tensor, positions: Tensor | None):
        self.model, self.point, self.operation = model, point, operation
        self.value, self.positions = value, positions
        self.handle: Any = None

    def __call__(self, x: Float[Tensor, "..."], hook: HookPoint) -> Float[Tensor, "..."]:
        value = self.value.to(device=x.device, dtype=x.dtype) if self.operation != "ablate_heads" else self.value
        if self.operation == "add":
            out = x + value
        elif self.operation == "scale":
            out = x * value
        elif self.operation == "set":
            out = value.expand_as(x)
        else:
            keep = ~self.value.to(x.device)
            axis = 1 if self.point.endswith(_HEAD_AXIS_1) else 2
            shape = [1] * x.dim()
            shape[axis] = -1
            out = x * keep.view(shape).to(x.dtype)
        if self.positions is None:
            return out
        pos = hook.ctx.positions if hook.ctx is not None else torch.arange(x.shape[1], device=x.device)[None]
        where = torch.isin(pos, self.positions.to(pos.device))  # [batch, chunk]
        axis = 2 if self.point.endswith(_HEAD_AXIS_1) else 1
        where = where.view(where.shape[0], *([1] * (axis - 1)), where.shape[1], *([1] * (x.dim() - axis - 1)))
        return torch.where(where, out, x)

    def update(self, **values: Any) -> "Steering":
        """Give the operation new values in place (same shape): ``s.update(add=v)``, ``s.update(scale=0.5)``."""
        if set(values) != {self.operation}:
            raise ValueError(
                f"`update` takes this intervention's operation only ({self.operation!r}), got {sorted(values)}."
            )
        new = _value(self.model, self.point, self.operation, values[self.operation])
        if new.shape != self.value.shape:
            raise ValueError(
                f"`{self.operation}` must keep its shape {tuple(self.value.shape)} (tensors are updated in place), "
                f"got {tuple(new.shape)}."
            )
        self.value.copy_(new)
        return self

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def __enter__(self) -> "Steering":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def steer(
    model: HookRegistry,
    point: str,
    *,
    add: Tensor | None = None,
    scale: float | Tensor | None = None,
    set: Tensor | None = None,
    ablate_heads: Sequence[int] | None = None,
    positions: int | Sequence[int] | None = None,
) -> Steering:
    """Register a declarative intervention on hook point ``point``; see the module docstring.

    Returns the `Steering`: ``.update(...)`` changes its values in place, ``.remove()`` (or leaving a
    ``with`` block) unregisters it.

    Example:
        >>> s = model.steer("blocks.0.attn.hook_z", ablate_heads=[0, 2])
        >>> logits = model("Hello")
        >>> s.remove()
    """
    given = {name: v for name, v in (("add", add), ("scale", scale), ("set", set), ("ablate_heads", ablate_heads))
             if v is not None}  # fmt: skip
    if len(given) != 1:
        raise ValueError(f"`steer` takes exactly one of {', '.join(OPERATIONS)}; got {sorted(given) or 'none'}.")
    if not isinstance(point, str) or point not in model.hook_dict:
        raise ValueError(f"`point` must be the name of one hook point, e.g. 'blocks.0.hook_resid_post'; got {point!r}.")
    ((operation, raw),) = given.items()
    value = _value(model, point, operation, raw)
    where = None
    if positions is not None:
        listed = [positions] if isinstance(positions, int) else list(positions)
        if not listed or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in listed):
            raise ValueError(f"`positions` must be a non-negative int or a non-empty list of them, got {positions!r}.")
        where = torch.tensor(listed, dtype=torch.long)
    steering = _reuse(model, point, operation, value, where)
    steering.handle = model.add_hook(point, steering)
    return steering


def _reuse(model: HookRegistry, point: str, operation: str, value: Tensor, where: Tensor | None) -> Steering:
    """A removed `Steering` of the same kind given the new values in place, or a new one (kept for reuse)."""
    device = getattr(model, "device", value.device)
    value = value.to(device)
    where = None if where is None else where.to(device)
    key = (point, operation, value.shape, value.dtype, None if where is None else where.shape)
    kept = model.__dict__.setdefault("_steerings", {}).setdefault(key, [])
    for steering in kept:
        if steering.handle is None and steering.value.device == device:
            steering.value.copy_(value)
            if where is not None:
                steering.positions.copy_(where)
            return steering
    steering = Steering(model, point, operation, value, where)
    kept.append(steering)
    return steering


def _value(model: HookRegistry, point: str, operation: str, raw: Any) -> Tensor:
    if operation == "ablate_heads":
        if not point.endswith(_HEAD_AXIS_1 + _HEAD_AXIS_2):
            raise ValueError(
                f"`ablate_heads` needs a per-head hook point ({', '.join(_HEAD_AXIS_2 + _HEAD_AXIS_1)}), got {point!r}."
            )
        heads = model.cfg.n_kv_heads if point.endswith(("hook_k", "hook_v", "hook_rot_k")) else model.cfg.n_heads
        listed = list(raw)
        if not all(isinstance(h, int) and 0 <= h < (heads or 0) for h in listed):
            raise ValueError(f"`ablate_heads` must list heads in [0, {heads}) for {point!r}, got {raw!r}.")
        mask = torch.zeros(heads, dtype=torch.bool)
        mask[listed] = True
        return mask
    if operation == "scale" and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return torch.tensor(float(raw))
    if not isinstance(raw, Tensor):
        kinds = "a tensor or a number" if operation == "scale" else "a tensor"
        raise TypeError(f"`{operation}` must be {kinds}, got {type(raw)}.")
    return raw.detach().clone()
