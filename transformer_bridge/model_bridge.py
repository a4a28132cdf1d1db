"""``transformer_bridge.model_bridge``: the path of TransformerLens 4's ``from transformer_lens.model_bridge import
TransformerBridge``, so that the import keeps working when ``transformer_lens`` becomes ``transformer_bridge``.

Example:
    >>> from transformer_bridge.model_bridge import TransformerBridge
    >>> import transformer_bridge
    >>> TransformerBridge is transformer_bridge.TransformerBridge
    True
"""

from .bridge import BridgeConfig, TransformerBridge

__all__ = ["BridgeConfig", "TransformerBridge"]
