"""State-space and convolution mixers: which HF module boundaries serve which ``mixer.*`` points, per kind.

A mixer replaces attention in a state-space block (Mamba, Mamba2, Falcon-Mamba) and in the state-space or
convolution layers of a hybrid (Jamba, Bamba, Nemotron-H, LFM2). Each point below is the input or output
of an HF module the mixer calls at prefill and at every decode step, so an edit enters the recurrent (or
convolution) state exactly as it would from a torch hook on that module. The scan itself, and the causal
convolution, are function calls inside the mixer's forward: there is no module boundary there, so there are
no points for the convolution's output or the recurrent state. Widths: ``d_inner`` the mixer's width
(``cfg.d_mlp`` on a pure state-space model), ``d_state`` the state size, ``group`` the B/C groups of Mamba 2.

``mamba`` (Mamba 1: Mamba, Falcon-Mamba, Jamba):
  - ``mixer.hook_in`` / ``hook_gate [batch pos d_inner]``: the two halves of the input projection (the scan's
    input before the causal convolution, and ``z`` of the output's ``y · silu(z)``);
  - ``mixer.hook_dt [batch pos dt_rank]``, ``hook_B`` / ``hook_C [batch pos d_state]``: the selection projection's
    parts (Jamba, Falcon-Mamba: after their RMS norms, i.e. what the scan reads; dt before ``dt_proj``);
  - ``mixer.hook_y [batch pos d_inner]``: the gated scan output, the input of the output projection.

``mamba2`` (Mamba2, Bamba, Nemotron-H):
  - ``mixer.hook_in [batch pos d_inner + 2 * group * d_state]``: ``[x | B | C]`` before the causal convolution
    (B and C of Mamba 2 come out of the convolution, so they have no point of their own);
  - ``mixer.hook_gate [batch pos d_inner]``: ``z``; ``mixer.hook_dt [batch pos head]``: the step size per head
    before ``dt_bias`` and softplus;
  - ``mixer.hook_scan [batch pos d_inner]``: the scan output (``D`` skip included) before the gated norm;
  - ``mixer.hook_y [batch pos d_inner]``: ``norm(scan · silu(z))``, the input of the output projection.

``short_conv`` (LFM2): ``out = W_out (C ⊙ conv(B ⊙ x))``:
  - ``mixer.hook_in``, ``hook_B``, ``hook_C [batch pos d_model]``: the three parts of the input projection;
  - ``mixer.hook_y [batch pos d_model]``: ``C ⊙ conv(B ⊙ x)``, the input of the output projection.

And on every mixer layer ``blocks.L.hook_mixer_out [batch pos d_model]``: what the mixer adds to the stream.
"""

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ..adapters.base import SSM, Adapter

Run = Callable[[str, Tensor], Tensor]


@dataclass(frozen=True)
class MixerSite:
    """One module boundary of a mixer and the points it serves (``mixer.hook_<key>`` for each of ``keys``, in
    canonical order); ``process(run, x, inp)`` as for `transformer_bridge.sites.build.Site`."""

    module: nn.Module
    kind: Literal["pre", "post"]
    process: Callable[[Run, Tensor, Tensor | None], Tensor]
    keys: tuple[str, ...]


def split(keys: tuple[str, ...], widths: list[int] | None = None) -> Callable:
    """Show slices of the last axis (``widths``, or equal parts) as the points ``keys``; edits are
    concatenated back.

    Example:
        >>> process = split(("in", "gate"))   # [x | z] halves of Mamba's input projection
    """

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        sizes = widths or [x.shape[-1] // len(keys)] * len(keys)
        bounds = list(itertools.accumulate(sizes, initial=0))
        parts = [x[..., a:b] for a, b in itertools.pairwise(bounds)]  # slices: see sites.fused_qkv
        new = [run(key, part) for key, part in zip(keys, parts, strict=True)]
        if all(a is b for a, b in zip(new, parts, strict=True)):
            return x
        return torch.cat(new, dim=-1)

    return process


def _keyed(key: str) -> Callable:
    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        return run(key, x)

    return process


def module_at(root: nn.Module, path: str) -> nn.Module | None:
    """The module at a dotted ``path`` under ``root``, or None when some part is missing or None (a hybrid's
    layer holds either its mixer or its attention)."""
    try:
        return operator.attrgetter(path)(root)
    except AttributeError:
        return None


def holds(block: nn.Module, path: str, adapter: Adapter) -> bool:
    """Whether ``block`` holds the module at ``path``: always in a family whose blocks are all alike; in a hybrid
    only in the layers of that kind (attention, MLP).

    Example:
        >>> holds(block, adapter.o_proj, adapter)   # an attention layer?
    """
    return adapter.hybrid is None or module_at(block, path) is not None


def mixer_of(block: nn.Module, spec: SSM | None) -> nn.Module | None:
    """The mixer of ``block`` when it is a mixer layer of ``spec``'s kind, else None (an attention or MLP layer)."""
    if spec is None or module_at(block, spec.out_proj) is None or module_at(block, spec.in_proj) is None:
        return None
    return module_at(block, spec.mixer)


def mixer_sites(block: nn.Module, spec: SSM) -> list[MixerSite]:
    """The module boundaries of ``block``'s mixer that serve its ``mixer.*`` points, in canonical order
    (``hook_mixer_out`` is the caller's: it may serve ``hook_resid_mid`` too).

    Example:
        >>> [s.keys for s in mixer_sites(mamba.hf_model.backbone.layers[0], MAMBA.ssm)]
        [('in', 'gate'), ('dt', 'B', 'C'), ('y',)]
    """
    mixer = module_at(block, spec.mixer)
    in_proj = module_at(block, spec.in_proj)
    y = MixerSite(module_at(block, spec.out_proj), "pre", _keyed("y"), ("y",))
    if spec.kind == "short_conv":
        return [MixerSite(in_proj, "post", split(("B", "C", "in")), ("in", "B", "C")), y]
    if spec.kind == "mamba2":
        widths = [mixer.intermediate_size, mixer.conv_dim, mixer.num_heads]
        if sum(widths) != in_proj.out_features:
            raise ValueError(
                f"{type(mixer).__name__}.in_proj has {in_proj.out_features} outputs, not [gate | x B C | dt] = "
                f"{widths}: this Mamba 2 layout has parts the bridge does not know."
            )
        sites = [MixerSite(in_proj, "post", split(("gate", "in", "dt"), widths), ("in", "gate", "dt"))]
        norm = module_at(block, spec.gated_norm) if spec.gated_norm else None
        if norm is not None:  # Falcon-H1 without `mamba_rms_norm` gates by hand: no boundary before the gate
            sites.append(MixerSite(norm, "pre", _keyed("scan"), ("scan",)))
        return [*sites, y]
    halves = MixerSite(in_proj, "post", split(("in", "gate")), ("in", "gate"))
    if spec.selection_norms:  # Jamba, Falcon-Mamba: the scan reads dt, B, C after their norms
        prefix = spec.x_proj.rpartition(".")[0]
        norms = {key: module_at(block, f"{prefix}.{key.lower()}_layernorm") for key in ("dt", "B", "C")}
        return [halves, *(MixerSite(module, "post", _keyed(key), (key,)) for key, module in norms.items()), y]
    widths = [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size]
    selection = MixerSite(module_at(block, spec.x_proj), "post", split(("dt", "B", "C"), widths), ("dt", "B", "C"))
    return [halves, selection, y]


__all__ = ["MixerSite", "holds", "mixer_of", "mixer_sites", "module_at", "split"]
