"""Where each hook point of a vLLM model is read and written: one `Site` per torch hook on one of vLLM's modules.

A site reads its points out of the module's inputs (a forward pre-hook) or outputs (a forward hook) as flat
``[tokens, ...]`` tensors, whole under tensor parallelism (sharded projections are gathered), and writes an edited
point back. The residual stream is the sum of vLLM's ``(hidden, residual)`` pair; an edited residual row is written
back as ``(edited, 0)``, so the fused add of the next norm gives exactly the edited value, and rows no hook edited
keep their pair untouched (bitwise the same as without the bridge).
"""

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from ..sites.moe import route
from . import internals
from .internals import Family

Get = Callable[[Any], Tensor]  # module inputs/outputs -> the point, flat [tokens, ...]
Put = Callable[[Any, Tensor, Tensor], Any]  # (inputs/outputs, edited point, edited-row mask) -> new inputs/outputs


@dataclasses.dataclass
class Point:
    name: str
    get: Get
    put: Put | None  # None: read-only (computed from other points, for caching only)


@dataclasses.dataclass
class Site:
    """Points served by one torch hook: ``kind`` "pre" (inputs: ``(args, kwargs)``) or "fwd" (output), or "attn" (the
    ``(query, key)`` HF hands vLLM's attention under the Transformers backend: `internals.tap_attention`)."""

    module: nn.Module
    kind: str
    points: list[Point]


# -- reading and writing inputs / outputs -------------------------------------------------------------------------


def _arg(i: int, key: str) -> Callable[[Any], Any]:
    def read(inputs: Any) -> Any:
        args, kwargs = inputs
        return args[i] if len(args) > i else kwargs.get(key)

    return read


def _with_arg(inputs: Any, i: int, key: str, value: Any) -> Any:
    args, kwargs = inputs
    if len(args) > i:
        return (*args[:i], value, *args[i + 1 :]), kwargs
    return args, {**kwargs, key: value}


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def _with_first(out: Any, new: Tensor) -> Any:
    return (new, *out[1:]) if isinstance(out, tuple) else new


def _rows(mask: Tensor, t: Tensor) -> Tensor:
    return mask.view(-1, *([1] * (t.dim() - 1)))


def _pair_put(old_hidden: Tensor, old_residual: Tensor | None, new: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """An edited residual as vLLM's pair: ``(edited, 0)`` on edited rows, the old pair elsewhere."""
    m = _rows(rows, new)
    if old_residual is None:
        return torch.where(m, new, old_hidden), torch.zeros_like(new)
    return torch.where(m, new, old_hidden), torch.where(m, torch.zeros_like(new), old_residual)


# -- tensor parallelism: a sharded last axis, gathered for hooks and split back for writes --------------------------


@dataclasses.dataclass
class Shards:
    rank: int
    size: int

    def gather(self, t: Tensor) -> Tensor:
        return t if self.size == 1 else internals.all_gather(t)

    def gather_heads(self, t: Tensor) -> Tensor:
        """Concatenate every rank's heads (axis 1 of ``[tokens, head, ...]``)."""
        if self.size == 1:
            return t
        return internals.all_gather(t.transpose(1, -1)).transpose(1, -1)

    def local(self, full: Tensor) -> Tensor:
        if self.size == 1:
            return full
        width = full.shape[-1] // self.size
        return full[..., self.rank * width : (self.rank + 1) * width]


def _heads(t: Tensor, d_head: int) -> Tensor:
    return t.reshape(*t.shape[:-1], -1, d_head)


def _flat(t: Tensor) -> Tensor:
    return t.reshape(*t.shape[:-2], -1)


# -- one layer of a Llama-like model (Llama, Mistral, Qwen2, Qwen3, Phi-3; Gemma 2 / 3 with their sandwich norms) --


def rms_points(prefix: str, eps: float, resid: Callable[[Any], Tensor]) -> list[Point]:
    """``hook_scale`` / ``hook_normalized`` of an RMS norm, computed (float32) from the residual it reads."""

    def scale(x: Any) -> Tensor:
        h = resid(x).float()
        return (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()

    def normalized(x: Any) -> Tensor:
        h = resid(x)
        return (h.float() / scale(x)).to(h.dtype)

    return [Point(f"{prefix}.hook_scale", scale, None), Point(f"{prefix}.hook_normalized", normalized, None)]


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def layer_sites(model: nn.Module, fam: Family, i: int, sh: Shards) -> list[Site]:
    """The sites of block ``i``."""
    layer = internals.submodule(model, f"{fam.layers}.{i}", "a decoder layer")
    sub = lambda path: internals.submodule(layer, path, f"block {i}")  # noqa: E731
    b = f"blocks.{i}"
    n_q, n_kv, d_head, _ = internals.head_sizes(sub(fam.core))
    q_w, kv_w = n_q * d_head, n_kv * d_head  # local widths
    ln1, ln2 = sub(fam.ln1), sub(fam.ln2)

    hidden_in, residual_in = _arg(1, "hidden_states"), _arg(2, "residual")

    def resid_pre(x: Any) -> Tensor:
        r = residual_in(x)
        return hidden_in(x) if r is None else hidden_in(x) + r

    def put_resid_pre(x: Any, new: Tensor, rows: Tensor) -> Any:
        h, r = _pair_put(hidden_in(x), residual_in(x), new, rows)
        return _with_arg(_with_arg(x, 1, "hidden_states", h), 2, "residual", r)

    def resid_mid(x: Any) -> Tensor:
        return x[0][0] + x[0][1]

    def put_resid_mid(x: Any, new: Tensor, rows: Tensor) -> Any:
        args, kwargs = x
        h, r = _pair_put(args[0], args[1], new, rows)
        return (h, r, *args[2:]), kwargs

    def resid_post(out: Any) -> Tensor:
        return out[0] + out[1]

    def put_resid_post(out: Any, new: Tensor, rows: Tensor) -> Any:
        return _pair_put(out[0], out[1], new, rows)

    def core_get(i_arg: int, key: str) -> Get:
        read = _arg(i_arg, key)
        return lambda x: _heads(sh.gather(read(x)), d_head)

    def core_put(i_arg: int, key: str) -> Put:
        read = _arg(i_arg, key)
        return lambda x, new, rows: _with_arg(x, i_arg, key, sh.local(_flat(new)).reshape(read(x).shape).contiguous())

    o_proj = sub(fam.o_proj)
    ln1_out = lambda out: _first(out)  # noqa: E731
    sites = [
        Site(layer, "pre", [Point(f"{b}.hook_resid_pre", resid_pre, put_resid_pre)]),
        Site(layer, "pre", rms_points(f"{b}.ln1", _eps(ln1), resid_pre)),
        Site(ln1, "fwd", [Point(f"{b}.attn.hook_in", ln1_out, lambda o, n, r: _with_first(o, n))]),
        qkv_site(sub(fam.qkv), b, q_w, kv_w, d_head, sh),
        Site(
            sub(fam.core),
            "pre",
            [
                Point(f"{b}.attn.hook_rot_q", core_get(0, "query"), core_put(0, "query")),
                Point(f"{b}.attn.hook_rot_k", core_get(1, "key"), core_put(1, "key")),
            ],
        ),
        z_site(o_proj, b, d_head, sh),
        *sublayer_out(o_proj if fam.ln1_post is None else sub(fam.ln1_post), fam.ln1_post, f"{b}.ln1_post", "attn"),
        Site(ln2, "pre", [Point(f"{b}.hook_resid_mid", resid_mid, put_resid_mid)]),
        Site(ln2, "pre", rms_points(f"{b}.ln2", _eps(ln2), resid_mid)),
        Site(ln2, "fwd", [Point(f"{b}.mlp.hook_in", _first, lambda o, n, r: _with_first(o, n))]),
    ]
    if fam.qk_norm is not None:  # Qwen3: per-head norms of q and k before RoPE
        for j, (path, which) in enumerate(zip(fam.qk_norm, ("q_norm", "k_norm"), strict=True)):
            norm = sub(path)
            heads_in = lambda x: sh.gather_heads(x[0][0])  # noqa: E731
            sites.insert(4 + j, Site(norm, "pre", rms_points(f"{b}.attn.{which}", _eps(norm), heads_in)))
    if fam.gate_up is not None and fam.down is not None:
        sites += gated_mlp_sites(sub(fam.gate_up), sub(fam.down), b, sh)
    if fam.router is not None:
        sites.append(_router_site(sub(fam.router), fam.routing, getattr(model, "config", None), b))
    sites += [
        *sublayer_out(sub(fam.mlp if fam.ln2_post is None else fam.ln2_post), fam.ln2_post, f"{b}.ln2_post", "mlp"),
        Site(layer, "fwd", [Point(f"{b}.hook_resid_post", resid_post, put_resid_post)]),
    ]
    return sites


def qkv_site(qkv: nn.Module, b: str, q_w: int, kv_w: int, d_head: int, sh: Shards) -> Site:
    """``hook_q`` / ``hook_k`` / ``hook_v``, split out of vLLM's fused projection (local widths ``q_w``, ``kv_w``)."""

    def get(part: int) -> Get:
        lo, hi = [(0, q_w), (q_w, q_w + kv_w), (q_w + kv_w, q_w + 2 * kv_w)][part]
        return lambda out: _heads(sh.gather(_first(out)[..., lo:hi]), d_head)

    def put(part: int) -> Put:
        lo, hi = [(0, q_w), (q_w, q_w + kv_w), (q_w + kv_w, q_w + 2 * kv_w)][part]

        def write(out: Any, new: Tensor, rows: Tensor) -> Any:
            fused = _first(out).clone()
            fused[..., lo:hi] = sh.local(_flat(new))
            return _with_first(out, fused)

        return write

    return Site(qkv, "fwd", [Point(f"{b}.attn.hook_{c}", get(j), put(j)) for j, c in enumerate("qkv")])


def z_site(o_proj: nn.Module, b: str, d_head: int, sh: Shards) -> Site:
    """``hook_z`` (o_proj's input) and ``hook_result`` (computed on demand)."""

    def z_get(x: Any) -> Tensor:
        return _heads(sh.gather(x[0][0]), d_head)

    def z_put(x: Any, new: Tensor, rows: Tensor) -> Any:
        return (sh.local(_flat(new)).contiguous(), *x[0][1:]), x[1]

    def result(x: Any) -> Tensor:
        """Per-head outputs: each head's z alone through vLLM's own o_proj (its weights may be repacked for the
        CPU kernels, so they are not read); a bias is counted once, in ``hook_attn_out``, as the HF bridge does.
        Under tensor parallelism o_proj sums over ranks, so every rank runs each global head in turn (zeros where it
        does not own it) and the sum is that head alone."""
        z = x[0][0]
        heads = z.reshape(z.shape[0], -1, d_head)
        n_local = heads.shape[1]
        zero = o_proj.forward(torch.zeros_like(z))[0]
        outs = []
        for g in range(n_local * sh.size):
            alone = torch.zeros_like(heads)
            if sh.rank * n_local <= g < (sh.rank + 1) * n_local:
                alone[:, g - sh.rank * n_local] = heads[:, g - sh.rank * n_local]
            outs.append(o_proj.forward(alone.reshape(z.shape))[0] - zero)
        return torch.stack(outs, dim=1)

    return Site(o_proj, "pre", [Point(f"{b}.attn.hook_z", z_get, z_put), Point(f"{b}.attn.hook_result", result, None)])


def sublayer_out(module: nn.Module, post_norm: str | None, norm_name: str, which: str) -> list[Site]:
    """``hook_attn_out`` / ``hook_mlp_out`` (``which``: "attn" / "mlp"): the output of the sublayer, or (Gemma 2 / 3's
    sandwich norms) of the norm applied to it before the residual add, with that norm's ``hook_scale`` /
    ``hook_normalized``."""
    block = norm_name.rsplit(".", 1)[0]
    out = Site(module, "fwd", [Point(f"{block}.hook_{which}_out", _first, lambda o, n, r: _with_first(o, n))])
    if post_norm is None:
        return [out]
    return [Site(module, "pre", rms_points(norm_name, _eps(module), lambda x: x[0][0])), out]


def _router_site(router: nn.Module, routing: str, config: Any, b: str) -> Site:
    """``hook_router_logits`` (the router's output: an edit re-routes, since vLLM's expert kernel routes from it) and
    ``hook_expert_weights`` (dense ``[tokens, expert]``, 0 for experts a token does not use), recomputed from the
    logits by the HF bridge's rule (`sites.moe.route`) for caching."""
    rule = SimpleNamespace(
        top_k=int(_need_config(config, "num_experts_per_tok")), norm_topk_prob=getattr(config, "norm_topk_prob", True)
    )

    def expert_weights(out: Any) -> Tensor:
        logits = _first(out)
        weights, idx = route(routing, logits, rule)  # type: ignore[arg-type]
        return torch.zeros_like(logits).scatter(-1, idx, weights.to(logits.dtype))

    return Site(
        router,
        "fwd",
        [
            Point(f"{b}.mlp.hook_router_logits", _first, lambda o, n, r: _with_first(o, n)),
            Point(f"{b}.mlp.hook_expert_weights", expert_weights, None),
        ],
    )


def _need_config(config: Any, key: str) -> Any:
    value = getattr(config, key, None)
    if value is None:
        raise internals.VLLMInternalsError(f"The model's config has no `{key}` (needed to recompute expert weights).")
    return value


def gated_mlp_sites(gate_up: nn.Module, down: nn.Module, b: str, sh: Shards) -> list[Site]:
    """``hook_pre`` (gate), ``hook_pre_linear`` (up), split out of vLLM's fused projection, and ``hook_post``."""

    def half(j: int) -> Get:
        return lambda out: sh.gather(_first(out).chunk(2, dim=-1)[j])

    def put_half(j: int) -> Put:
        def put(out: Any, new: Tensor, rows: Tensor) -> Any:
            fused = _first(out).clone()
            width = fused.shape[-1] // 2
            fused[..., j * width : (j + 1) * width] = sh.local(new)
            return _with_first(out, fused)

        return put

    post_get = lambda x: sh.gather(x[0][0])  # noqa: E731
    post_put = lambda x, new, rows: ((sh.local(new).contiguous(), *x[0][1:]), x[1])  # noqa: E731
    return [
        Site(
            gate_up,
            "fwd",
            [Point(f"{b}.mlp.hook_pre", half(0), put_half(0)), Point(f"{b}.mlp.hook_pre_linear", half(1), put_half(1))],
        ),
        Site(down, "pre", [Point(f"{b}.mlp.hook_post", post_get, post_put)]),
    ]


def _put_hidden(x: Any, new: Tensor, rows: Tensor) -> Any:
    return _with_arg(x, 1, "hidden_states", torch.where(_rows(rows, new), new, _arg(1, "hidden_states")(x)))


def model_sites(
    model: nn.Module,
    fam: Family,
    n_layers: int,
    sh: Shards,
    layers: Callable[[nn.Module, Family, int, Shards], list[Site]] | None = None,
    outer: Callable[[Site], Site] = lambda site: site,
) -> list[Site]:
    """Every site of the model, in the order the forward reaches them: the blocks' from ``layers`` (default
    `layer_sites`; `hf_sites.hf_layer_sites` for vLLM's Transformers backend), the embedding's and the final norm's
    through ``outer`` (`hf_sites.batched` there, whose modules see a batch of one)."""
    layers = layer_sites if layers is None else layers
    embed = internals.submodule(model, fam.embed, "the token embedding")
    norm = internals.submodule(model, fam.final_norm, "the final norm")
    logits = internals.unembed_logits(model)

    def final_resid(x: Any) -> Tensor:
        args = x[0]
        return args[0] if len(args) < 2 or args[1] is None else args[0] + args[1]

    if fam.embed_scaled:  # Gemma: the scaled embedding (the HF bridge's `hook_embed`) is what block 0 reads
        first = internals.submodule(model, f"{fam.layers}.0", "block 0")
        embed_site = Site(first, "pre", [Point("hook_embed", _arg(1, "hidden_states"), _put_hidden)])
    else:
        embed_site = Site(embed, "fwd", [Point("hook_embed", _first, lambda o, n, r: n)])
    final = [
        Site(norm, "pre", rms_points("ln_final", _eps(norm), final_resid)),
        Site(
            norm,
            "fwd",
            [
                Point("unembed.hook_in", _first, lambda o, n, r: _with_first(o, n)),
                Point("unembed.hook_out", lambda out: logits(_first(out)), None),
            ],
        ),
    ]
    tokens = Site(model, "pre", [Point("hook_tokens", _arg(0, "input_ids"), None)])
    blocks = [site for i in range(n_layers) for site in layers(model, fam, i, sh)]
    return [tokens, outer(embed_site), *blocks, *map(outer, final)]
