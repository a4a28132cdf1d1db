"""TransformerLens weight names and shapes over the HF parameters (``W_Q`` … ``W_U``).

Two levels, as in TransformerLens:

* **Per layer** — ``W_Q(core, layer)`` and friends, plain functions over a `BridgeCore`. They return
  **views** of the HF parameters wherever the layout allows (every family's Q/K/V/O and MLP matrices
  and existing biases, fused ones included: GPT-2's Conv1D ``c_attn``, GPT-NeoX's per-head
  ``query_key_value``, Phi-3's ``qkv_proj`` and ``gate_up_proj``), so editing one in place (under
  ``torch.no_grad()``: they are parameters) edits the model. Fresh tensors, not views: the zeros for a
  bias the family does not have, and ``W_K`` / ``W_V`` / ``b_K`` / ``b_V`` of a GQA model asked for with
  ``kv_heads=False``, whose kv heads are then repeated to ``n_heads``. By default a GQA model's ``W_K`` /
  ``W_V`` / ``b_K`` / ``b_V`` are over its ``n_kv_heads`` key/value heads, as in TransformerLens 4
  (``_W_K`` … are the same); query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``.
* **Stacked** — the `WeightProperties` mixin of `TransformerBridge`: ``model.W_Q`` is
  ``[layer, head, d_model, d_head]``, a **copy** (``torch.stack``) that still carries gradients.

The unembedding follows TransformerLens' folded numbers: ``W_U = diag(γ) @ W_U_raw`` and
``b_U = β @ W_U_raw + b_U_raw`` (γ, β: the final norm's weight and bias; Gemma's γ is ``1 + w``), so
``cache.accumulated_resid(apply_ln=True)[-1] @ model.W_U + model.b_U`` are the model's logits (Gemma 2:
before the final soft-cap). ``W_U_raw`` / ``b_U_raw`` are the HF unembedding itself (views; ``b_U_raw`` is
None when the model has no unembedding bias). TransformerLens 4's unprocessed bridge returns the raw matrix as
``W_U``, so where the two differ (a final norm whose γ is not 1 or whose β is not 0, a logit scale) reading
``model.W_U`` / ``model.b_U`` warns once per model (`TransformerLensDifferenceWarning`), naming ``W_U_raw``.
"""

from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..adapters.base import one_plus
from ..cache.decompose import logit_multiplier, wide
from ..checks import ArgumentIndexError, ArgumentTypeError, as_index, warn_difference_once
from ..core import BridgeCore
from ..distributed import full_param
from ..sites.module_paths import get_module
from ..sites.moe import is_moe_block

__all__ = [
    "ATTN_WEIGHTS",
    "MLP_WEIGHTS",
    "W_E",
    "W_K",
    "W_O",
    "W_Q",
    "W_U",
    "W_V",
    "W_U_raw",
    "W_gate",
    "W_in",
    "W_out",
    "W_pos",
    "WeightNotAvailableError",
    "b_K",
    "b_O",
    "b_Q",
    "b_U",
    "b_U_raw",
    "b_V",
    "b_in",
    "b_out",
]


class WeightNotAvailableError(ValueError, AttributeError):
    """The model has no such weight (e.g. ``W_pos`` of a rotary model).

    An `AttributeError` (``hasattr(model, "W_pos")`` is False, as in TransformerLens) and, as before, a
    `ValueError`; the bridge re-raises it with its explanation where `torch.nn.Module` would replace it with a
    bare "has no attribute" (`TransformerBridge.__getattr__`).
    """


# -- helpers ----------------------------------------------------------------------------------------
def _block(core: BridgeCore, layer: int) -> nn.Module:
    n = core.cfg.n_layers
    index = as_index(layer)
    if index is None:
        raise ArgumentTypeError(f"`layer` must be an int, got {type(layer).__name__} {layer!r}.")
    layer = index
    if not -n <= layer < n:
        raise ArgumentIndexError(
            f"`layer`={layer} is out of range; this model has {n} layers, so use 0..{n - 1} (or -{n}..-1)."
        )
    return get_module(core.hf_model, core.adapter.blocks)[layer]


def _dense_mlp_block(core: BridgeCore, layer: int) -> nn.Module:
    """Block ``layer``, which must have a dense MLP: a mixture of experts has no single ``W_in`` / ``W_out``."""
    block = _block(core, layer)
    if is_moe_block(block, core.adapter.moe):
        raise ValueError(
            f"`layer`={layer} is a mixture-of-experts block of this {core.cfg.model_type!r} model: it has no single "
            "W_in / W_gate / W_out / b_in / b_out. Each expert's weights are in the HF experts module "
            f"(`model.hf_model.{core.adapter.blocks}[{layer}].{core.adapter.moe.experts}`); see docs/hook_points.md."
        )
    return block


def _in_out(core: BridgeCore, module: nn.Module) -> Float[Tensor, "d_in d_out"]:
    """The module's weight as ``[in, out]`` (a view): Conv1D stores it so, ``nn.Linear`` as ``[out, in]``."""
    w = full_param(module)  # whole under tensor parallelism or offload (then a copy, not a view)
    return w if core.adapter.conv1d else w.T


def _bias(module: nn.Module) -> Tensor | None:
    return full_param(module, "bias")


def _zeros(like: Tensor, *shape: int) -> Tensor:
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _qkv(core: BridgeCore, layer: int, which: Literal["q", "k", "v"]) -> tuple[Tensor, Tensor | None]:
    """``(weight [n, d_model, d_head], bias [n, d_head] or None)`` of one of Q, K, V: views, n its heads."""
    a, c = core.adapter, core.cfg
    block = _block(core, layer)
    if a.mla:
        raise ValueError(
            f"This {c.model_type!r} model uses multi-head latent attention: queries go through a low-rank "
            "projection and a norm, keys and values are expanded from a compressed latent, so there is no "
            "W_Q / W_K / W_V / b_Q / b_K / b_V. W_O and b_O exist; see docs/families.md."
        )
    n = c.n_heads if which == "q" else c.n_kv_heads
    if a.qkv is None:
        module = get_module(block, getattr(a, which))
        w, b = _in_out(core, module), _bias(module)
    else:
        module = get_module(block, a.qkv)
        fused, fused_b = _in_out(core, module), _bias(module)
        index = "qkv".index(which)
        if a.qkv_layout == "per_head":  # [head, q|k|v, d_head] along the output features
            w = fused.view(c.d_model, c.n_heads, 3, c.d_head)[:, :, index].transpose(0, 1)
            b = None if fused_b is None else fused_b.view(c.n_heads, 3, c.d_head)[:, index]
            return w, b
        start = 0 if which == "q" else (c.n_heads + (index - 1) * c.n_kv_heads) * c.d_head
        stop = start + n * c.d_head
        w, b = fused[:, start:stop], None if fused_b is None else fused_b[start:stop]
    w = w.view(c.d_model, n, c.d_head).transpose(0, 1)
    return w, None if b is None else b.view(n, c.d_head)


def _repeat_kv(core: BridgeCore, t: Tensor, kv_heads: bool) -> Tensor:
    groups = core.cfg.n_heads // core.cfg.n_kv_heads
    # HF's repeat_kv: kv head j serves query heads j*groups … (j+1)*groups - 1.
    return t if kv_heads or groups == 1 else t.repeat_interleave(groups, dim=0)


def _mlp_in(core: BridgeCore, layer: int, gate: bool) -> tuple[Tensor, Tensor | None] | None:
    """``(weight [d_model, d_mlp], bias or None)`` of the gate (``gate=True``) or the input projection."""
    a, d_mlp = core.adapter, core.cfg.d_mlp
    block = _dense_mlp_block(core, layer)
    if not a.gated:
        return None if gate else (_in_out(core, m := get_module(block, a.mlp_in)), _bias(m))
    if a.fused_gate_up:  # [gate | up] along the output features, as `sites.gate_up` splits them
        m = get_module(block, a.mlp_in)
        part = slice(0, d_mlp) if gate else slice(d_mlp, 2 * d_mlp)
        b = _bias(m)
        return _in_out(core, m)[:, part], None if b is None else b[part]
    m = get_module(block, a.mlp_in if gate else a.mlp_up)  # mlp_in is the gate (hook_pre), mlp_up W_in
    return _in_out(core, m), _bias(m)


def _norm_weight_bias(core: BridgeCore, module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """A norm's effective γ (Gemma: ``1 + w``, in float32 as HF computes it) and β (None for RMS norms)."""
    w = full_param(module, "weight")
    if w is None:  # OLMo's LayerNorm has no weight
        return torch.ones(core.cfg.d_model, dtype=core.cfg.dtype, device=core.cfg.device), None
    return (1.0 + wide(w) if one_plus(core.adapter.norm) else w), _bias(module)


def _check_d_model(core: BridgeCore, t: Tensor, what: str) -> None:
    if t.shape[-1] != core.cfg.d_model:
        raise WeightNotAvailableError(
            f"`{what}`: the HF matrix has width {t.shape[-1]}, not d_model={core.cfg.d_model} (a projection between "
            "the embedding and the residual stream, as in OPT-350m, is not supported)."
        )


# -- attention (per layer) -----------------------------------------------------------------------------
def W_Q(core: BridgeCore, layer: int) -> Float[Tensor, "head d_model d_head"]:  # noqa: N802 (TransformerLens name)
    """Query weights of ``layer``: ``hook_q = normalized_input @ W_Q + b_Q`` per head. A view.

    Example:
        >>> with torch.no_grad():
        ...     W_Q(model, 0)[3] = 0.0          # zeroes head 3's queries in the model itself
    """
    return _qkv(core, layer, "q")[0]


def W_K(  # noqa: N802
    core: BridgeCore, layer: int, kv_heads: bool = True
) -> Float[Tensor, "kv_head d_model d_head"] | Float[Tensor, "head d_model d_head"]:
    """Key weights of ``layer`` over its kv heads, ``[kv_head, d_model, d_head]`` (a view), as TransformerLens 4.

    ``kv_heads=False`` repeats a GQA model's kv heads to ``n_heads`` (a copy): row ``h`` is query head ``h``'s.
    """
    return _repeat_kv(core, _qkv(core, layer, "k")[0], kv_heads)


def W_V(  # noqa: N802
    core: BridgeCore, layer: int, kv_heads: bool = True
) -> Float[Tensor, "kv_head d_model d_head"] | Float[Tensor, "head d_model d_head"]:
    """Value weights of ``layer`` over its kv heads (see `W_K`; ``kv_heads=False``: repeated to ``n_heads``)."""
    return _repeat_kv(core, _qkv(core, layer, "v")[0], kv_heads)


def b_Q(core: BridgeCore, layer: int) -> Float[Tensor, "head d_head"]:  # noqa: N802
    """Query bias of ``layer``: a view, or zeros when the family has none."""
    w, b = _qkv(core, layer, "q")
    return _zeros(w, core.cfg.n_heads, core.cfg.d_head) if b is None else b


def b_K(  # noqa: N802
    core: BridgeCore, layer: int, kv_heads: bool = True
) -> Float[Tensor, "kv_head d_head"] | Float[Tensor, "head d_head"]:
    """Key bias of ``layer`` over its kv heads like `W_K` (``kv_heads=False``: repeated; zeros if the family has
    none)."""
    w, b = _qkv(core, layer, "k")
    b = _zeros(w, core.cfg.n_kv_heads, core.cfg.d_head) if b is None else b
    return _repeat_kv(core, b, kv_heads)


def b_V(  # noqa: N802
    core: BridgeCore, layer: int, kv_heads: bool = True
) -> Float[Tensor, "kv_head d_head"] | Float[Tensor, "head d_head"]:
    """Value bias of ``layer`` over its kv heads like `W_V` (``kv_heads=False``: repeated; zeros if the family has
    none)."""
    w, b = _qkv(core, layer, "v")
    b = _zeros(w, core.cfg.n_kv_heads, core.cfg.d_head) if b is None else b
    return _repeat_kv(core, b, kv_heads)


def W_O(core: BridgeCore, layer: int) -> Float[Tensor, "head d_head d_model"]:  # noqa: N802
    """Output weights of ``layer``: ``hook_result[..., h, :] = hook_z[..., h, :] @ W_O[h]``. A view."""
    c = core.cfg
    module = get_module(_block(core, layer), core.adapter.o_proj)
    return _in_out(core, module).view(c.n_heads, c.d_head, c.d_model)


def b_O(core: BridgeCore, layer: int) -> Float[Tensor, "d_model"]:  # noqa: N802
    """Output bias of ``layer`` (added once, not per head): a view, or zeros when the family has none."""
    module = get_module(_block(core, layer), core.adapter.o_proj)
    b = _bias(module)
    return _zeros(full_param(module), core.cfg.d_model) if b is None else b


# -- MLP (per layer) -------------------------------------------------------------------------------------
def W_in(core: BridgeCore, layer: int) -> Float[Tensor, "d_model d_mlp"]:  # noqa: N802
    """MLP input weights: ``hook_pre`` (ungated) or ``hook_pre_linear`` (gated: the up projection). A view."""
    return _mlp_in(core, layer, gate=False)[0]


def b_in(core: BridgeCore, layer: int) -> Float[Tensor, "d_mlp"]:
    """Bias of `W_in`: a view, or zeros when the family has none."""
    w, b = _mlp_in(core, layer, gate=False)
    return _zeros(w, core.cfg.d_mlp) if b is None else b


def W_gate(core: BridgeCore, layer: int) -> Float[Tensor, "d_model d_mlp"] | None:  # noqa: N802
    """Gate weights of a gated MLP (``hook_pre = normalized_input @ W_gate``), a view; None when ungated."""
    found = _mlp_in(core, layer, gate=True)
    return None if found is None else found[0]


def W_out(core: BridgeCore, layer: int) -> Float[Tensor, "d_mlp d_model"]:  # noqa: N802
    """MLP output weights: ``hook_post @ W_out + b_out`` is the down projection's output. A view."""
    return _in_out(core, get_module(_dense_mlp_block(core, layer), core.adapter.mlp_down))


def b_out(core: BridgeCore, layer: int) -> Float[Tensor, "d_model"]:
    """Bias of `W_out`: a view, or zeros when the family has none."""
    module = get_module(_dense_mlp_block(core, layer), core.adapter.mlp_down)
    b = _bias(module)
    return _zeros(full_param(module), core.cfg.d_model) if b is None else b


# -- embeddings and unembedding ----------------------------------------------------------------------------
def W_E(core: BridgeCore) -> Float[Tensor, "d_vocab d_model"]:  # noqa: N802
    """Token embedding: ``W_E[tokens] == hook_embed``. A view, except where the embedding module scales
    its output (Gemma: ``√d_model``), which is folded in as TransformerLens does: then a copy."""
    module = get_module(core.hf_model, core.adapter.embed)
    w = full_param(module)
    _check_d_model(core, w, "W_E")
    scale = getattr(module, "embed_scale", None)
    return w if scale is None else w * scale.to(w.dtype)


def W_pos(core: BridgeCore) -> Float[Tensor, "pos d_model"]:  # noqa: N802
    """Learned position embedding by position (OPT's offset of 2 removed): ``W_pos[:pos] == hook_pos_embed``.

    A view. Rotary families have none: raises `WeightNotAvailableError`.
    """
    if core.adapter.pos_embed is None:
        raise WeightNotAvailableError(
            f"`W_pos`: this model ({core.cfg.model_type}) has no learned absolute positional embedding; its "
            "positions act inside attention by rotary embedding (see the `hook_rot_q` / `hook_rot_k` points)."
        )
    module = get_module(core.hf_model, core.adapter.pos_embed)
    return full_param(module)[getattr(module, "offset", 0) :]


def W_U_raw(core: BridgeCore) -> Float[Tensor, "d_model d_vocab"]:  # noqa: N802
    """The HF unembedding matrix itself, transposed to ``[d_model, d_vocab]`` (a view; tied models share it
    with the embedding). The final norm's γ is not in it: see `W_U`."""
    w = full_param(core.hf_model.get_output_embeddings())
    _check_d_model(core, w, "W_U_raw")
    return w.T


def b_U_raw(core: BridgeCore) -> Float[Tensor, "d_vocab"] | None:  # noqa: N802
    """The HF unembedding bias (a view), or None when the model has none. See `b_U` for the folded bias."""
    return _bias(core.hf_model.get_output_embeddings())


def W_U(core: BridgeCore, warn: bool = True) -> Float[Tensor, "d_model d_vocab"]:  # noqa: N802
    """Unembedding with the final norm's weight folded in, as TransformerLens: ``diag(γ) @ W_U_raw``. A copy.

    With `b_U`, ``normalized_final_resid @ W_U + b_U`` are the logits (Gemma 2: before the soft-cap). ``warn``:
    say once per model when this differs from `W_U_raw` (TransformerLens 4's unprocessed ``W_U``).
    """
    raw = W_U_raw(core)
    gamma, beta = _norm_weight_bias(core, get_module(core.hf_model, core.adapter.ln_final))
    if warn:
        _warn_folded_unembed(core, gamma, beta, "W_U")
    # Cohere's logit_scale and Granite's 1 / logits_scaling are folded in like γ.
    return (wide(gamma)[:, None] * wide(raw) * logit_multiplier(core)).to(raw.dtype)


def b_U(core: BridgeCore, warn: bool = True) -> Float[Tensor, "d_vocab"]:  # noqa: N802
    """Unembedding bias with the final norm's bias folded in: ``β @ W_U_raw + b_U_raw`` (zeros if neither).

    A copy. ``warn``: as for `W_U`.
    """
    raw = W_U_raw(core)
    gamma, beta = _norm_weight_bias(core, get_module(core.hf_model, core.adapter.ln_final))
    if warn:
        _warn_folded_unembed(core, gamma, beta, "b_U")
    bias = b_U_raw(core)
    out = _zeros(raw, core.cfg.d_vocab) if bias is None else bias.clone()
    out = out if beta is None else out + beta @ raw
    scale = logit_multiplier(core)
    return out if scale == 1.0 else out * scale


def _warn_folded_unembed(core: BridgeCore, gamma: Tensor, beta: Tensor | None, what: str) -> None:
    """Once per model: `what` holds the final norm folded in where TransformerLens 4's unprocessed bridge gives
    the HF unembedding itself (nothing is said when folding changes nothing: γ = 1, β = 0, no logit scale)."""
    with torch.no_grad():
        same = logit_multiplier(core) == 1.0 and bool((gamma == 1).all())
        same = same and (beta is None or not bool(beta.any()))
    if not same:
        warn_difference_once(core, "_warned_folded_unembed", (
            f"`model.{what}` has the final norm folded in (W_U = diag(γ) @ W_U_raw, b_U = β @ W_U_raw + b_U_raw, and "
            "any logit scale), TransformerLens' processed reading, so that the normalized residual stream times W_U "
            "plus b_U gives the model's logits without enable_compatibility_mode(); TransformerLens 4's unprocessed "
            "TransformerBridge returns the HF matrix itself, which is `model.W_U_raw` / `model.b_U_raw` here."
        ))  # fmt: skip


# TransformerLens attribute name → per-layer function, for the component objects (``blocks[i].attn.W_Q``).
LayerWeight = Callable[[BridgeCore, int], Tensor | None]
ATTN_WEIGHTS: dict[str, LayerWeight] = {
    "W_Q": W_Q,
    "W_K": W_K,
    "W_V": W_V,
    "W_O": W_O,
    "b_Q": b_Q,
    "b_K": b_K,
    "b_V": b_V,
    "b_O": b_O,
    "_W_K": partial(W_K, kv_heads=True),
    "_W_V": partial(W_V, kv_heads=True),
    "_b_K": partial(b_K, kv_heads=True),
    "_b_V": partial(b_V, kv_heads=True),
}
MLP_WEIGHTS: dict[str, LayerWeight] = {"W_in": W_in, "W_gate": W_gate, "W_out": W_out, "b_in": b_in, "b_out": b_out}


def stacked(core: BridgeCore, fn: LayerWeight) -> Tensor:
    return torch.stack([fn(core, layer) for layer in range(core.cfg.n_layers)])
