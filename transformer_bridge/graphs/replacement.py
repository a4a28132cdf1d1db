"""The replacement model, as hooks on the bridge's points (no module paths, so every wrapped family works).

Freezing is a hook that detaches: every attention pattern (``blocks.L.attn.hook_pattern``, which holds soft-capping,
sinks and windows) and every normalisation scale the bridge serves (``*.hook_scale``: ln1 / ln2, Gemma's sandwich
norms, q / k norms, latent-attention norms, the embedding norm, the final norm). With both frozen, each block is
linear in the residual stream apart from its MLP, and the MLP output point is replaced by the transcoders'
reconstruction plus a detached error, which equals the MLP's output.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor

from .transcoders import TranscoderSet

Hook = tuple[str, Callable]


def frozen_points(model) -> list[str]:
    """The points whose values the replacement model holds fixed: attention patterns and norm scales."""
    return [name for name in model.hook_dict if name.endswith(("attn.hook_pattern", "hook_scale"))]


def freeze_hooks(model) -> list[Hook]:
    """Hooks that detach every frozen point (gradients then treat it as a constant)."""
    return [(name, lambda x, hook: x.detach()) for name in frozen_points(model)]


def check_points(model, tc: TranscoderSet) -> None:
    """Raise unless ``tc`` fits ``model``: one layer each, the same width, every point served."""
    names = model.hook_dict
    mixers = [layer for layer in range(model.cfg.n_layers) if f"blocks.{layer}.attn.hook_pattern" not in names]
    if mixers:  # a state-space or convolution mixer has no pattern to freeze: the model would not be linear
        raise ValueError(f"{model.cfg.model_type}: layers {mixers} have no attention pattern to freeze; graphs need "
                         "attention in every layer (state-space and hybrid models are not supported)")  # fmt: skip
    if tc.n_layers != model.cfg.n_layers or tc.d_model != model.cfg.d_model:
        raise ValueError(
            f"`transcoders` have {tc.n_layers} layers of width {tc.d_model}; the model has {model.cfg.n_layers} of "
            f"{model.cfg.d_model}"
        )
    for layer in range(tc.n_layers):
        for name in (tc.input_point(layer), tc.output_point(layer)):
            if name not in model.hook_dict:
                raise ValueError(f"the transcoders' point {name!r} is not a hook point of this {model.cfg.model_type}")


@dataclass
class ReplacementState:
    """What the replacement hooks saw in the last forward: inputs, feature activations and errors per layer."""

    inputs: dict[int, Tensor] = field(default_factory=dict)
    acts: dict[int, Tensor] = field(default_factory=dict)
    errors: dict[int, Tensor] = field(default_factory=dict)
    outputs: dict[int, Tensor] = field(default_factory=dict)


def replacement_hooks(
    model, tc: TranscoderSet, *, errors: bool = True, freeze: bool = True, skip_positions: int = 0
) -> tuple[list[Hook], ReplacementState]:
    """Hooks that turn the bridge into the replacement model, and the state they fill.

    Each MLP output becomes ``reconstruction + (mlp_out - reconstruction).detach()`` (``errors=False``: the
    reconstruction alone); features of the first ``skip_positions`` positions are not used (their whole MLP
    output is error). With ``errors=True`` the forward equals the model's (up to rounding).

    Example:
        >>> hooks, state = replacement_hooks(model, tc)
        >>> with model.hooks(fwd_hooks=hooks):
        ...     logits = model(tokens)                           # == model(tokens) up to rounding
    """
    check_points(model, tc)
    state = ReplacementState()

    def read(x, hook, layer):
        acts = tc.encode(x.to(tc.W_enc.dtype), layer)
        acts[:, :skip_positions] = 0
        state.inputs[layer], state.acts[layer] = x, acts

    def write(out, hook, layer):
        x = state.inputs[layer]
        recon = tc.reconstruct([state.acts[i] for i in range(layer + 1)], x.to(tc.W_enc.dtype), layer).to(out.dtype)
        state.errors[layer] = (out - recon).detach()
        state.outputs[layer] = out.detach()
        return recon + state.errors[layer] if errors else recon

    hooks = freeze_hooks(model) if freeze else []
    for layer in range(tc.n_layers):
        hooks.append((tc.input_point(layer), lambda x, hook, layer=layer: read(x, hook, layer)))
        hooks.append((tc.output_point(layer), lambda x, hook, layer=layer: write(x, hook, layer)))
    return hooks, state


def replacement_logits(
    model, tokens: Tensor, tc: TranscoderSet, *, errors: bool = True
) -> Float[Tensor, "batch pos d_vocab"]:
    """Logits of the replacement model (frozen attention and norms, MLPs replaced by ``tc``).

    Example:
        >>> torch.testing.assert_close(replacement_logits(model, tokens, tc), model(tokens))
    """
    hooks, _ = replacement_hooks(model, tc, errors=errors)
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        return model(tokens)
