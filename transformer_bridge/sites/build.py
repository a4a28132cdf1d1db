"""Building a model's sites: every hook point of a model and the torch hooks on HF modules that serve it.

A site is one forward (or forward-pre) hook on one HF module that serves an ordered group of
points, with a small ``process`` function that shows each point its tensor in TransformerLens
layout and writes edits back. A site's torch hook exists only while a point it serves (or a point
that depends on it) has a function registered.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..adapters import Adapter
from ..hooks.points import HookPoint, HookRegistry
from . import attention, mixers, mla, moe, split_inputs
from .base import (
    AttnFnSite,
    Run,
    Site,
    TwoCallNormSite,
    batch_broadcast,
    copied,
    fused_qkv,
    gate_up,
    head_results,
    heads,
    identity,
    private_input,
    token_ids,
)
from .module_paths import get_module, optional_module
from .norms import after_norm, norm, pos_before_head


@dataclass
class SiteMap:
    """All hook points of a model and, for each, the sites that must be active to serve it."""

    points: dict[str, HookPoint]
    sites_for: dict[str, list]
    stash: dict[int | tuple, Any]  # resid_pre per layer; (layer, kind): the split inputs' per-forward state


def build_sites(
    registry: HookRegistry,
    model: nn.Module,
    adapter: Adapter,
    n_heads: int,
    n_kv: int,
    d_head: int,
    parallel: bool,
) -> SiteMap:
    """Create every hook point of ``model`` in canonical TransformerLens order, with its sites."""
    points: dict[str, HookPoint] = {}
    sites_for: dict[str, list] = {}
    stash: dict[int | tuple, Any] = {}

    def add(name: str, site, key: str = "", extra: tuple = ()) -> None:
        point = HookPoint(name, registry)
        points[name] = point
        if isinstance(site, (Site, moe.ModuleSite)):
            site.points[key] = point
        sites_for[name] = [site, *extra]
        for s in sites_for[name]:
            s.served.append(point)

    def site(module: nn.Module, kind: str, process: Callable) -> Site:
        return Site(module, kind, process, registry)  # type: ignore[arg-type]

    add("hook_tokens", site(get_module(model, adapter.embed), "pre", token_ids))  # the ids the embedding reads
    add("hook_embed", site(get_module(model, adapter.embed), "post", identity))
    if adapter.pos_embed:
        add("hook_pos_embed", site(get_module(model, adapter.pos_embed), "post", batch_broadcast(registry)))
    ln_final = get_module(model, adapter.ln_final)
    final = site(ln_final, "post", norm(adapter.norm, ln_final))
    if adapter.embed_norm:  # one norm module for the embedding and the final norm (NanoChat)
        root = get_module(model, adapter.blocks.rpartition(".")[0])
        final = TwoCallNormSite(ln_final, "post", final.process, registry, root=root)
        add("ln_embed.hook_scale", final, "embed_scale")
        add("ln_embed.hook_normalized", final, "embed_normalized")

    blocks = get_module(model, adapter.blocks)
    refused = split_inputs.refusals(model, adapter, blocks, parallel)
    split_offered, mlp_in_offered = "use_attn_in" not in refused, "use_hook_mlp_in" not in refused
    for layer, block in enumerate(blocks):
        p = f"blocks.{layer}."

        def m(path: str, block: nn.Module = block) -> nn.Module:
            return get_module(block, path)

        def stash_resid_pre(run: Run, x: Tensor, inp, layer=layer) -> Tensor:
            x = run("", x)
            stash[layer] = x
            return x

        resid_pre = site(block, "pre", stash_resid_pre)
        add(p + "hook_resid_pre", resid_pre)
        ln1_module = optional_module(block, adapter.ln1)
        if ln1_module is not None:  # OLMo 2: no norm before attention
            add(p + "ln1.hook_scale", ln1 := site(ln1_module, "post", norm(adapter.norm, ln1_module)), "scale")
            add(p + "ln1.hook_normalized", ln1, "normalized")

        # A hybrid's block holds a mixer or attention, and maybe no MLP (Nemotron-H: one sublayer per block).
        mixer = mixers.mixer_of(block, adapter.hybrid)
        attention_here = mixer is None and mixers.holds(block, adapter.o_proj, adapter)
        moe_block = moe.is_moe_block(block, adapter.moe)
        ffn_here = moe_block or mixers.holds(block, adapter.mlp_down, adapter)
        if attention_here:  # TransformerLens 4's attn.hook_in: what the attention module reads (ln1's output)
            attn_in = site(m(adapter.attn), "pre", identity)
            attn_in.process = private_input(lambda s=attn_in: s.points[""])
            add(p + "attn.hook_in", attn_in)
            if adapter.mla:
                attn_module = m(adapter.attn)
                add(p + "attn.hook_q", site(mla.query_module(attn_module), "post", mla.query_heads(n_heads)))
                latent = site(attn_module.kv_a_proj_with_mqa, "post", mla.latent_split(attn_module.kv_lora_rank))
                add(p + "attn.hook_kv_latent", latent, "kv_latent")
                add(p + "attn.hook_k_rope", latent, "k_rope")
                for key in ("q_a_layernorm", "kv_a_layernorm"):  # no q_a_layernorm without a query low-rank
                    if (latent_ln := getattr(attn_module, key, None)) is not None:
                        ln_site = site(latent_ln, "post", norm(adapter.norm, latent_ln))
                        add(p + f"attn.{key}.hook_scale", ln_site, "scale")
                        add(p + f"attn.{key}.hook_normalized", ln_site, "normalized")
            else:
                if adapter.qkv is None:
                    proj = {k: site(m(getattr(adapter, k)), "post", heads(n_heads if k == "q" else n_kv, d_head))
                            for k in "qkv"}  # fmt: skip
                else:
                    fused = site(m(adapter.qkv), "post", fused_qkv(adapter.qkv_layout, n_heads, n_kv, d_head))
                    proj = dict.fromkeys("qkv", fused)
                if split_offered:  # the split-input points run before hook_q / k / v, on the same sites
                    layout = adapter.qkv_layout if adapter.qkv else "separate"  # GPT-Neo keeps GPT-2's "concat"
                    _split_points(add, site, proj, split_inputs.SplitLayer(
                        layer, stash, registry, ln1_module, layout, n_heads, n_kv, d_head, adapter.conv1d
                    ), ln1_module or m(adapter.attn), p)  # fmt: skip
                for key in "qkv":
                    add(p + f"attn.hook_{key}", proj[key], "" if adapter.qkv is None else key)

            for key in ("q_norm", "k_norm"):
                # GLM-4 MoE builds its q/k norms only when its config asks (`use_qk_norm`).
                if (qk_module := optional_module(block, getattr(adapter, key), may_be_absent=True)) is not None:
                    qk_process = norm(adapter.norm, qk_module)
                    if adapter.qk_norm_layout == "head_pos":
                        qk_process = pos_before_head(qk_process)
                    qk = site(qk_module, "post", qk_process)
                    add(p + f"attn.{key}.hook_scale", qk, "scale")
                    add(p + f"attn.{key}.hook_normalized", qk, "normalized")

            if adapter.attn_registry or adapter.sdpa_call:
                attn_points = attention.AttentionPoints(None, None, HookPoint("", registry), HookPoint("", registry))
                site_class = AttnFnSite if adapter.attn_registry else attention.SdpaSite
                fn_site = site_class(m(adapter.attn), attn_points)
                if adapter.rotary:
                    add(p + "attn.hook_rot_q", fn_site)
                    add(p + "attn.hook_rot_k", fn_site)
                    attn_points.rot_q, attn_points.rot_k = points[p + "attn.hook_rot_q"], points[p + "attn.hook_rot_k"]
                add(p + "attn.hook_attn_scores", fn_site)
                add(p + "attn.hook_pattern", fn_site)
                attn_points.scores = points[p + "attn.hook_attn_scores"]
                attn_points.pattern = points[p + "attn.hook_pattern"]
            elif adapter.pattern_module is not None:
                # Attention computed inside the HF module (GPT-J, GPT-Neo): the softmax output passes through a
                # dropout module before it meets the values, so that module's output is the pattern.
                add(p + "attn.hook_pattern", site(m(adapter.pattern_module), "post", identity))

            o_proj = m(adapter.o_proj)
            add(p + "attn.hook_z", site(o_proj, "pre", heads(n_heads, d_head)))
            result_process = head_results(n_heads, d_head, o_proj, adapter.conv1d, registry)
            add(p + "attn.hook_result", site(o_proj, "post", result_process))

        if mixer is not None:
            for part in mixers.mixer_sites(block, adapter.hybrid):
                part_site = site(part.module, part.kind, part.process)
                for key in part.keys:
                    add(p + f"mixer.hook_{key}", part_site, key)
        first = mixer if mixer is not None else m(adapter.attn_out) if attention_here else None
        if first is not None:
            attn_out_site = site(first, "post", identity)
            attn_out_site.process = _attn_out_and_mid(attn_out_site, stash, layer, adapter.residual_scale(model.config))
            if adapter.sandwich:
                attn_out_site.process = after_norm(
                    attn_out_site, norm(adapter.norm, m(adapter.attn_out)), attn_out_site.process
                )
                add(p + "ln1_post.hook_scale", attn_out_site, "scale")
                add(p + "ln1_post.hook_normalized", attn_out_site, "normalized")
            add(p + ("hook_mixer_out" if mixer is not None else "hook_attn_out"), attn_out_site, "attn_out")
            if not parallel and ffn_here:
                add(p + "hook_resid_mid", attn_out_site, "mid", extra=(resid_pre,))

        if ffn_here and mlp_in_offered:  # TransformerLens' hook_mlp_in: the MLP branch's input, a copy
            branch = split_inputs.mlp_branch(block, adapter, parallel)
            add(p + "hook_mlp_in", site(branch, "pre", split_inputs.mlp_in(registry)))
        if ffn_here:
            # One norm feeds both in parallel blocks (Phi, GPT-J; Falcon's parallel blocks lack the attribute).
            if (ln2_module := optional_module(block, adapter.ln2, may_be_absent=parallel)) is not None:
                ln2 = site(ln2_module, "post", norm(adapter.norm, ln2_module))
                add(p + "ln2.hook_scale", ln2, "scale")
                add(p + "ln2.hook_normalized", ln2, "normalized")
            if (mlp_module := _mlp_module(block, adapter, moe_block)) is not None:
                mlp_in = site(mlp_module, "pre", identity)  # what the MLP reads (TransformerLens 4)
                mlp_in.process = private_input(lambda s=mlp_in: s.points[""])
                add(p + "mlp.hook_in", mlp_in)

            if moe_block:
                for key, moe_site in moe.moe_sites(adapter.moe, block, registry, get_module):
                    add(p + f"mlp.hook_{key}", moe_site, key)
                for key, path, kind in moe.shared_points(adapter.moe):
                    add(p + f"mlp.hook_{key}", site(m(path), kind, moe.token_rows(registry)))
            elif adapter.fused_gate_up:
                fused_mlp = site(m(adapter.mlp_in), "post", gate_up)
                add(p + "mlp.hook_pre", fused_mlp, "pre")
                add(p + "mlp.hook_pre_linear", fused_mlp, "pre_linear")
            else:
                add(p + "mlp.hook_pre", site(m(adapter.mlp_in), "post", identity))
                if adapter.mlp_up is not None:
                    add(p + "mlp.hook_pre_linear", site(m(adapter.mlp_up), "post", identity))
            if not moe_block:
                add(p + "mlp.hook_post", site(m(adapter.mlp_down), "pre", identity))
            mlp_out = m(adapter.mlp_out)
            if adapter.sandwich:
                mlp_out_site = site(mlp_out, "post", identity)
                mlp_out_site.process = after_norm(mlp_out_site, norm(adapter.norm, mlp_out), _keyed("mlp_out"))
                add(p + "ln2_post.hook_scale", mlp_out_site, "scale")
                add(p + "ln2_post.hook_normalized", mlp_out_site, "normalized")
                add(p + "hook_mlp_out", mlp_out_site, "mlp_out")
            else:
                add(p + "hook_mlp_out", site(mlp_out, "post", copied if adapter.mlp_out_mutated else identity))
        add(p + "hook_resid_post", site(block, "post", identity))

    add("ln_final.hook_scale", final, "scale")
    add("ln_final.hook_normalized", final, "normalized")
    unembed = model.get_output_embeddings()  # TransformerLens' unembed.hook_in / hook_out: lm_head's input, output
    add("unembed.hook_in", site(unembed, "pre", identity))
    add("unembed.hook_out", site(unembed, "post", identity))
    return SiteMap(points, sites_for, stash)


def _split_points(add: Callable, site: Callable, proj: dict, split: "split_inputs.SplitLayer", before, p: str) -> None:
    """The split-input points of one attention layer: ``split.capture`` on ``before`` (ln1, or the attention
    module without one) keeps the residual they copy; each projection site runs them before its own points."""
    capture = site(before, "pre", split.capture)
    for s in dict.fromkeys(proj.values()):
        s.process = split.around(s.module, "".join(k for k in "qkv" if proj[k] is s), s.process)
    every = tuple(dict.fromkeys(proj.values()))
    add(p + "hook_attn_in", proj["q"], "attn_in", extra=(*every[1:], capture))
    for key in "qkv":
        add(p + f"hook_{key}_input", proj[key], f"{key}_input", extra=(capture,))
    split.points.update(
        {k: proj["q" if k == "attn_in" else k[0]].points[k] for k in ("attn_in", "q_input", "k_input", "v_input")}
    )


def _mlp_module(block: nn.Module, adapter: Adapter, moe_block: bool) -> nn.Module | None:
    """The module whose input is what ``block``'s MLP reads (``mlp.hook_in``): the module adding to the residual
    stream; behind a sandwich norm (Gemma 2) the parent of the down projection; without an MLP module (OPT: the
    down projection adds) the first projection of an ungated MLP. None where no one module reads it."""
    if adapter.mlp_out == adapter.mlp_down:
        return None if moe_block or adapter.mlp_up is not None else get_module(block, adapter.mlp_in)
    if not adapter.sandwich:
        return get_module(block, adapter.mlp_out)
    path = adapter.mlp_down.rpartition(".")[0]
    return None if moe_block or not path else get_module(block, path)


def _keyed(key: str) -> Callable:
    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        return run(key, x)

    return process


def _attn_out_and_mid(site: Site, stash: dict[int, Tensor], layer: int, multiplier: float = 1.0) -> Callable:
    """``hook_attn_out``, then ``hook_resid_mid`` = resid_pre + multiplier * attn_out.

    Edits of resid_mid travel through the attention output: it is the only tensor of the residual
    add the bridge can replace without touching the model's code. ``multiplier``: Granite's
    ``residual_multiplier`` (1 elsewhere).
    """

    def process(run: Run, a: Tensor, inp: Tensor | None) -> Tensor:
        new = run("attn_out", a)
        mid_point = site.points.get("mid")
        if mid_point is None or not mid_point.active:
            return new
        resid_pre = stash[layer].to(new.device)  # a device map may run the block elsewhere than its input
        if multiplier != 1.0:
            mid = resid_pre + new * multiplier
            new_mid = run("mid", mid)
            return new if new_mid is mid else (new_mid - resid_pre) / multiplier
        mid = resid_pre + new
        new_mid = run("mid", mid)
        return new if new_mid is mid else new_mid - resid_pre

    return process


__all__ = ["SiteMap", "build_sites"]
