"""transformer-bridge: TransformerLens-named hook points on unmodified HuggingFace decoder models."""

from . import evals, hook_points, model_bridge, patching, utilities, utils
from .activations import ActivationStore, harvest
from .adapters import SUPPORTED_MODEL_TYPES, UnsupportedArchitectureError
from .bridge import BridgeConfig, TransformerBridge
from .cache.activation_cache import ActivationCache, CacheFileError, get_act_name
from .compat.factored import FactoredMatrix
from .compat.hooked_root import HookedRootModule
from .compat.kv_cache import TransformerLensKeyValueCache
from .core import BridgeCore
from .generation import Branch, GenerationOutput, View, sample
from .hooked_transformer import HookedTransformer
from .hooks.entries import TensorConversion
from .hooks.names import LayerOutOfRangeError, NotCachedError, UnknownHookError
from .hooks.points import HookContext, HookHandle, HookPoint
from .relevance import Relevance, RelevanceRun
from .sites.checks import StaleCompiledHooksError

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
