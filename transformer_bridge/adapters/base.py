"""The `Adapter` record: where one architecture family keeps each part the bridge hooks.

Paths are dotted attribute paths; block-level paths are relative to one decoder block.
"""

from dataclasses import dataclass
from typing import Literal

NormKind = Literal["layernorm", "rms", "rms_one_plus", "layernorm_one_plus"]


def centred(kind: str) -> bool:
    """Whether a norm of this kind subtracts the mean (a LayerNorm) before scaling."""
    return kind in ("layernorm", "layernorm_one_plus")


def one_plus(kind: str) -> bool:
    """Whether a norm of this kind stores its weight as ``w - 1`` (Gemma's RMS norms, Nemotron's LayerNorm1P)."""
    return kind in ("rms_one_plus", "layernorm_one_plus")


QKVLayout = Literal["separate", "concat", "per_head"]
QKNormLayout = Literal["pos_head", "head_pos", "flat"]
MixerKind = Literal["mamba", "mamba2", "short_conv"]
Routing = Literal["softmax_topk", "softmax_topk_unnormalized", "topk_softmax", "sigmoid_group_topk", "topk_sigmoid"]


@dataclass(frozen=True)
class MoE:
    """Where a mixture-of-experts MLP keeps its router and experts (paths relative to one block).

    Attributes:
        router: the module returning the router logits (and, ``sparse``, the top-k weights and indices).
        experts: the module holding every expert's weights.
        routing: how the router turns logits into expert weights; the bridge re-routes with it when
            ``hook_router_logits`` is edited. ``softmax_topk`` (Mixtral, Qwen-MoE, OLMoE: softmax over all
            experts, top-k, renormalised unless the router's ``norm_topk_prob`` is False),
            ``softmax_topk_unnormalized`` (Jamba: the same, never renormalised),
            ``topk_softmax`` (GPT-OSS: top-k logits, softmax over them), ``sigmoid_group_topk``
            (DeepSeek-V3), ``topk_sigmoid`` (Llama 4: sigmoid of the top-k logits, dense).
        dense: the router returns dense ``[token, expert]`` scores and the experts module runs every
            expert on its input scaled by them (Llama 4); otherwise the experts module takes
            ``(hidden, top_k_index, top_k_weights)``.
        shared: the shared expert, a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``) every token runs
            (Qwen2-MoE, Llama 4, DeepSeek-V3); ``shared_gate``: the linear map whose sigmoid scales its output
            (Qwen2-MoE). Their points are ``mlp.hook_shared_pre`` / ``hook_shared_post`` / ``hook_shared_gate``.
        router_output: what a sparse router returns, in order: ``("logits", "weights", "indices")`` (every
            family on current releases), ``("indices", "weights", "logits")`` (GraniteMoE before transformers
            5.21), or ``LINEAR_ROUTER``: a plain linear map whose logits the MoE block routes itself, handing the
            experts ``(hidden, top_k_index, top_k_weights)`` (Jamba before 5.21); there an edit of
            ``hook_router_logits`` is routed by HF's own code and ``hook_expert_weights`` is the experts' input.
    """

    router: str
    experts: str
    routing: Routing = "softmax_topk"
    dense: bool = False
    shared: str | None = None
    shared_gate: str | None = None
    router_output: tuple[str, ...] = ("logits", "weights", "indices")


# `MoE.router_output` of a router that is a plain linear map (its output: the logits alone).
LINEAR_ROUTER = ("logits",)


@dataclass(frozen=True)
class SSM:
    """Where a state-space or convolution mixer keeps its projections (paths relative to one block); the
    points each kind gets are listed in `transformer_bridge.sites.mixers`.

    Attributes:
        mixer: the mixer module (its output is ``hook_mixer_out``).
        in_proj: the input projection: ``[x | gate]`` (``mamba``), ``[gate | x B C | dt]`` (``mamba2``) or
            ``[B | C | x]`` (``short_conv``).
        x_proj: ``mamba``: the selection projection ``[dt | B | C]`` (``mixer.hook_dt``, ``hook_B``, ``hook_C``).
        out_proj: the output projection; its input is ``mixer.hook_y``.
        kind: ``mamba`` (Mamba 1: Mamba, Falcon-Mamba, Jamba), ``mamba2`` (Mamba 2: Mamba2, Bamba, Nemotron-H) or
            ``short_conv`` (LFM2's gated short convolution).
        selection_norms: ``mamba``: dt, B and C pass through RMS norms after ``x_proj`` (Jamba, Falcon-Mamba:
            ``dt_layernorm``, ``b_layernorm``, ``c_layernorm`` next to ``x_proj``); their outputs are the points.
        gated_norm: ``mamba2``: the gated RMS norm between the scan and ``out_proj``; its input is ``mixer.hook_scan``.
    """

    mixer: str = "mixer"
    in_proj: str = "mixer.in_proj"
    x_proj: str = "mixer.x_proj"
    out_proj: str = "mixer.out_proj"
    kind: MixerKind = "mamba"
    selection_norms: bool = False
    gated_norm: str | None = None


@dataclass(frozen=True)
class Adapter:
    """Declarative description of one HF architecture family.

    Attributes:
        model_types: ``config.model_type`` values this adapter serves.
        embed, pos_embed, blocks, ln_final, unembed: model-level module paths.
        ln1, ln2: norms before attention and before the MLP (block-relative). ``ln2`` is None, or names a
            module the block holds as None, where one norm feeds attention and MLP (Phi, GPT-J, Cohere,
            parallel Falcon / StableLM); both are None where the block has no pre-norms (OLMo 2).
        attn: the attention module; ``q``, ``k``, ``v``: its projections, or ``qkv`` when fused.
        qkv_layout: ``separate`` (three projections), ``concat`` (``[q | k | v]`` along features,
            GPT-2, Phi-3) or ``per_head`` (``[head, q|k|v, d_head]``, GPT-NeoX).
        o_proj: attention output projection; its input is ``hook_z``, its output ``hook_result``.
        attn_out, mlp_out: modules whose outputs are added to the residual stream.
        mlp_in: first MLP projection (``hook_pre``); gated families name the gate projection.
        mlp_up: up projection of gated MLPs (``hook_pre_linear``); ``fused_gate_up`` when
            ``mlp_in`` holds ``[gate | up]`` (Phi-3).
        mlp_down: last MLP projection; its input is ``hook_post``.
        norm: ``layernorm`` (mean-centred), ``rms``, ``rms_one_plus`` (weight stored as w - 1, Gemma) or
            ``layernorm_one_plus`` (a LayerNorm whose weight is stored as w - 1, Nemotron).
        parallel_attn_mlp: attention and MLP read the same residual: True, or the config attribute that
            says so (GPT-NeoX's ``use_parallel_residual``).
        attn_registry: attention runs through HF's attention registry, so the bridge offers ``hook_rot_q``,
            ``hook_rot_k`` (rotary families), ``hook_attn_scores`` and ``hook_pattern``. False where the HF
            module computes attention itself (GPT-J, GPT-Neo, Falcon).
        sdpa_call: without the registry, the HF attention module calls torch's SDPA itself (Falcon): the
            attention points come from that call (`attention.SdpaSite`).
        pattern_module: without the registry, the module whose output is the attention pattern (the
            dropout after the softmax in GPT-J and GPT-Neo); it serves ``hook_pattern``.
        mlp_out_mutated: HF adds to the MLP output in place (Falcon's parallel block), so a hooked MLP
            output is handed on as a copy.
        residual_multiplier: config attribute by which the attention and MLP outputs are multiplied before
            the residual add (Granite). ``hook_attn_out`` / ``hook_mlp_out`` are the sublayer outputs
            before it; the ``resid`` points and decompositions include it.
        conv1d: projections store weights ``[in, out]`` (GPT-2's Conv1D) instead of ``[out, in]``.
        q_norm, k_norm: per-head norms applied to q and k after their projections (Qwen 3); they get
            ``attn.q_norm.hook_scale`` / ``hook_normalized`` (and the same for ``k_norm``), shown as
            ``[batch, pos, head, d_head]`` (``[batch, pos, 1]`` for the scale) whatever the HF layout.
        qk_norm_layout: the layout HF hands the q/k norms: ``pos_head`` (``[b, pos, head, d]``, Qwen 3)
            or ``head_pos`` (``[b, head, pos, d]``, Gemma 3, Apertus, Hunyuan, EXAONE 4); ``flat``: one norm
            over all heads of the projection (OLMo 2), shown as HF has it, ``[b, pos, head * d_head]``.
        mla: multi-head latent attention (DeepSeek-V3): ``hook_q`` from the query projection, and instead
            of ``hook_k`` / ``hook_v`` the latent points of `transformer_bridge.sites.mla`; ``d_head`` is the value
            head width.
        ssm: a state-space family (`SSM`): its blocks have a mixer instead of attention and MLP, and get
            the points of `transformer_bridge.sites.ssm` (no attention or MLP points).
        hybrid: a hybrid family's state-space or convolution mixer (`SSM`): a block holding ``hybrid.out_proj``
            gets the mixer points (`transformer_bridge.sites.mixers`) instead of the attention points; a block without
            the attention's ``o_proj`` has no attention points, one without the MLP (or experts) no MLP points
            (Nemotron-H's blocks hold one sublayer each).
        moe: the mixture-of-experts layout (`MoE`); a block whose ``moe.experts`` module exists gets the
            MoE hook points instead of ``mlp.hook_pre`` / ``hook_pre_linear`` / ``hook_post``.
        transformers: the transformers releases this adapter describes (a PEP 440 range, ``""``: every
            supported release). A family HF restructured has one adapter per side of the change, and
            `adapter_for` picks the one for the installed release (GPT-J moved onto the attention
            interface in 5.24).
        sandwich: ``attn_out`` and ``mlp_out`` are norms applied to the sublayer outputs before the
            residual add (Gemma 2); they get ``ln1_post.*`` and ``ln2_post.*`` scale/normalized points.
        embed_norm: the ``ln_final`` module also normalises the embedding before the first block (NanoChat:
            one module, two calls per forward). Its first call in a forward serves ``ln_embed.hook_scale`` /
            ``hook_normalized``, its second ``ln_final.*``; ``blocks.0.hook_resid_pre`` is the normalised
            embedding, so decompositions count it as the embedding.
        positions_from_mask: the model derives positions from a 2-D attention mask itself (OPT), so a forward
            passes it no ``position_ids`` and its logits are HF's at every position, padding included.
    """

    model_types: tuple[str, ...]
    embed: str
    blocks: str
    ln_final: str
    ln1: str | None
    ln2: str | None
    attn: str
    o_proj: str
    attn_out: str
    mlp_out: str
    mlp_in: str
    mlp_down: str
    unembed: str = "lm_head"
    pos_embed: str | None = None
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    qkv_layout: QKVLayout = "separate"
    mlp_up: str | None = None
    fused_gate_up: bool = False
    norm: NormKind = "rms"
    parallel_attn_mlp: str | bool | None = None
    attn_registry: bool = True
    sdpa_call: bool = False
    pattern_module: str | None = None
    mlp_out_mutated: bool = False
    residual_multiplier: str | None = None
    conv1d: bool = False
    rotary: bool = True
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_layout: QKNormLayout = "pos_head"
    sandwich: bool = False
    moe: MoE | None = None
    ssm: SSM | None = None
    hybrid: SSM | None = None
    mla: bool = False
    embed_norm: bool = False
    positions_from_mask: bool = False
    transformers: str = ""

    @property
    def gated(self) -> bool:
        return self.mlp_up is not None or self.fused_gate_up

    @property
    def bool_4d_mask_is_keep(self) -> bool:
        """TransformerLens' flag for the meaning of a bool 4-D attention mask: True marks the pairs that attend,
        HF's convention, in every family (`inputs.split_4d_mask`)."""
        return True

    @property
    def has_mixers(self) -> bool:
        """Some layers are state-space or convolution mixers (``ssm`` or ``hybrid``): the model keeps a recurrent
        state besides its KV cache, which the row driver (controllers), speculative decoding and the static cache
        cannot rewind, copy per row or preallocate, and the LRP rules do not cover."""
        return self.ssm is not None or self.hybrid is not None

    def residual_scale(self, config: object) -> float:
        """What the sublayer outputs are multiplied by before the residual add (1.0 but for Granite)."""
        return float(getattr(config, self.residual_multiplier)) if self.residual_multiplier else 1.0

    def is_parallel(self, config: object) -> bool:
        """Whether attention and MLP read the same residual in a model with this HF ``config``."""
        if isinstance(self.parallel_attn_mlp, bool):
            return self.parallel_attn_mlp
        return bool(self.parallel_attn_mlp and getattr(config, self.parallel_attn_mlp, False))
