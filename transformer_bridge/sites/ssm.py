"""State-space (Mamba) hook points: a block is ``norm → mixer → + residual``, with no attention and no MLP.

TransformerLens names where they apply (``hook_embed``, ``blocks.L.hook_resid_pre`` / ``hook_resid_post``,
``blocks.L.ln1.hook_scale`` / ``hook_normalized`` for the block's norm, ``ln_final.*``) and new ones for
the mixer (``d_inner`` = the mixer's width, ``cfg.d_mlp``; ``d_state`` = the SSM state size):

- ``blocks.L.mixer.hook_in [batch pos d_inner]``: the SSM branch of the input projection, before the
  causal convolution;
- ``blocks.L.mixer.hook_gate [batch pos d_inner]``: the gate branch ``z`` (the output is ``y * silu(z)``);
- ``blocks.L.mixer.hook_dt [batch pos dt_rank]``, ``hook_B`` / ``hook_C [batch pos d_state]``: the
  input-dependent selection parameters (the low-rank step size before ``dt_proj``, and B, C);
- ``blocks.L.mixer.hook_y [batch pos d_inner]``: the gated scan output, input of the output projection;
- ``blocks.L.hook_mixer_out [batch pos d_model]``: what the mixer adds to the residual stream.

Every point is the input or output of an HF module called at prefill and at each decode step alike, so
edits propagate into the recurrent state the same way in both. Mamba 2 and Falcon-Mamba blocks have the
points of their mixer kind (`transformer_bridge.sites.mixers`).
"""

from torch import nn

from ..adapters import Adapter
from ..hooks.points import HookPoint, HookRegistry
from .base import Site, identity
from .build import SiteMap
from .mixers import mixer_sites
from .module_paths import get_module
from .norms import norm


def build_ssm_sites(registry: HookRegistry, model: nn.Module, adapter: Adapter) -> SiteMap:
    """Every hook point of a state-space ``model`` in canonical order, with its sites."""
    ssm = adapter.ssm
    if ssm is None:
        raise ValueError(f"`adapter` for {adapter.model_types} describes no state-space mixer (`ssm` is None).")
    points: dict[str, HookPoint] = {}
    sites_for: dict[str, list] = {}

    def add(name: str, site: Site, key: str = "") -> None:
        point = HookPoint(name, registry)
        points[name] = point
        site.points[key] = point
        sites_for[name] = [site]
        site.served.append(point)

    def site(module: nn.Module, kind: str, process) -> Site:
        return Site(module, kind, process, registry)  # type: ignore[arg-type]

    add("hook_embed", site(get_module(model, adapter.embed), "post", identity))
    for layer, block in enumerate(get_module(model, adapter.blocks)):
        p = f"blocks.{layer}."
        add(p + "hook_resid_pre", site(block, "pre", identity))
        ln = get_module(block, adapter.ln1)
        ln_site = site(ln, "post", norm(adapter.norm, ln))
        add(p + "ln1.hook_scale", ln_site, "scale")
        add(p + "ln1.hook_normalized", ln_site, "normalized")
        for part in mixer_sites(block, ssm):
            part_site = site(part.module, part.kind, part.process)
            for key in part.keys:
                add(p + f"mixer.hook_{key}", part_site, key)
        add(p + "hook_mixer_out", site(get_module(block, ssm.mixer), "post", identity))
        add(p + "hook_resid_post", site(block, "post", identity))
    ln_final = get_module(model, adapter.ln_final)
    final = site(ln_final, "post", norm(adapter.norm, ln_final))
    add("ln_final.hook_scale", final, "scale")
    add("ln_final.hook_normalized", final, "normalized")
    return SiteMap(points, sites_for, {})
