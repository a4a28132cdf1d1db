"""transformer-bridge's `TransformerBridge` with TransformerLens' constructors, building the port's tiny models."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

from transformer_bridge import TransformerBridge as _Bridge


class TransformerLensConfig:
    """TransformerLens' config object, as the tests build it: keyword fields as attributes."""

    def __init__(self, **kwargs):
        defaults = dict(
            n_key_value_heads=None,
            normalization_type="LN",
            act_fn="gelu",
            seed=None,
            dtype=torch.float32,
            device=None,
            d_vocab=-1,
            n_ctx=1024,
            d_mlp=None,
            positional_embedding_type="standard",
        )
        self.__dict__.update({**defaults, **kwargs})


TransformerBridgeConfig = TransformerLensConfig


class ArchitectureAdapter:
    """TransformerLens' architecture adapter, as a test constructs one (``LlamaArchitectureAdapter(cfg)``):
    model construction. transformer-bridge picks its adapter from the HF model's ``model_type``, so the
    bridge built with one wraps the same model the same way."""

    def __init__(self, cfg=None):
        self.cfg = cfg


class TransformerBridge(_Bridge):
    def __init__(self, model, adapter=None, tokenizer=None):
        if tokenizer is None and adapter is not None and not isinstance(adapter, ArchitectureAdapter):
            adapter, tokenizer = None, adapter  # TransformerBridge(model, tokenizer): this package's own call
        super().__init__(model, tokenizer)

    @classmethod
    def boot_transformers(
        cls,
        model_name,
        device=None,
        dtype=torch.float32,
        tokenizer=None,
        hf_model=None,
        n_ctx=None,
        load_weights=True,
        hf_config_overrides=None,
        **kwargs,
    ):
        if hf_model is None:  # this package's loader, with TransformerLens' loader options
            return cls.from_pretrained(model_name, dtype=dtype, device=device, tokenizer=tokenizer, n_ctx=n_ctx,
                                       hf_config_overrides=hf_config_overrides, load_weights=load_weights)  # fmt: skip
        model = hf_model.to(device) if device is not None else hf_model
        return cls(model.eval(), tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_name))

    @classmethod
    def boot_native(cls, cfg, dtype=None, **kwargs):
        """TransformerLens' own model from a TL config; here the HF family with that norm (LN: GPT-2, RMS: Llama).
        A bridge's own `cfg` (a test re-booting a model's config) gives the same sizes; ``dtype`` overrides."""
        if not isinstance(cfg, TransformerLensConfig):
            cfg = TransformerLensConfig(
                n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, d_head=cfg.d_head,
                d_vocab=cfg.d_vocab, n_ctx=cfg.n_ctx, d_mlp=cfg.d_mlp, n_key_value_heads=cfg.n_kv_heads,
                normalization_type="RMS" if cfg.normalization.startswith("rms") else "LN", dtype=cfg.dtype,
            )  # fmt: skip
        if dtype is not None:
            cfg.dtype = dtype
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        d_mlp = cfg.d_mlp or 4 * cfg.d_model
        if str(cfg.normalization_type).startswith("RMS"):
            hf = LlamaConfig(vocab_size=cfg.d_vocab, hidden_size=cfg.d_model, intermediate_size=d_mlp,
                             num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                             num_key_value_heads=cfg.n_key_value_heads or cfg.n_heads, head_dim=cfg.d_head,
                             max_position_embeddings=cfg.n_ctx)  # fmt: skip
        else:
            act = {"gelu": "gelu_new", "relu": "relu", "gelu_new": "gelu_new", "silu": "silu"}.get(
                cfg.act_fn, "gelu_new"
            )
            hf = GPT2Config(vocab_size=cfg.d_vocab, n_embd=cfg.d_model, n_inner=d_mlp, n_layer=cfg.n_layers,
                            n_head=cfg.n_heads, n_positions=cfg.n_ctx, activation_function=act)  # fmt: skip
        return cls(AutoModelForCausalLM.from_config(hf, dtype=cfg.dtype or torch.float32).eval(), None)


def build_bridge_from_module(model, architecture=None, *, tokenizer=None, dtype=None, device=None, **kwargs):
    return TransformerBridge(model.to(dtype=dtype) if dtype else model, tokenizer)
