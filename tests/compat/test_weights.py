"""TransformerLens weight properties: shapes, and oracles that recompute every cached activation from them.

Every parameter of the tiny models is perturbed first (HF initialises biases to 0 and norm weights to 1,
which would hide a wrong bias layout or a missing γ/β).
"""

import pytest
import torch
from conftest import FAMILIES, make_bridge, perturb_

from transformer_bridge.adapters.base import centred, one_plus
from transformer_bridge.cache.decompose import logit_multiplier
from transformer_bridge.compat import weights
from transformer_bridge.compat.weights import ATTN_WEIGHTS, MLP_WEIGHTS, WeightNotAvailableError
from transformer_bridge.sites.module_paths import get_module

TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3, 60], [1, 9, 9, 33, 71, 12, 4]])
TOL = dict(atol=2e-5, rtol=1e-4)
BIAS_OWNERS = {"b_Q": "q", "b_K": "k", "b_V": "v", "_b_K": "k", "_b_V": "v", "b_O": "o_proj", "b_in": "mlp_in",
               "b_out": "mlp_down"}  # fmt: skip


def hf_biases(model) -> set[str]:
    """The TransformerLens bias names whose HF module has a bias (fused projections: the fused module)."""
    a = model.adapter
    block = get_module(model.hf_model, a.blocks)[1]
    found = set()
    for name, owner in BIAS_OWNERS.items():
        if (owner.startswith("mlp") and is_moe(model, 1)) or (owner in "qkv" and a.mla):
            continue
        path = getattr(a, owner) if owner not in "qkv" or a.qkv is None else a.qkv
        if owner == "mlp_in" and a.mlp_up is not None:
            path = a.mlp_up  # a gated MLP's W_in / b_in is the up projection
        if getattr(get_module(block, path), "bias", None) is not None:
            found.add(name)
    return found


def perturbed(family: str):
    return perturb_(make_bridge(family))


@pytest.fixture(scope="module", params=FAMILIES)
def run(request):
    model = perturbed(request.param)
    logits, cache = model.run_with_cache(TOKENS)
    return model, logits, cache


def normed_input(model, cache, name: str, module) -> torch.Tensor:
    """What a norm hands on: ``hook_normalized`` times γ plus β (Gemma: times ``1 + w``)."""
    return cache[name] * gamma_of(model, module) + beta_of(module)


def block_input(model, cache, block, layer: int, norm: str) -> torch.Tensor:
    """What attention (``ln1``) or the MLP (``ln2``) reads: its norm's output; the other norm's where one
    feeds both (Phi, GPT-J); the residual itself where the block has no pre-norms (OLMo 2)."""
    if f"blocks.{layer}.{norm}.hook_normalized" not in cache:
        if norm == "ln2" and model.cfg.parallel_attn_mlp:
            norm = "ln1"
        else:
            return cache["resid_pre" if norm == "ln1" else "resid_mid", layer]
    module = get_module(block, getattr(model.adapter, norm))
    return normed_input(model, cache, f"blocks.{layer}.{norm}.hook_normalized", module)


def gamma_of(model, module):
    w = getattr(module, "weight", None)  # OLMo's LayerNorm has none
    return 1.0 if w is None else 1.0 + w if one_plus(model.adapter.norm) else w


def beta_of(module):
    b = getattr(module, "bias", None)
    return 0.0 if b is None else b


def sandwich(model, module, x: torch.Tensor) -> torch.Tensor:
    """A post-sublayer norm (Gemma 2/3, GLM-4), computed by hand."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    if centred(model.adapter.norm):
        x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma_of(model, module) + beta_of(module)


def check_attention(model, cache, layer: int) -> None:
    block = get_module(model.hf_model, model.adapter.blocks)[layer]
    x = block_input(model, cache, block, layer, "ln1")
    if model.adapter.mla:  # no W_Q / W_K / W_V (low-rank queries, latent keys and values): W_O only
        with pytest.raises(ValueError, match="latent attention"):
            _ = model.W_Q
    else:
        check_qkv(model, cache, layer, x)
    z = cache["z", layer]
    out = torch.einsum("bphd,hdm->bpm", z, model.W_O[layer]) + model.b_O[layer]
    if model.adapter.sandwich:
        out = sandwich(model, get_module(block, model.adapter.attn_out), out)
    torch.testing.assert_close(out, cache["attn_out", layer], **TOL)


def check_qkv(model, cache, layer: int, x: torch.Tensor) -> None:
    q = torch.einsum("bpm,hmd->bphd", x, model.W_Q[layer]) + model.b_Q[layer]
    torch.testing.assert_close(q, cache["q", layer], **TOL)  # pre-RoPE for rotary families
    groups = model.cfg.n_heads // model.cfg.n_kv_heads
    for key, kv_w, kv_b, w, b in [
        ("k", model._W_K, model._b_K, model.W_K, model.b_K),
        ("v", model._W_V, model._b_V, model.W_V, model.b_V),
    ]:
        kv_heads = torch.einsum("bpm,hmd->bphd", x, kv_w[layer]) + kv_b[layer]
        torch.testing.assert_close(kv_heads, cache[key, layer], **TOL)
        # W_K / W_V are over the kv heads too (TransformerLens 4), the same numbers as _W_K / _W_V.
        assert torch.equal(w, kv_w) and torch.equal(b, kv_b)
        # Repeated to n_heads (kv_heads=False): query head h reads kv head h // groups (HF's repeat_kv).
        fn = {"k": (ATTN_WEIGHTS["W_K"], ATTN_WEIGHTS["b_K"]), "v": (ATTN_WEIGHTS["W_V"], ATTN_WEIGHTS["b_V"])}[key]
        per_head = torch.einsum("bpm,hmd->bphd", x, fn[0](model, layer, kv_heads=False))
        per_head = per_head + fn[1](model, layer, kv_heads=False)
        torch.testing.assert_close(per_head, cache[key, layer].repeat_interleave(groups, dim=2), **TOL)


MLA_ABSENT = ("W_Q", "W_K", "W_V", "_W_K", "_W_V", "b_Q", "b_K", "b_V", "_b_K", "_b_V")  # DeepSeek's latent attention


def is_moe(model, layer: int) -> bool:
    """A mixture-of-experts block: no dense MLP points and no single W_in / W_out (tests/sites/test_moe.py)."""
    return f"blocks.{layer}.mlp.hook_post" not in model.hook_dict


def check_mlp(model, cache, layer: int) -> None:
    if is_moe(model, layer):
        with pytest.raises(ValueError, match="mixture-of-experts"):
            _ = MLP_WEIGHTS["W_in"](model, layer)
        return
    block = get_module(model.hf_model, model.adapter.blocks)[layer]
    x = block_input(model, cache, block, layer, "ln2")
    # Per layer, not model.W_in[layer]: a model mixing dense and MoE blocks (Llama 4) has no stack.
    w = {name: fn(model, layer) for name, fn in MLP_WEIGHTS.items()}
    linear = x @ w["W_in"] + w["b_in"]
    if w["W_gate"] is None:
        torch.testing.assert_close(linear, cache[f"blocks.{layer}.mlp.hook_pre"], **TOL)
    else:
        torch.testing.assert_close(x @ w["W_gate"], cache[f"blocks.{layer}.mlp.hook_pre"], **TOL)
        torch.testing.assert_close(linear, cache[f"blocks.{layer}.mlp.hook_pre_linear"], **TOL)
    out = cache[f"blocks.{layer}.mlp.hook_post"] @ w["W_out"] + w["b_out"]
    if model.adapter.sandwich:
        out = sandwich(model, get_module(block, model.adapter.mlp_out), out)
    torch.testing.assert_close(out, cache["mlp_out", layer], **TOL)


def check_logit_lens(model, logits, cache) -> None:
    final = cache.accumulated_resid(apply_ln=True)[-1]
    lens = final @ model.W_U + model.b_U
    cap = getattr(model.hf_model.config, "final_logit_softcapping", None)
    if cap:  # Gemma 2: W_U / b_U give the logits before the final soft-cap
        lens = cap * torch.tanh(lens / cap)
    torch.testing.assert_close(lens, logits, atol=1e-4, rtol=1e-4)


def test_shapes(run):
    model, _, _ = run
    c = model.cfg
    n, h, kv, d, dh, m, v = c.n_layers, c.n_heads, c.n_kv_heads, c.d_model, c.d_head, c.d_mlp, c.d_vocab
    expected = {
        "W_Q": (n, h, d, dh), "W_K": (n, kv, d, dh), "W_V": (n, kv, d, dh), "_W_K": (n, kv, d, dh),
        "_W_V": (n, kv, d, dh), "W_O": (n, h, dh, d), "b_Q": (n, h, dh), "b_K": (n, kv, dh), "b_V": (n, kv, dh),
        "_b_K": (n, kv, dh), "_b_V": (n, kv, dh), "b_O": (n, d), "W_in": (n, d, m), "W_out": (n, m, d),
        "b_in": (n, m), "b_out": (n, d), "W_E": (v, d), "W_U": (d, v), "b_U": (v,), "W_U_raw": (d, v),
    }  # fmt: skip
    moe = any(is_moe(model, layer) for layer in range(n))
    for name, shape in expected.items():
        if (moe and name in MLP_WEIGHTS) or (model.adapter.mla and name in MLA_ABSENT):
            with pytest.raises(ValueError, match=r"mixture-of-experts|latent attention"):
                getattr(model, name)
            continue
        assert tuple(getattr(model, name).shape) == shape, name
    assert moe or (model.W_gate is None) == (not c.gated_mlp)
    if c.gated_mlp and not moe:
        assert model.W_gate.shape == (n, d, m)
    raw_bias = getattr(model.hf_model.get_output_embeddings(), "bias", None)
    assert (model.b_U_raw is None) == (raw_bias is None)
    torch.testing.assert_close(model.W_U_raw, model.hf_model.get_output_embeddings().weight.T, atol=0, rtol=0)


def test_attention_weights_reproduce_q_k_v_and_the_output(run):
    model, _, cache = run
    for layer in range(model.cfg.n_layers):
        check_attention(model, cache, layer)


def test_head_results_are_z_times_w_o(run):
    model, _, _ = run
    _, cache = model.run_with_cache(TOKENS, names_filter=["blocks.1.attn.hook_z", "blocks.1.attn.hook_result"])
    torch.testing.assert_close(torch.einsum("bphd,hdm->bphm", cache["z", 1], model.W_O[1]), cache["result", 1], **TOL)


def test_mlp_weights_reproduce_pre_and_the_output(run):
    model, _, cache = run
    for layer in range(model.cfg.n_layers):
        check_mlp(model, cache, layer)


def test_embeddings(run):
    model, _, cache = run
    torch.testing.assert_close(model.W_E[TOKENS], cache["hook_embed"], atol=0, rtol=0)
    if model.adapter.pos_embed is None:
        with pytest.raises(WeightNotAvailableError, match="rotary"):
            _ = model.W_pos
        with pytest.raises(AttributeError, match="absolute positional"):  # TransformerLens' exception type
            _ = model.W_E_pos
        assert not hasattr(model, "W_pos")
    else:
        assert model.W_pos.shape == (model.cfg.n_ctx, model.cfg.d_model)
        pos = TOKENS.shape[1]
        torch.testing.assert_close(model.W_pos[:pos].expand(2, -1, -1), cache["hook_pos_embed"], atol=0, rtol=0)


def test_logit_lens_with_folded_unembedding_gives_the_logits(run):
    model, logits, cache = run
    check_logit_lens(model, logits, cache)
    if model.cfg.normalization != "rms_one_plus":  # the fold is γ ⊙ raw and β @ raw (+ raw bias)
        norm = get_module(model.hf_model, model.adapter.ln_final)
        scale = logit_multiplier(model)  # Cohere, Granite
        torch.testing.assert_close(model.W_U, model.ln_final_weight[:, None] * model.W_U_raw * scale)
        beta = getattr(norm, "bias", None)
        want = (beta @ model.W_U_raw if beta is not None else 0) + (model.b_U_raw if model.b_U_raw is not None else 0)
        torch.testing.assert_close(model.b_U, torch.zeros_like(model.b_U) + want * scale)


def _is_view(model, t: torch.Tensor) -> bool:
    return any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in model.hf_model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_per_layer_weights_are_views_that_edit_the_model(family):
    model = perturbed(family)
    before = model(TOKENS)
    gen = torch.Generator().manual_seed(2)
    edited, biases = [], hf_biases(model)
    attn = {k: f for k, f in ATTN_WEIGHTS.items() if not (model.adapter.mla and k in MLA_ABSENT)}
    for name, fn in {**attn, **({} if is_moe(model, 1) else MLP_WEIGHTS)}.items():
        t = fn(model, 1)
        if t is None:  # W_gate of an ungated MLP
            continue
        must_be_view = "W" in name or name in biases
        assert _is_view(model, t) == must_be_view, name
        if "b" in name and name not in biases:
            assert not t.any(), name  # no such bias in this family: zeros, as TransformerLens
        if must_be_view:
            with torch.no_grad():
                t.add_(0.05 * torch.randn(t.shape, generator=gen))
            edited.append(name)
    qkv = () if model.adapter.mla else ("W_Q", "_W_K", "_W_V")
    assert {*qkv, "W_O", *(() if is_moe(model, 1) else ("W_in", "W_out"))} <= set(edited)
    logits, cache = model.run_with_cache(TOKENS)
    assert not torch.allclose(logits, before)
    check_attention(model, cache, 1)
    check_mlp(model, cache, 1)
    check_logit_lens(model, logits, cache)


def test_stacked_properties_are_copies():
    model = make_bridge("gpt2")
    w = model.W_Q
    assert not _is_view(model, w) and w.requires_grad  # a stack of the views, gradients kept
    with torch.no_grad():
        w.zero_()
    assert model.W_Q.abs().sum() > 0


def test_embedding_views_and_gemma_scaling():
    model = make_bridge("llama")
    assert _is_view(model, model.W_E)
    with torch.no_grad():
        model.W_E[5] += 1.0
    assert torch.equal(model.hf_model.get_input_embeddings().weight[5], model.W_E[5])
    gemma = make_bridge("gemma2")
    raw = gemma.hf_model.get_input_embeddings().weight
    torch.testing.assert_close(gemma.W_E, raw * gemma.cfg.d_model**0.5)  # folded in, as TransformerLens does


def test_bad_layer():
    model = make_bridge("llama")
    assert torch.equal(weights.W_Q(model, -1), weights.W_Q(model, 1))
    with pytest.raises(IndexError, match="`layer`=2 is out of range"):
        weights.W_Q(model, 2)
    with pytest.raises(TypeError, match="`layer` must be an int"):
        weights.W_out(model, "0")
