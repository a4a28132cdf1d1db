"""Shared fixtures: tiny seeded models of every supported family, a character tokenizer, SmolLM2."""

import contextlib
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    FalconConfig,
    Gemma2Config,
    GPT2Config,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from transformer_bridge import TransformerBridge
from transformer_bridge.adapters import (
    ADAPTERS,
    SUPPORTED_MODEL_TYPES,
    Adapter,
    UnsupportedArchitectureError,
    adapter_for,
)

# Under pytest-xdist (`make test` runs `-n auto`) each worker gets its share of the cores, so that N workers of
# torch's default N threads each do not oversubscribe the machine; set in the environment too, so that the
# subprocesses tests start (and compare with bitwise) compute with the same thread count.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Distinct sizes so a swapped axis fails loudly: vocab 99, d_model 32, d_mlp 37, 4 heads, 2 kv heads.
V, D, M, H, KV, L = 99, 32, 37, 4, 2, 2
_COMMON = dict(vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_ROPE = dict(_COMMON, hidden_size=D, intermediate_size=M, num_hidden_layers=L, num_attention_heads=H,
             num_key_value_heads=KV, max_position_embeddings=128)  # fmt: skip


def _auto(model_type: str, **overrides):
    """A tiny config of ``model_type`` with the shared sizes (4 heads, 2 kv heads) and ``overrides``."""
    return AutoConfig.for_model(model_type, **{**_ROPE, **overrides})


CONFIGS = {
    "gpt2": lambda: GPT2Config(**_COMMON, n_embd=D, n_inner=M, n_layer=L, n_head=H, n_positions=128),
    "llama": lambda: LlamaConfig(**_ROPE),
    "mistral": lambda: MistralConfig(**_ROPE, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**_ROPE),
    "qwen3": lambda: Qwen3Config(**_ROPE, head_dim=8),
    "gemma2": lambda: Gemma2Config(**_ROPE, head_dim=8),
    "gpt_neox": lambda: GPTNeoXConfig(**{k: v for k, v in _ROPE.items() if k != "num_key_value_heads"}),
    "phi3": lambda: Phi3Config(**_ROPE),
    "opt": lambda: OPTConfig(**_COMMON, hidden_size=D, ffn_dim=M, num_hidden_layers=L, num_attention_heads=H,
                             word_embed_proj_dim=D, max_position_embeddings=128),
    # Dense families of #12. Windows of 4 tokens bite on the 6-token test prompts; layer 0 is windowed.
    "gemma": lambda: _auto("gemma", head_dim=8),
    "gemma3_text": lambda: _auto("gemma3_text", head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                 layer_types=["sliding_attention", "full_attention"]),
    "glm": lambda: _auto("glm", head_dim=8),
    "glm4": lambda: _auto("glm4", head_dim=8),
    "stablelm": lambda: _auto("stablelm", use_qkv_bias=True),
    "starcoder2": lambda: _auto("starcoder2", sliding_window=4),
    "olmo": lambda: _auto("olmo"),
    "smollm3": lambda: _auto("smollm3", no_rope_layers=[1, 0], layer_types=["full_attention"] * L),
    "helium": lambda: _auto("helium", head_dim=8),
    "ministral": lambda: _auto("ministral", head_dim=8, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"]),
    "seed_oss": lambda: _auto("seed_oss", head_dim=8),
    "ernie4_5": lambda: _auto("ernie4_5", head_dim=8),
    "hunyuan_v1_dense": lambda: _auto("hunyuan_v1_dense", head_dim=8),
    "arcee": lambda: _auto("arcee", head_dim=8),
    "apertus": lambda: _auto("apertus", rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "phi": lambda: _auto("phi", head_dim=8),
    "cohere": lambda: _auto("cohere", logit_scale=0.5),
    # No GQA in GPT-J, GPT-Neo, GPT-BigCode, Falcon: their configs get no kv-head count (BigCode and Falcon
    # are multi-query: one kv head).
    "gptj": lambda: GPTJConfig(**_COMMON, n_embd=D, n_inner=M, n_layer=L, n_head=H, rotary_dim=4, n_positions=128),
    "falcon": lambda: FalconConfig(**_COMMON, hidden_size=D, ffn_hidden_size=M, num_hidden_layers=L,
                                   num_attention_heads=H, bias=True),
    "olmo2": lambda: _auto("olmo2"),
    "olmo3": lambda: _auto("olmo3", sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "exaone4": lambda: _auto("exaone4", sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "gpt_bigcode": lambda: GPTBigCodeConfig(**_COMMON, n_embd=D, n_inner=M, n_layer=L, n_head=H, n_positions=128),
    # Multipliers far from 1 so a missing one fails loudly.
    "granite": lambda: _auto("granite", embedding_multiplier=3.0, residual_multiplier=2.0, attention_multiplier=0.5,
                             logits_scaling=0.5),
    "cwm": lambda: _auto("cwm", head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "vaultgemma": lambda: _auto("vaultgemma", head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                layer_types=["full_attention", "sliding_attention"]),
    "persimmon": lambda: _auto("persimmon", qk_layernorm=True),
    "gpt_neo": lambda: GPTNeoConfig(**_COMMON, hidden_size=D, intermediate_size=M, num_layers=L, num_heads=H,
                                    attention_types=[[["local", "global"], 1]], window_size=4,
                                    max_position_embeddings=128),
    # Known layouts under other names (#22). Ministral 3: the query scale changes at position 4; Cohere 2: layer 0
    # a 4-token window with RoPE, layer 1 global without positions.
    "ministral3": lambda: _auto("ministral3", head_dim=8, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
        "original_max_position_embeddings": 4}),
    "cohere2": lambda: _auto("cohere2", logit_scale=0.5, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"]),
    "jais2": lambda: _auto("jais2"),
    # LayerNorm1P (weight stored as w - 1), relu² MLP without a gate, partial rotary (half of each head).
    "nemotron": lambda: _auto("nemotron", head_dim=8),
    # One norm module for the embedding and the final norm; q/k norms after RoPE; a final logit soft-cap.
    "nanochat": lambda: _auto("nanochat", head_dim=8, final_logit_softcapping=15.0),
    # DeepSeek-V3's latent attention (query / key heads 10 wide, value heads 8), dense MLPs.
    "youtu": lambda: _auto("youtu", q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6,
                           v_head_dim=8, num_key_value_heads=H,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}  # fmt: skip
# Mixture-of-experts families of #12: 4 experts, top-2, the eager experts loop (the default kernel,
# grouped_mm, needs 16-byte rows: tests/sites/test_moe.py runs it at width 36). Qwen2-MoE: a shared expert (width
# 41) and top-k weights not renormalised.
_E = dict(num_experts=4, num_experts_per_tok=2, experts_implementation="eager")
_GLM4_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=M,
                 first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True, head_dim=8,
                 experts_implementation="eager")  # fmt: skip
MOE_CONFIGS = {
    "mixtral": lambda: _auto("mixtral", num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"),
    "qwen2_moe": lambda: _auto("qwen2_moe", **_E, moe_intermediate_size=M, shared_expert_intermediate_size=41,
                               norm_topk_prob=False),
    "qwen3_moe": lambda: _auto("qwen3_moe", **_E, moe_intermediate_size=M, head_dim=8, norm_topk_prob=True),
    "olmoe": lambda: _auto("olmoe", **_E),
    # Attention sinks; layer 0 has a 4-token window.
    "gpt_oss": lambda: _auto("gpt_oss", num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager",
                             head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    # Layer 0: dense MLP, rotary and 4-token attention chunks; layer 1: MoE, no rotary (NoPE), full attention.
    "llama4_text": lambda: _auto("llama4_text", num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                 intermediate_size_mlp=M, experts_implementation="eager", attention_chunk_size=4,
                                 moe_layers=[1], no_rope_layers=[1, 0]),
    # MLA attention (query / key heads 10 wide, value heads 8) and group routing; layer 0 has a dense MLP.
    "deepseek_v3": lambda: _auto("deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                 moe_intermediate_size=M, first_k_dense_replace=1, n_shared_experts=1,
                                 q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6,
                                 v_head_dim=8, num_key_value_heads=H, experts_implementation="eager",
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Granite's multipliers far from 1, as for "granite".
    "granitemoe": lambda: _auto("granitemoe", num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0,
                                residual_multiplier=2.0, attention_multiplier=0.5, logits_scaling=0.5,
                                experts_implementation="eager"),
    "flex_olmo": lambda: _auto("flex_olmo", **_E),
    # Layer 0 dense, layer 1 group-routed experts with a shared expert; per-head q/k norms, half the head rotary.
    "glm4_moe": lambda: _auto("glm4_moe", **_GLM4_MOE),
}  # fmt: skip
CONFIGS.update(MOE_CONFIGS)
# State-space families: not in FAMILIES (those tests are about attention and MLPs); tests/sites/test_ssm.py.
SSM_CONFIGS = {
    "mamba": lambda: AutoConfig.for_model(
        "mamba", **_COMMON, hidden_size=D, state_size=8, num_hidden_layers=L, expand=2, conv_kernel=4, time_step_rank=2
    ),
    "falcon_mamba": lambda: AutoConfig.for_model("falcon_mamba", **_COMMON, hidden_size=D, state_size=8,
                                                 num_hidden_layers=L, expand=2, conv_kernel=4, time_step_rank=2),
    # Mamba 2: 4 heads of 16 (d_inner 64), one B/C group of state size 8, chunks of 4 so a 6-token prompt spans two.
    "mamba2": lambda: AutoConfig.for_model("mamba2", **_COMMON, hidden_size=D, num_heads=4, head_dim=16, state_size=8,
                                           n_groups=1, num_hidden_layers=L, expand=2, conv_kernel=4, chunk_size=4),
}  # fmt: skip
# Hybrids (attention layers and state-space / convolution layers): tests/sites/test_mixer_families.py. Layer 0 is the
# mixer, layer 1 attention; Nemotron-H has one block of each of its four kinds.
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
               mamba_chunk_size=4)  # fmt: skip
HYBRID_CONFIGS = {
    "bamba": lambda: _auto("bamba", **_MAMBA2, attn_layer_indices=[1]),
    # Layer 1: attention (no positions) and a mixture of experts (softmax top-2 of 4, not renormalised).
    "jamba": lambda: _auto("jamba", attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                           expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                           mamba_expand=2, mamba_dt_rank=2, experts_implementation="eager"),
    "lfm2": lambda: _auto("lfm2", layer_types=["conv", "full_attention"], conv_L_cache=3, block_ff_dim=M,
                          block_auto_adjust_ff_dim=False),
    # Mamba 2, attention, relu² MLP, mixture of experts (group routing, a shared expert).
    "nemotron_h": lambda: _auto("nemotron_h", num_hidden_layers=4,
                                layer_types=["linear_attention", "full_attention", "mlp", "moe"], mamba_num_heads=4,
                                mamba_head_dim=16, ssm_state_size=8, n_groups=1, conv_kernel=4, expand=2, chunk_size=4,
                                head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                moe_intermediate_size=M, moe_shared_expert_intermediate_size=41,
                                experts_implementation="eager"),
}  # fmt: skip
# Model types transformers builds with the class of a family above (tests/adapters/test_aliases.py): type ->
# (twin, config).
ALIAS_CONFIGS = {
    "exaone": ("llama", lambda: _auto("exaone", head_dim=8)),
    "internlm3": ("llama", lambda: _auto("internlm3", head_dim=8)),
    "iquestcoder": ("llama", lambda: _auto("iquestcoder", head_dim=8)),
    "sarvam_mla": ("deepseek_v3", lambda: _renamed("sarvam_mla", MOE_CONFIGS["deepseek_v3"]())),
    "sarvam_moe": ("glm4_moe", lambda: _renamed("sarvam_moe", MOE_CONFIGS["glm4_moe"]())),
}  # fmt: skip


def _renamed(model_type: str, config):
    """``config``'s settings as a config of ``model_type`` (the eager experts loop, as the twin's)."""
    settings = {k: v for k, v in config.to_diff_dict().items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(model_type, **settings, experts_implementation="eager")


FAMILIES = list(CONFIGS)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """99-token character tokenizer (4 specials + printable ASCII) that adds BOS, like Llama's."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def declared_adapter(model_type: str) -> Adapter:
    """The bridge's adapter for ``model_type`` whatever the installed transformers (its layout facts: MoE or not, the
    norm kind ...); `adapter_for` is the one a wrap uses, and raises outside the adapter's release range. The keys
    of CONFIGS and MOE_CONFIGS are model types."""
    return next(a for a in ADAPTERS if model_type in a.model_types)


def adapted_config(model_type: str, make_config):
    """``make_config()``, or a skip naming the installed transformers when the bridge's adapter for ``model_type``
    covers other releases (`Adapter.transformers`) or the release has no such model type."""
    try:
        adapter_for(model_type)
    except UnsupportedArchitectureError as e:
        if model_type in SUPPORTED_MODEL_TYPES:  # an adapter for other releases; an unknown type is a failure
            pytest.skip(str(e))
        raise
    try:
        return make_config()
    except (KeyError, ValueError) as e:  # an unknown model type
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}: {str(e).splitlines()[0][:120]}")


def make_hf(family: str, seed: int = 0) -> torch.nn.Module:
    config = adapted_config(family, CONFIGS[family])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def make_bridge(family: str, seed: int = 0) -> TransformerBridge:
    """A fresh bridge over a fresh tiny model (the HF model is reachable as ``.hf_model``)."""
    return TransformerBridge(make_hf(family, seed), char_tokenizer())


def normalized_input(model: TransformerBridge, cache, layer: int, mlp: bool = False) -> torch.Tensor:
    """``hook_normalized`` of the norm before ``layer``'s attention (the MLP's with ``mlp``): the other norm's
    where one feeds both (Phi, GPT-J), the residual stream itself where there is none (OLMo 2)."""
    for norm in ("ln2", "ln1") if mlp else ("ln1",):
        if f"blocks.{layer}.{norm}.hook_normalized" in model.hook_dict:
            if norm == "ln1" and mlp and not model.cfg.parallel_attn_mlp:
                break
            return cache[f"blocks.{layer}.{norm}.hook_normalized"]
    return cache["resid_mid" if mlp else "resid_pre", layer]


def perturb_(model: TransformerBridge, scale: float = 0.1, seed: int = 1) -> TransformerBridge:
    """Add seeded noise to every weight in place, so zero-initialised biases and norms matter in oracles."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.hf_model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def bridge(family) -> TransformerBridge:
    return make_bridge(family)


@pytest.fixture(scope="session")
def smollm2() -> TransformerBridge:
    """The real SmolLM2-135M-Instruct (fp32), converted once into the user cache."""
    try:
        from transformer_bridge.real_model import smollm2_path

        path = smollm2_path()
    except (ImportError, FileNotFoundError) as e:  # pragma: no cover - setup problem, say so loudly
        pytest.fail(f"SmolLM2 is not available: {e}. Run `make setup`.")
    model = TransformerBridge.from_pretrained(str(path), dtype=torch.float32)
    # SmolLM2's BOS is its chat-turn marker <|im_start|>; these tests tokenize raw text as HF does.
    model.cfg.default_prepend_bos = False
    return model


# -- the vLLM bridge's fixtures (tests/vllm; they skip without vLLM) ----------------------------------------------
# Here rather than in tests/vllm/conftest.py: a second `conftest` module would shadow this one for the test modules
# that import their models from it (`from conftest import make_bridge`). Tiny seeded models of each family saved to
# disk, one eager in-process engine per family (1 GB of KV cache), and the HF bridge on the same weights as oracle.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks are plain calls
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# vLLM's own import-time deprecations are not ours to fail on: imported here, quietly, when installed.
with warnings.catch_warnings(), contextlib.suppress(ImportError):
    warnings.simplefilter("ignore")
    import vllm.entrypoints.llm  # noqa: F401

# Distinct sizes (vocab 99, d_mlp 148, 4 heads, 2 kv heads); head_dim 64: vLLM's CPU attention refuses 16.
VLLM_COMMON = dict(vocab_size=99, hidden_size=256, intermediate_size=148, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)  # fmt: skip
VLLM_FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(head_dim=64)),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=64)),
    "mistral": (transformers.MistralConfig, dict(head_dim=64, sliding_window=None)),
    "phi3": (transformers.Phi3Config, dict(pad_token_id=0)),
    # A window of 4 (every prompt here is longer on some row) on alternate layers, Gemma 2's soft-caps and sandwich
    # norms; Gemma 3 adds per-head q/k norms and a second RoPE base for its windowed layers. Weights drawn at 0.05, not
    # HF's 0.02: the sandwich norms divide each sublayer's output by its RMS, ~0.015 at 0.02, which magnifies the
    # GEMMs' fp32 rounding (vLLM's and torch's differ) 60-fold.
    "gemma2": (transformers.Gemma2Config, dict(head_dim=64, sliding_window=4, initializer_range=0.05)),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            head_dim=64, sliding_window=4, initializer_range=0.05, layer_types=["sliding_attention", "full_attention"]
        ),
    ),
    # A mixture of experts: 4 experts, 2 per token (the experts run fused on vLLM: only the router's points).
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    ),
    # vLLM serves OLMo 2 with its Transformers backend (HF's layers): post-norm, whole-projection q/k norms.
    "olmo2": (transformers.Olmo2Config, dict(head_dim=64)),
    "mixtral": (
        transformers.MixtralConfig,
        dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
}
VLLM_ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256, seed=0)


def save_vllm_tiny(family: str, root) -> str:
    cls, extra = VLLM_FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**VLLM_COMMON, **extra), dtype=torch.float32)
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
    return lambda family: save_vllm_tiny(family, root) if not (root / family).exists() else str(root / family)


@pytest.fixture(scope="session")
def oracle(tiny_dir):
    """The HF bridge on the same saved weights."""
    made = {}

    def get(family: str) -> TransformerBridge:
        if family not in made:
            # Gemma 2 eager: HF's sdpa drops its attention soft-cap on the releases vLLM accepts (vLLM keeps it)
            attn = {"attn_implementation": "eager"} if family == "gemma2" else {}
            hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir(family), dtype=torch.float32, **attn)
            made[family] = TransformerBridge(hf.eval())
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
            made[key] = VLLMBridge.from_pretrained(tiny_dir(family), **{**VLLM_ENGINE, **kwargs})
        return made[key]

    return get


@pytest.fixture(scope="session")
def fresh_engine(tiny_dir):
    """A new eager vLLM bridge with extra engine keywords (not shared). Each is kept until the session ends: an
    in-process engine that is freed tears down vLLM's process-wide parallel state, which the others still use."""
    from transformer_bridge.vllm import VLLMBridge

    kept = []

    def make(family: str, **kwargs):  # a family of VLLM_FAMILIES, or a model folder
        path = tiny_dir(family) if family in VLLM_FAMILIES else family
        kept.append(VLLMBridge.from_pretrained(path, **{**VLLM_ENGINE, **kwargs}))
        return kept[-1]

    return make


def pytest_collection_modifyitems(items: list) -> None:
    for item in items:  # third-party code warning about third-party code (torch.distributed inside vLLM)
        if "tests/vllm" in str(item.fspath):
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
