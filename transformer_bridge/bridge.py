"""`TransformerBridge`: the public class. The core bridge (`BridgeCore`: wrap, tokens, forward, hooks,
caches) plus thin methods over the function packages below it: `generation.generate`,
`relevance.forward_pass` / `relevance.relevance`, and the TransformerLens-compatible surface in
`compat/`. Every import points down: nothing below imports this module.
"""

from .compat.components import Components
from .compat.tokens import TokenHelpers
from .compat.weights import WeightProperties
from .core import BridgeConfig, BridgeCore
from .generation import generate as _generate
from .generation import generate_stream as _generate_stream
from .generation.hf_generate import hf_generate as _hf_generate
from .relevance import forward_pass as _forward_pass
from .relevance import relevance as _relevance
from .steering import steer as _steer

__all__ = ["BridgeConfig", "TransformerBridge"]


class TransformerBridge(Components, TokenHelpers, WeightProperties, BridgeCore):
    """Wrap a HF causal LM: TransformerLens-named hook points, caches, hooked generation, relevance.

    With no hook registered the model runs its own code: logits are bitwise those of the HF model.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig
        >>> model = TransformerBridge.from_config(LlamaConfig(vocab_size=99, hidden_size=32,
        ...     intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> logits, cache = model.run_with_cache(torch.tensor([[1, 2, 3]]))
        >>> cache["resid_post", 1].shape
        torch.Size([1, 3, 32])
    """

    generate = _generate
    generate_stream = _generate_stream
    hf_generate = _hf_generate
    forward_pass = _forward_pass
    relevance = _relevance
    steer = _steer
