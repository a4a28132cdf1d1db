"""transformer-bridge: TransformerLens-named hook points on unmodified HuggingFace decoder models.

The public names are imported on first use (``from transformer_bridge import TransformerBridge`` imports the bridge,
torch and transformers then), so that ``python -m transformer_bridge --help`` answers at once.
"""

import importlib
from typing import Any

# name -> (module, attribute; None: the module itself)
_PUBLIC: dict[str, tuple[str, str | None]] = {
    "evals": (".evals", None),
    "hook_points": (".hook_points", None),
    "model_bridge": (".model_bridge", None),
    "patching": (".patching", None),
    "utilities": (".utilities", None),
    "utils": (".utils", None),
    "ActivationStore": (".activations", "ActivationStore"),
    "harvest": (".activations", "harvest"),
    "SUPPORTED_MODEL_TYPES": (".adapters", "SUPPORTED_MODEL_TYPES"),
    "UnsupportedArchitectureError": (".adapters", "UnsupportedArchitectureError"),
    "BridgeConfig": (".bridge", "BridgeConfig"),
    "TransformerBridge": (".bridge", "TransformerBridge"),
    "ActivationCache": (".cache.activation_cache", "ActivationCache"),
    "CacheFileError": (".cache.activation_cache", "CacheFileError"),
    "get_act_name": (".cache.activation_cache", "get_act_name"),
    "FactoredMatrix": (".compat.factored", "FactoredMatrix"),
    "HookedRootModule": (".compat.hooked_root", "HookedRootModule"),
    "TransformerLensKeyValueCache": (".compat.kv_cache", "TransformerLensKeyValueCache"),
    "BridgeCore": (".core", "BridgeCore"),
    "Branch": (".generation", "Branch"),
    "GenerationOutput": (".generation", "GenerationOutput"),
    "View": (".generation", "View"),
    "sample": (".generation", "sample"),
    "HookedTransformer": (".hooked_transformer", "HookedTransformer"),
    "TensorConversion": (".hooks.entries", "TensorConversion"),
    "LayerOutOfRangeError": (".hooks.names", "LayerOutOfRangeError"),
    "NotCachedError": (".hooks.names", "NotCachedError"),
    "UnknownHookError": (".hooks.names", "UnknownHookError"),
    "HookContext": (".hooks.points", "HookContext"),
    "HookHandle": (".hooks.points", "HookHandle"),
    "HookPoint": (".hooks.points", "HookPoint"),
    "Relevance": (".relevance", "Relevance"),
    "RelevanceRun": (".relevance", "RelevanceRun"),
    "StaleCompiledHooksError": (".sites.checks", "StaleCompiledHooksError"),
    "TransformerLensDifferenceWarning": (".checks", "TransformerLensDifferenceWarning"),
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _PUBLIC[name]
    value = importlib.import_module(module, __name__)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ActivationCache",
    "ActivationStore",
    "Branch",
    "BridgeConfig",
    "BridgeCore",
    "CacheFileError",
    "FactoredMatrix",
    "GenerationOutput",
    "HookContext",
    "HookHandle",
    "HookPoint",
    "HookedRootModule",
    "HookedTransformer",
    "LayerOutOfRangeError",
    "NotCachedError",
    "Relevance",
    "RelevanceRun",
    "StaleCompiledHooksError",
    "TensorConversion",
    "TransformerBridge",
    "TransformerLensDifferenceWarning",
    "TransformerLensKeyValueCache",
    "UnknownHookError",
    "UnsupportedArchitectureError",
    "View",
    "evals",
    "get_act_name",
    "harvest",
    "hook_points",
    "model_bridge",
    "patching",
    "sample",
    "utilities",
    "utils",
]
