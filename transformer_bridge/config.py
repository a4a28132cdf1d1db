"""`BridgeConfig`: the wrapped model's sizes and TransformerLens' `cfg` names, read once from the HF config."""

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import PreTrainedModel

from .adapters import Adapter
from .adapters.base import centred
from .sites.mixers import holds
from .sites.module_paths import get_module
from .sites.moe import is_moe_block
from .sites.split_inputs import EXCLUSIVE, ON_DEMAND, SWITCHES, Switches, refusals


class ConfigFieldError(AttributeError, ValueError):
    """An assignment to ``model.cfg`` that the bridge cannot honour: a field read off the HF model, an unknown
    name, or a value a field does not take. Also a `ValueError`, for code that catches that."""


@dataclass
class BridgeConfig:
    """Sizes of the wrapped model in the project's dimension vocabulary, plus TransformerLens' `cfg` names.

    Every field can be read; the fields a user may assign take effect where TransformerLens reads them, and
    any other assignment raises `ConfigFieldError` naming the field (nothing is silently ignored):

    - ``default_prepend_bos``: whether text gets a BOS token when a call does not say (TransformerLens' rule:
      True when the tokenizer has one); ``default_padding_side``: how `to_tokens` pads a batch, and whether
      token ids are read as left-padded.
    - ``tokenizer_appends_eos``: strip the EOS a tokenizer appends (OLMo-style) from `to_tokens`' rows.
    - ``eos_token_id`` / ``bos_token_id`` (an id, a list of ids for EOS, or None): written through to
      ``hf_model.generation_config``, the source `generate` reads, so generation stops at that EOS (None or
      ``[]``: at no EOS); ``bos_token_id`` is also the BOS that left-padded ids keep.
    - ``n_ctx``: the context limit inputs are checked and `to_tokens` truncates against.
    - ``use_attn_result``: False by default, as in TransformerLens: caches of all points (and filters given as
      predicates) leave ``attn.hook_result`` out, while a hook or ``names_filter`` naming it computes it (from
      ``hook_z`` and the output projection); True puts it in caches of all points. The cache's head analyses
      compute each head's output from ``hook_z`` either way.
    - ``use_split_qkv_input`` / ``use_attn_in`` / ``use_hook_mlp_in`` (False by default; TransformerLens'
      switches, also ``model.set_use_split_qkv_input(True)`` …): switch on ``blocks.L.hook_q_input`` /
      ``hook_k_input`` / ``hook_v_input``, ``hook_attn_in`` and ``hook_mlp_in``, copies of the residual stream
      that the model reads (per head for Q / K / V, ln1 applied to each copy; see `split_inputs`). Off, their
      points are off as ``hook_result`` is; on but unhooked they cost nothing. The first two are mutually
      exclusive; a family that cannot honour one exactly (latent attention, state-space and hybrid models;
      ``hook_mlp_in`` where one norm feeds attention and the MLP) refuses True with `ConfigFieldError`.

    Mixture-of-experts families set ``num_experts`` and ``experts_per_token`` (TransformerLens' names; None
    otherwise), with ``d_mlp`` one expert's width when no block is dense. State-space families (Mamba) have
    ``n_heads = d_head = 0`` and ``d_mlp`` the mixer's width.

    Example:
        >>> model.cfg.n_layers, model.cfg.d_head, model.cfg.default_prepend_bos
        >>> model.cfg.default_prepend_bos = False          # honoured by to_tokens, forward, generate ...
        >>> model.cfg.n_layers = 3                         # raises ConfigFieldError: read off the HF model
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
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    tokenizer_name: str | None = None
    name_or_path: str | None = None  # what the HF model was loaded from (its config's ``_name_or_path``)
    num_experts: int | None = None
    experts_per_token: int | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None
    tokenizer_appends_eos: bool = False
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    use_attn_in: bool = False
    use_hook_mlp_in: bool = False
    # Why this model refuses a split-input switch (field -> reason; `split_inputs.refusals`); set by `bridge_config`.
    split_refusals: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # The bridge's switchable points (`split_inputs.Switches`): its hook_dict follows the switches above.
    switches: Switches = field(default_factory=Switches, repr=False, compare=False)
    # Where assigned BOS / EOS ids are written through (the HF model's generation config); set by `bridge_config`.
    generation_config: Any = field(default=None, repr=False, compare=False)
    locked: bool = field(default=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("locked", False):
            object.__setattr__(self, name, value)
            return
        rule = _ASSIGNABLE.get(name)
        if rule is None:
            raise ConfigFieldError(_refusal(name))
        value = rule(self, value)
        if name in SWITCHES and not value and (hooked := self.switches.hooked(name)):
            raise ConfigFieldError(
                f"`cfg.{name}` = False would switch off points that have hooks ({hooked[:3]}); remove them first "
                "(`model.reset_hooks(including_permanent=True)`)."
            )
        object.__setattr__(self, name, value)
        if name in SWITCHES or name in ON_DEMAND:
            self.switches.show()  # hook_dict (and what selections leave out) follows the switch

    def assigned(self) -> dict[str, Any]:
        """The values of the assignable fields (what a copy of the bridge carries over)."""
        return {name: getattr(self, name) for name in _ASSIGNABLE}

    def assign(self, values: dict[str, Any]) -> None:
        """Assign several fields, each checked as ``cfg.<name> = value`` is."""
        for name, value in values.items():
            setattr(self, name, value)

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
        """What the model was loaded from (HF's ``config._name_or_path``), else its tokenizer's, else its type."""
        return self.name_or_path or self.tokenizer_name or self.model_type


_READ_OFF = ("dtype", "device")


def _refusal(name: str) -> str:
    assignable = ", ".join(f"`{n}`" for n in _ASSIGNABLE)
    if name in _READ_OFF:
        return (
            f"`cfg.{name}` cannot be assigned: it says where the HF model's weights are; move or cast the model "
            f"instead (`model.to({'torch.float16' if name == 'dtype' else repr('cuda')})`). Assignable: {assignable}."
        )
    if name in {f.name for f in fields(BridgeConfig)} or isinstance(getattr(BridgeConfig, name, None), property):
        return (
            f"`cfg.{name}` cannot be assigned: it is read off the wrapped HF model, which the bridge runs unchanged "
            f"(build or load a different HF model to change it). Assignable: {assignable}."
        )
    return f"`cfg` has no field `{name}` (a misspelling?); assignable fields: {assignable}."


def _bool(name: str) -> Callable[[BridgeConfig, Any], bool]:
    def check(cfg: BridgeConfig, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigFieldError(f"`cfg.{name}` must be True or False, got {type(value).__name__} {value!r}.")
        return value

    return check


def _padding_side(cfg: BridgeConfig, value: Any) -> str:
    if value not in ("left", "right"):
        raise ConfigFieldError(f"`cfg.default_padding_side` must be 'left' or 'right', got {value!r}.")
    return value


def _n_ctx(cfg: BridgeConfig, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigFieldError(f"`cfg.n_ctx` must be a positive int (a context limit) or None, got {value!r}.")
    return value


def _token_ids(name: str, many: bool) -> Callable[[BridgeConfig, Any], Any]:
    def check(cfg: BridgeConfig, value: Any) -> Any:
        ids = value if many and isinstance(value, (list, tuple)) else [] if value is None else [value]
        # An EOS id past the vocabulary (GPT-2's 50256 on a smaller model) is never produced: harmless, as in
        # generate's reading of the model's own config; a BOS id is fed to the model, so it must be in it.
        top = None if many else cfg.d_vocab - 1
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (top is not None and t > top):
                kind = "a token id (≥ 0), a list of them, or None" if many else f"a token id in [0, {top}] or None"
                raise ConfigFieldError(f"`cfg.{name}` must be {kind}, got {type(value).__name__} {value!r}.")
        stored = list(value) if isinstance(value, (list, tuple)) else value
        if cfg.generation_config is not None:  # what `generate` reads first; [] means: stop at no EOS
            setattr(cfg.generation_config, name, [] if many and value is None else stored)
        return stored

    return check


def _split_flag(name: str) -> Callable[[BridgeConfig, Any], bool]:
    """A split-input switch: True where the family can honour it exactly, and not with its exclusive twin."""
    as_bool = _bool(name)

    def check(cfg: BridgeConfig, value: Any) -> bool:
        if as_bool(cfg, value) and (why := cfg.split_refusals.get(name)):
            raise ConfigFieldError(f"`cfg.{name}` = True is not offered for model_type {cfg.model_type!r}: {why}.")
        other = EXCLUSIVE.get(name)
        if value and other and getattr(cfg, other):
            raise ConfigFieldError(
                f"`cfg.{name}` and `cfg.{other}` are mutually exclusive (TransformerLens' rule); set "
                f"`cfg.{other} = False` (`model.set_{other}(False)`) before `cfg.{name} = True`."
            )
        return value

    return check


_ASSIGNABLE: dict[str, Callable[[BridgeConfig, Any], Any]] = {
    "default_prepend_bos": _bool("default_prepend_bos"),
    "default_padding_side": _padding_side,
    "tokenizer_appends_eos": _bool("tokenizer_appends_eos"),
    "eos_token_id": _token_ids("eos_token_id", many=True),
    "bos_token_id": _token_ids("bos_token_id", many=False),
    "n_ctx": _n_ctx,
    "use_attn_result": _bool("use_attn_result"),
    "use_split_qkv_input": _split_flag("use_split_qkv_input"),
    "use_attn_in": _split_flag("use_attn_in"),
    "use_hook_mlp_in": _split_flag("use_hook_mlp_in"),
}


def bridge_config(model: PreTrainedModel, adapter: Adapter, tokenizer: Any = None) -> BridgeConfig:
    """The `BridgeConfig` of ``model`` (an HF causal LM of ``adapter``'s family)."""
    c = model.config
    n_heads = getattr(c, "num_attention_heads", None) or 0  # 0: a state-space model has no attention
    d_model = c.hidden_size
    d_head = getattr(c, "head_dim", None) or (d_model // n_heads if n_heads else 0)
    if adapter.mla:  # DeepSeek's config.head_dim is the rotary width; z and result are per value head
        d_head = c.v_head_dim
    blocks = get_module(model, adapter.blocks)
    # A hybrid's blocks without an MLP (Nemotron-H's mixer and attention blocks) say nothing about its width.
    dense = [b for b in blocks if not is_moe_block(b, adapter.moe) and holds(b, adapter.mlp_down, adapter)]
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
        # TransformerLens' meaning: "layernorm" (centred) or an RMS kind; Nemotron's LayerNorm1P is a LayerNorm.
        normalization="layernorm" if centred(adapter.norm) else adapter.norm,
        act_fn=getattr(c, "hidden_act", None) or getattr(c, "activation_function", None),
        positional_embedding_type="standard" if adapter.pos_embed else ("rotary" if adapter.rotary else "none"),
        default_prepend_bos=getattr(tokenizer, "bos_token_id", None) is not None,
        eos_token_id=_first_id(getattr(tokenizer, "eos_token_id", None), getattr(c, "eos_token_id", None)),
        bos_token_id=_first_id(getattr(tokenizer, "bos_token_id", None), getattr(c, "bos_token_id", None)),
        tokenizer_name=getattr(tokenizer, "name_or_path", None) or None,
        name_or_path=getattr(c, "_name_or_path", None) or None,
        dtype=next(model.parameters()).dtype,
        device=next(model.parameters()).device,
        tokenizer_appends_eos=_appends_eos(tokenizer),
        generation_config=getattr(model, "generation_config", None),
        split_refusals=refusals(model, adapter, blocks, parallel),
        locked=True,
    )


def _appends_eos(tokenizer: Any) -> bool:
    """Whether the tokenizer ends its encodings with EOS (OLMo-style), TransformerLens' detection."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None or eos == getattr(tokenizer, "bos_token_id", None):
        return False
    try:
        ids = tokenizer("a")["input_ids"]
    except Exception:  # a tokenizer that cannot encode plain text says nothing about EOS
        return False
    return bool(ids) and ids[-1] == eos


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
