"""Architecture adapters: one declarative record per HF family."""

from .base import Adapter
from .gemma2 import GEMMA2
from .gpt2 import GPT2
from .gpt_neox import GPT_NEOX
from .llama import LLAMA, QWEN3
from .opt import OPT
from .phi3 import PHI3

ADAPTERS: tuple[Adapter, ...] = (GPT2, LLAMA, QWEN3, GEMMA2, GPT_NEOX, PHI3, OPT)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for a in ADAPTERS for t in a.model_types)


class UnsupportedArchitectureError(ValueError):
    """The model's family has no adapter."""


def adapter_for(model_type: str) -> Adapter:
    """The adapter for a ``config.model_type``; raises `UnsupportedArchitectureError` otherwise."""
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise UnsupportedArchitectureError(
        f"Unsupported architecture: config.model_type={model_type!r}. Supported families: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}. Adding one is a short file in transformer_bridge/adapters/."
    )


__all__ = ["ADAPTERS", "SUPPORTED_MODEL_TYPES", "Adapter", "UnsupportedArchitectureError", "adapter_for"]
