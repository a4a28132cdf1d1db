"""Activation functions by TransformerLens' names (``cfg.act_fn`` values) and Gemma's soft-cap, for
reimplementing or checking an MLP or a logit by hand."""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

ActivationFunction = Callable[..., Tensor]
SOFTCAP_DISABLED: float = -1.0


def gelu_new(input: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
    """GPT-2's GELU, the tanh approximation written out as GPT-2 computes it (HF's ``gelu_new``).

    Example:
        >>> gelu_new(torch.tensor([0.0, 1.0]))
        tensor([0.0000, 0.8412])
    """
    return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


def gelu_fast(input: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
    """The tanh approximation of GELU with its constant rounded (HF's ``gelu_fast``).

    Example:
        >>> gelu_fast(torch.tensor([0.0, 1.0]))
        tensor([0.0000, 0.8412])
    """
    return 0.5 * input * (1.0 + torch.tanh(input * 0.7978845608 * (1.0 + 0.044715 * input * input)))


def gelu_pytorch_tanh(input: Tensor) -> Tensor:
    """PyTorch's tanh-approximated GELU (HF's ``gelu_pytorch_tanh``, Gemma's).

    Example:
        >>> gelu_pytorch_tanh(torch.tensor([0.0]))
        tensor([0.])
    """
    return F.gelu(input, approximate="tanh")


def solu(input: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
    """SoLU, ``x * softmax(x)`` over the neurons (the layer norm after it belongs to the MLP).

    Example:
        >>> solu(torch.tensor([0.0, 0.0]))
        tensor([0., 0.])
    """
    return input * F.softmax(input, dim=-1)


def xielu(input: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
    """xIELU with its default parameters (alpha_p = alpha_n = 0.8, beta = 0.5, eps = -1e-6).

    Example:
        >>> xielu(torch.tensor([1.0]))
        tensor([1.3000])
    """
    alpha_p, alpha_n, beta = 0.8, 0.8, 0.5
    negative = (torch.expm1(torch.clamp_max(input, -1e-6)) - input) * alpha_n + beta * input
    return torch.where(input > 0, alpha_p * input * input + beta * input, negative)


def relu2(input: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
    """Squared ReLU, ``relu(x) ** 2`` (HF's ``relu2``).

    Example:
        >>> relu2(torch.tensor([-1.0, 3.0]))
        tensor([0., 9.])
    """
    positive = F.relu(input)
    return positive * positive


SUPPORTED_ACTIVATIONS: dict[str, ActivationFunction] = {
    "solu": solu,
    "solu_ln": solu,
    "gelu_new": gelu_new,
    "gelu_fast": gelu_fast,
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": gelu_pytorch_tanh,
    "xielu": xielu,
    "relu2": relu2,
}
"""TransformerLens' activation functions by name (``cfg.act_fn``)."""


def softcap_enabled(cap: float | None) -> bool:
    """Whether ``cap`` turns a soft-cap on: only a positive number does (None, 0 and -1.0 mean off).

    Example:
        >>> softcap_enabled(30.0), softcap_enabled(SOFTCAP_DISABLED), softcap_enabled(None)
        (True, False, False)
    """
    return cap is not None and cap > 0


def apply_softcap(x: Tensor, cap: float | None) -> Tensor:
    """Gemma's soft-cap ``cap * tanh(x / cap)`` when ``cap`` is on, ``x`` unchanged otherwise. Gemma 2's final
    logits: ``apply_softcap(lens_logits, model.hf_model.config.final_logit_softcapping)``.

    Example:
        >>> apply_softcap(torch.tensor([100.0]), 30.0)
        tensor([29.9237])
    """
    return cap * torch.tanh(x / cap) if softcap_enabled(cap) else x
