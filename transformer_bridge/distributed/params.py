"""Parameters of a model split across devices: onloaded, local or gathered.

Two engines move parameters away from where a hook reads them. accelerate's offload (``device_map``
with ``"disk"`` or a CPU-offloaded GPU map) keeps an offloaded module's parameters on the ``meta``
device except while that module runs, so a bridge hook that recomputes something from a weight
after the module returned (a norm's ``hook_normalized``, ``hook_result``) must onload it first.
HF tensor parallelism (``tp_plan="auto"``) makes parameters `DTensor`\\ s: a shard per rank that
plain-tensor arithmetic refuses to mix with ordinary tensors.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

try:  # accelerate is optional: without it nothing can be offloaded
    from accelerate.utils import align_module_device, has_offloaded_params
except ImportError:  # pragma: no cover - exercised only without accelerate
    align_module_device = has_offloaded_params = None

__all__ = ["full_param", "input_device", "local_param", "onloaded"]


@contextlib.contextmanager
def onloaded(module: nn.Module) -> Iterator[nn.Module]:
    """While the block runs, ``module``'s parameters are real tensors even if accelerate offloaded them.

    A no-op for modules that are not offloaded.

    Example:
        >>> import torch
        >>> with onloaded(torch.nn.Linear(2, 2)) as m:
        ...     w = m.weight
    """
    if has_offloaded_params is not None and has_offloaded_params(module):
        with align_module_device(module):
            yield module
    else:
        yield module


def local_param(module: nn.Module, name: str = "weight") -> Tensor | None:
    """``module.<name>`` as a plain tensor: this rank's shard of a tensor-parallel parameter (the whole
    of a replicated one), the parameter itself otherwise. Read it inside `onloaded` for offloaded modules.

    Example:
        >>> import torch
        >>> local_param(torch.nn.Linear(2, 3)).shape
        torch.Size([3, 2])
    """
    p = getattr(module, name, None)
    return p.to_local() if isinstance(p, DTensor) else p


def full_param(module: nn.Module, name: str = "weight") -> Tensor | None:
    """``module.<name>`` whole, wherever it lives: the parameter itself when it is a plain tensor on a
    real device (so views of it still edit the model); a gathered copy of a tensor-parallel parameter
    (a collective: every rank must call it); a copy loaded from accelerate's offload for an offloaded one.

    Raises `ValueError` for a parameter on ``meta`` with nothing to load it from.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 3)
        >>> full_param(lin) is lin.weight
        True
    """
    p = getattr(module, name, None)
    if p is None:
        return None
    if isinstance(p, DTensor):
        return p.full_tensor()
    if p.device.type != "meta":
        return p
    if has_offloaded_params is not None and has_offloaded_params(module):
        with align_module_device(module):
            return getattr(module, name).detach().clone()
    raise ValueError(
        f"`{type(module).__name__}.{name}` is on the meta device (no values) and no accelerate offload hook "
        "can load it; load the model with real weights (`device_map=` with an `offload_folder`, or no meta init)."
    )


def input_device(model: nn.Module) -> torch.device:
    """Where token ids go: the embedding's execution device under an accelerate device map (its weights
    may be offloaded to ``meta``), else the device of the model's first parameter.

    Example:
        >>> import torch
        >>> input_device(torch.nn.Linear(2, 2))
        device(type='cpu')
    """
    first = next(model.parameters())
    if first.device.type != "meta":
        return first.device
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    execution = getattr(getattr(embed, "_hf_hook", None), "execution_device", None)
    if execution is not None:
        return torch.device("cuda", execution) if isinstance(execution, int) else torch.device(execution)
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")
