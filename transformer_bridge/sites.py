"""Sites: the torch hooks on HF modules that serve the bridge's hook points.

A site is one forward (or forward-pre) hook on one HF module that serves an ordered group of
points, with a small ``process`` function that shows each point its tensor in TransformerLens
layout and writes edits back. A site's torch hook exists only while a point it serves (or a point
that depends on it) has a function registered.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from . import attention, mixers, mla, moe, split_inputs
from .adapters import Adapter
from .distributed import local_param, o_proj_weight, onloaded, sum_over_ranks
from .hook_points import HookPoint, HookRegistry
from .module_paths import MissingModuleError, get_module, optional_module
from .norm_sites import after_norm, norm, pos_before_head
from .site_checks import StaleCompiledHooksError, arm_sites, check_sites, disarm_sites
from .torch_hook import TorchHook

Run = Callable[[str, Tensor], Tensor]


@dataclass(eq=False)
class Site(TorchHook):
    """One torch hook serving ``points``; ``process(run, x, inp)`` returns the (maybe new) tensor.

    For a ``pre`` site ``x`` is the module's first input; for a ``post`` site ``x`` is its output
    (the first element when the module returns a tuple) and ``inp`` its first input.
    """

    module: nn.Module
    kind: Literal["pre", "post"]
    process: Callable[[Run, Tensor, Tensor | None], Tensor]
    registry: HookRegistry
    points: dict[str, HookPoint] = field(default_factory=dict)
    served: list[HookPoint] = field(default_factory=list)
    handle: RemovableHandle | None = None
    fired: bool = False  # set by the torch hook; the bridge checks it after each forward

    def _register(self) -> RemovableHandle:
        if self.kind == "pre":
            return self.module.register_forward_pre_hook(self._pre, with_kwargs=True)
        return self.module.register_forward_hook(self._post, with_kwargs=True)

    def _run(self, key: str, tensor: Tensor) -> Tensor:
        point = self.points.get(key)
        return point.run(tensor) if point is not None and point.active else tensor

    def _call(self, x: Tensor, inp: Tensor | None) -> Tensor:
        # OPT runs its MLP on flattened tokens [batch * pos, d]; hooks always see [batch, pos, d].
        ctx = self.registry.ctx
        if x.dim() == 2 and ctx is not None and x.is_floating_point():  # not token ids (`hook_tokens`)
            shape = x.shape
            x3 = x.view(ctx.positions.shape[0], -1, shape[-1])
            inp3 = None if inp is None else inp.view(ctx.positions.shape[0], -1, inp.shape[-1])
            out = self.process(self._run, x3, inp3)
            return x if out is x3 else out.reshape(shape)
        return self.process(self._run, x, inp)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict):
        self.fired = True
        if args:
            new = self._call(args[0], None)
            return None if new is args[0] else ((new, *args[1:]), kwargs)
        new = self._call(kwargs["hidden_states"], None)
        return None if new is kwargs["hidden_states"] else (args, {**kwargs, "hidden_states": new})

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output):
        self.fired = True
        inp = args[0] if args else kwargs.get("hidden_states")
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(inp, Tensor) and inp.device != out.device:  # a device map: the input came from another device
            inp = inp.to(out.device)
        new = self._call(out, inp)
        if new is out:
            return None
        return (new, *output[1:]) if isinstance(output, tuple) else new


@dataclass(eq=False)
class TwoCallNormSite(Site):
    """A norm module the model calls twice per forward (NanoChat's ``model.norm``: on the embedding, then
    before the unembedding). Each time ``root`` (the module making both calls) starts a forward, the count
    restarts: the first call then serves the keys prefixed ``embed_``, every later one the plain keys, so a
    direct call of the norm outside a forward (a logit lens) counts as the final norm."""

    root: nn.Module | None = None
    calls: int = 0

    def _register(self) -> RemovableHandle:
        own = super()._register()
        return attention.Handles(own, self.root.register_forward_pre_hook(self._reset))

    def _reset(self, module: nn.Module, args: tuple) -> None:
        self.calls = 0

    def _call(self, x: Tensor, inp: Tensor | None) -> Tensor:
        prefix = "embed_" if self.calls == 0 else ""
        self.calls += 1
        return self.process(lambda key, t: self._run(prefix + key, t), x, inp)


def identity(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
    return run("", x)


def token_ids(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
    """``hook_tokens``: the hooks see a copy of the ids (an in-place edit must not change the caller's tensor);
    an edit of the copy is what the embedding reads."""
    shown = x.clone()
    out = run("", shown)
    return x if out is shown else out


def batch_broadcast(registry: HookRegistry) -> Callable:
    """Position embeddings computed once for the batch ([1, pos, d]) are shown as [batch, pos, d]."""

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        batch = registry.ctx.positions.shape[0] if registry.ctx is not None else x.shape[0]
        # A [batch, ...] copy, not an expanded view: in-place edits of an expanded view are refused.
        shown = x.expand(batch, *x.shape[1:]).clone() if x.shape[0] == 1 and batch > 1 else x
        out = run("", shown)
        return x if out is shown else out

    return process


def heads(n_heads: int, d_head: int) -> Callable:
    """``[b, p, head * d]`` shown as ``[b, p, head, d]`` (fewer heads on a tensor-parallel shard)."""

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        shown = x.view(*x.shape[:-1], -1, d_head)
        out = run("", shown)
        return x if out is shown else out.reshape(x.shape)

    return process


def fused_qkv(layout: str, n_heads: int, n_kv: int, d_head: int) -> Callable:
    """Split a fused QKV projection output into ``q``, ``k``, ``v`` and write edits back."""

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        # Slices, not split(): split's views cannot be edited in place while autograd records.
        if layout == "per_head":
            grouped = x.view(*x.shape[:-1], -1, 3 * d_head)  # -1: a tensor-parallel shard has fewer heads
            parts = [grouped[..., i * d_head : (i + 1) * d_head] for i in range(3)]
        else:
            bounds = [0, n_heads * d_head, (n_heads + n_kv) * d_head, (n_heads + 2 * n_kv) * d_head]
            parts = [x[..., a:b].view(*x.shape[:-1], -1, d_head) for a, b in itertools.pairwise(bounds)]
        new = [run(key, part) for key, part in zip("qkv", parts, strict=True)]
        if all(a is b for a, b in zip(new, parts, strict=True)):
            return x
        if layout == "per_head":
            return torch.cat(new, dim=-1).reshape(x.shape)
        return torch.cat([p.flatten(-2) for p in new], dim=-1)

    return process


def gate_up(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]  # slices, not chunk(): see fused_qkv
    new_gate, new_up = run("pre", gate), run("pre_linear", up)
    if new_gate is gate and new_up is up:
        return x
    return torch.cat([new_gate, new_up], dim=-1)


def head_results(n_heads: int, d_head: int, module: nn.Module, conv1d: bool, registry: HookRegistry) -> Callable:
    """``hook_result``: each head's contribution through the output projection, bias excluded."""

    def process(run: Run, out: Tensor, z: Tensor | None) -> Tensor:
        with onloaded(module):
            # [d_model, head * d_head]; under tensor parallelism this rank's heads, whose sum is partial.
            w, partial_over = o_proj_weight(module, conv1d, z.shape[-1])
            bias = local_param(module, "bias")
        w = w.reshape(w.shape[0], -1, d_head)
        result = torch.einsum("bphd,mhd->bphm", z.view(*z.shape[:-1], -1, d_head), w)
        # Under tensor parallelism this rank's heads only: edits are added to the model's output as the
        # change of their sum, which every rank joins, edited or not (under `local_shards` only the ranks
        # holding an edited head see a change). Summed before the hooks run: they may edit in place.
        before = result.sum(-2) if partial_over is not None else None
        new = run("", result)
        if before is not None and (new is not result or registry.shard_local):
            return out + sum_over_ranks(new.sum(-2) - before, partial_over).to(out.dtype)
        if new is result:
            return out
        total = new.sum(-2)
        return total + bias if bias is not None else total

    return process


class AttnFnSite(TorchHook):
    """A forward pre-hook on the layer's attention module that routes it through the explicit path.

    The hook adds this layer's points to the keyword `attention.POINTS_KWARG`, which HF passes on to
    the registered attention function.
    """

    def __init__(self, module: nn.Module, points: "attention.AttentionPoints") -> None:
        self.module, self.points = module, points
        self.served: list[HookPoint] = []
        self.handle: RemovableHandle | None = None
        self.fired = False

    def _register(self) -> RemovableHandle:
        return self.module.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict):
        self.fired = True
        groups = [*kwargs.get(attention.POINTS_KWARG, ()), self.points]
        return args, {**kwargs, attention.POINTS_KWARG: groups}


def copied(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
    """The model goes on with a copy: HF adds to this output in place (Falcon), which the tensor hooks saw
    (and caches keep, and backward hooks are registered on) must not see."""
    return run("", x).clone()


def private_input(point: Callable[[], HookPoint]) -> Callable:
    """A module input other code may also read (one norm's output feeds attention and the MLP in parallel blocks;
    the residual itself where there is no norm): a hook that may edit sees a copy, so an in-place edit reaches this
    module only. Read-only hooks (caching) see the tensor itself. ``point``: the site's point, once added."""

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        shown = x if all(e.read_only for e in point().fwd_hooks) else x.clone()
        new = run("", shown)
        return x if new is shown else new

    return process


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


__all__ = [  # the compiled-hooks check lives in site_checks.py, module paths in module_paths.py, the norms'
    # processes in norm_sites.py; the rest of the package imports them from here
    "AttnFnSite", "MissingModuleError", "Site", "SiteMap", "StaleCompiledHooksError", "arm_sites", "build_sites",
    "check_sites", "disarm_sites", "get_module", "norm", "optional_module",
]  # fmt: skip
