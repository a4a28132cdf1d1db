"""transformer-bridge: TransformerLens-named hook points on unmodified HuggingFace decoder models.

The public names are imported on first use (``from transformer_bridge import TransformerBridge`` imports the bridge,
torch and transformers then), so that ``python -m transformer_bridge --help`` answers at once.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
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


# TransformerLens' upper-case module paths (``from transformer_lens.HookedRootModule import HookedRootModule``), each
# the module here that defines the name: imported on first use like the names above.
_MODULE_PATHS: dict[str, str] = {
    "ActivationCache": ".cache.activation_cache",
    "FactoredMatrix": ".compat.factored",
    "HookedRootModule": ".compat.hooked_root",
    "HookedTransformer": ".hooked_transformer",
}


class _ModulePaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``transformer_bridge.<upper-case TL module>`` as the module here that defines that name."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for one of `_MODULE_PATHS` under this package; None for every other name."""
        package, _, child = fullname.rpartition(".")
        if package != __name__ or child not in _MODULE_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        """The defining module itself (its own ``__name__`` and ``__spec__`` kept)."""
        return importlib.import_module(_MODULE_PATHS[spec.name.rpartition(".")[2]], __name__)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing: the defining module ran when it was imported."""


class _Package(types.ModuleType):
    """This package's module type: importing an upper-case module path leaves the package's attribute of that name
    the class, as in TransformerLens (``transformer_bridge.HookedRootModule`` is the class, not the module)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MODULE_PATHS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


if not any(isinstance(f, _ModulePaths) for f in sys.meta_path):
    sys.meta_path.append(_ModulePaths())
sys.modules[__name__].__class__ = _Package


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
