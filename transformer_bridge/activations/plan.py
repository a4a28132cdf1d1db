"""A harvest's settings, resolved once before any forward: hook points, their row shapes, where to stop, the
storage dtype, the shard size, the process's rank, and the manifest fields that a resumed run must match."""

import importlib.metadata
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from ..checks import ArgumentTypeError, ArgumentValueError, check_bool, check_int, describe
from ..core import BridgeCore
from ..distributed import tp_mesh
from ..layers import check_layer

FORMAT = "transformer_bridge.activations"
VERSION = 1
NO_POSITION_AXIS = ("hook_pattern", "hook_attn_scores")
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "float64": torch.float64}  # fmt: skip


class HarvestConfigError(ValueError):
    """``out_dir`` holds a harvest made with other settings or other data; resuming it would mix the two."""


@dataclass(frozen=True)
class Plan:
    """What `harvest` resolved from its arguments; ``config`` is what a resumed run must share."""

    names: list[str]
    shapes: dict[str, list[int]]
    dtype: torch.dtype
    stop_at_layer: int | None
    context_length: int
    batch_size: int
    exclude: list[int]
    prepend_bos: bool
    shard_rows: int
    rank: int
    world: int  # data-parallel world (1 under tensor parallelism, where every rank runs the same data)
    writes: bool  # False on tensor-parallel ranks other than 0
    tensor_parallel: bool
    max_tokens: int | None
    config: dict[str, Any]


def parse_bytes(value: int | str, param: str) -> int:
    """``value`` in bytes: an int, or a string such as ``"256MB"``, ``"1.5 GiB"``.

    Example:
        >>> parse_bytes("256MB", "shard_size"), parse_bytes(1024, "shard_size")
        (256000000, 1024)
    """
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B)?\s*", value, re.IGNORECASE)
        if match is None:
            raise ArgumentValueError(f"`{param}`={value!r} is not a size; give bytes (an int) or e.g. '256MB', '1GiB'.")
        unit = (match.group(2) or "B").upper()
        power = " KMGT".index(unit[0]) if unit[0] in "KMGT" else 0
        return int(float(match.group(1)) * (1024 if "I" in unit else 1000) ** power)
    return check_int(param, value, minimum=1, hint="Give bytes, or a string such as '256MB'.")


def ranks(model: BridgeCore) -> tuple[int, int, bool, bool]:
    """``(rank, data-parallel world, writes, tensor parallel)``: under ``torchrun`` each process harvests its share
    of the data; under tensor parallelism every rank runs the same batches and rank 0 alone writes."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and tp_mesh(model.hf_model) is not None:
        return rank, 1, rank == 0, True
    return rank, world, True, False


def needed_layers(names: list[str]) -> int | None:
    """The first block a forward can stop before, having run every point in ``names``; None: the whole model
    (the final norm's points)."""
    stop = 0
    for name in names:
        match = re.match(r"blocks\.(\d+)\.", name)
        if match:
            stop = max(stop, int(match.group(1)) + 1)
        elif not name.startswith(("hook_tokens", "hook_embed", "hook_pos_embed", "ln_embed.")):
            return None
    return stop


def resolve(
    model: BridgeCore, names: Any, context_length: int, batch_size: int, dtype: Any, stop_at_layer: int | None,
    exclude_bos: bool, exclude_tokens: Any, prepend_bos: bool | None, shard_size: int | str, max_tokens: int | None,
    kind: str,
) -> Plan:  # fmt: skip
    """Check every argument (errors name the parameter, the value and what is allowed) and resolve the plan."""
    if not isinstance(model, BridgeCore) and not getattr(model, "harvest_runner", False):
        raise ArgumentTypeError(f"`model` must be a TransformerBridge or a VLLMBridge, got {describe(model)}.")
    points = model.names_matching(names, "names")
    flat = [p for p in points if p.endswith(NO_POSITION_AXIS)]
    if flat:
        raise ArgumentValueError(
            f"`names` includes {flat[:3]}: attention patterns and scores have no row per token ([batch, head, "
            "query_pos, key_pos]). Harvest per-token points (hook_resid_*, hook_z, hook_q/k/v, mlp.hook_post ...)."
        )
    context_length = check_int("context_length", context_length, minimum=1)
    if model.cfg.n_ctx is not None and context_length > model.cfg.n_ctx:
        raise ArgumentValueError(
            f"`context_length`={context_length} is longer than the model's context ({model.cfg.n_ctx} tokens)."
        )
    batch_size = check_int("batch_size", batch_size, minimum=1)
    storage = _dtype(dtype, model.cfg.dtype)
    need = needed_layers(points)
    if stop_at_layer is None:
        stop = need
    else:
        stop = check_layer(stop_at_layer, model.cfg.n_layers, "stop_at_layer")
        if need is None or stop < need:
            first = "the end (the final norm's points)" if need is None else f"layer {need}"
            raise ArgumentValueError(
                f"`stop_at_layer`={stop_at_layer} stops before a requested point: {points} need the forward to run to "
                f"{first}. Give stop_at_layer >= {need} or None (the default stops right after the last point)."
            )
    exclude = _exclusions(model, check_bool("exclude_bos", exclude_bos), exclude_tokens)
    bos = model.cfg.default_prepend_bos if prepend_bos is None else check_bool("prepend_bos", prepend_bos)
    if max_tokens is not None:
        max_tokens = check_int("max_tokens", max_tokens, minimum=1)
    shapes = _row_shapes(model, points, stop)
    row_bytes = sum(math.prod(s) for s in shapes.values()) * storage.itemsize + 16  # + token, document, position
    shard_rows = max(1, parse_bytes(shard_size, "shard_size") // row_bytes)
    rank, world, writes, tensor_parallel = ranks(model)
    config = {
        "hook_names": points, "shapes": shapes, "dtype": str(storage).removeprefix("torch."),
        "context_length": context_length, "batch_size": batch_size, "stop_at_layer": stop,
        "exclude_tokens": exclude, "prepend_bos": bos if kind == "text" else None, "data_kind": kind,
        "world_size": world, "max_tokens": max_tokens, "model": model_info(model),
    }  # fmt: skip
    return Plan(points, shapes, storage, stop, context_length, batch_size, exclude, bos, shard_rows, rank, world,
                writes, tensor_parallel, max_tokens, config)  # fmt: skip


def _dtype(dtype: Any, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, str):
        dtype = STORAGE_DTYPES.get(dtype.removeprefix("torch."), dtype)
    if not isinstance(dtype, torch.dtype) or dtype not in STORAGE_DTYPES.values():
        allowed = list(STORAGE_DTYPES)
        raise ArgumentValueError(f"`dtype` must be one of {allowed} (or None: the model's), got {dtype!r}.")
    return dtype


def _exclusions(model: BridgeCore, exclude_bos: bool, exclude_tokens: Any) -> list[int]:
    if isinstance(exclude_tokens, (int, str)) or not hasattr(exclude_tokens, "__iter__"):
        raise ArgumentTypeError(f"`exclude_tokens` must be a list of token ids, got {describe(exclude_tokens)}.")
    ids = [check_int("exclude_tokens", t, 0, model.cfg.d_vocab - 1) for t in exclude_tokens]
    if exclude_bos and model.cfg.bos_token_id is not None:
        ids.append(int(model.cfg.bos_token_id))
    return sorted(set(ids))


def _row_shapes(model: BridgeCore, names: list[str], stop: int | None) -> dict[str, list[int]]:
    """Each point's shape per token, from one forward over two tokens."""
    probe = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    _, tensors = model.cache_forward(probe, torch.ones_like(probe), names, stop_at_layer=stop)
    return {name: list(tensors[name].shape[2:]) for name in names}


def model_info(model: BridgeCore) -> dict[str, Any]:
    """The model and library versions a manifest records."""
    config = model.hf_model.config
    try:
        ours = importlib.metadata.version("transformer-bridge")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        ours = "unknown"
    return {
        "name": getattr(config, "_name_or_path", "") or type(model.hf_model).__name__,
        "revision": getattr(config, "_commit_hash", None),
        "model_type": config.model_type,
        "dtype": str(model.cfg.dtype).removeprefix("torch."),
        "versions": {"transformer_bridge": ours, "transformers": transformers.__version__, "torch": torch.__version__},
    }


def check_resume(manifest: dict[str, Any], plan: Plan, out_dir: Path) -> None:
    """Refuse to continue a harvest whose settings differ (the model's versions may differ: a warning elsewhere)."""
    if manifest.get("format") != FORMAT:
        raise HarvestConfigError(f"{out_dir} holds a manifest that is not a harvest's; give another `out_dir`.")
    mine = {k: v for k, v in plan.config.items() if k != "model"}
    theirs = {k: manifest.get(k) for k in mine}
    theirs["shapes"] = {k: list(v) for k, v in (theirs.get("shapes") or {}).items()}
    diff = [k for k in mine if mine[k] != theirs[k]]
    for key in ("name", "model_type"):
        if manifest["model"].get(key) != plan.config["model"][key]:
            diff.append(f"model {key}")
    if diff:
        shown = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} now" for k in diff if k in mine)
        raise HarvestConfigError(
            f"`out_dir`={str(out_dir)!r} holds a harvest made with other settings ({', '.join(diff)}; {shown}). "
            "Give the same arguments to continue it, another `out_dir`, or `overwrite=True` to start over."
        )
