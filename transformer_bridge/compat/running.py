"""TransformerLens' name for the wrapped model (``original_model``) and its ``set_use_attn_result`` switch.

(TransformerLens' ``run_with_cache`` keywords are the core's own: `running.Running.run_with_cache`.)
"""

from typing import Literal

from torch import nn

from ..checks import check_bool
from ..core import BridgeCore

ReturnType = Literal["logits", "loss", "both"] | None


class RunCompat:
    """Mixin: ``original_model`` and ``set_use_attn_result``."""

    @property
    def original_model(self: BridgeCore) -> nn.Module:
        """TransformerLens' name for the wrapped HF model: the same object as ``model.hf_model``.

        Example:
            >>> model.original_model is model.hf_model
            True
        """
        return self.hf_model

    def set_use_attn_result(self: BridgeCore, use_attn_result: bool) -> None:
        """TransformerLens' switch for ``blocks.L.attn.hook_result``. Here the point is computed whenever it is
        hooked or cached (from ``hook_z`` and the output projection), so either value leaves the model as it is:
        ``True`` is what the bridge always does, and with ``False`` an unhooked, uncached point costs nothing.

        Example:
            >>> model.set_use_attn_result(True)
            >>> _, cache = model.run_with_cache("Hi")
            >>> cache["result", 0].shape   # [batch, pos, head, d_model]
        """
        check_bool("use_attn_result", use_attn_result)
        self.cfg.use_attn_result = use_attn_result  # TransformerLens' cfg field, which reads it back
