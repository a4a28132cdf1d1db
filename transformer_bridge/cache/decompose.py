"""One decomposition of the residual stream into what each component adds, and its logit read-out.

The residual stream a layer reads is a sum: the embedding (as it enters the stream, scaled or
projected), the position embedding, and for each block before it the attention output (each head's
``hook_result`` plus the output projection's bias) and the MLP output (each neuron's ``hook_post[n] ·
W_out[n]`` plus the down projection's bias). Behind a sandwich norm (Gemma 2 and 3, OLMo 2's post-norms)
a sublayer's output is normalised before the residual add; a norm is linear once its scale is fixed, so
there a part's contribution is the part (centred for LayerNorm) divided by the *cached* scale times the
norm's weight, and the norm's bias is one more constant part.

`components` (stacked; `component_groups` keeps them grouped by source) lists these parts, in stream
order, from cached activations; `logit_attributions` projects a stack of parts, normalised by the final
norm's cached scale, on the unembedding direction of a token (minus a contrast token's), and
`readout_biases` gives the constant terms (the final norm's bias read by ``W_U``, ``b_U``) that complete
the sum to the logit. The cache's TransformerLens methods
(`decompose_resid`, `stack_head_results`, `get_full_resid_decomposition`, `logit_attrs`) and the
``dla`` relevance method are views of this one decomposition. Everything family-specific comes from the
adapter (module paths, norm kind, sandwich norms, experts), the config (a logit multiplier) and the
bridge's hook points; a family whose blocks add ``hook_attn_out`` and ``hook_mlp_out`` to the stream
needs nothing here.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..adapters.base import centred, one_plus
from ..distributed import full_param
from ..sites.module_paths import get_module

Sublayer = Literal["attn", "mlp"]
Kind = Literal[
    "embed", "pos_embed", "head", "attn_out", "attn_bias", "neuron", "mlp_out", "mlp_bias", "expert", "mlp_rest",
    "mixer_out", "edit"
]  # fmt: skip


@dataclass(frozen=True)
class Activations:
    """Cached activations by canonical hook name, each already indexed at the positions wanted.

    ``get(name)`` returns the tensor (``[..., d_model]`` for residual-stream points, the same leading
    axes for every name) or raises a `KeyError` saying what is missing; ``has(name)`` says whether it
    is there without raising.

    Example:
        >>> acts = Activations(lambda name: cache[name][:, -1], lambda name: name in cache)
    """

    get: Callable[[str], Tensor]
    has: Callable[[str], bool]


@dataclass(frozen=True)
class Component:
    """One part of the residual stream: its kind, the layer it comes from and its head or neuron index; for an
    ``edit`` (what hooks added to the stream), the residual point where it was found (None: not located)."""

    kind: Kind
    layer: int | None = None
    index: int | None = None
    point: str | None = None

    @property
    def is_bias(self) -> bool:
        return self.kind in ("attn_bias", "mlp_bias")


# -- weights ----------------------------------------------------------------------------------
def block_module(model: Any, layer: int, path: str) -> nn.Module:
    """The module at ``path`` (adapter-relative) in block ``layer``."""
    return get_module(get_module(model.hf_model, model.adapter.blocks)[layer], path)


def has_experts(model: Any, layer: int) -> bool:
    """Whether block ``layer`` is a mixture of experts (the adapter's ``moe.experts`` module exists there)."""
    moe = getattr(model.adapter, "moe", None)
    module: Any = get_module(model.hf_model, model.adapter.blocks)[layer]
    for part in moe.experts.split(".") if moe is not None else ():
        module = getattr(module, part, None)
        if module is None:
            return False
    return moe is not None


def o_weight(model: Any, layer: int) -> Float[Tensor, "d_model head d_head"]:
    """The attention output projection of ``layer`` as ``[d_model, head, d_head]`` (a view)."""
    weight = full_param(block_module(model, layer, model.adapter.o_proj))  # whole if sharded or offloaded
    weight = weight.T if model.adapter.conv1d else weight  # [d_model, head * d_head]
    return weight.reshape(weight.shape[0], model.cfg.n_heads, model.cfg.d_head)


def out_weight(model: Any, layer: int) -> Float[Tensor, "d_mlp d_model"]:
    """The MLP's down projection of ``layer`` as TransformerLens' ``W_out`` ``[d_mlp, d_model]`` (a view)."""
    if has_experts(model, layer):
        raise ValueError(
            f"Layer {layer} of this {model.cfg.model_type!r} model is a mixture of experts: it has no single "
            "`W_out`, so its output cannot be split into neurons. Use the MLP outputs (`expand_neurons=False`, "
            "`hook_mlp_out`) instead."
        )
    weight = full_param(block_module(model, layer, model.adapter.mlp_down))
    return weight if model.adapter.conv1d else weight.T


def sublayer_bias(model: Any, layer: int, which: Sublayer) -> Float[Tensor, "d_model"] | None:
    """``b_O`` (``which="attn"``) or ``b_out`` (``"mlp"``) of ``layer``, None where the family has none."""
    if which == "mlp" and has_experts(model, layer):
        return None  # a mixture's biases live in its experts, inside `hook_mlp_out`
    path = model.adapter.o_proj if which == "attn" else model.adapter.mlp_down
    return full_param(block_module(model, layer, path), "bias")


def wide(t: Tensor) -> Tensor:
    """``t`` in at least float32, keeping float64: analyses and weight processing compute at the model's
    precision or better, never below it.

    Example:
        >>> wide(torch.ones(2, dtype=torch.bfloat16)).dtype, wide(torch.ones(2, dtype=torch.float64)).dtype
        (torch.float32, torch.float64)
    """
    return t.to(torch.promote_types(t.dtype, torch.float32))


def norm_weight(model: Any, norm: nn.Module) -> Float[Tensor, "d_model"] | None:
    """A norm's effective weight γ as float (Gemma's stored ``w`` is ``1 + w``), None if it has none."""
    weight = full_param(norm, "weight")
    if weight is None:
        return None
    weight = wide(weight.detach())
    return 1.0 + weight if one_plus(model.adapter.norm) else weight


def _post_norm(model: Any, layer: int, which: Sublayer) -> nn.Module:
    return block_module(model, layer, model.adapter.attn_out if which == "attn" else model.adapter.mlp_out)


def post_norm_scale_name(layer: int, which: Sublayer) -> str:
    """The hook point holding the scale of ``layer``'s sandwich norm after ``which``."""
    return f"blocks.{layer}.{'ln1_post' if which == 'attn' else 'ln2_post'}.hook_scale"


def to_resid(
    model: Any, acts: Activations, layer: int, which: Sublayer, x: Tensor, per_part: bool
) -> Float[Tensor, "... d_model"]:
    """What ``x``, a part of ``layer``'s attention or MLP output, adds to the residual stream.

    The identity, except behind a sandwich norm: there ``x`` (centred for LayerNorm) ``/ scale * γ`` at the
    cached scale; times Granite's ``residual_multiplier``. ``per_part``: ``x`` has a head or neuron axis before
    ``d_model``.
    """
    if not model.adapter.sandwich:
        multiplier = model.adapter.residual_scale(model.hf_model.config)  # Granite's residual_multiplier
        return x if multiplier == 1.0 else x * multiplier
    scale = acts.get(post_norm_scale_name(layer, which))
    scale = scale[..., None, :] if per_part else scale
    if centred(model.adapter.norm):
        x = x - x.mean(-1, keepdim=True)
    x = x / scale.to(x.device, x.dtype)
    gamma = norm_weight(model, _post_norm(model, layer, which))
    return x if gamma is None else x * gamma.to(x.device, x.dtype)


def _bias_in_resid(model: Any, acts: Activations, layer: int, which: Sublayer, like: Tensor) -> Tensor | None:
    """The constant that ``which`` of ``layer`` adds: its output bias (through a sandwich norm) and that norm's
    bias; None when there is neither."""
    bias = sublayer_bias(model, layer, which)
    total = None
    if bias is not None:
        total = to_resid(model, acts, layer, which, bias.detach().to(like).expand_as(like), per_part=False)
    beta = getattr(_post_norm(model, layer, which), "bias", None) if model.adapter.sandwich else None
    if beta is not None:
        beta = beta.detach().to(like).expand_as(like)
        total = beta if total is None else total + beta
    return total


# -- the parts --------------------------------------------------------------------------------
def z_to_result(model: Any, layer: int, z: Float[Tensor, "... head d_head"]) -> Float[Tensor, "... head d_model"]:
    """``hook_result`` from ``hook_z``: each head's output through the output projection, bias excluded."""
    dtype = torch.promote_types(z.dtype, o_weight(model, layer).dtype)
    weight = o_weight(model, layer).detach().to(z.device, dtype)
    return torch.einsum("...hd,mhd->...hm", z.to(dtype), weight)


def head_outputs(model: Any, acts: Activations, layer: int) -> Float[Tensor, "... head d_model"]:
    """Each head's contribution to the stream in ``layer``: ``hook_result`` (or computed from ``hook_z``)."""
    name = f"blocks.{layer}.attn.hook_result"
    z_name = f"blocks.{layer}.attn.hook_z"
    result = acts.get(name) if acts.has(name) else z_to_result(model, layer, acts.get(z_name))
    return to_resid(model, acts, layer, "attn", result, per_part=True)


def neuron_outputs(model: Any, acts: Activations, layer: int) -> Float[Tensor, "... neuron d_model"]:
    """Each neuron's contribution ``hook_post[n] · W_out[n]`` in ``layer`` (the bias excluded)."""
    weight = out_weight(model, layer)
    post = acts.get(f"blocks.{layer}.mlp.hook_post")
    dtype = torch.promote_types(post.dtype, weight.dtype)
    parts = post.to(dtype)[..., None] * weight.detach().to(post.device, dtype)
    return to_resid(model, acts, layer, "mlp", parts, per_part=True)


def expert_result_name(layer: int) -> str:
    """The hook point holding each expert's weighted output in a mixture-of-experts block."""
    return f"blocks.{layer}.mlp.hook_expert_result"


@dataclass(frozen=True)
class Group:
    """Parts of the stream from one source, stacked on axis 0: a layer's heads (``indexed``: part ``i`` is head
    ``i``), its neurons or experts, or one part (an MLP output, a bias, the embedding)."""

    parts: Float[Tensor, "part ... d_model"]
    kind: Kind
    layer: int | None = None
    indexed: bool = False
    point: str | None = None

    @property
    def components(self) -> list[Component]:
        if not self.indexed:
            return [Component(self.kind, self.layer, point=self.point)]
        return [Component(self.kind, self.layer, i) for i in range(self.parts.shape[0])]


def component_groups(
    model: Any,
    acts: Activations,
    layer: int,
    mlp_input: bool = False,
    heads: bool = False,
    neurons: bool = False,
    embeds: bool = True,
    kinds: tuple[Sublayer, ...] = ("attn", "mlp"),
    experts: bool = False,
    edits: bool = False,
) -> list[Group]:
    """The parts of the residual stream that ``layer`` reads (its MLP's input if ``mlp_input``), in stream order.

    ``layer`` is ``0..n_layers`` (``n_layers``: the final norm's input). ``mlp_input`` adds ``layer``'s
    attention, which its MLP reads (the caller decides whether it does; parallel blocks read none).
    ``heads``: each head and the attention bias separately, else ``hook_attn_out`` whole; ``neurons``: each
    neuron and the MLP bias separately (a mixture-of-experts block stays ``hook_mlp_out`` whole), else
    ``hook_mlp_out`` whole. ``experts``: a mixture-of-experts block as each expert's weighted output
    (``mlp.hook_expert_result``, zero where a token is not routed to the expert) plus the rest of
    ``hook_mlp_out`` (a shared expert, the post-norm's bias). ``kinds`` limits the blocks' parts to
    attention or MLP outputs. The parts sum to the residual when everything is included. Parts stay in
    groups (a layer's heads are one tensor), so a caller stacks them with one copy (`stack_groups`). A
    state-space (Mamba) block has one part, ``hook_mixer_out`` (kind ``mixer_out``), whatever the options; so does
    a hybrid's mixer layer in place of its attention (with ``kinds`` it counts as ``attn``).

    ``edits`` (with every kind and the embeddings): a hook that edited the residual stream during the cached
    forward (steering, an ablation of ``hook_resid_*``) added something that no block output holds. Each such
    edit becomes a part of kind ``edit``, found between consecutive cached residual points (``point``: the
    point where it shows, e.g. ``blocks.10.hook_resid_post``) when it exceeds float rounding
    (`edit_tolerance`); what remains between the parts and the cached residual that ``layer`` reads (an edit
    between points that are not cached) is one more ``edit`` part with ``point`` None. Without edits nothing
    is added, so the parts sum to the residual in every case.

    Example:
        >>> groups = component_groups(model, acts, model.cfg.n_layers, heads=True, edits=True)
        >>> stack_groups(groups).sum(0)   # == the final residual stream, steering vectors included
    """
    found: list[Group] = []
    if embeds:
        resid0 = acts.get("blocks.0.hook_resid_pre")
        if "hook_pos_embed" in model.hook_dict:
            pos = acts.get("hook_pos_embed").expand_as(resid0)
            found += [_one(resid0 - pos, "embed"), _one(pos, "pos_embed")]  # the embedding as it enters
        else:
            found.append(_one(resid0, "embed"))
    edits = edits and embeds and set(kinds) == {"attn", "mlp"}
    tol = edit_tolerance(model)
    for i in range(layer + mlp_input):
        if edits and i > 0:
            found += _edit(acts, f"blocks.{i - 1}.hook_resid_post", f"blocks.{i}.hook_resid_pre", [], i, tol)
        if model.adapter.ssm is not None:  # a state-space block adds one part: its mixer's output (any `kinds`)
            mixer = [_one(acts.get(f"blocks.{i}.hook_mixer_out"), "mixer_out", i)] if i < layer else []
            found += mixer
            if edits and mixer:
                found += _edit(acts, f"blocks.{i}.hook_resid_pre", f"blocks.{i}.hook_resid_post", mixer, i, tol)
            continue
        # A hybrid's block: a mixer (one part, counted with the attention `kinds`) or attention, maybe no MLP.
        mixer_out, has_mlp = f"blocks.{i}.hook_mixer_out", f"blocks.{i}.hook_mlp_out" in model.hook_dict
        if "attn" not in kinds:
            attn = []
        elif mixer_out in model.hook_dict:
            attn = [_one(acts.get(mixer_out), "mixer_out", i)]
        else:
            attn = _attn_groups(model, acts, i, heads) if f"blocks.{i}.hook_attn_out" in model.hook_dict else []
        mlp = _mlp_groups(model, acts, i, neurons, experts) if "mlp" in kinds and i < layer and has_mlp else []
        if edits and f"blocks.{i}.hook_resid_mid" in model.hook_dict:
            attn += _edit(acts, f"blocks.{i}.hook_resid_pre", f"blocks.{i}.hook_resid_mid", attn, i, tol)
            if mlp:
                mlp += _edit(acts, f"blocks.{i}.hook_resid_mid", f"blocks.{i}.hook_resid_post", mlp, i, tol)
        elif edits and (mlp or (i < layer and not has_mlp)):  # parallel blocks; Nemotron-H's one-sublayer blocks
            mlp += _edit(acts, f"blocks.{i}.hook_resid_pre", f"blocks.{i}.hook_resid_post", attn + mlp, i, tol)
        found += attn + mlp
    if edits and layer < model.cfg.n_layers and not mlp_input and layer > 0:
        found += _edit(acts, f"blocks.{layer - 1}.hook_resid_post", f"blocks.{layer}.hook_resid_pre", [], layer, tol)
    return found + (_remainder(model, acts, layer, mlp_input, found, tol) if edits else [])


def edit_label(point: str | None) -> str:
    """The label of an ``edit`` part: ``edit:blocks.10.hook_resid_post``, or ``edit:unlocated`` (between points
    that were not cached)."""
    return f"edit:{point or 'unlocated'}"


def edit_tolerance(model: Any) -> float:
    """The relative size (of the residual stream, row by row) below which a difference between cached residual
    points and the parts between them is float rounding, not an edit: 1e-4 in float32, more in half precision."""
    dtype = model.cfg.dtype if model.cfg.dtype.is_floating_point else torch.float32
    return max(1e-4, 32 * torch.finfo(dtype).eps)


def _edit(acts: Activations, before: str, after: str, parts: list[Group], layer: int, tol: float) -> list[Group]:
    """``[after − before − Σ parts]`` as an ``edit`` part at ``after`` when it is larger than rounding, else ``[]``
    (also when either point is not cached)."""
    if not (acts.has(before) and acts.has(after)):
        return []
    start, end = acts.get(before), acts.get(after)
    gap = end.float() - start.float()
    for g in parts:
        gap = gap - g.parts.float().sum(0)
    if not _significant(gap, [start, end], tol):
        return []
    return [Group(gap.to(end.dtype)[None], "edit", layer, point=after)]


def _remainder(
    model: Any, acts: Activations, layer: int, mlp_input: bool, found: list[Group], tol: float
) -> list[Group]:
    """The residual that ``layer`` reads minus every part, as an unlocated ``edit`` when it is larger than rounding."""
    n = model.cfg.n_layers
    where = "mid" if mlp_input else "pre"
    name = f"blocks.{n - 1}.hook_resid_post" if layer == n else f"blocks.{layer}.hook_resid_{where}"
    if not acts.has(name) or not found:
        return []
    resid = acts.get(name)
    gap = resid.float() - sum(g.parts.float().sum(0) for g in found)
    if not _significant(gap, [resid], tol):
        return []
    return [Group(gap.to(resid.dtype)[None], "edit", None, point=None)]


def _significant(gap: Tensor, streams: list[Tensor], tol: float) -> bool:
    """Whether any row of ``gap`` is larger than ``tol`` times the largest of ``streams`` in that row (plus a
    floor for rows near zero)."""
    scale = torch.stack([s.float().norm(dim=-1) for s in streams]).amax(0)
    return bool((gap.norm(dim=-1) > tol * scale + 1e-6).any())


def stack_groups(groups: list[Group]) -> Float[Tensor, "component ... d_model"]:
    """Every part of ``groups`` in one tensor (one copy, in the first group's dtype)."""
    dtype = groups[0].parts.dtype
    return torch.cat([g.parts.to(dtype) for g in groups]) if len(groups) > 1 else groups[0].parts


def components(
    model: Any, acts: Activations, layer: int, mlp_input: bool = False, **options: Any
) -> tuple[Float[Tensor, "component ... d_model"], list[Component]]:
    """`component_groups` stacked: ``[component, ..., d_model]`` and the components in stream order.

    Example:
        >>> parts, comps = components(model, acts, model.cfg.n_layers, heads=True)
        >>> parts.sum(0)   # == the final residual stream
    """
    groups = component_groups(model, acts, layer, mlp_input, **options)
    return stack_groups(groups), [c for g in groups for c in g.components]


def _one(x: Tensor, kind: Kind, layer: int | None = None) -> Group:
    return Group(x[None], kind, layer)


def _split(per_part: Tensor, kind: Kind, layer: int) -> Group:
    """``[..., part, d_model]`` as a group of ``kind`` parts of ``layer``."""
    return Group(per_part.movedim(-2, 0), kind, layer, indexed=True)


def _attn_groups(model: Any, acts: Activations, layer: int, heads: bool) -> list[Group]:
    if not heads:
        return [_one(_added(model, acts.get(f"blocks.{layer}.hook_attn_out")), "attn_out", layer)]
    per_head = head_outputs(model, acts, layer)
    bias = _bias_in_resid(model, acts, layer, "attn", per_head[..., 0, :])
    found = [_split(per_head, "head", layer)]
    return found if bias is None else [*found, _one(bias, "attn_bias", layer)]


def _mlp_groups(model: Any, acts: Activations, layer: int, neurons: bool, experts: bool) -> list[Group]:
    moe = has_experts(model, layer)
    if experts and moe:
        out = _added(model, acts.get(f"blocks.{layer}.hook_mlp_out"))
        per_expert = to_resid(model, acts, layer, "mlp", acts.get(expert_result_name(layer)), per_part=True)
        rest = out - per_expert.sum(-2).to(out.dtype)
        return [_split(per_expert, "expert", layer), _one(rest, "mlp_rest", layer)]
    if neurons and not moe:  # a mixture of experts has no single W_out: it stays whole
        per_neuron = neuron_outputs(model, acts, layer)
        bias = _bias_in_resid(model, acts, layer, "mlp", per_neuron[..., 0, :])
        found = [_split(per_neuron, "neuron", layer)]
        return found if bias is None else [*found, _one(bias, "mlp_bias", layer)]
    return [_one(_added(model, acts.get(f"blocks.{layer}.hook_mlp_out")), "mlp_out", layer)]


def _added(model: Any, out: Tensor) -> Tensor:
    """What a sublayer output (``hook_attn_out`` / ``hook_mlp_out``) adds to the stream: itself, but for
    Granite's ``residual_multiplier``."""
    multiplier = model.adapter.residual_scale(model.hf_model.config)
    return out if multiplier == 1.0 else out * multiplier


# -- the logit read-out -----------------------------------------------------------------------
def final_normalized(
    model: Any, stack: Float[Tensor, "component ... d_model"], scale: Float[Tensor, "... 1"]
) -> Float[Tensor, "component ... d_model"]:
    """Each part through the final norm at its cached ``scale``: centred (LayerNorm), divided by it."""
    if model.cfg.normalization == "layernorm":
        stack = stack - stack.mean(-1, keepdim=True)
    return stack / scale.to(stack.device, stack.dtype)


def logit_multiplier(model: Any) -> float:
    """The constant a family multiplies its logits by after the unembedding: Cohere's ``logit_scale``,
    Granite's ``1 / logits_scaling`` (read from the HF config); 1.0 for every other family."""
    config = model.hf_model.config
    return float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)


def logit_direction(
    model: Any, tokens: Int[Tensor, "..."], contrast: Int[Tensor, "..."] | int | None = None
) -> Float[Tensor, "... d_model"]:
    """``γ ⊙ W_U[:, token]`` (minus the contrast token's), times `logit_multiplier`: what a normalised residual
    is read along."""
    direction = model.unembed_directions(tokens)
    if contrast is not None:
        direction = direction - model.unembed_directions(contrast)
    scale = logit_multiplier(model)
    return direction if scale == 1.0 else direction * scale


def logit_attributions(
    model: Any,
    stack: Float[Tensor, "component ... d_model"],
    direction: Float[Tensor, "... d_model"],
    scale: Float[Tensor, "... 1"] | None = None,
) -> Float[Tensor, "component ..."]:
    """Each part's direct effect on the logit: normalised by the final norm's ``scale`` (unless None: already
    normalised) and projected on ``direction`` (`logit_direction`)."""
    if scale is not None:
        stack = final_normalized(model, stack, scale)
    return (stack * direction.to(stack.device, stack.dtype)).sum(-1)


def readout_biases(
    model: Any, tokens: Int[Tensor, "n"], contrast: int | None = None
) -> tuple[Float[Tensor, "bias n"], list[str]]:
    """The constant terms of each token's logit: ``β · W_U[:, t]`` (``bias:ln_final``, a final norm with a
    bias) and ``b_U[t]`` (``bias:unembed``), minus the contrast token's, times `logit_multiplier`; ``[0, n]``
    when there are none."""
    rows, labels = [], []
    unembed = model.hf_model.get_output_embeddings()
    w = wide(full_param(unembed).detach())
    tokens = tokens.to(w.device)
    beta = full_param(get_module(model.hf_model, model.adapter.ln_final), "bias")
    if beta is not None:
        read = w[tokens] - (w[contrast] if contrast is not None else 0.0)
        rows.append(read @ wide(beta.detach()))
        labels.append("bias:ln_final")
    b_u = getattr(unembed, "bias", None)  # the raw bias, `b_U_raw`
    if b_u is not None:
        b = wide(b_u.detach())
        rows.append(b[tokens] - (b[contrast] if contrast is not None else 0.0))
        labels.append("bias:unembed")
    if not rows:
        return torch.zeros(0, len(tokens)), []
    return (torch.stack(rows) * logit_multiplier(model)).cpu(), labels
