"""transformer-bridge: TransformerLens-named hook points on unmodified HuggingFace decoder models."""

from . import patching
from .activations import ActivationStore, harvest
from .adapters import SUPPORTED_MODEL_TYPES, UnsupportedArchitectureError
from .bridge import BridgeConfig, TransformerBridge
from .cache.activation_cache import ActivationCache, CacheFileError, get_act_name
from .compat.hooked_root import HookedRootModule
from .compat.kv_cache import TransformerLensKeyValueCache
from .core import BridgeCore
from .generation import Branch, GenerationOutput, View, sample
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
    "GenerationOutput",
    "HookContext",
    "HookHandle",
    "HookPoint",
    "HookedRootModule",
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
    "get_act_name",
    "harvest",
    "patching",
    "sample",
]
