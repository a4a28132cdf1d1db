"""Fixtures for the vLLM bridge: tiny seeded models of each family saved to disk, one eager engine per family
(in-process, 1 GB of KV cache), and the HF bridge on the same weights as the oracle. Skipped without vLLM."""

import contextlib
import os
import warnings

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks are plain calls
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

# vLLM's own import-time deprecations are not ours to fail on: imported here, quietly, when installed. The test
# modules skip without it (they import a submodule: without vLLM, `import vllm` finds this folder, a namespace package).
with warnings.catch_warnings(), contextlib.suppress(ImportError):
    warnings.simplefilter("ignore")
    import vllm.entrypoints.llm  # noqa: F401

import torch
import transformers

from transformer_bridge import TransformerBridge

# Distinct sizes (vocab 99, d_mlp 148, 4 heads, 2 kv heads); head_dim 64: vLLM's CPU attention refuses 16.
COMMON = dict(vocab_size=99, hidden_size=256, intermediate_size=148, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)  # fmt: skip
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(head_dim=64)),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=64)),
    "mistral": (transformers.MistralConfig, dict(head_dim=64, sliding_window=None)),
    "phi3": (transformers.Phi3Config, dict(pad_token_id=0)),
}
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256, seed=0)


def pytest_collection_modifyitems(items: list) -> None:
    for item in items:  # third-party code warning about third-party code (torch.distributed inside vLLM)
        if "tests/vllm" in str(item.fspath):
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))


def save_tiny(family: str, root) -> str:
    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**COMMON, **extra), dtype=torch.float32)
    with torch.no_grad():  # random non-trivial norm weights and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = str(root / family)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tiny")
    return lambda family: save_tiny(family, root) if not (root / family).exists() else str(root / family)


@pytest.fixture(scope="session")
def oracle(tiny_dir):
    """The HF bridge on the same saved weights."""
    made = {}

    def get(family: str) -> TransformerBridge:
        if family not in made:
            hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir(family), dtype=torch.float32).eval()
            made[family] = TransformerBridge(hf)
        return made[family]

    return get


@pytest.fixture(scope="session")
def engine(tiny_dir):
    """One eager vLLM bridge per family, made on first use."""
    from transformer_bridge.vllm import VLLMBridge

    made = {}

    def get(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = VLLMBridge.from_pretrained(tiny_dir(family), **{**ENGINE, **kwargs})
        return made[key]

    return get


@pytest.fixture(scope="session")
def fresh_engine(tiny_dir):
    """A new eager vLLM bridge with extra engine keywords (not shared). Each is kept until the session ends: an
    in-process engine that is freed tears down vLLM's process-wide parallel state, which the others still use."""
    from transformer_bridge.vllm import VLLMBridge

    kept = []

    def make(family: str, **kwargs):  # a family of FAMILIES, or a model folder
        path = tiny_dir(family) if family in FAMILIES else family
        kept.append(VLLMBridge.from_pretrained(path, **{**ENGINE, **kwargs}))
        return kept[-1]

    return make
