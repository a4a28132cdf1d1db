"""Module paths: an adapter names HF modules by dotted paths; `get_module` resolves them (failing loudly, naming
the missing part, when a transformers release renamed one)."""

from torch import nn


def optional_module(block: nn.Module, path: str | None, may_be_absent: bool = False) -> nn.Module | None:
    """The module at ``path``, or None when the adapter names none or the block holds None there (StableLM's
    ``post_attention_layernorm`` in parallel blocks). ``may_be_absent``: the block may also lack the attribute
    (Falcon's parallel blocks); otherwise a missing attribute is a missing module (`MissingModuleError`)."""
    if path is None:
        return None
    head, _, last = path.rpartition(".")
    parent = get_module(block, head) if head else block
    if not hasattr(parent, last):
        if may_be_absent:
            return None
        get_module(block, path)  # raises, naming what is missing
    return getattr(parent, last)


class MissingModuleError(AttributeError):
    """A module path an adapter names does not exist on the model (a transformers release renamed it)."""


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The module at a dotted ``path`` under ``root`` (digits index module lists); `MissingModuleError`
    naming the path and the missing part otherwise.

    Example:
        >>> get_module(model.hf_model, "model.layers.0.self_attn.q_proj")
    """
    module = root
    for part in path.split("."):
        try:
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        except (AttributeError, IndexError, TypeError) as e:
            raise MissingModuleError(
                f"{type(root).__name__} has no module `{path}`: {type(module).__name__} has no `{part}`"
            ) from e
    return module
