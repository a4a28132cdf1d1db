"""Attention variants, handled by the general machinery and checked against HF's own eager attention.

For every family with a ``hook_pattern`` point, the pattern the bridge computes (left padding included)
equals the attention weights HF's eager implementation returns with ``output_attentions=True``: sliding
windows, logit soft-capping, q/k norms, partial rotary, parallel and post-norm blocks, multi-query and GQA
all go through the same code. Weights are perturbed so patterns are far from uniform; the window and the
soft-cap are also checked to bite on these inputs. Every family in the test matrix is supported and
listed in docs/families.md.
"""

from pathlib import Path

import pytest
import torch
from conftest import ALIAS_CONFIGS, CONFIGS, FAMILIES, HYBRID_CONFIGS, SSM_CONFIGS, V, char_tokenizer, perturb_
from transformers import AutoModelForCausalLM

from transformer_bridge import SUPPORTED_MODEL_TYPES, TransformerBridge
from transformer_bridge.versions import sdpa_drops_softcap

TOKENS = torch.randint(4, V, (2, 8), generator=torch.Generator().manual_seed(11))
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
POSITIONS = (MASK.cumsum(-1) - 1).clamp_min(0)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "families.md"


def _bridge(family: str, **config_overrides) -> TransformerBridge:
    config = CONFIGS[family]()
    for key, value in config_overrides.items():
        setattr(config, key, value)
    # Gemma 2 and VaultGemma soft-cap their attention scores; where HF's sdpa drops the cap (5.19: it loads them on
    # sdpa; later releases load them eager) the model runs on the kernel that caps, as the oracle does.
    attn = "eager" if getattr(config, "attn_logit_softcapping", None) and sdpa_drops_softcap() else None
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    return perturb_(TransformerBridge(hf, char_tokenizer()), scale=0.3)


def _hf_eager_attentions(model: TransformerBridge) -> tuple[torch.Tensor, ...]:
    hf = model.hf_model
    before = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf(TOKENS, attention_mask=MASK, position_ids=POSITIONS, output_attentions=True)
    finally:
        hf.set_attn_implementation(before)
    return out.attentions


def _bridge_patterns(model: TransformerBridge) -> list[torch.Tensor]:
    _, cache = model.run_with_cache(TOKENS, attention_mask=MASK, names_filter="pattern")
    return [cache["pattern", layer] for layer in range(model.cfg.n_layers)]


def _assert_same_on_real_queries(ours: list[torch.Tensor], theirs: tuple[torch.Tensor, ...]) -> None:
    real = MASK.bool()  # rows of padding queries are not attention anyone reads
    for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.shape == b.shape, (layer, a.shape, b.shape)
        torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=2e-6, rtol=1e-5)


# HF's Falcon has no separate eager path to compare with (`set_attn_implementation("eager")` leaves it on SDPA,
# and its `output_attentions` branch adds the boolean mask as numbers): its pattern is checked by hand below.
HF_EAGER_ORACLE = [f for f in FAMILIES if f != "falcon"]


@pytest.mark.parametrize("family", HF_EAGER_ORACLE)
def test_pattern_equals_hf_eager_attention_weights(family):
    model = _bridge(family)
    if "blocks.0.attn.hook_pattern" not in model.hook_dict:
        pytest.skip(f"{family} offers no hook_pattern (see docs/families.md)")
    _assert_same_on_real_queries(_bridge_patterns(model), _hf_eager_attentions(model))


@pytest.mark.parametrize("overrides", [{}, {"parallel_attn": False}], ids=["parallel", "sequential"])
def test_falcon_attention_points_from_its_sdpa_call(overrides):
    """Falcon's module calls SDPA itself: the points come from that call and equal the manual softmax of the
    rotated query and key; an edit of the pattern equals the same edit of ``hook_z``; read-only hooks change no
    bit of the logits."""
    model = _bridge("falcon", **overrides)
    with torch.no_grad():
        plain = model(TOKENS, attention_mask=MASK)
        logits, cache = model.run_with_cache(TOKENS, attention_mask=MASK, names_filter=lambda n: ".attn." in n)
    assert torch.equal(logits, plain)
    causal = torch.tril(torch.ones(TOKENS.shape[1], TOKENS.shape[1], dtype=torch.bool))
    allowed = causal[None] & MASK.bool()[:, None, :]  # [batch, query, key]
    for layer in range(model.cfg.n_layers):
        q, k = cache["rot_q", layer], cache["rot_k", layer]  # [b, pos, 4, d], [b, pos, 1, d] (multi-query)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k.expand_as(q)) / model.cfg.d_head**0.5
        expected = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        _assert_same_on_real_queries([cache["pattern", layer]], (expected,))
        assert cache["attn_scores", layer].shape == expected.shape

    def zero_head_pattern(pattern, hook):
        pattern[:, 1] = 0

    def zero_head_z(z, hook):
        z[:, :, 1] = 0

    with torch.no_grad():
        by_pattern = model.run_with_hooks(TOKENS, attention_mask=MASK, fwd_hooks=[("blocks.1.attn.hook_pattern",
                                                                                   zero_head_pattern)])  # fmt: skip
        by_z = model.run_with_hooks(TOKENS, attention_mask=MASK, fwd_hooks=[("blocks.1.attn.hook_z", zero_head_z)])
    real = MASK.bool()
    torch.testing.assert_close(by_pattern[real], by_z[real], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(by_pattern[real], plain[real], atol=1e-4)


def _windowed_layers(config) -> list[tuple[int, int]]:
    """``(layer, window)`` for each layer with local attention (keys within ``window`` positions)."""
    n = config.num_hidden_layers
    if getattr(config, "attention_layers", None):  # GPT-Neo
        return [(i, config.window_size) for i, kind in enumerate(config.attention_layers) if kind == "local"]
    window = getattr(config, "sliding_window", None)
    if not window:
        return []
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * n
    return [(i, window) for i, kind in enumerate(kinds) if kind == "sliding_attention"]


# Windows shorter than the prompt (Gemma 2's tiny config keeps its 4096-token default).
WINDOWED = [f for f in FAMILIES if any(w < TOKENS.shape[1] for _, w in _windowed_layers(CONFIGS[f]()))]


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_windows_bite_and_hold_in_the_pattern(family):
    model = _bridge(family)
    if "blocks.0.attn.hook_pattern" not in model.hook_dict:
        pytest.skip("no pattern point")
    patterns = _bridge_patterns(model)
    pos = TOKENS.shape[1]
    distance = torch.arange(pos)[:, None] - torch.arange(pos)[None, :]  # query - key
    for layer, window in _windowed_layers(model.hf_model.config):
        outside = distance >= window
        assert torch.all(patterns[layer][1][:, outside] == 0), (layer, window)
        inside = (distance >= 0) & ~outside
        assert torch.all(patterns[layer][1][:, inside] > 0)


def test_logit_soft_capping_bites_and_matches_hf():
    """Gemma 2 caps scores with ``cap * tanh(s / cap)``; a small cap makes it matter on a tiny model."""
    capped = _bridge("gemma2", attn_logit_softcapping=0.5)
    _assert_same_on_real_queries(_bridge_patterns(capped), _hf_eager_attentions(capped))
    plain = _bridge("gemma2", attn_logit_softcapping=None)
    assert not torch.allclose(_bridge_patterns(capped)[1], _bridge_patterns(plain)[1], atol=1e-3)


def test_scores_are_soft_capped_before_the_mask():
    capped = _bridge("gemma2", attn_logit_softcapping=0.5)
    _, cache = capped.run_with_cache(TOKENS, attention_mask=MASK, names_filter="attn_scores")
    scores = cache["attn_scores", 1][1]  # the unpadded row
    causal = torch.tril(torch.ones(TOKENS.shape[1], TOKENS.shape[1], dtype=torch.bool))
    assert scores[:, causal].abs().max() <= 0.5  # |cap * tanh(.)| <= cap where attention is allowed
    assert torch.all(scores[:, ~causal] == float("-inf"))  # masked scores are -inf, as in TransformerLens


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_supported_and_documented(family):
    model_type = CONFIGS[family]().model_type
    assert model_type in SUPPORTED_MODEL_TYPES
    assert f"`{model_type}`" in DOCS.read_text(), f"docs/families.md has no row for {model_type}"


def test_every_supported_model_type_has_a_tiny_config():
    tested = {CONFIGS[f]().model_type for f in FAMILIES}
    tested |= {c().model_type for c in [*SSM_CONFIGS.values(), *HYBRID_CONFIGS.values()]}
    tested |= set(ALIAS_CONFIGS)  # tests/adapters/test_aliases.py
    assert set(SUPPORTED_MODEL_TYPES) <= tested, set(SUPPORTED_MODEL_TYPES) - tested


@pytest.mark.parametrize(
    ("family", "overrides", "parallel"),
    [("falcon", {"parallel_attn": False}, False), ("stablelm", {"use_parallel_residual": True}, True)],
    ids=["falcon-sequential", "stablelm-parallel"],
)
def test_config_switched_block_layouts(family, overrides, parallel):
    """A config flag that switches a family between sequential and parallel blocks changes the points."""
    model = _bridge(family, **overrides)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), model.hf_model(TOKENS).logits)
    assert model.cfg.parallel_attn_mlp == parallel
    assert ("blocks.1.ln2.hook_scale" in model.hook_dict) == (not parallel)
    assert ("blocks.1.hook_resid_mid" in model.hook_dict) == (not parallel)
    logits, cache = model.run_with_cache(TOKENS)
    torch.testing.assert_close(cache.decompose_resid().sum(0), cache["resid_post", 1], atol=1e-5, rtol=1e-5)
    lens = cache.accumulated_resid(apply_ln=True)[-1] @ model.W_U + model.b_U
    torch.testing.assert_close(lens, logits, atol=1e-4, rtol=1e-4)
    if not parallel:
        delta = torch.linspace(-1, 1, model.cfg.d_model)
        add = lambda x, hook: x + delta  # noqa: E731
        with torch.no_grad():
            mid = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_resid_mid", add)])
            out = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_attn_out", add)])
        torch.testing.assert_close(mid, out, atol=1e-5, rtol=1e-5)
