"""Hook points of a tensor-parallel model (HF ``tp_plan="auto"`` under ``torchrun``).

HF's tensor parallelism splits attention heads and MLP neurons across ranks: the output of a
column-wise projection (``q_proj``, ``gate_proj`` …) and the input of a row-wise one (``o_proj``,
``down_proj``) are this rank's shard, plain tensors, while the residual stream, the norms and the
logits are whole on every rank. A hook point whose tensor is a shard gets a `ShardSpec`: before its
functions run the shards are gathered into the full activation (identical to one process), and an
edit is cut back to this rank's shard. `local_shards` turns the gathering off for speed.

Every rank must register the same hooks: gathering is a collective, and a point hooked on one
rank only would wait forever for the others.
"""

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..adapters import UnsupportedArchitectureError
from ..hooks.points import HookPoint, HookRegistry
from ..versions import TP_UNEVEN_SHARDS, installed

__all__ = ["SHARDED_AXES", "SUPPORTED_STYLES", "ShardSpec", "attach_shard_specs", "check_tensor_parallel",
           "check_tp_plan", "local_shards", "o_proj_weight", "sum_over_ranks", "tp_mesh"]  # fmt: skip

# Points that a tensor-parallel plan can split: suffix -> (axis of the tensor the hook sees, size
# attribute of `BridgeConfig`). Heads for attention, neurons for the MLP.
SHARDED_AXES: dict[str, tuple[int, str]] = {
    "attn.hook_q": (2, "n_heads"),
    "attn.hook_k": (2, "n_kv_heads"),
    "attn.hook_v": (2, "n_kv_heads"),
    "attn.q_norm.hook_scale": (2, "n_heads"),
    "attn.q_norm.hook_normalized": (2, "n_heads"),
    "attn.k_norm.hook_scale": (2, "n_kv_heads"),
    "attn.k_norm.hook_normalized": (2, "n_kv_heads"),
    "attn.hook_rot_q": (2, "n_heads"),
    "attn.hook_rot_k": (2, "n_kv_heads"),
    "attn.hook_attn_scores": (1, "n_heads"),
    "attn.hook_pattern": (1, "n_heads"),
    "attn.hook_z": (2, "n_heads"),
    "attn.hook_result": (2, "n_heads"),
    "mlp.hook_pre": (2, "d_mlp"),
    "mlp.hook_pre_linear": (2, "d_mlp"),
    "mlp.hook_post": (2, "d_mlp"),
}


@dataclass(frozen=True)
class ShardSpec:
    """How a hook point's tensor is split across the ranks of ``mesh``: along axis ``dim`` of full
    length ``size``, in `torch.chunk` order (rank r holds chunk r; the last chunks may be shorter).

    ``hook.shard`` is this object on a sharded point (None elsewhere). Inside `local_shards`, a hook
    finds its own slice of the full axis with ``hook.shard.local_range()``.

    Example:
        >>> def show(t, hook):
        ...     if hook.shard is not None:
        ...         print(hook.name, hook.shard.dim, hook.shard.local_range())
    """

    dim: int
    size: int
    mesh: DeviceMesh

    def local_range(self) -> range:
        """Indices along `dim` of the full tensor that this rank holds."""
        chunk = math.ceil(self.size / self.mesh.size())
        start = min(self.mesh.get_local_rank() * chunk, self.size)
        return range(start, min(start + chunk, self.size))

    def gather(self, local: Tensor) -> Tensor:
        """The full tensor from every rank's shard (differentiable; the same on every rank)."""
        shape = (*local.shape[: self.dim], self.size, *local.shape[self.dim + 1 :])
        stride = torch.empty(shape, device="meta").stride()
        spread = DTensor.from_local(
            local.contiguous(), self.mesh, [Shard(self.dim)], run_check=False, shape=shape, stride=stride
        )
        return spread.full_tensor()

    def scatter(self, full: Tensor, like: Tensor) -> Tensor:
        """This rank's shard of ``full``; gradients flowing back reach the whole of ``full``."""
        whole = DTensor.from_local(full, self.mesh, [Replicate()], run_check=False)
        local = whole.redistribute(self.mesh, [Shard(self.dim)]).to_local()
        if local.shape != like.shape:
            raise RuntimeError(
                f"Cutting an edited activation of shape {tuple(full.shape)} along axis {self.dim} gave this rank "
                f"shape {tuple(local.shape)}, but the model's shard is {tuple(like.shape)}: the tensor-parallel "
                "plan splits this axis in an order the bridge does not know. Use `local_shards` to edit shards."
            )
        return local

    def run(self, apply: Callable[[Tensor], Tensor], tensor: Tensor) -> Tensor:
        """Gather ``tensor`` if it is a shard, run the point's functions (``apply``) on the full
        activation, and hand back this rank's shard of the result (``tensor`` itself if unchanged)."""
        if tensor.shape[self.dim] == self.size:  # this module's plan left the axis whole
            return apply(tensor)
        full = self.gather(tensor)
        out = apply(full)
        return tensor if out is full else self.scatter(out, tensor)


# HF tensor-parallel styles whose outputs are either whole or split along the axes of `SHARDED_AXES`.
# Others split what the bridge shows whole (sequence parallelism splits the residual stream by position,
# expert styles split a mixture's experts): refused rather than shown as shards.
SUPPORTED_STYLES = frozenset({
    "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
    "embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce", "replicate",
})  # fmt: skip


def check_tp_plan(plan: Mapping[str, str]) -> None:
    """Raise `NotImplementedError` when a tensor-parallel ``plan`` uses a style the bridge cannot show whole.

    Example:
        >>> check_tp_plan({"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"})
    """
    unknown = {name: style for name, style in plan.items() if style not in SUPPORTED_STYLES}
    if unknown:
        raise NotImplementedError(
            f"The tensor-parallel plan uses {sorted(set(unknown.values()))} (on {sorted(unknown)[:4]}); the bridge "
            f"gathers hook points only for the styles {sorted(SUPPORTED_STYLES)}, and would otherwise show "
            "shards as if they were whole activations. Load with a plan of those styles (`tp_plan=` a dict), or "
            "without tensor parallelism (`device_map=` splits layers across devices instead)."
        )


def tp_mesh(model: nn.Module) -> DeviceMesh | None:
    """The device mesh of ``model``'s first sharded parameter, or None when nothing is sharded.

    Raises `NotImplementedError` when ``model.tp_plan`` uses styles the bridge cannot gather (`check_tp_plan`).

    Example:
        >>> import torch
        >>> tp_mesh(torch.nn.Linear(2, 2)) is None
        True
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            check_tp_plan(getattr(model, "tp_plan", None) or {})
            return p.device_mesh
    return None


def check_tensor_parallel(model: nn.Module) -> None:
    """Refuse a tensor-parallel model whose shards are plain tensors (transformers 5.15 shards that way; later
    releases make them `DTensor`\\ s, which say which axis is split and over which ranks): the bridge would read a
    shard's shape as the whole weight's (half the vocabulary on two ranks). Before transformers 5.21 also refuse
    one with a width its ranks do not divide, which HF's own forward fails on there (`versions.TP_UNEVEN_SHARDS`).

    Example:
        >>> check_tensor_parallel(torch.nn.Linear(2, 2))  # not tensor-parallel: nothing to check
    """
    if (getattr(model, "tp_size", None) or 1) > 1 and tp_mesh(model) is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} is tensor-parallel (tp_size={model.tp_size}) with its shards as plain tensors, "
            f"as {installed()} loads it; the bridge reads shards from DTensors (the releases it is tested on make "
            "them). Install a newer transformers, or load the model without tensor parallelism."
        )
    uneven = [] if TP_UNEVEN_SHARDS else _uneven_shards(model)
    if uneven:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} is tensor-parallel (tp_size={model.tp_size}) with widths the ranks do not divide "
            f"({', '.join(uneven[:3])}); HF's tensor-parallel forward on {installed()} fails on such shards (from "
            "transformers 5.21 on it runs them). Install transformers>=5.21, or load with a `tp_size` that divides "
            "every sharded width."
        )


def _uneven_shards(model: nn.Module) -> list[str]:
    """``"name: width over N ranks"`` for each parameter split along an axis its ranks do not divide evenly."""
    found = []
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        for mesh_dim, placement in enumerate(p.placements):
            ranks = p.device_mesh.size(mesh_dim)
            if isinstance(placement, Shard) and p.shape[placement.dim] % ranks:
                found.append(f"{name}: {p.shape[placement.dim]} over {ranks} ranks")
    return found


def attach_shard_specs(points: dict[str, HookPoint], mesh: DeviceMesh, sizes: object) -> None:
    """Give every point a tensor-parallel plan can split its `ShardSpec` (``sizes``: a `BridgeConfig`)."""
    for name, point in points.items():
        suffix = name.split(".", 2)[2] if name.startswith("blocks.") else name
        axis = SHARDED_AXES.get(suffix)
        if axis is not None:
            point.shard = ShardSpec(axis[0], getattr(sizes, axis[1]), mesh)


@contextlib.contextmanager
def local_shards(model: HookRegistry) -> Iterator[None]:
    """Opt-in: while the block runs, hooks on sharded points see this rank's shard, not the full tensor.

    Faster (no gather per hooked point), and the hook must know what it holds: ``hook.shard.dim`` and
    ``hook.shard.local_range()`` say which slice of heads or neurons. An edit of the shard is used as is.
    Outside tensor parallelism it changes nothing.

    Example:
        >>> with local_shards(model):
        ...     logits = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", fn)])
    """
    previous, model.shard_local = model.shard_local, True
    try:
        yield
    finally:
        model.shard_local = previous


def o_proj_weight(module: nn.Module, conv1d: bool, width: int) -> tuple[Tensor, DeviceMesh | None]:
    """The attention output projection as ``[d_model, width]`` matching a ``hook_z`` of ``width`` features,
    and the mesh to sum the heads' contributions over when that width is this rank's shard (else None)."""
    p = module.weight
    if not isinstance(p, DTensor):
        return (p.T if conv1d else p), None
    local = p.to_local()
    w = local.T if conv1d else local
    if w.shape[-1] == width:
        return w, (p.device_mesh if local.shape != p.shape else None)
    full = p.full_tensor()
    return (full.T if conv1d else full), None


def sum_over_ranks(partial: Tensor, mesh: DeviceMesh) -> Tensor:
    """Sum of every rank's ``partial`` (differentiable: each rank's gradient is the replicated one)."""
    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
