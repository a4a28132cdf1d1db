"""Mixture-of-experts hook points: the router's logits, the expert weights per token, each expert's output.

On a block whose MLP is a mixture of experts (the adapter's `MoE` names its router and experts):

- ``blocks.L.mlp.hook_router_logits [batch pos expert]``: the router's logits. An edit re-routes: the
  bridge recomputes the top-k choice and weights from the edited logits with the family's rule
  (`route`), so banning an expert is ``logits[..., e] = -inf``.
- ``blocks.L.mlp.hook_expert_weights [batch pos expert]``: the weight each expert's output is multiplied
  by, dense (0 for the experts a token is not routed to). An edit is the routing: a non-zero weight
  sends the token to that expert (forcing it), a zero keeps it away (banning it). After an edit each
  token runs as many experts as the busiest token needs (under autograd: all of them, so every weight
  gets a gradient); experts with weight 0 add exact zeros, so the result is the model's sum for that
  routing.
- ``blocks.L.mlp.hook_expert_pre`` and ``hook_expert_post [batch pos expert d_mlp]`` (experts stored
  as ``gate_up_proj [expert, 2 * d_mlp, d_model]`` and ``down_proj [expert, d_model, d_mlp]`` with no
  biases: Mixtral, Qwen-MoE, OLMoE; or Llama 4's ``gate_up_proj [expert, d_model, 2 * d_mlp]``, whose
  experts run on each token already scaled by its router score, so its points are of that scaled input; or
  GPT-OSS's ``gate_up_proj [expert, d_model, 2 * d_mlp]`` with gate and up interleaved and biases, whose
  ``hook_expert_post`` is its own clamped ``_apply_gate`` and whose ``hook_expert_pre`` includes the gate's bias):
  each expert's gate pre-activation and its ``act(gate) * up``, the
  input of its down projection; TransformerLens' ``hook_pre`` / ``hook_post`` per expert. Every
  expert is evaluated on every token (those a token is not routed to weigh 0). Computed only while
  hooked; an edit makes the bridge compute the routed sum itself from them.
- ``blocks.L.mlp.hook_expert_result [batch pos expert d_model]``: each expert's weighted output,
  zero for experts a token is not routed to; computed only while hooked (like ``attn.hook_result``),
  from the points above, or else by one call of the experts module per expert. Summed over experts
  it is the routed part of ``hook_mlp_out`` (plus the shared expert's output where the family has
  one). An edit replaces the routed part by the edited sum.

- ``blocks.L.mlp.hook_shared_pre`` / ``hook_shared_post [batch pos d_mlp_shared]`` (Qwen2-MoE, Llama 4,
  DeepSeek-V3): the shared expert's gate projection and ``act(gate) * up`` (the input of its down
  projection), and ``blocks.L.mlp.hook_shared_gate [batch pos 1]`` (Qwen2-MoE): the logit whose sigmoid
  scales the shared expert's output. Torch hooks on the shared expert's own modules, attached only while
  hooked; an edit takes effect.

The router and experts modules work on flattened tokens ``[batch * pos, ...]``; the points show
``[batch, pos, ...]``. Where the router is a plain linear map (`LINEAR_ROUTER`: Jamba before transformers 5.21) the
MoE block routes the logits itself: ``hook_router_logits`` is the linear map's output (an edit is routed by HF's own
code) and ``hook_expert_weights`` is read from, and written into, the experts module's input.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..adapters.base import LINEAR_ROUTER, MoE, Routing
from ..hooks.points import HookPoint, HookRegistry
from .torch_hook import TorchHook

Run = Callable[[str, Tensor], Tensor]


@dataclass(eq=False)
class ModuleSite(TorchHook):
    """A forward hook on one module whose ``process(run, args, output)`` sees all its inputs and its whole
    output, and returns the output (the same object when nothing changed)."""

    module: nn.Module
    process: Callable[[Run, tuple, Any], Any]
    registry: HookRegistry
    points: dict[str, HookPoint] = field(default_factory=dict)
    served: list[HookPoint] = field(default_factory=list)
    handle: RemovableHandle | None = None
    fired: bool = False

    def _register(self) -> RemovableHandle:
        return self.module.register_forward_hook(self._post, with_kwargs=True)

    def active(self, key: str) -> bool:
        point = self.points.get(key)
        return point is not None and point.active

    def _run(self, key: str, tensor: Tensor) -> Tensor:
        return self.points[key].run(tensor) if self.active(key) else tensor

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self.fired = True
        new = self.process(self._run, args, output)
        return None if new is output else new


def is_moe_block(block: nn.Module, moe: MoE | None) -> bool:
    """Whether ``block`` has experts (DeepSeek-V3, Qwen2-MoE and Llama 4 mix dense and MoE blocks)."""
    if moe is None:
        return False
    module: Any = block
    for part in moe.experts.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True


def route(
    routing: Routing, logits: Float[Tensor, "token expert"], router: nn.Module
) -> tuple[Tensor, Int[Tensor, "token top_k"]]:
    """The expert weights and indices the router would give for ``logits``, by the family's rule.

    Returns ``(weights [token top_k], indices [token top_k])``, or for ``topk_sigmoid`` (Llama 4)
    ``(dense scores [token expert], indices)``.

    Example:
        >>> w, idx = route("softmax_topk", torch.randn(5, 4), model.hf_model.model.layers[0].mlp.gate)
    """
    k = router.top_k
    if routing in ("softmax_topk", "softmax_topk_unnormalized"):
        top, idx = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), k, dim=-1)
        if routing == "softmax_topk" and getattr(router, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), idx
    if routing == "topk_softmax":
        top, idx = torch.topk(logits, k, dim=-1)
        return torch.softmax(top, dim=-1), idx
    if routing == "topk_sigmoid":
        top, idx = torch.topk(logits, k, dim=-1)
        dense = torch.full_like(logits, float("-inf")).scatter(1, idx, top)
        return torch.sigmoid(dense.float()).to(logits.dtype), idx
    if routing == "sigmoid_group_topk":
        scores = logits.sigmoid()
        choice = scores + router.e_score_correction_bias
        n, groups = logits.shape[-1], router.num_group
        group_scores = choice.view(-1, groups, n // groups).topk(2, dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(router.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores).scatter(1, kept, 1).bool().repeat_interleave(n // groups, dim=1)
        idx = choice.masked_fill(~mask, float("-inf")).topk(k, dim=-1).indices
        weights = scores.gather(1, idx)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor, idx
    raise ValueError(f"Unknown `routing`={routing!r}; allowed: softmax_topk, softmax_topk_unnormalized, "
                     "topk_softmax, topk_sigmoid, sigmoid_group_topk.")  # fmt: skip


def _batch(registry: HookRegistry) -> int:
    return registry.ctx.positions.shape[0] if registry.ctx is not None else 1


def _router(moe: MoE, router: nn.Module, registry: HookRegistry) -> ModuleSite:
    """``hook_router_logits`` then ``hook_expert_weights`` on the router's output."""
    n = router.num_experts
    order = moe.router_output

    def process(run: Run, args: tuple, output: Any) -> Any:
        if moe.dense:
            weights, logits = output[0], output[1]
        else:
            named = dict(zip(order, output, strict=False))
            logits, weights, indices = named["logits"], named["weights"], named["indices"]
        batch = _batch(registry)
        shown = logits.view(batch, -1, n)
        new = run("router_logits", shown)
        changed = new is not shown
        if changed:
            logits = new.reshape(logits.shape)
            weights, indices = route(moe.routing, logits, router)
        if site.active("expert_weights"):
            dense = weights if moe.dense else torch.zeros_like(logits, dtype=weights.dtype).scatter(1, indices, weights)
            shown = dense.view(batch, -1, n)
            new = run("expert_weights", shown)
            if new is not shown:
                changed = True
                if moe.dense:
                    weights = new.reshape(dense.shape)
                else:
                    weights, indices = _sparse(new.reshape(dense.shape))
        if not changed:
            return output
        if moe.dense:
            return (weights, logits, *output[2:])
        named = {"logits": logits, "weights": weights, "indices": indices}
        return (*(named[name] for name in order), *output[len(order) :])

    site = ModuleSite(router, process, registry)
    return site


def _linear_router(router: nn.Module, registry: HookRegistry) -> ModuleSite:
    """``hook_router_logits`` on a router that is a plain linear map (`LINEAR_ROUTER`): the MoE block routes the
    (edited) logits with its own code."""

    def process(run: Run, args: tuple, logits: Tensor) -> Tensor:
        shown = logits.view(_batch(registry), -1, logits.shape[-1])
        new = run("router_logits", shown)
        return logits if new is shown else new.reshape(logits.shape)

    return ModuleSite(router, process, registry)


@dataclass(eq=False)
class InputSite(ModuleSite):
    """A forward pre-hook on one module whose ``process(run, args)`` returns its positional inputs (the same tuple
    when nothing changed)."""

    def _register(self) -> RemovableHandle:
        return self.module.register_forward_pre_hook(self._pre)

    def _pre(self, module: nn.Module, args: tuple) -> tuple | None:
        self.fired = True
        new = self.process(self._run, args, None)
        return None if new is args else new


def _expert_inputs(experts: nn.Module, n: int, registry: HookRegistry) -> InputSite:
    """``hook_expert_weights`` at the experts' input ``(hidden, top_k_index, top_k_weights)``, where the router does
    not return them (`LINEAR_ROUTER`); an edit hands the experts the edited routing."""

    def process(run: Run, args: tuple, _: None) -> tuple:
        hidden, index, weights = args[:3]
        dense = torch.zeros(index.shape[0], n, dtype=weights.dtype, device=weights.device).scatter(1, index, weights)
        shown = dense.view(_batch(registry), -1, n)
        new = run("expert_weights", shown)
        if new is shown:
            return args
        weights, index = _sparse(new.reshape(dense.shape))
        return (hidden, index, weights, *args[3:])

    return InputSite(experts, process, registry)


def has_expert_internals(experts: nn.Module, d_model: int) -> bool:
    """Experts stored as ``gate_up_proj [expert, 2 * d_mlp, d_model]``, ``down_proj [expert, d_model, d_mlp]``,
    no biases: the layout whose hidden activations the bridge computes itself (``hook_expert_pre/post``)."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (
        isinstance(gate_up, Tensor)
        and isinstance(down, Tensor)
        and gate_up.dim() == down.dim() == 3
        and gate_up.shape[-1] == down.shape[1] == d_model
        and gate_up.shape[1] == 2 * down.shape[2]
        and getattr(experts, "gate_up_proj_bias", None) is None
        and callable(getattr(experts, "act_fn", None))
    )


def has_dense_expert_internals(experts: nn.Module, d_model: int) -> bool:
    """Llama 4's layout: ``gate_up_proj [expert, d_model, 2 * d_mlp]``, ``down_proj [expert, d_mlp, d_model]``,
    run on every expert's router-scaled copy of the tokens."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (
        isinstance(gate_up, Tensor)
        and isinstance(down, Tensor)
        and gate_up.dim() == down.dim() == 3
        and gate_up.shape[1] == down.shape[2] == d_model
        and gate_up.shape[2] == 2 * down.shape[1]
        and callable(getattr(experts, "act_fn", None))
    )


def has_interleaved_expert_internals(experts: nn.Module, d_model: int) -> bool:
    """GPT-OSS's layout: ``gate_up_proj [expert, d_model, 2 * d_mlp]`` with gate and up interleaved (even and odd
    columns) and biases on both projections; the activation is the experts module's own ``_apply_gate``."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (
        isinstance(gate_up, Tensor)
        and isinstance(down, Tensor)
        and gate_up.dim() == down.dim() == 3
        and gate_up.shape[1] == down.shape[2] == d_model
        and gate_up.shape[2] == 2 * down.shape[1]
        and isinstance(getattr(experts, "gate_up_proj_bias", None), Tensor)
        and isinstance(getattr(experts, "down_proj_bias", None), Tensor)
        and callable(getattr(experts, "_apply_gate", None))
    )


def _sparse(dense: Float[Tensor, "token expert"]) -> tuple[Tensor, Int[Tensor, "token k"]]:
    """Top-k style ``(weights, indices)`` for edited dense weights.

    Under autograd every expert is kept, so the gradient reaches the weight of every expert (the ones at 0
    included); otherwise only as many as the most experts any token uses. Either way experts weighing 0
    add exact zeros, so the values are the same.
    """
    n = dense.shape[-1]
    if torch.is_grad_enabled() and dense.requires_grad:
        return dense, torch.arange(n, device=dense.device).expand(dense.shape)
    k = max(int((dense != 0).sum(dim=-1).max()), 1)
    indices = dense.abs().topk(k, dim=-1).indices
    return dense.gather(1, indices), indices


def _experts(moe: MoE, experts: nn.Module, n: int, registry: HookRegistry, internals: str | None) -> ModuleSite:
    """``hook_expert_pre`` / ``hook_expert_post`` (``internals``: the weights' layout, ``standard``, ``dense`` or
    ``interleaved``) and ``hook_expert_result``."""

    def process(run: Run, args: tuple, output: Tensor) -> Tensor:
        batch = _batch(registry)
        if internals == "dense":
            return _from_dense_internals(run, args, output, batch)
        if internals == "interleaved":
            return _from_interleaved_internals(run, args, output, batch)
        if internals:
            return _from_internals(run, args, output, batch)
        if moe.dense:  # Llama 4: the output is already [expert * token, d_model]
            shown = output.view(n, batch, -1, output.shape[-1]).permute(1, 2, 0, 3)
            new = run("expert_result", shown)
            return output if new is shown else new.permute(2, 0, 1, 3).reshape(output.shape)
        hidden, index, weights = args[:3]
        dense = torch.zeros(index.shape[0], n, dtype=weights.dtype, device=weights.device)
        dense = dense.scatter(1, index, weights)
        one = torch.empty(index.shape[0], 1, dtype=index.dtype, device=index.device)
        parts = [experts.forward(hidden, one.fill_(e).clone(), dense[:, e : e + 1]) for e in range(n)]
        result = torch.stack(parts, dim=1)
        shown = result.view(batch, -1, n, result.shape[-1])
        new = run("expert_result", shown)
        return output if new is shown else new.reshape(result.shape).sum(dim=1).to(output.dtype)

    def _from_internals(run: Run, args: tuple, output: Tensor, batch: int) -> Tensor:
        hidden, index, weights = args[:3]
        dense = torch.zeros(index.shape[0], n, dtype=weights.dtype, device=weights.device)
        dense = dense.scatter(1, index, weights)
        gate_up = torch.einsum("td,ejd->tej", hidden, experts.gate_up_proj)
        d_mlp = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :d_mlp], gate_up[..., d_mlp:]  # slices, not chunk(): see sites.fused_qkv
        shown = gate.reshape(batch, -1, n, d_mlp)
        pre = run("expert_pre", shown)
        edited = pre is not shown
        shown = (experts.act_fn(pre) * up.reshape(pre.shape)).reshape(pre.shape)
        post = run("expert_post", shown)
        edited |= post is not shown
        out = torch.einsum("bpej,edj->bped", post, experts.down_proj) * dense.reshape(batch, -1, n, 1)
        result = run("expert_result", out)
        if not edited and result is out:
            return output
        return result.reshape(-1, n, result.shape[-1]).sum(dim=1).to(output.dtype)

    def _from_interleaved_internals(run: Run, args: tuple, output: Tensor, batch: int) -> Tensor:
        # GPT-OSS: gate and up interleaved, biases, and its clamped activation, applied by its own `_apply_gate`.
        hidden, index, weights = args[:3]
        dense = torch.zeros(index.shape[0], n, dtype=weights.dtype, device=weights.device)
        dense = dense.scatter(1, index, weights)
        gate_up = torch.einsum("td,edj->tej", hidden, experts.gate_up_proj) + experts.gate_up_proj_bias
        d_mlp = gate_up.shape[-1] // 2
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        shown = gate.reshape(batch, -1, n, d_mlp)
        pre = run("expert_pre", shown)
        edited = pre is not shown
        if edited:
            gate_up = torch.stack((pre.reshape(gate.shape), up), dim=-1).flatten(-2)
        shown = experts._apply_gate(gate_up).reshape(batch, -1, n, d_mlp)
        post = run("expert_post", shown)
        edited |= post is not shown
        out = torch.einsum("bpej,ejd->bped", post, experts.down_proj) + experts.down_proj_bias
        out = out * dense.reshape(batch, -1, n, 1)
        result = run("expert_result", out)
        if not edited and result is out:
            return output
        return result.reshape(-1, n, result.shape[-1]).sum(dim=1).to(output.dtype)

    def _from_dense_internals(run: Run, args: tuple, output: Tensor, batch: int) -> Tensor:
        hidden = args[0].view(n, -1, args[0].shape[-1])  # each expert's copy, already scaled by its weight
        gate_up = torch.bmm(hidden, experts.gate_up_proj).transpose(0, 1)  # [token, expert, 2 * d_mlp]
        d_mlp = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :d_mlp], gate_up[..., d_mlp:]
        shown = gate.reshape(batch, -1, n, d_mlp)
        pre = run("expert_pre", shown)
        edited = pre is not shown
        shown = experts.act_fn(pre) * up.reshape(pre.shape)
        post = run("expert_post", shown)
        edited |= post is not shown
        out = torch.einsum("bpej,ejd->bped", post, experts.down_proj)
        result = run("expert_result", out)
        if not edited and result is out:
            return output
        return result.permute(2, 0, 1, 3).reshape(output.shape).to(output.dtype)

    return ModuleSite(experts, process, registry)


def token_rows(registry: HookRegistry) -> Callable:
    """A site process showing ``[batch * pos, d]`` (or ``[batch, pos, d]``) as ``[batch, pos, d]``."""

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        shown = x if x.dim() == 3 else x.view(_batch(registry), -1, x.shape[-1])
        out = run("", shown)
        return x if out is shown else out.reshape(x.shape)

    return process


def shared_points(moe: MoE) -> list[tuple[str, str, str]]:
    """``(point key, module path, site kind)`` of the shared expert's points (none without one)."""
    if moe.shared is None:
        return []
    out = [("shared_pre", f"{moe.shared}.gate_proj", "post"), ("shared_post", f"{moe.shared}.down_proj", "pre")]
    return out + ([("shared_gate", moe.shared_gate, "post")] if moe.shared_gate else [])


def moe_sites(
    moe: MoE, block: nn.Module, registry: HookRegistry, get: Callable[[nn.Module, str], nn.Module]
) -> list[tuple[str, ModuleSite]]:
    """``(point key, site)`` for the MoE points of one block, in canonical order."""
    router, experts = get(block, moe.router), get(block, moe.experts)
    d_model = router.weight.shape[-1]
    if moe.router_output == LINEAR_ROUTER:
        n = router.out_features
        weights: ModuleSite = _expert_inputs(experts, n, registry)
        routing = _linear_router(router, registry)
    else:
        n = router.num_experts
        routing = weights = _router(moe, router, registry)
    if moe.dense:
        internals = "dense" if has_dense_expert_internals(experts, d_model) else None
    elif has_expert_internals(experts, d_model):
        internals = "standard"
    else:
        internals = "interleaved" if has_interleaved_expert_internals(experts, d_model) else None
    computed = _experts(moe, experts, n, registry, internals)
    keys = ["expert_pre", "expert_post", "expert_result"] if internals else ["expert_result"]
    return [("router_logits", routing), ("expert_weights", weights), *((key, computed) for key in keys)]
