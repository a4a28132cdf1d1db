"""The TransformerLens-compatible surface, as small modules over the core bridge."""

from .components import Blocks, Components, ComponentView
from .weights import WeightNotAvailableError, WeightProperties

__all__ = ["Blocks", "ComponentView", "Components", "WeightNotAvailableError", "WeightProperties"]
