"""`from_pretrained`'s loader options (TransformerLens' ``boot_transformers`` / ``from_pretrained`` keywords):
``n_ctx`` (the context length, written to the HF config's own field), ``hf_config_overrides`` (HF config fields)
and ``load_weights=False`` (the checkpoint's architecture, randomly initialised)."""

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .adapters import adapter_for
from .checks import describe


def check_local_folder(name_or_path: object) -> None:
    """A name that can only be a local path (absolute, ``./``, ``../``, ``~``, or more than one ``/``: a hub id is
    ``org/name``) must be a folder; HF would report a missing one as a malformed repo id.

    Example:
        >>> check_local_folder("HuggingFaceTB/SmolLM2-135M-Instruct")   # a hub id: HF decides
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        return
    text = os.fspath(name_or_path)
    if not isinstance(text, str):
        return
    path = Path(text).expanduser()
    if not (path.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text):
        return
    if path.is_file():
        raise FileNotFoundError(
            f"`name_or_path`={text!r} is a file, not a folder: pass the folder that holds it (for a GGUF file, the "
            f"folder and `gguf_file=`: `from_pretrained({str(path.parent)!r}, gguf_file={path.name!r})`)."
        )
    if not path.is_dir():
        missing = next((p for p in [path, *path.parents] if p.exists()), None)
        hint = f" (the closest folder that exists is {str(missing)!r})" if missing is not None else ""
        raise FileNotFoundError(
            f"`name_or_path`={text!r}: no such folder{hint}. Give the folder of a saved HF model (its config.json "
            "and weights), or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct' already in the HF cache."
        )


# What `AutoConfig.from_pretrained` shares with the model's own loading.
_CONFIG_KEYWORDS = ("gguf_file", "revision", "trust_remote_code", "cache_dir", "local_files_only", "token")


def loader_config(
    name_or_path: str,
    n_ctx: int | None,
    hf_config_overrides: Mapping[str, Any] | None,
    load_weights: bool,
    hf_kwargs: Mapping[str, Any],
) -> PretrainedConfig | None:
    """The HF config the loader options ask for, or None when none is given (HF's own loading then).

    ``n_ctx`` goes to ``max_position_embeddings`` (each config maps it to its own field: GPT-2's
    ``n_positions``) and wins over ``hf_config_overrides`` for that field; a checkpoint with learned position
    embeddings keeps its length when its weights are loaded (HF could not load a table of another size).

    Example:
        >>> config = loader_config("path/to/SmolLM2", 4096, None, True, {})
        >>> config.max_position_embeddings
        4096
    """
    if not isinstance(load_weights, bool):
        raise TypeError(f"`load_weights` must be True or False, got {describe(load_weights)}.")
    if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0):
        raise ValueError(f"`n_ctx` must be a positive integer (a context length), got {describe(n_ctx)}.")
    if hf_config_overrides is not None and (
        not isinstance(hf_config_overrides, Mapping) or not all(isinstance(k, str) for k in hf_config_overrides)
    ):
        raise TypeError(
            f"`hf_config_overrides` must be a dict of HF config fields, got {describe(hf_config_overrides)}."
        )
    loading_only = sorted(k for k in hf_kwargs if k not in _CONFIG_KEYWORDS)
    if not load_weights and loading_only:
        raise ValueError(
            f"`load_weights=False` builds the model from its config; {loading_only} load weights. Drop them, or "
            "load the weights."
        )
    if n_ctx is None and not hf_config_overrides and load_weights:
        return None
    shared = {k: v for k, v in hf_kwargs.items() if k in _CONFIG_KEYWORDS}
    overrides = dict(hf_config_overrides or {})
    # HF's own reading of config keywords (`attn_implementation` included); the ones no field takes come back.
    config, unused = AutoConfig.from_pretrained(name_or_path, return_unused_kwargs=True, **shared, **overrides)
    if unused:
        raise ValueError(
            f"`hf_config_overrides` names {sorted(unused)}, no field of {type(config).__name__}; fields include "
            f"{sorted(config.to_dict())[:8]}."
        )
    if n_ctx is not None:
        _set_n_ctx(config, n_ctx, hf_config_overrides or {}, load_weights)
    return config


def _set_n_ctx(config: PretrainedConfig, n_ctx: int, overrides: Mapping[str, Any], load_weights: bool) -> None:
    if "max_position_embeddings" not in config.to_dict() and "max_position_embeddings" not in getattr(
        config, "attribute_map", {}
    ):
        raise ValueError(f"`n_ctx`={n_ctx}: {type(config).__name__} has no context length to set.")
    field = config.attribute_map.get("max_position_embeddings", "max_position_embeddings")
    for key in {field, "max_position_embeddings"} & set(overrides):
        if overrides[key] != n_ctx:
            warnings.warn(
                f"Both n_ctx={n_ctx} and hf_config_overrides[{key!r}]={overrides[key]!r} set the context length; "
                "n_ctx takes precedence.",
                stacklevel=3,
            )
    default = config.max_position_embeddings
    if n_ctx != default and load_weights and adapter_for(config.model_type).pos_embed is not None:
        raise RuntimeError(
            f"n_ctx={n_ctx}: this checkpoint has {default} learned positional embeddings, one per position, and "
            f"its weights cannot load into a table of {n_ctx}. Keep n_ctx={default} (and pass shorter inputs), or "
            "give `load_weights=False` for a randomly initialised model of that length."
        )
    if n_ctx > default:
        warnings.warn(
            f"n_ctx={n_ctx} is larger than the model's default context length {default}: positions past it were "
            "not seen in training.",
            stacklevel=3,
        )
    config.max_position_embeddings = n_ctx
