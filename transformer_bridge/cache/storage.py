"""Saving and loading an `ActivationCache` as one safetensors file (no pickle): each storage written once, aliases
(``resid_pre[l+1]`` is ``resid_post[l]``) and the batch layout kept in the metadata."""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..checks import check_device


class CacheFileError(ValueError):
    """A file that is not a cache written by `ActivationCache.save` (or is damaged)."""


def save(cache: Any, path: str | Path) -> None:
    """Write ``cache`` (an `ActivationCache`) to ``path``; tensors shared under several names are written once."""
    unique: dict[tuple, str] = {}
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in cache.cache_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.device)
        if key in unique:
            aliases[name] = unique[key]
        else:
            unique[key] = name
            tensors[name] = t.detach().contiguous().clone() if not t.is_contiguous() else t.detach().clone()
    for extra in ("attention_mask", "prompt_lengths"):
        value = getattr(cache, extra)
        if value is not None:
            tensors[f"__{extra}__"] = value.detach().contiguous().clone()
    meta = {"aliases": json.dumps(aliases), "has_batch_dim": json.dumps(cache.has_batch_dim)}
    save_file({k: v.cpu() for k, v in tensors.items()}, str(path), metadata=meta)


def load(path: str | Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The `ActivationCache` arguments stored in ``path`` (tensors, attention mask, prompt lengths, batch layout)."""
    path = Path(path) if isinstance(path, (str, Path)) else path
    if not isinstance(path, Path):
        raise TypeError(f"`path` must be a str or Path, got {type(path).__name__} {path!r}.")
    if path.is_dir():
        raise CacheFileError(f"`path`={str(path)!r} is a directory; give the .safetensors file written by `save`.")
    if not path.exists():
        raise FileNotFoundError(f"`path`={str(path)!r} does not exist.")
    device = check_device(device) or torch.device("cpu")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CacheFileError(f"`path`={str(path)!r} is not a safetensors cache file written by `save`: {e}") from e
    mask = tensors.pop("__attention_mask__", None)
    lengths = tensors.pop("__prompt_lengths__", None)
    aliases = _read_meta(meta, "aliases", "{}", path)
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CacheFileError(f"{str(path)!r}: metadata `aliases` must map names to names, got {aliases!r}.")
    for name, target in aliases.items():
        if target not in tensors:
            raise CacheFileError(f"{str(path)!r}: metadata alias {name!r} -> {target!r} names no stored tensor.")
        tensors[name] = tensors[target]
    has_batch_dim = _read_meta(meta, "has_batch_dim", "true", path)
    if not isinstance(has_batch_dim, bool):
        raise CacheFileError(f"{str(path)!r}: metadata `has_batch_dim` must be true or false, got {has_batch_dim!r}.")
    return {"tensors": tensors, "attention_mask": mask, "prompt_lengths": lengths, "has_batch_dim": has_batch_dim}


def _read_meta(meta: dict[str, str], key: str, default: str, path: Path) -> Any:
    try:
        return json.loads(meta.get(key, default))
    except json.JSONDecodeError as e:
        raise CacheFileError(f"{str(path)!r}: metadata `{key}` is not valid JSON ({e}).") from e
