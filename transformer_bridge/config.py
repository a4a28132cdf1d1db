"""`BridgeConfig`: the wrapped model's sizes and TransformerLens' `cfg` names, read once from the HF config."""

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from .adapters import Adapter
from .moe import is_moe_block
from .sites import get_module


@dataclass
class BridgeConfig:
    """Sizes of the wrapped model in the project's dimension vocabulary, plus TransformerLens' `cfg` names.

    ``default_prepend_bos`` (TransformerLens' rule: True when the tokenizer has a BOS token) decides
    whether text gets a BOS token when a call does not say, and ``default_padding_side`` how
    `to_tokens` pads a batch; they are the fields meant to be changed
    (``model.cfg.default_prepend_bos = False``).

    Mixture-of-experts families set ``num_experts`` and ``experts_per_token`` (TransformerLens' names; None
    otherwise), with ``d_mlp`` one expert's width when no block is dense. State-space families (Mamba) have
    ``n_heads = d_head = 0`` and ``d_mlp`` the mixer's width.

    Example:
        >>> model.cfg.n_layers, model.cfg.d_head, model.cfg.default_prepend_bos
    """

    model_type: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int | None
    parallel_attn_mlp: bool
    gated_mlp: bool
    normalization: str
    act_fn: str | None = None
    positional_embedding_type: str = "standard"
    default_prepend_bos: bool = True
    default_padding_side: str = "right"
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    tokenizer_name: str | None = None
    num_experts: int | None = None
    experts_per_token: int | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None

    @property
    def n_key_value_heads(self) -> int:
        """TransformerLens' name for `n_kv_heads`."""
        return self.n_kv_heads

    @property
    def normalization_type(self) -> str:
        """TransformerLens' name: ``"LN"`` (LayerNorm) or ``"RMS"`` (RMSNorm, Gemma's 1 + w included)."""
        return "LN" if self.normalization == "layernorm" else "RMS"

    @property
    def d_vocab_out(self) -> int:
        return self.d_vocab

    @property
    def model_name(self) -> str:
        return self.tokenizer_name or self.model_type


def bridge_config(model: PreTrainedModel, adapter: Adapter, tokenizer: Any = None) -> BridgeConfig:
    """The `BridgeConfig` of ``model`` (an HF causal LM of ``adapter``'s family)."""
    c = model.config
    n_heads = getattr(c, "num_attention_heads", None) or 0  # 0: a state-space model has no attention
    d_model = c.hidden_size
    d_head = getattr(c, "head_dim", None) or (d_model // n_heads if n_heads else 0)
    if adapter.mla:  # DeepSeek's config.head_dim is the rotary width; z and result are per value head
        d_head = c.v_head_dim
    dense = [b for b in get_module(model, adapter.blocks) if not is_moe_block(b, adapter.moe)]
    if dense:
        down = get_module(dense[0], adapter.mlp_down)
        d_mlp = down.weight.shape[0] if adapter.conv1d else down.weight.shape[1]
    else:  # every block is a mixture of experts: one expert's hidden width, as TransformerLens' Mixtral
        d_mlp = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    parallel = adapter.is_parallel(c)
    return BridgeConfig(
        model_type=c.model_type,
        n_layers=c.num_hidden_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=_kv_heads(model, adapter, c, n_heads, d_head),
        d_head=d_head,
        d_mlp=d_mlp,
        d_vocab=model.get_output_embeddings().weight.shape[0],
        n_ctx=getattr(c, "max_position_embeddings", None),
        parallel_attn_mlp=parallel,
        gated_mlp=adapter.gated,
        num_experts=(getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)) if adapter.moe else None,
        experts_per_token=getattr(c, "num_experts_per_tok", None) if adapter.moe else None,
        normalization=adapter.norm,
        act_fn=getattr(c, "hidden_act", None) or getattr(c, "activation_function", None),
        positional_embedding_type="standard" if adapter.pos_embed else ("rotary" if adapter.rotary else "none"),
        default_prepend_bos=getattr(tokenizer, "bos_token_id", None) is not None,
        eos_token_id=_first_id(getattr(tokenizer, "eos_token_id", None), getattr(c, "eos_token_id", None)),
        bos_token_id=_first_id(getattr(tokenizer, "bos_token_id", None), getattr(c, "bos_token_id", None)),
        tokenizer_name=getattr(tokenizer, "name_or_path", None) or None,
        dtype=next(model.parameters()).dtype,
        device=next(model.parameters()).device,
    )


def _kv_heads(model: PreTrainedModel, adapter: Adapter, c: Any, n_heads: int, d_head: int) -> int:
    """Key/value heads; read off a fused ``[q | k | v]`` projection, whose config may not say (Falcon's
    ``multi_query`` keeps one kv head whatever ``num_kv_heads`` says)."""
    if adapter.qkv is not None and adapter.qkv_layout == "per_head":  # [head, q|k|v, d]: no GQA
        return n_heads
    if adapter.qkv is not None and adapter.qkv_layout == "concat":
        w = get_module(get_module(model, adapter.blocks)[0], adapter.qkv).weight
        width = w.shape[1] if adapter.conv1d else w.shape[0]
        return (width // d_head - n_heads) // 2
    return getattr(c, "num_key_value_heads", None) or n_heads


def _first_id(*values: Any) -> int | None:
    for value in values:
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
