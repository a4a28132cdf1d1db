"""Declared interventions on vLLM: data that travels with each request, applied to its rows only.

An `Intervention` is one operation at one hook point: ``add`` a vector, ``scale`` by a number or vector, ``set`` to
a value, or ``ablate`` (zero; ``heads=[...]`` zeroes only those heads of a per-head point), at every position or
at the absolute ``positions`` given. The bridge sends a request's interventions in its own sampling parameters
(``extra_args``), so the worker finds them from the request that owns each row of the batch: batch-mates without
one run exactly as they would alone.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

OPERATIONS = ("add", "scale", "set", "ablate")


@dataclasses.dataclass(frozen=True)
class Intervention:
    """One declared edit at ``point`` for one request (or, through `VLLMBridge.steer`, for every request).

    Example:
        >>> iv = Intervention("blocks.1.hook_resid_post", add=3.0 * direction, positions=[2, 3])
        >>> out = model.generate(prompts, max_new_tokens=8, interventions=[[iv], None])
    """

    point: str
    add: Float[Tensor, "..."] | None = None
    scale: Float[Tensor, "..."] | float | None = None
    set: Float[Tensor, "..."] | float | None = None
    ablate: bool = False
    heads: Sequence[int] | None = None
    positions: Sequence[int] | int | None = None

    def __post_init__(self) -> None:
        given = [op for op in OPERATIONS if _given(getattr(self, op))]
        if len(given) != 1:
            raise ValueError(
                f"An Intervention takes exactly one of `add`, `scale`, `set`, `ablate=True`; got {given or 'none'} "
                f"at {self.point!r}."
            )
        if self.heads is not None and not self.ablate:
            raise ValueError("`heads` goes with `ablate=True` (zero those heads of a per-head point).")
        if isinstance(self.positions, int):
            object.__setattr__(self, "positions", [self.positions])

    @property
    def operation(self) -> str:
        return next(op for op in OPERATIONS if _given(getattr(self, op)))

    def encode(self) -> dict[str, Any]:
        """Plain data (lists and floats) for the request's ``extra_args``."""
        value = getattr(self, self.operation)
        if isinstance(value, Tensor):
            value = {"shape": list(value.shape), "data": value.detach().float().cpu().flatten().tolist()}
        elif self.operation == "ablate":
            value = list(self.heads) if self.heads is not None else None
        else:
            value = float(value)
        return {"point": self.point, "op": self.operation, "value": value,
                "positions": None if self.positions is None else [int(p) for p in self.positions]}  # fmt: skip


def _given(value: Any) -> bool:
    return value is not None and value is not False


def encode_all(items: Sequence[Intervention] | None) -> list[dict[str, Any]]:
    if items is None:
        return []
    if isinstance(items, Intervention):
        items = [items]
    bad = [i for i in items if not isinstance(i, Intervention)]
    if bad:
        raise TypeError(f"Interventions must be `Intervention` objects, got {type(bad[0]).__name__}.")
    return [i.encode() for i in items]


def _decode(tag: dict[str, Any]) -> dict[str, list[tuple[str, Any, Tensor | None]]]:
    by_point: dict[str, list[tuple[str, Any, Tensor | None]]] = {}
    for iv in tag.get("iv", ()):
        value = iv["value"]
        if isinstance(value, dict):
            value = torch.tensor(value["data"], dtype=torch.float32).reshape(value["shape"])
        where = None if iv["positions"] is None else torch.tensor(iv["positions"], dtype=torch.long)
        by_point.setdefault(iv["point"], []).append((iv["op"], value, where))
    return by_point


def apply_interventions(
    tag: dict[str, Any], decoded: dict[str, Any], req_id: str, name: str, x: Tensor, positions: Tensor
) -> Tensor:
    """``x`` (one request's rows of ``name``, ``[chunk, ...]``) after that request's interventions; ``x`` itself
    when none applies to these rows."""
    mine = decoded.get(req_id)
    if mine is None:
        mine = decoded[req_id] = _decode(tag)
    out = x
    for op, value, where in mine.get(name, ()):
        rows = torch.ones(len(x), dtype=torch.bool, device=x.device) if where is None else torch.isin(
            positions, where.to(positions.device))  # fmt: skip
        if not bool(rows.any()):
            continue
        mask = rows.view(-1, *([1] * (x.dim() - 1)))
        if op == "ablate":
            if value is None:
                new = torch.zeros_like(out)
            else:  # heads: axis 1 of a per-head point [chunk, head, d]
                new = out.clone()
                new[:, list(value)] = 0
        else:
            v = value.to(device=x.device, dtype=x.dtype) if isinstance(value, Tensor) else value
            new = out + v if op == "add" else out * v if op == "scale" else torch.zeros_like(out) + v
        out = torch.where(mask, new, out)
    return out
