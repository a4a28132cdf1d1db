"""The TransformerLens-compatible surface, as small modules over the core bridge."""

from .components import Blocks, Components, ComponentView
from .kv_cache import TransformerLensKeyValueCache, TransformerLensKeyValueCacheEntry
from .weights import WeightNotAvailableError, WeightProperties

__all__ = [
    "Blocks",
    "ComponentView",
    "Components",
    "TransformerLensKeyValueCache",
    "TransformerLensKeyValueCacheEntry",
    "WeightNotAvailableError",
    "WeightProperties",
]
