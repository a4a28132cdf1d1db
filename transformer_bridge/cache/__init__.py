"""Caches: `ActivationCache` (hook name → tensor, TransformerLens' shorthand keys and analysis methods,
`activation_cache`), the hooks that fill it during a forward (`caching`), its safetensors file (`storage`),
position selections (`pos_slice`), and the analyses behind its methods: the residual decomposition
(`decompose`), residual stacks, head and neuron results (`analysis`, `heads`, `full`).

Open this folder to add a cache analysis or change how activations are stored. It may import `hooks`,
`sites` (to read which module serves a point), `adapters`, `distributed`, `utils` and the top-level `checks`,
never the core bridge, generation or relevance.
"""

from .activation_cache import ActivationCache, CacheFileError

__all__ = ["ActivationCache", "CacheFileError"]
