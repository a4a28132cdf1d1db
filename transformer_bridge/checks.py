"""Small argument checks shared by every layer (nothing here imports from the package)."""

from typing import Any

import torch


def describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"


def check_device(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"`device`={device!r} is not a valid torch device (e.g. 'cpu', 'cuda', 'cuda:0').") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device`={device!r} asks for CUDA, but no CUDA device is available here; use 'cpu'.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"`device`={device!r}: only {torch.cuda.device_count()} CUDA device(s) exist.")
    return dev
