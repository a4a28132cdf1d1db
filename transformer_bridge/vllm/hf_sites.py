"""Sites on vLLM's Transformers backend (``model_impl="transformers"``, and vLLM's own choice for families it has no
class for, such as OLMo 2): HF's decoder layers run there with vLLM's fused projections (``qkv_proj``,
``gate_up_proj``) and vLLM's attention swapped in, on a batch of one: ``[1, tokens, ...]``.

The points are those of `sites` (one request's rows of the flattened batch), read from HF's modules. HF's layer adds
the residual in Python, so the residual between the sublayers (``hook_resid_mid``) is read where the next sublayer
takes it and is read-only: an edit there would reach that sublayer's input but not the residual. RoPE is a function
in HF's attention, so the rotated queries and keys are read where HF hands them to vLLM's attention
(`internals.tap_attention`).
"""

from typing import Any

from torch import Tensor, nn

from . import internals
from .internals import Family
from .sites import (
    Point,
    Shards,
    Site,
    _arg,
    _eps,
    _first,
    _with_arg,
    _with_first,
    gated_mlp_sites,
    qkv_site,
    rms_points,
    sublayer_out,
    z_site,
)


def _squeeze(x: Any) -> tuple[Any, Any]:
    """``x`` (a module's ``(args, kwargs)`` or output) with the batch axis of its top-level ``[1, ...]`` tensors
    dropped, and how to put it back."""

    def drop(v: Any) -> Any:
        return v[0] if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[0] == 1 else v

    def back(new: Any, old: Any) -> Any:
        return new[None] if isinstance(old, Tensor) and old.dim() >= 2 and old.shape[0] == 1 else new

    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple) and isinstance(x[1], dict):  # (args, kwargs)
        args, kwargs = x
        squeezed = (tuple(map(drop, args)), {k: drop(v) for k, v in kwargs.items()})

        def restore(y: Any) -> Any:
            a, k = y
            return tuple(back(n, o) for n, o in zip(a, args, strict=True)), {
                n: back(v, kwargs.get(n)) for n, v in k.items()
            }

        return squeezed, restore
    if isinstance(x, tuple):
        return tuple(map(drop, x)), lambda y: tuple(back(n, o) for n, o in zip(y, x, strict=True))
    return drop(x), lambda y: back(y, x)


def batched(site: Site) -> Site:
    """``site`` (written for flat ``[tokens, ...]`` tensors) on modules that see ``[1, tokens, ...]``."""

    def wrap(point: Point) -> Point:
        def get(x: Any) -> Tensor:
            return point.get(_squeeze(x)[0])

        def put(x: Any, new: Tensor, rows: Tensor) -> Any:
            flat, restore = _squeeze(x)
            return restore(point.put(flat, new, rows))  # type: ignore[misc]

        return Point(point.name, get, None if point.put is None else put)

    return Site(site.module, site.kind, [wrap(p) for p in site.points])


def hf_layer_sites(model: nn.Module, fam: Family, i: int, sh: Shards) -> list[Site]:
    """The sites of block ``i``: pre-norm (Llama-like) or post-norm (OLMo 2) HF layers."""
    layer = internals.submodule(model, f"{fam.layers}.{i}", "a decoder layer")
    sub = lambda path: internals.submodule(layer, path, f"block {i}")  # noqa: E731
    b = f"blocks.{i}"
    n_q, n_kv, d_head, _ = internals.head_sizes(sub(fam.core))
    post_norm = fam.ln1_post is not None
    attn, mlp = sub(fam.attn), sub(fam.mlp)
    first = lambda x: x[0][0]  # noqa: E731
    replace = lambda o, n, r: _with_first(o, n)  # noqa: E731
    hidden = _arg(0, "hidden_states")
    sites = [
        Site(layer, "pre", [Point(f"{b}.hook_resid_pre", hidden, lambda x, n, r: _with_arg(x, 0, "hidden_states", n))])
    ]
    if post_norm:  # OLMo 2: each sublayer reads the residual itself and its output is normed before the add
        sites.append(
            Site(attn, "pre", [Point(f"{b}.attn.hook_in", hidden, lambda x, n, r: _with_arg(x, 0, "hidden_states", n))])
        )
    else:
        ln1 = sub(fam.ln1)
        sites += [
            Site(layer, "pre", rms_points(f"{b}.ln1", _eps(ln1), hidden)),
            Site(ln1, "fwd", [Point(f"{b}.attn.hook_in", _first, replace)]),
        ]
    sites.append(qkv_site(sub(fam.qkv), b, n_q * d_head, n_kv * d_head, d_head, sh))
    if fam.qk_norm is not None:
        for path, which in zip(fam.qk_norm, ("q_norm", "k_norm"), strict=True):
            norm = sub(path)
            sites.append(Site(norm, "pre", rms_points(f"{b}.attn.{which}", _eps(norm), lambda x: sh.gather(x[0][0]))))
    sites.append(_rotated_site(attn, b, d_head, sh))
    sites.append(z_site(sub(fam.o_proj), b, d_head, sh))
    if post_norm:
        sites += sublayer_out(sub(fam.ln1_post), fam.ln1_post, f"{b}.ln1_post", "attn")
        sites += [
            Site(mlp, "pre", [Point(f"{b}.hook_resid_mid", first, None)]),
            Site(mlp, "pre", [Point(f"{b}.mlp.hook_in", first, lambda x, n, r: ((n, *x[0][1:]), x[1]))]),
        ]
    else:
        ln2 = sub(fam.ln2)
        sites += sublayer_out(sub(fam.o_proj), None, f"{b}.ln1_post", "attn")
        sites += [
            Site(ln2, "pre", [Point(f"{b}.hook_resid_mid", first, None)]),
            Site(ln2, "pre", rms_points(f"{b}.ln2", _eps(ln2), first)),
            Site(ln2, "fwd", [Point(f"{b}.mlp.hook_in", _first, replace)]),
        ]
    sites += gated_mlp_sites(sub(fam.gate_up), sub(fam.down), b, sh)
    sites += sublayer_out(sub(fam.ln2_post) if post_norm else mlp, fam.ln2_post, f"{b}.ln2_post", "mlp")
    sites.append(Site(layer, "fwd", [Point(f"{b}.hook_resid_post", _first, replace)]))
    return [site if site.kind == "attn" else batched(site) for site in sites]


def _rotated_site(attn: nn.Module, b: str, d_head: int, sh: Shards) -> Site:
    """``hook_rot_q`` / ``hook_rot_k``: HF's ``[1, head, tokens, d]`` query and key as it hands them to vLLM's
    attention (a site of kind "attn": its input is the pair)."""

    def get(j: int) -> Any:
        return lambda x: sh.gather_heads(x[j][0].transpose(0, 1))

    def put(j: int) -> Any:
        def write(x: Any, new: Tensor, rows: Tensor) -> Any:
            local = new.shape[1] // sh.size
            mine = new[:, sh.rank * local : (sh.rank + 1) * local]
            pair = list(x)
            pair[j] = mine.transpose(0, 1)[None].to(x[j].dtype).contiguous()
            return tuple(pair)

        return write

    return Site(attn, "attn", [Point(f"{b}.attn.hook_rot_{c}", get(j), put(j)) for j, c in enumerate("qk")])


__all__ = ["batched", "hf_layer_sites"]
