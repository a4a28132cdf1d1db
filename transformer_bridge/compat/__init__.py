"""The TransformerLens-compatible surface, as small modules over the core bridge."""

from .weights import WeightNotAvailableError, WeightProperties

__all__ = ["WeightNotAvailableError", "WeightProperties"]
