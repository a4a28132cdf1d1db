"""TransformerLens' weight processing, opt-in: ``fold_ln``, ``center_writing_weights``, ``center_unembed``,
``fold_value_biases``, applied to the parameters of the HF model the bridge runs (in place).

The bridge runs the HF model unmodified by default (bitwise HF logits). TransformerLens' analyses (logit
lens, direct logit attribution, composition scores) usually assume its processed weights; this module
rewrites the HF parameters into that form, so the model computes the same function (logits within float
reassociation; ``center_unembed``: the same log-probabilities) while ``W_Q``, ``OV``, the residual stream
and ``decompose_resid`` become TransformerLens' processed numbers:

- ``fold_ln``: each pre-norm's weight γ (and bias β, LayerNorm) is folded into the matrices that read it
  (Q/K/V, the MLP input and gate, the unembedding), and the norm's weight set to 1 (β to 0). For LayerNorm
  the reading matrices are also centred over ``d_model`` (their input is centred). Afterwards
  ``ln1.hook_normalized @ W_Q + b_Q == hook_q``.
- ``center_writing_weights`` (LayerNorm families only: an RMS norm does not remove the mean): the matrices
  writing to the residual stream (``W_E``, ``W_pos``, ``W_O``, ``W_out`` and their biases) are centred over
  ``d_model``, so the residual stream has mean 0 at every point.
- ``center_unembed``: ``W_U`` and ``b_U`` are centred over the vocabulary (logits shift by a constant per
  position). Not defined with a final logit soft-cap (Gemma 2), which is not shift-invariant.
- ``fold_value_biases``: the value bias ``b_V`` is folded into ``b_O`` (the pattern sums to 1), and zeroed.
- ``refactor_factored_attn_matrices`` (off by default, as in TransformerLens; learned or no positional
  embeddings only, where ``W_Q @ W_K.T`` alone decides the scores): each head's ``W_Q``, ``W_K`` (with their
  biases as an extra input row) are replaced by the even factors of the SVD of their product, and ``W_V``,
  ``W_O`` by ``U S`` and ``Vᵀ`` of ``W_V @ W_O``; scores and head outputs are unchanged.

A step not defined for a family is skipped, and the reason recorded in ``model.weight_processing``, as
TransformerLens skips ``center_writing_weights`` for RMS norms. A tied unembedding is untied first. Mixtures
of experts, state-space and latent-attention families are refused.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..adapters.base import centred, one_plus
from ..cache.decompose import wide
from ..core import BridgeCore
from ..sites.module_paths import get_module, optional_module
from . import weights
from .factored import FactoredMatrix

__all__ = ["WeightProcessing", "process_weights"]

STEPS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases", "refactor_factored_attn_matrices")


@dataclass(frozen=True)
class WeightProcessing:
    """What `process_weights` did: the steps applied, and each step skipped with the reason.

    Example:
        >>> model.enable_compatibility_mode()
        >>> model.weight_processing.applied           # ('fold_ln', 'center_unembed') on an RMS-norm model
    """

    applied: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)


def process_weights(
    core: BridgeCore,
    fold_ln: bool = True,
    center_writing_weights: bool = True,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
    refactor_factored_attn_matrices: bool = False,
) -> WeightProcessing:
    """Rewrite the HF model's parameters in place into TransformerLens' processed form (see the module doc).

    Example:
        >>> report = process_weights(model, fold_ln=True, center_writing_weights=True)
        >>> normalized = cache["normalized", 0, "ln1"]             # after a new run_with_cache
        >>> q = torch.einsum("bpd,hde->bphe", normalized, model.W_Q[0]) + model.b_Q[0]   # == cache["q", 0]
    """
    asked = {"fold_ln": fold_ln, "center_writing_weights": center_writing_weights,
             "center_unembed": center_unembed, "fold_value_biases": fold_value_biases,
             "refactor_factored_attn_matrices": refactor_factored_attn_matrices}  # fmt: skip
    for name, value in asked.items():
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` must be True or False, got {type(value).__name__} {value!r}.")
    _check_family(core)
    if refactor_factored_attn_matrices:
        _check_refactor(core)
    skipped = _undefined(core)
    todo = [s for s in STEPS if asked[s] and s not in skipped]
    skipped = {s: why for s, why in skipped.items() if asked[s]}
    with torch.no_grad():
        if todo:
            if "n_params_as_loaded" not in core.__dict__:  # `n_params_total`: untying and new biases do not count
                core.__dict__["n_params_as_loaded"] = sum(p.numel() for p in core.hf_model.parameters())
            _untie_unembedding(core)
        layernorm = centred(core.adapter.norm)
        if "fold_ln" in todo:
            _fold_norms(core, center_readers=layernorm)
        if "center_writing_weights" in todo:
            _center_writers(core)
        if "center_unembed" in todo:
            w = _weight_io(core, core.hf_model.get_output_embeddings())  # [d_model, d_vocab]
            w.sub_(w.mean(-1, keepdim=True))
            b = getattr(core.hf_model.get_output_embeddings(), "bias", None)
            if b is not None:
                b.sub_(b.mean())
        if "fold_value_biases" in todo:
            _fold_value_biases(core, center=layernorm and "center_writing_weights" in todo)
        if "refactor_factored_attn_matrices" in todo:
            for layer in range(core.cfg.n_layers):
                _refactor_layer(core, layer)
    return WeightProcessing(tuple(todo), skipped)


def _check_family(core: BridgeCore) -> None:
    a = core.adapter
    what = ("a state-space" if a.ssm or a.hybrid else "a mixture-of-experts" if a.moe else
            "a multi-head latent attention" if a.mla else None)  # fmt: skip
    if what is not None:
        raise ValueError(
            f"Weight processing is not defined here for {core.cfg.model_type!r}, {what} family: its blocks are not "
            "TransformerLens' attention + MLP layout. Run it unprocessed (the default)."
        )
    for p in core.hf_model.parameters():
        if p.device.type == "meta" or (type(p) is not nn.Parameter and type(p) is not torch.Tensor):
            raise ValueError(
                "Weight processing rewrites every parameter in place: it needs the whole model on real devices "
                "(not offloaded or tensor-parallel). Load it whole, or run it unprocessed."
            )


def _undefined(core: BridgeCore) -> dict[str, str]:
    """The steps not defined for this family, with the reason (TransformerLens' rules)."""
    out = {}
    if not centred(core.adapter.norm):
        out["center_writing_weights"] = "an RMS norm does not remove the mean, so centring would change the output"
    elif core.adapter.sandwich or core.adapter.ln1 is None:
        out["center_writing_weights"] = "a norm after a sublayer (before the residual add) is not mean-invariant"
    if getattr(core.hf_model.config, "final_logit_softcapping", None):
        out["center_unembed"] = "the final logit soft-cap is not invariant to a shift of the logits"
    return out


def _weight_io(core: BridgeCore, module: nn.Module) -> Tensor:
    """The module's weight as ``[in, out]``, a view (GPT-2's Conv1D stores it so, ``nn.Linear`` as ``[out, in]``;
    a Conv1D family's unembedding is still an ``nn.Linear``)."""
    return module.weight.T if isinstance(module, nn.Linear) or not core.adapter.conv1d else module.weight


def _bias(module: nn.Module, out_features: int, like: Tensor) -> Tensor:
    """The module's bias, created (zeros) when the module has none, so a folded shift has somewhere to go."""
    if getattr(module, "bias", None) is None:
        module.bias = nn.Parameter(torch.zeros(out_features, dtype=like.dtype, device=like.device))
    return module.bias


def _untie_unembedding(core: BridgeCore) -> None:
    """Give the unembedding its own weight when it shares the embedding's (GPT-2, Gemma …): processing
    treats them differently."""
    unembed, embed = core.hf_model.get_output_embeddings(), core.hf_model.get_input_embeddings()
    if unembed.weight.data_ptr() == embed.weight.data_ptr():
        unembed.weight = nn.Parameter(unembed.weight.detach().clone())
        core.hf_model.config.tie_word_embeddings = False  # a later tie_weights() must not re-tie them


def _fold_into(core: BridgeCore, norm: nn.Module, readers: list[nn.Module], center_readers: bool) -> None:
    """Fold ``norm``'s γ (and β) into each reader's input dimension, then make the norm the identity affine."""
    w = getattr(norm, "weight", None)
    gamma = None if w is None else (1.0 + wide(w) if one_plus(core.adapter.norm) else wide(w))
    beta = getattr(norm, "bias", None)
    for module in readers:
        weight = _weight_io(core, module)  # [d_model, out]
        folded = wide(weight) * gamma[:, None] if gamma is not None else wide(weight)
        if beta is not None and bool(beta.any()):
            bias = _bias(module, weight.shape[1], weight)
            bias.add_((wide(beta) @ wide(weight)).to(bias.dtype))
        if center_readers:
            folded = folded - folded.mean(0, keepdim=True)
        weight.copy_(folded.to(weight.dtype))
    if w is not None:
        w.fill_(0.0 if one_plus(core.adapter.norm) else 1.0)
    if beta is not None:
        beta.zero_()


def _attention_readers(core: BridgeCore, block: nn.Module) -> list[nn.Module]:
    a = core.adapter
    return [get_module(block, a.qkv)] if a.qkv is not None else [get_module(block, p) for p in (a.q, a.k, a.v)]


def _mlp_readers(core: BridgeCore, block: nn.Module) -> list[nn.Module]:
    a = core.adapter
    return [get_module(block, a.mlp_in), *([get_module(block, a.mlp_up)] if a.mlp_up else [])]


def _fold_norms(core: BridgeCore, center_readers: bool) -> None:
    a = core.adapter
    for block in get_module(core.hf_model, a.blocks):
        ln1, ln2 = optional_module(block, a.ln1), optional_module(block, a.ln2, may_be_absent=True)
        if ln1 is not None:  # one norm feeding attention and MLP (GPT-J, Phi, parallel Falcon) when ln2 is None
            readers = _attention_readers(core, block) + ([] if ln2 is not None else _mlp_readers(core, block))
            _fold_into(core, ln1, readers, center_readers)
        if ln2 is not None:
            _fold_into(core, ln2, _mlp_readers(core, block), center_readers)
    final = get_module(core.hf_model, a.ln_final)
    _fold_into(core, final, [core.hf_model.get_output_embeddings()], center_readers)


def _center_rows(t: Tensor | None) -> None:
    if t is not None:
        t.sub_(t.mean(-1, keepdim=True))


def _center_writers(core: BridgeCore) -> None:
    a = core.adapter
    _center_rows(core.hf_model.get_input_embeddings().weight)  # [d_vocab, d_model]
    if a.pos_embed:
        _center_rows(get_module(core.hf_model, a.pos_embed).weight)
    for block in get_module(core.hf_model, a.blocks):
        for path in (a.o_proj, a.mlp_down):
            module = get_module(block, path)
            _center_rows(_weight_io(core, module))  # [in, d_model]
            _center_rows(getattr(module, "bias", None))


def _fold_value_biases(core: BridgeCore, center: bool) -> None:
    """``b_O += Σ_h b_V[kv(h)] @ W_O[h]``, then ``b_V = 0`` (each query head reads its kv head's values)."""
    c, a = core.cfg, core.adapter
    groups = c.n_heads // c.n_kv_heads
    for block in get_module(core.hf_model, a.blocks):
        b_v = _value_bias(core, block)
        if b_v is None:
            continue
        o_proj = get_module(block, a.o_proj)
        w_o = _weight_io(core, o_proj)  # [n_heads * d_head, d_model]
        per_query_head = b_v.repeat_interleave(groups, dim=0).reshape(-1)  # [n_heads * d_head]
        b_o = _bias(o_proj, c.d_model, w_o)
        b_o.add_((wide(per_query_head) @ wide(w_o)).to(b_o.dtype))
        if center:
            b_o.sub_(b_o.mean())
        b_v.zero_()


def _value_bias(core: BridgeCore, block: nn.Module) -> Tensor | None:
    """``b_V`` as ``[n_kv_heads, d_head]``: a view of the HF bias (None when the family has none)."""
    c, a = core.cfg, core.adapter
    if a.qkv is None:
        b = getattr(get_module(block, a.v), "bias", None)
        return None if b is None else b.view(c.n_kv_heads, c.d_head)
    b = getattr(get_module(block, a.qkv), "bias", None)
    if b is None:
        return None
    if a.qkv_layout == "per_head":  # [head, q|k|v, d_head]
        return b.view(c.n_heads, 3, c.d_head)[:, 2]
    start = (c.n_heads + c.n_kv_heads) * c.d_head
    return b[start : start + c.n_kv_heads * c.d_head].view(c.n_kv_heads, c.d_head)


def _check_refactor(core: BridgeCore) -> None:
    c, a = core.cfg, core.adapter
    rotary = c.positional_embedding_type == "rotary"
    why = ("its positions are rotary: the scores depend on W_Q and W_K separately" if rotary
           else "queries and keys are normalised per head after the projections" if a.q_norm or a.k_norm
           else "its key/value heads are shared between query heads (GQA)" if c.n_kv_heads != c.n_heads
           else None)  # fmt: skip
    if why is not None:
        raise ValueError(
            f"`refactor_factored_attn_matrices=True` is not defined for this {c.model_type!r} model: {why}. "
            "TransformerLens refuses it there too; leave it False."
        )


def _biased(core: BridgeCore, layer: int) -> None:
    """Give Q/K/V/O biases to a family whose projections have none (GPT-Neo), so the refactor can write them."""
    a = core.adapter
    block = get_module(core.hf_model, a.blocks)[layer]
    paths = [a.qkv] if a.qkv is not None else [a.q, a.k, a.v]
    for path in [*paths, a.o_proj]:
        module = get_module(block, path)
        _bias(module, _weight_io(core, module).shape[1], module.weight)


def _refactor_layer(core: BridgeCore, layer: int) -> None:
    """TransformerLens' ``refactor_factored_attn_matrices`` for one layer, through views of the HF weights."""
    _biased(core, layer)
    w_q, b_q, w_k, b_k = (f(core, layer) for f in (weights.W_Q, weights.b_Q, weights.W_K, weights.b_K))
    q_eff = torch.cat([w_q, b_q[:, None, :]], dim=1)  # [head, d_model + 1, d_head]: the bias as an input row
    k_eff = torch.cat([w_k, b_k[:, None, :]], dim=1)
    q_even, k_even_t = FactoredMatrix(q_eff, k_eff.transpose(-1, -2)).make_even().pair
    k_even = k_even_t.transpose(-1, -2)
    w_q.copy_(q_even[:, :-1]), b_q.copy_(q_even[:, -1]), w_k.copy_(k_even[:, :-1]), b_k.copy_(k_even[:, -1])
    w_v, b_v, w_o, b_o = (f(core, layer) for f in (weights.W_V, weights.b_V, weights.W_O, weights.b_O))
    b_o.add_((b_v[:, :, None] * w_o).sum((0, 1)))
    b_v.zero_()
    u, s, v = FactoredMatrix(w_v, w_o).svd()
    w_v.copy_(u * s[:, None, :])
    w_o.copy_(v.transpose(-1, -2))
