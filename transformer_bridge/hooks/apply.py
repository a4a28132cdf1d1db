"""Running a hook point's functions on one tensor: forward functions in registration order (an edit, however it is
written, becomes what the model computes; read-only functions cost no copy) and the backward functions attached to
the result. `HookPoint.run` calls these; they know nothing of models or sites.
"""

import functools
from typing import Any

import torch
from torch import Tensor

from .checks import _saved_for_backward, check_replacement
from .entries import HookEntry


def apply_forward(point: Any, tensor: Tensor) -> Tensor:
    """Run ``point``'s forward functions on ``tensor`` in registration order and attach its backward ones.

    Returns ``tensor`` itself when no function changed it, and a different tensor object when one did (a
    replacement, or ``tensor`` edited in place under a fresh alias), so a site knows when to write it back.
    """
    start = point._owner.start_layer
    if start is not None and point.layer_index < start:
        return tensor  # a layer before `start_at_layer`: it runs on a placeholder input
    conversion = point.hook_conversion
    for entry in list(point.fwd_hooks):
        if entry.read_only:
            try:
                entry(tensor if conversion is None else conversion.convert(tensor))
            except Exception as e:
                _explain_failure(e, point, entry, tensor)
                raise
            continue
        shown = tensor
        if tensor.requires_grad and torch.is_grad_enabled() and _saved_for_backward(tensor):
            # Its producer kept it for the backward pass (softmax, sqrt, relu...): an in-place
            # edit would break the gradient, so the hook edits a copy that is written back.
            shown = tensor.clone()
        inference = not torch.compiler.is_compiling() and shown.is_inference()
        # Inference tensors have no version counter: compare with a snapshot instead.
        before = shown.clone() if inference else shown._version
        seen = shown if conversion is None else conversion.convert(shown)
        try:
            out = entry(seen)
        except Exception as e:
            _explain_failure(e, point, entry, tensor)
            raise
        if out is None or (out is seen and conversion is None):
            changed = not torch.equal(before, shown) if inference else shown._version != before
            # A copy the hook asked to keep the gradient of (``x.retain_grad()``) must be on the path.
            changed = changed or (shown is not tensor and shown.retains_grad)
            if changed:  # a new object tells the site to write the edit back
                tensor = shown if shown is not tensor else shown.view_as(shown)
            continue
        if conversion is not None:
            out = conversion.revert(out)
        check_replacement(out, shown, entry.fn, point.name)
        tensor = out
    if point.bwd_hooks and tensor.requires_grad:
        # A fresh alias gives the gradient a node of its own, even when the site splits a tensor.
        tensor = tensor.view_as(tensor)
        # The functions registered now run on this forward's gradient, even when the backward comes after they
        # are removed (`run_with_hooks(bwd_hooks=...)` then `.backward()`, as in TransformerLens 4).
        tensor.register_hook(functools.partial(apply_backward, point, list(point.bwd_hooks)))
    return tensor


def _explain_failure(error: Exception, point: Any, entry: HookEntry, tensor: Tensor) -> None:
    """At a decode step, add to ``error`` (its type kept, re-raised by the caller) where it happened: hooks written
    for a whole sequence (``resid[:, 4]``) meet a chunk of one position there. The message gains it when it is a
    plain message, else a note (Python 3.11+); on Python 3.10 such an error is left as it is."""
    ctx = point._owner.ctx
    if ctx is None or ctx.phase != "decode":
        return
    fn = getattr(entry.fn, "__name__", type(entry.fn).__name__)
    where = (
        f"(raised by hook {fn!r} on {point.name!r} at decode step {ctx.step}: phase 'decode', where a hook sees only "
        f"the new positions, a chunk of shape {tuple(tensor.shape)}; `hook.ctx.positions` [batch, chunk] holds each "
        "token's absolute position, e.g. `resid[hook.ctx.positions == 4] += v` instead of `resid[:, 4] += v`)"
    )
    if type(error).__str__ is BaseException.__str__ and len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{where}",)
    elif hasattr(error, "add_note"):
        error.add_note(where)


def apply_backward(point: Any, entries: list[HookEntry], grad: Tensor) -> Tensor | None:
    """Run the backward ``entries`` registered on ``point`` (when its forward ran) on ``grad``."""
    conversion = point.hook_conversion
    for entry in entries:
        seen = grad if conversion is None else conversion.convert(grad)
        out = entry(seen)
        if isinstance(out, tuple) and len(out) == 1:  # TransformerLens' torch-style ``(grad,)``
            out = out[0]
        if out is not None and conversion is not None:
            out = conversion.revert(out)
        if out is not None and out is not grad:
            check_replacement(out, grad, entry.fn, f"{point.name} (backward)")
            grad = out
    return grad
