"""`HookedTransformer`: TransformerLens' class name, bound to the bridge, so that a TransformerLens script whose
``transformer_lens`` became ``transformer_bridge`` loads the same weights TransformerLens would run.

TransformerLens' ``HookedTransformer.from_pretrained`` processes the weights by default (``fold_ln``,
``center_writing_weights``, ``center_unembed``, ``fold_value_biases``), so this one does too; everything else is
`TransformerBridge`'s, whose own ``from_pretrained`` keeps the weights as HF ships them.
``from_pretrained_no_processing`` loads them unprocessed, as in TransformerLens. Likewise ``generate`` samples by
default, from the whole distribution at temperature 1, as TransformerLens' does (`TransformerBridge.generate` is
greedy unless asked, as HF's); any sampling argument given is used as it is.
"""

import functools
from typing import Any

from .bridge import TransformerBridge

__all__ = ["HookedTransformer"]


class HookedTransformer(TransformerBridge):
    """A `TransformerBridge` whose ``from_pretrained`` processes the weights as TransformerLens' does.

    Example:
        >>> model = HookedTransformer.from_pretrained("path/to/SmolLM2")        # folded and centred, as in TL
        >>> model.weight_processing.applied
        ('fold_ln', 'center_unembed', 'fold_value_biases')
        >>> raw = HookedTransformer.from_pretrained_no_processing("path/to/SmolLM2")   # HF's weights
    """

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *args: Any,
        fold_ln: bool = True,
        center_writing_weights: bool = True,
        center_unembed: bool = True,
        fold_value_biases: bool = True,
        refactor_factored_attn_matrices: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Load, wrap and process as TransformerLens' ``HookedTransformer.from_pretrained`` (see
        `TransformerBridge.from_pretrained` for the loading keywords)."""
        return super().from_pretrained(
            name_or_path,
            *args,
            fold_ln=fold_ln,
            center_writing_weights=center_writing_weights,
            center_unembed=center_unembed,
            fold_value_biases=fold_value_biases,
            refactor_factored_attn_matrices=refactor_factored_attn_matrices,
            **kwargs,
        )

    @functools.wraps(TransformerBridge.generate)
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        # TransformerLens' defaults, each where the call does not set it: sampling over the whole distribution
        # (top_k / top_p off, temperature 1), also when only some sampling arguments are given (`temperature=0.7`
        # must not bring in HF's top-k of 50). Greedy decoding and a caller's generation config are left alone.
        if kwargs.get("do_sample") is not False and kwargs.get("generation_config") is None:
            kwargs = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0, **kwargs}
        return super().generate(*args, **kwargs)

    @classmethod
    def from_pretrained_no_processing(cls, name_or_path: str, *args: Any, **kwargs: Any) -> Any:
        """Load and wrap with the weights as HF ships them (TransformerLens' name for it)."""
        steps = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
        return super().from_pretrained(name_or_path, *args, **{**dict.fromkeys(steps, False), **kwargs})
