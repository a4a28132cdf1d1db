"""Feature interventions through the bridge's hooks: set or scale a transcoder feature at positions, in a forward
or during ``generate`` (positions are absolute, read from ``hook.ctx.positions``, so an edit lands on the same
token at prefill, at each decode step and in the recompute).

The edit is made where the feature lives: its activation is computed from the transcoder's input point, and the
change ``(new - old) · W_dec`` is added to the MLP output point of every layer the feature writes to. With
``direct=True`` the rest of the model is frozen at a clean forward's values (patterns, norm scales, MLP outputs),
which is the linear model a graph's edges describe: the change of a target is then the graph's prediction.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from .replacement import Hook, check_points, frozen_points
from .transcoders import TranscoderSet

MODES = ("set", "scale")


@dataclass(frozen=True)
class Intervention:
    """Set (``mode="set"``) or multiply (``mode="scale"``) feature ``feature`` of ``layer`` at absolute position
    ``pos`` (None: every position, generated ones included).

    Example:
        >>> Intervention(layer=1, feature=7, value=0.0, pos=4)              # ablate at position 4
        >>> Intervention(layer=0, feature=3, value=2.0, mode="scale")      # double everywhere
    """

    layer: int
    feature: int
    value: float
    pos: int | None = None
    mode: str = "set"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {self.mode!r}")


def _positions(x: Tensor, hook) -> Tensor:
    ctx = getattr(hook, "ctx", None)
    pos = getattr(ctx, "positions", None)
    if pos is None:  # outside a bridge call: positions are the chunk's own
        return torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    return pos.to(x.device)


def intervention_hooks(
    model, tc: TranscoderSet, interventions: list[Intervention], *, direct: bool = False, tokens: Tensor | None = None
) -> list[Hook]:
    """Hooks that apply ``interventions`` (use with ``model.hooks(fwd_hooks=...)``, around a forward or
    ``generate``). ``direct=True`` also freezes the rest of the model at the clean forward of ``tokens`` (a forward
    of those tokens only).

    Example:
        >>> with model.hooks(fwd_hooks=intervention_hooks(model, tc, [Intervention(1, 7, 0.0, pos=4)])):
        ...     out = model.generate(tokens, max_new_tokens=8)
    """
    check_points(model, tc)
    for edit in interventions:
        if not (0 <= edit.layer < tc.n_layers and 0 <= edit.feature < tc.d_transcoder):
            raise ValueError(f"an `Intervention` names layer {edit.layer} feature {edit.feature}; the transcoders have "
                             f"layers 0..{tc.n_layers - 1} and features 0..{tc.d_transcoder - 1}")  # fmt: skip
    layers = sorted({e.layer for e in interventions})
    deltas: dict[int, Tensor] = {}
    clean = None
    if direct:
        if tokens is None:
            raise ValueError("`direct=True` needs the clean `tokens` the frozen values come from")
        names = frozen_points(model) + [tc.output_point(layer) for layer in range(tc.n_layers)]
        names += [tc.input_point(layer) for layer in range(tc.n_layers)]
        with torch.no_grad():
            _, clean = model.run_with_cache(tokens, names_filter=names)

    seen: dict[int, Tensor] = {}

    def read(x, hook, layer):
        seen[layer] = x
        if layer not in layers:
            return
        src = clean[hook.name] if clean is not None else x
        acts = tc.encode(src.to(tc.W_enc.dtype), layer)
        new = acts.clone()
        pos = _positions(x, hook)
        for e in (e for e in interventions if e.layer == layer):
            where = torch.ones_like(pos, dtype=torch.bool) if e.pos is None else pos == e.pos
            col = new[..., e.feature]
            new[..., e.feature] = torch.where(where, e.value if e.mode == "set" else col * e.value, col)
        deltas[layer] = (new - acts).detach()

    def write(out, hook, layer):
        base = clean[hook.name] if clean is not None else out
        add = sum(deltas[src] @ tc.decoder(src, layer).detach() for src in layers if layer in tc.writes_to(src))
        if clean is not None and tc.W_skip is not None:  # the skip path is linear: it follows the input
            now, then = seen[layer].to(tc.W_enc.dtype), clean[tc.input_point(layer)].to(tc.W_enc.dtype)
            add = add + tc.skip(now, layer) - tc.skip(then, layer)
        return base + add.to(base.dtype) if torch.is_tensor(add) else base

    hooks: list[Hook] = []
    if clean is not None:
        hooks += [(name, lambda x, hook: clean[hook.name]) for name in frozen_points(model)]
    for layer in layers if clean is None else range(tc.n_layers):
        hooks.append((tc.input_point(layer), lambda x, hook, layer=layer: read(x, hook, layer)))
    written = sorted({out for src in layers for out in tc.writes_to(src)}) if clean is None else range(tc.n_layers)
    for layer in written:
        hooks.append((tc.output_point(layer), lambda x, hook, layer=layer: write(x, hook, layer)))
    return hooks
