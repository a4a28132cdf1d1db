"""The bridge's hook names, hooks, caches and per-request interventions inside a vLLM engine.

Needs the ``[vllm]`` extra (``pip install 'transformer-bridge[vllm]'``). Everything the bridge knows about vLLM's
internals is in `internals`; the supported releases are ``internals.TESTED_RANGE``.

Example:
    >>> from transformer_bridge.vllm import VLLMBridge, Intervention
    >>> model = VLLMBridge.from_pretrained(path, enforce_eager=True, dtype="float32")
    >>> logits, cache = model.run_with_cache([[1, 5, 7, 9]], names_filter="resid_post")
"""

from .bridge import CompiledEngineError, VLLMBridge, VLLMConfig, VLLMGeneration
from .internals import TESTED_RANGE, VLLMInternalsError
from .interventions import Intervention
from .naming import FusedPointError
from .options import UnsupportedOptionError
from .worker import RequestContext

__all__ = [
    "TESTED_RANGE",
    "CompiledEngineError",
    "FusedPointError",
    "Intervention",
    "RequestContext",
    "UnsupportedOptionError",
    "VLLMBridge",
    "VLLMConfig",
    "VLLMGeneration",
    "VLLMInternalsError",
]
