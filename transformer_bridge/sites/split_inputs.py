"""TransformerLens' split-input points, read by the model: per-head copies of the residual stream that feed
Q, K and V (``use_split_qkv_input``, ``use_attn_in``) and the MLP branch's own input (``use_hook_mlp_in``).

Points (canonical names are HookedTransformer's; TransformerLens 4's ``blocks.L.attn.hook_q_input`` … resolve to
them, `names.tl4_spelling`):

- ``blocks.L.hook_q_input [batch, pos, n_heads, d_model]``, ``hook_k_input`` / ``hook_v_input`` ``[batch, pos,
  n_kv_heads, d_model]`` (``cfg.use_split_qkv_input``): each head's copy of the residual entering the block's
  attention norm (``ln1``'s input). Head ``h``'s query is ``ln1(copy_h) @ W_Q[h] + b_Q[h]``: the norm is applied to
  each copy separately (the module's own forward; ln1's points show the unsplit norm, and their edits do not reach
  a head whose copy was edited), the projection is that head's slice of the HF weight (fused ``[q | k | v]`` and
  per-head interleaved layouts included). An edit of one head's copy changes that head's projection only.
- ``blocks.L.hook_attn_in [batch, pos, n_heads, d_model]`` (``cfg.use_attn_in``): one copy per query head that
  feeds Q, K and V alike. With grouped-query attention key/value head ``g`` reads copy ``g`` (the first
  ``n_kv_heads`` copies: TransformerLens 4.3's choice, ``attn_in[..., :n_kv_heads, :]``).
- ``blocks.L.hook_mlp_in [batch, pos, d_model]`` (``cfg.use_hook_mlp_in``): a copy of the residual entering the MLP
  branch (``ln2``'s input; the MLP's own input in post-norm blocks without ``ln2``, OLMo 2). An edit changes what
  the MLP reads, not the residual its output is added to.

The recomputation happens in the projection modules' forward hooks, before ``attn.hook_q`` / ``hook_k`` /
``hook_v`` (which then show, and may edit, the recomputed projections; q/k norms, RoPE and the KV cache follow in
HF's code). Only heads whose copy a hook changed are recomputed: with no hook nothing is attached, and hooks that
edit nothing leave the logits bitwise those of the unsplit model. A backward hook on a point recomputes every head,
so gradients reach the copies. Families where this cannot be done exactly refuse the flag (`refusals`).
"""

import weakref
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..distributed import local_param, onloaded, tp_mesh
from ..hooks.points import HookPoint
from .mixers import holds
from .module_paths import get_module, optional_module
from .moe import is_moe_block

Run = Callable[[str, Tensor], Tensor]
# TransformerLens' switches: the flag, and the ends of the names of the points it switches on.
SWITCHES: dict[str, tuple[str, ...]] = {
    "use_split_qkv_input": (".hook_q_input", ".hook_k_input", ".hook_v_input"),
    "use_attn_in": (".hook_attn_in",),
    "use_hook_mlp_in": (".hook_mlp_in",),
}
EXCLUSIVE = {"use_split_qkv_input": "use_attn_in", "use_attn_in": "use_split_qkv_input"}
# Points computed on demand: while the flag is False, selections of many points (None, predicates) leave them out,
# but a hook or ``names_filter`` naming one computes it (``attn.hook_result``: from ``hook_z`` and the projection).
ON_DEMAND: dict[str, tuple[str, ...]] = {"use_attn_result": (".attn.hook_result",)}


class Switches:
    """TransformerLens' switches over one bridge's points: ``hook_dict`` lists the points that are on; the names of
    those that are off (name -> how to switch it on) resolve to `names.HookOffError`. Recomputed once per setting.

    `config.BridgeConfig` holds one and calls `show` after each switch; a copy of the config holds a detached one.

    Example:
        >>> model.cfg.switches.off(model.cfg)["blocks.0.hook_q_input"]
        '`cfg.use_split_qkv_input` is False; call `model.set_use_split_qkv_input(True)` to hook or cache it.'
    """

    def __init__(self) -> None:
        self.registry: weakref.ref | None = None
        self.points: dict[str, HookPoint] = {}
        self.memo: dict[tuple[bool, ...], dict[str, str]] = {}
        self.current: dict[str, str] = {}  # `off` for the attached bridge's config as it is now (kept by `show`)
        self.lazy: frozenset[str] = frozenset()  # the on-demand points left out of selections now (`ON_DEMAND`)

    def __deepcopy__(self, memo: dict) -> "Switches":
        return Switches()

    def attach(self, registry: Any, points: dict[str, HookPoint]) -> None:
        """Serve ``registry`` (a bridge: its ``cfg`` and ``hook_dict``), whose every point is in ``points``."""
        self.registry, self.points, self.memo = weakref.ref(registry), dict(points), {}
        self.show()

    def off(self, cfg: Any) -> dict[str, str]:
        key = tuple(bool(getattr(cfg, flag)) for flag in SWITCHES)
        off = self.memo.get(key)
        if off is None:
            off = {}
            for (flag, ends), on in zip(SWITCHES.items(), key, strict=True):
                if not on:
                    why = f"`cfg.{flag}` is False; call `model.set_{flag}(True)` to hook or cache it."
                    off.update({n: why for n in self.points if n.endswith(ends)})
            self.memo[key] = off
        return off

    def hooked(self, flag: str) -> list[str]:
        """The points ``flag`` switches that have hooks (a switch cannot turn them off)."""
        return [n for n, p in self.points.items() if n.endswith(SWITCHES[flag]) and p.active]

    def show(self) -> None:
        """Make the bridge's ``hook_dict`` the points its config switches on (in canonical order)."""
        registry = self.registry() if self.registry is not None else None
        if registry is not None:
            off = self.current = self.off(registry.cfg)
            self.lazy = frozenset(
                n for flag, ends in ON_DEMAND.items() if not getattr(registry.cfg, flag) for n in self.points
                if n.endswith(ends)
            )  # fmt: skip
            registry.hook_dict = {n: p for n, p in self.points.items() if n not in off}


# -- which families: refused flags ----------------------------------------------------------------------------


def refusals(model: nn.Module, adapter: Any, blocks: nn.ModuleList, parallel: bool) -> dict[str, str]:
    """Why ``model`` cannot honour each split-input flag (flag -> reason; a flag it honours is absent).

    Example:
        >>> refusals(hf_model, adapter_for("gpt_neox"), hf_model.gpt_neox.layers, True)
        {}
    """
    why = attention_refusal(model, adapter)
    out = dict.fromkeys(("use_split_qkv_input", "use_attn_in"), why) if why else {}
    mlp_why = None
    if adapter.ssm is not None:
        mlp_why = "a state-space model has no MLP branch"
    else:
        for block in blocks:
            if is_moe_block(block, adapter.moe) or holds(block, adapter.mlp_down, adapter):
                target = mlp_branch(block, adapter, parallel)
                if isinstance(target, str):
                    mlp_why = target
                    break
    if mlp_why:
        out["use_hook_mlp_in"] = mlp_why
    return out


def attention_refusal(model: nn.Module, adapter: Any) -> str | None:
    """Why Q/K/V cannot be recomputed per head from split copies in ``model`` (None: they can)."""
    if adapter.ssm is not None:
        return "a state-space model has no attention (its mixer reads the residual through one projection)"
    if adapter.hybrid is not None:
        return "a hybrid's mixer layers read the residual through one projection, with no per-head copies"
    if adapter.mla:
        return "latent attention (DeepSeek-V3's) projects one low-rank latent shared by all heads, not per head"
    c = model.config
    if c.model_type == "falcon" and (getattr(c, "new_decoder_architecture", False) or not c.multi_query):
        return "only Falcon's multi-query layout ([q heads | k | v]) is split by the bridge"
    if tp_mesh(model) is not None:
        return "under tensor parallelism each rank holds some heads' weights only"
    return None


def mlp_branch(block: nn.Module, adapter: Any, parallel: bool) -> nn.Module | str:
    """The module whose input is ``block``'s MLP-branch input (``ln2``; the MLP itself in post-norm blocks), or
    why there is none."""
    ln2 = optional_module(block, adapter.ln2, may_be_absent=True)
    if ln2 is not None:
        return ln2
    if parallel:
        return "attention and the MLP read one norm's output (a parallel block with a shared norm)"
    path = adapter.mlp_in.rpartition(".")[0]
    if optional_module(block, adapter.ln1, may_be_absent=True) is not None or not path:
        return "the block has no separate MLP-branch input (no norm of the MLP's own, no MLP module)"
    return get_module(block, path)


# -- the processes ------------------------------------------------------------------------------------------------


def heads_of(x: Tensor, layout: str, which: str, n_heads: int, n_kv: int, d_head: int) -> Tensor:
    """The ``which`` (q, k or v) part of a projection's last axis, as ``[..., head, d_head]`` (a view).

    ``layout``: ``separate`` (the whole axis), ``concat`` (``[q | k | v]``), ``per_head`` (``[head, q|k|v, d]``).
    The same function slices a projection's output, its bias and its weight as ``[d_model, out]``.

    Example:
        >>> heads_of(torch.zeros(2, 3, 96), "concat", "k", 4, 2, 8).shape
        torch.Size([2, 3, 2, 8])
    """
    if layout == "separate":
        return x.unflatten(-1, (-1, d_head))
    i = "qkv".index(which)
    if layout == "per_head":
        return x.unflatten(-1, (-1, 3 * d_head))[..., i * d_head : (i + 1) * d_head]
    bounds = [0, n_heads * d_head, (n_heads + n_kv) * d_head, (n_heads + 2 * n_kv) * d_head]
    return x[..., bounds[i] : bounds[i + 1]].unflatten(-1, (-1, d_head))


class SplitLayer:
    """One attention layer's split-input points and what recomputing its projections from them needs.

    ``capture`` (a forward pre-hook process on ``ln1``, or on the attention module where there is no ``ln1``)
    keeps the residual entering the layer's attention branch in ``stash``; ``around`` wraps a projection site's
    process so that the split points run, and changed heads are recomputed, before the site's own points.

    Example:
        >>> layer = SplitLayer(0, stash, model, ln1, "separate", 4, 2, 8, conv1d=False)
    """

    def __init__(
        self, layer: int, stash: dict, registry: Any, ln1: nn.Module | None, layout: str,
        n_heads: int, n_kv: int, d_head: int, conv1d: bool,
    ) -> None:  # fmt: skip
        self.layer, self.stash, self.registry, self.ln1 = layer, stash, registry, ln1
        self.layout, self.n_heads, self.n_kv, self.d_head, self.conv1d = layout, n_heads, n_kv, d_head, conv1d
        self.points: dict[str, HookPoint] = {}  # q_input, k_input, v_input, attn_in

    def _on(self, flag: str) -> bool:
        cfg = getattr(self.registry, "cfg", None)
        return bool(getattr(cfg, flag, False))

    def capture(self, run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        self.stash[(self.layer, "split_in")] = x
        self.stash.pop((self.layer, "attn_in"), None)  # hook_attn_in runs once per forward, for Q, K and V
        return x

    def around(self, module: nn.Module, which: str, then: Callable) -> Callable:
        """``then`` (a site's process on ``module``'s output), after the split points of ``which`` ("qkv" for a
        fused projection) have run and the heads they changed are recomputed."""

        def process(run: Run, out: Tensor, inp: Tensor | None) -> Tensor:
            split = self._on("use_split_qkv_input") and any(self.points[f"{k}_input"].active for k in which)
            if split or (self._on("use_attn_in") and self.points["attn_in"].active):
                out = self._recompute(module, which, out, "split" if split else "attn_in")
            return then(run, out, inp)

        return process

    def _recompute(self, module: nn.Module, which: str, out: Tensor, mode: str) -> Tensor:
        source = self.stash.get((self.layer, "split_in"))
        if source is None:  # the capture did not run (a module called outside the block's forward)
            return out
        new_out = None
        for part in which:
            copies, changed = self._copies(part, source, mode)
            if changed is None:
                continue
            idx = changed.nonzero().flatten()
            if idx.numel() == 0:
                continue
            heads = self._project(module, part, copies.index_select(-2, idx), idx)
            new_out = out.clone() if new_out is None else new_out
            shown = heads_of(new_out, self.layout, part, self.n_heads, self.n_kv, self.d_head)
            shown.index_copy_(-2, idx, heads.to(out.dtype))
        return out if new_out is None else new_out

    def _copies(self, part: str, source: Tensor, mode: str) -> tuple[Tensor, Tensor | None]:
        """The copies ``part`` reads and which heads' copies a hook changed (None: none)."""
        if mode == "split":
            return self._run(self.points[f"{part}_input"], source, self.n_heads if part == "q" else self.n_kv)
        key = (self.layer, "attn_in")
        if key not in self.stash:
            self.stash[key] = self._run(self.points["attn_in"], source, self.n_heads)
        copies, changed = self.stash[key]
        if part == "q" or changed is None:
            return copies, changed
        return copies[..., : self.n_kv, :], changed[: self.n_kv]  # kv head g reads copy g (TransformerLens 4.3)

    def _run(self, point: HookPoint, source: Tensor, n: int) -> tuple[Tensor, Tensor | None]:
        if not point.active:
            return source, None
        shown = source.unsqueeze(-2).expand(*source.shape[:-1], n, source.shape[-1]).clone()
        new = point.run(shown)
        if point.bwd_hooks:  # the gradient must reach the copies: every head is read from them
            return new, torch.ones(n, dtype=torch.bool, device=new.device)
        if new is shown:
            return new, None
        return new, (new != source.unsqueeze(-2)).flatten(0, -3).any(-1).any(0)

    def _project(self, module: nn.Module, part: str, copies: Tensor, idx: Tensor) -> Tensor:
        normed = copies if self.ln1 is None else self.ln1.forward(copies)  # forward: not ln1's own hooks
        with onloaded(module):
            weight, bias = local_param(module, "weight"), local_param(module, "bias")
        w_t = weight if self.conv1d else weight.t()  # [d_model, out]
        args = (self.layout, part, self.n_heads, self.n_kv, self.d_head)
        return project(normed, heads_of(w_t, *args).index_select(-2, idx),
                       None if bias is None else heads_of(bias, *args).index_select(-2, idx))  # fmt: skip


def project(
    x: Float[Tensor, "batch pos head d_model"],
    w: Float[Tensor, "d_model head d_head"],
    b: Float[Tensor, "head d_head"] | None,
) -> Float[Tensor, "batch pos head d_head"]:
    """Each head's copy through that head's slice of a projection: ``x[..., h, :] @ w[:, h] + b[h]``.

    Example:
        >>> project(torch.ones(1, 2, 4, 32), torch.ones(32, 4, 8), None).shape
        torch.Size([1, 2, 4, 8])
    """
    out = torch.einsum("bphm,mhe->bphe", x.to(w.dtype), w)
    return out if b is None else out + b


def mlp_in(registry: Any) -> Callable:
    """``hook_mlp_in``: the hooks see a copy of the MLP branch's input; an edit is what the branch reads (the
    residual its output is added to keeps the unedited tensor)."""

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        if not getattr(getattr(registry, "cfg", None), "use_hook_mlp_in", False):
            return x
        shown = x.clone()
        out = run("", shown)
        return x if out is shown else out

    return process


__all__ = ["EXCLUSIVE", "ON_DEMAND", "SWITCHES", "SplitLayer", "Switches", "heads_of", "mlp_branch", "mlp_in",
           "project", "refusals"]  # fmt: skip
