"""The processes of norm sites: ``hook_scale`` / ``hook_normalized`` of a norm, shown in TransformerLens layout
whatever layout HF hands the norm, and a norm whose module also serves the points that read its output."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..adapters.base import centred as is_centred
from ..distributed import local_param, onloaded

Run = Callable[[str, Tensor], Tensor]


def norm(kind: str, module: nn.Module) -> Callable:
    """Expose ``hook_scale`` ([b, p, 1]) and ``hook_normalized`` (before the weight) of a norm."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-5))

    def process(run: Run, out: Tensor, x: Tensor | None) -> Tensor:
        h = x if x.dtype == torch.float64 else x.float()  # at least float32, as HF's norms compute
        centred = h - h.mean(-1, keepdim=True) if is_centred(kind) else h
        # In float32 for a 16-bit model (float64 for a float64 one), as HF's norms compute it.
        scale = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        new_scale = run("scale", scale)
        normalized = (centred / new_scale.to(h.dtype)).to(x.dtype)
        new_normalized = run("normalized", normalized)
        if new_scale is scale and new_normalized is normalized:
            return out
        with onloaded(module):  # accelerate may have offloaded the weight once the module returned
            weight = local_param(module, "weight")  # OLMo's LayerNorm has neither weight nor bias
            bias = local_param(module, "bias")
        if kind == "rms_one_plus":
            return (new_normalized.float() * (1.0 + weight.float())).to(out.dtype)
        if kind == "layernorm_one_plus":  # Nemotron's LayerNorm1P
            y = new_normalized * (weight + 1.0)
            return (y + bias if bias is not None else y).to(out.dtype)
        y = new_normalized * weight if weight is not None else new_normalized
        return (y + bias if bias is not None else y).to(out.dtype)

    return process


def pos_before_head(process: Callable) -> Callable:
    """Show a ``[b, head, pos, d]`` module output and input as ``[b, pos, head, d]`` (q/k norms after the
    heads are moved forward: Gemma 3, Apertus, Hunyuan)."""

    def shown(run: Run, out: Tensor, x: Tensor | None) -> Tensor:
        out_t = out.transpose(1, 2)
        new = process(run, out_t, None if x is None else x.transpose(1, 2))
        return out if new is out_t else new.transpose(1, 2)

    return shown


def after_norm(site: Any, norm_process: Callable, then: Callable) -> Callable:
    """A norm's own points (``scale``, ``normalized``), then the points that read its output (``site``: the `Site`).

    Gemma 2's sandwich norms are also the modules whose outputs are ``hook_attn_out`` and
    ``hook_mlp_out``; one torch hook serves both, so their order is fixed. The norm's scale is
    recomputed only while one of its own points is hooked.
    """

    def process(run: Run, out: Tensor, x: Tensor | None) -> Tensor:
        if any(site.points[k].active for k in ("scale", "normalized")):
            out = norm_process(run, out, x)
        return then(run, out, x)

    return process
