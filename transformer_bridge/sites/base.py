"""What every site is made of: `Site` (one torch hook serving an ordered group of points, with a ``process``
that shows each point its tensor in TransformerLens layout and writes edits back), the norm site called twice per
forward, the attention-function site, and the small processes that sites share (identity, per-head views, fused
q/k/v and gate/up splits, head results, private copies of a shared input). `build` wires them into a model.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..distributed import local_param, o_proj_weight, onloaded, sum_over_ranks
from ..hooks.points import HookPoint, HookRegistry
from . import attention
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
