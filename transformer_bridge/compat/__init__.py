"""The TransformerLens-compatible surface over the core bridge: `TransformerLensSurface` (the one mixin of the
public class) and the modules doing its work."""

from .components import Blocks, ComponentView
from .kv_cache import TransformerLensKeyValueCache, TransformerLensKeyValueCacheEntry
from .surface import TransformerLensSurface
from .weights import WeightNotAvailableError

__all__ = [
    "Blocks",
    "ComponentView",
    "TransformerLensKeyValueCache",
    "TransformerLensKeyValueCacheEntry",
    "TransformerLensSurface",
    "WeightNotAvailableError",
]
