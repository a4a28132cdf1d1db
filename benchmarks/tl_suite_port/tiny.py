"""Tiny seeded HF models and one tokenizer for the TransformerLens-suite port (no hub): the same model for a
name on both sides. Imported by the port's conftest.py, which installs `patch_transformers()`."""

import copy
import functools
import os
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SMOLLM2 = Path(os.environ.get("TLS_TOKENIZER", Path.home() / ".cache/transformer_bridge/SmolLM2-135M-Instruct"))
VOCAB = 49152
_REAL = {"config": AutoConfig.from_pretrained, "model": AutoModelForCausalLM.from_pretrained,
         "tokenizer": AutoTokenizer.from_pretrained}  # fmt: skip


def family_of(name: str) -> tuple[str, dict]:
    """(model_type, config kwargs) standing in for a hub name."""
    n = str(name).lower()
    if "distilgpt2" in n:
        return "gpt2", dict(n_layer=6, n_embd=64, n_head=4, n_positions=1024)
    if "pythia" in n or "neox" in n:
        return "gpt_neox", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                max_position_embeddings=2048, rotary_pct=0.25)  # fmt: skip
    if "gemma" in n:
        return "gemma2", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=128, max_position_embeddings=1024)  # fmt: skip
    if "opt" in n:
        return "opt", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=256,
                           word_embed_proj_dim=64, max_position_embeddings=1024)  # fmt: skip
    for key, kind in (("mistral", "mistral"), ("qwen", "qwen2"), ("llama", "llama"), ("smollm", "llama")):
        if key in n:
            return kind, dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, max_position_embeddings=1024)  # fmt: skip
    return "gpt2", dict(n_layer=12, n_embd=64, n_head=4, n_positions=1024)


def tiny_config(name: str, **overrides):
    kind, kw = family_of(name)
    cfg = AutoConfig.for_model(kind, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, **kw)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_config_like_hf(name: str, *_, return_unused_kwargs=False, **kwargs):
    """`AutoConfig.from_pretrained` on a hub name: the tiny config, with config keywords read as HF reads them
    (fields set, ``attn_implementation`` applied, the rest returned unused when asked)."""
    loading = {"revision", "trust_remote_code", "cache_dir", "local_files_only", "token", "gguf_file"}
    base = tiny_config(name)
    fields = {k: v for k, v in kwargs.items() if k not in loading}
    return type(base).from_dict(base.to_dict(), return_unused_kwargs=return_unused_kwargs, **fields)


def tiny_model(name: str, config=None, dtype=None, attn_implementation=None, **_):
    torch.manual_seed(sum(map(ord, str(name))))
    cfg = config if config is not None else tiny_config(name)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
    model.config._name_or_path = str(name)  # as HF's from_pretrained records it
    return model.eval()


@functools.cache
def _base_tokenizer():
    tok = _REAL["tokenizer"](str(SMOLLM2))
    tok.add_special_tokens({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    tok.pad_token = None
    tok.chat_template = None
    return tok


def tiny_tokenizer(*_, **__):
    return copy.deepcopy(_base_tokenizer())


def patch_transformers() -> None:
    """Route hub loads of configs, causal LMs and tokenizers to the tiny stand-ins (both sides alike)."""
    AutoConfig.from_pretrained = staticmethod(tiny_config_like_hf)
    AutoModelForCausalLM.from_pretrained = staticmethod(lambda name, *a, **k: tiny_model(name, **k))
    AutoTokenizer.from_pretrained = staticmethod(tiny_tokenizer)
    transformers.AutoConfig, transformers.AutoModelForCausalLM = AutoConfig, AutoModelForCausalLM
