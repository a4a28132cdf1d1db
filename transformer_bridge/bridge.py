"""`TransformerBridge`: the public class. The core bridge (`BridgeCore`: wrap, tokens, forward, hooks,
caches; its mixins `Running`, `HookRegistry`, `Tokens`) plus one mixin, `compat.TransformerLensSurface`
(TransformerLens' weights, circuits, component tree, caching hooks, token helpers, weight processing), and thin
methods over the function packages below it: `generation.generate`, `relevance.forward_pass` /
`relevance.relevance`. No method is overridden across the mixins; the few the public class refines (loading with
TransformerLens' processing keywords, copying, attribute lookup of the component tree) are defined here.
Every import points down: nothing below imports this module.
"""

from collections.abc import Iterator
from typing import Any

import torch

from .compat.surface import TransformerLensSurface
from .core import BridgeConfig, BridgeCore
from .generation import generate as _generate
from .generation import generate_stream as _generate_stream
from .generation.hf_generate import hf_generate as _hf_generate
from .hooks.steering import steer as _steer
from .relevance import forward_pass as _forward_pass
from .relevance import relevance as _relevance

__all__ = ["BridgeConfig", "TransformerBridge"]


class TransformerBridge(TransformerLensSurface, BridgeCore):
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

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # nn.Module: parameters, buffers, submodules
        except AttributeError:
            points = self.__dict__.get("hook_dict")
            if points is not None and name in points:
                return points[name]
            prop = getattr(type(self), name, None)
            if isinstance(prop, property) and prop.fget is not None:  # a property refused (`W_pos` of a rotary
                return prop.fget(self)  # model): raise its own explanation, not nn.Module's bare message
            raise

    def __setattr__(self, name: str, value: Any) -> None:
        prop = getattr(type(self), name, None) if isinstance(value, torch.nn.Module) else None  # others: no lookup
        if isinstance(prop, property) and prop.fset is None:
            # nn.Module would register the module under that name while the property still answers: refuse it
            raise AttributeError(
                f"`{name}` is read off the wrapped HF model and cannot be assigned (got {type(value).__name__}); "
                "change the HF model (`model.hf_model`) instead."
            )
        super().__setattr__(name, value)

    @property
    def n_params_total(self) -> int:
        """The HF model's parameter count as loaded, tied weights counted once (TransformerLens 4's
        ``n_params_total``): weight processing's untied unembedding and zero biases are not counted.

        Example:
            >>> model.n_params_total == sum(p.numel() for p in model.hf_model.parameters())
            True
        """
        loaded = self.__dict__.get("n_params_as_loaded")
        return loaded if loaded is not None else sum(p.numel() for p in self.hf_model.parameters())

    def tl_parameters(self) -> dict[str, Any]:
        """TransformerLens' name for `get_params`: the weights under HookedTransformer's names, TL's shapes.

        Example:
            >>> model.tl_parameters()["blocks.0.attn.W_Q"].shape   # [n_heads, d_model, d_head]
        """
        return self.get_params()

    def tl_named_parameters(self) -> Iterator[tuple[str, Any]]:
        """`tl_parameters` as ``(name, tensor)`` pairs, like ``named_parameters``.

        Example:
            >>> names = [name for name, _ in model.tl_named_parameters()]
        """
        return iter(self.get_params().items())

    def __deepcopy__(self, memo: dict) -> Any:
        new = super().__deepcopy__(memo)  # type: ignore[misc]
        new.weight_processing = self.weight_processing
        return new

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *args: Any,
        fold_ln: bool = False,
        center_writing_weights: bool = False,
        center_unembed: bool = False,
        fold_value_biases: bool = False,
        refactor_factored_attn_matrices: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Load and wrap (see `BridgeCore.from_pretrained`); TransformerLens' processing keywords opt in to
        processed weights (`process_weights`), all False by default: the model runs as HF ships it.

        Example:
            >>> model = TransformerBridge.from_pretrained("path/to/SmolLM2", fold_ln=True, center_unembed=True)
        """
        model = super().from_pretrained(name_or_path, *args, **kwargs)  # type: ignore[misc]
        steps = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                     fold_value_biases=fold_value_biases,
                     refactor_factored_attn_matrices=refactor_factored_attn_matrices)  # fmt: skip
        if any(v is not False for v in steps.values()):
            model.process_weights(**steps)
        return model

    @classmethod
    def boot_transformers(cls, model_name: str, *args: Any, **kwargs: Any) -> Any:
        """TransformerLens 4's constructor: `from_pretrained` with TransformerLens 4's loading defaults, so that its
        scripts give its numbers: HF's eager attention (TransformerLens 4 forces it; `from_pretrained` keeps the
        model's kernel, SDPA, whose logits differ by float summation order, ~1e-5) and float32 weights. Either may
        be overridden (``attn_implementation=``, ``dtype=``); the other keywords are `from_pretrained`'s.

        Example:
            >>> model = TransformerBridge.boot_transformers("path/to/SmolLM2")
            >>> model.hf_model.config._attn_implementation
            'eager'
        """
        kwargs.setdefault("attn_implementation", "eager")
        kwargs.setdefault("dtype", torch.float32)
        return cls.from_pretrained(model_name, *args, **kwargs)
