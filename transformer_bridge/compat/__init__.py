"""The TransformerLens-compatible surface over the core bridge: `TransformerLensSurface` (the one mixin of the
public class) and the modules doing its work.

It is a layer over the core bridge: it may import the core, `cache`, `hooks`, `sites`, `adapters` and `distributed`;
only `bridge.py` mixes it into the public class.
"""

from .components import Blocks, ComponentView
from .dla_tool import DirectLogitAttribution, direct_logit_attribution
from .hooked_root import HookedRootModule
from .kv_cache import TransformerLensKeyValueCache, TransformerLensKeyValueCacheEntry
from .surface import TransformerLensSurface
from .weights import WeightNotAvailableError

__all__ = [
    "Blocks",
    "ComponentView",
    "DirectLogitAttribution",
    "HookedRootModule",
    "TransformerLensKeyValueCache",
    "TransformerLensKeyValueCacheEntry",
    "TransformerLensSurface",
    "WeightNotAvailableError",
    "direct_logit_attribution",
]
