"""Opt-in weight processing (`compat.processing`): each step keeps the model's function (logits within float
reassociation; ``center_unembed``: log-probabilities), and hooks mean what TransformerLens' processed model
means (``normalized @ W_Q + b_Q == hook_q``, a centred residual stream, a centred ``W_U``). The oracle is the
same bridge before processing; the default stays bitwise HF."""

import copy

import pytest
import torch
from conftest import make_bridge, perturb_

from transformer_bridge import TransformerBridge

TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3, 60], [1, 9, 9, 33, 71, 12, 4]])
LAYERNORM = ["gpt2", "gpt_neox", "opt", "phi", "gptj", "falcon", "stablelm"]
RMS = ["llama", "qwen2", "gemma2", "phi3", "gemma", "olmo2"]


@pytest.fixture(scope="module", params=LAYERNORM + RMS)
def base(request):
    return perturb_(make_bridge(request.param))  # perturbed: zero biases and unit norms would hide mistakes


def processed(base, **steps):
    model = copy.deepcopy(base)
    model.process_weights(**{"fold_ln": False, "center_writing_weights": False, "center_unembed": False,
                             "fold_value_biases": False, **steps})  # fmt: skip
    return model


@pytest.mark.parametrize("step", ["fold_ln", "center_writing_weights", "fold_value_biases"])
def test_each_step_keeps_the_logits(base, step):
    model = processed(base, **{step: True})
    torch.testing.assert_close(model(TOKENS), base(TOKENS), atol=1e-5, rtol=1e-5)


def test_all_steps_keep_the_log_probs(base):
    model = copy.deepcopy(base)
    model.enable_compatibility_mode()
    torch.testing.assert_close(model(TOKENS).log_softmax(-1), base(TOKENS).log_softmax(-1), atol=1e-5, rtol=1e-5)
    if "center_unembed" in model.weight_processing.applied:
        torch.testing.assert_close(model.W_U.mean(-1), torch.zeros(model.cfg.d_model), atol=1e-6, rtol=0)


def test_folded_norm_reads_like_transformer_lens(base):
    model = processed(base, fold_ln=True)
    _, cache = model.run_with_cache(TOKENS)
    for layer in range(model.cfg.n_layers):
        name = f"blocks.{layer}.ln1.hook_normalized"
        if name not in cache:  # OLMo 2: no norm before attention
            continue
        q = torch.einsum("bpd,hde->bphe", cache[name], model.W_Q[layer]) + model.b_Q[layer]
        torch.testing.assert_close(q, cache["q", layer], atol=1e-5, rtol=1e-5)
    final = cache["ln_final.hook_normalized"] @ model.W_U + model.b_U
    if cap := getattr(model.hf_model.config, "final_logit_softcapping", None):  # Gemma 2: W_U reads before the cap
        final = cap * torch.tanh(final / cap)
    torch.testing.assert_close(final, base(TOKENS), atol=1e-4, rtol=1e-4)


def test_centred_writers_centre_the_residual_stream(base):
    model = copy.deepcopy(base)
    model.enable_compatibility_mode()
    _, cache = model.run_with_cache(TOKENS)
    if model.cfg.normalization_type == "LN":
        assert "center_writing_weights" in model.weight_processing.applied
        for name in ("hook_embed", "blocks.0.hook_attn_out", "blocks.1.hook_resid_post"):
            assert cache[name].mean(-1).abs().max() < 1e-5, name
    else:  # TransformerLens' rule: not for RMS norms
        assert "RMS" in model.weight_processing.skipped["center_writing_weights"]


def test_value_biases_fold_into_the_output_bias(base):
    model = processed(base, fold_value_biases=True)
    assert model.b_V.abs().max() == 0
    _, before = base.run_with_cache(TOKENS)
    _, after = model.run_with_cache(TOKENS)
    torch.testing.assert_close(after["blocks.0.hook_attn_out"], before["blocks.0.hook_attn_out"], atol=1e-5, rtol=1e-5)


def test_default_is_unprocessed_and_bitwise():
    model = make_bridge("gpt2")
    assert model.weight_processing is None
    assert torch.equal(model(TOKENS), model.hf_model(TOKENS).logits)


def test_tied_unembedding_is_untied_before_centring():
    model = perturb_(make_bridge("gpt2"))
    embed = model.hf_model.get_input_embeddings().weight
    assert embed.data_ptr() == model.hf_model.get_output_embeddings().weight.data_ptr()
    before = embed.detach().clone()
    model.process_weights(fold_ln=False, center_writing_weights=False, center_unembed=True, fold_value_biases=False)
    assert torch.equal(embed, before)  # only the unembedding was centred
    assert model.hf_model.get_output_embeddings().weight.data_ptr() != embed.data_ptr()


def test_from_pretrained_keywords(tmp_path):
    base = perturb_(make_bridge("gpt_neox"))
    base.hf_model.save_pretrained(tmp_path)
    kw = dict(tokenizer=base.tokenizer, dtype=torch.float32)
    plain = TransformerBridge.from_pretrained(str(tmp_path), **kw)
    model = TransformerBridge.from_pretrained(str(tmp_path), fold_ln=True, center_writing_weights=True, **kw)
    assert plain.weight_processing is None
    assert model.weight_processing.applied == ("fold_ln", "center_writing_weights")
    assert copy.deepcopy(model).weight_processing == model.weight_processing
    torch.testing.assert_close(model(TOKENS), plain(TOKENS), atol=1e-5, rtol=1e-5)
    assert torch.equal(TransformerBridge.from_pretrained_no_processing(str(tmp_path), **kw)(TOKENS), plain(TOKENS))


def test_soft_capped_unembedding_is_not_centred():
    model = make_bridge("gemma2")
    model.enable_compatibility_mode()
    assert "soft-cap" in model.weight_processing.skipped["center_unembed"]


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_bridge("mixtral").enable_compatibility_mode()
    model = make_bridge("llama")
    with pytest.raises(ValueError, match=r"refactor_factored_attn_matrices.*rotary"):
        model.enable_compatibility_mode(refactor_factored_attn_matrices=True)
    with pytest.raises(TypeError, match="fold_ln"):
        model.process_weights(fold_ln="yes")
    model.enable_compatibility_mode(no_processing=True)
    assert model.weight_processing is None


@pytest.mark.parametrize("family", ["gpt2", "opt", "gpt_neo"])
def test_refactored_attention_keeps_the_function(family):
    base = perturb_(make_bridge(family))
    model = copy.deepcopy(base)
    model.enable_compatibility_mode(refactor_factored_attn_matrices=True)
    torch.testing.assert_close(model(TOKENS).log_softmax(-1), base(TOKENS).log_softmax(-1), atol=1e-4, rtol=1e-4)
    w_o = model.W_O[0]  # [head, d_head, d_model]: orthonormal rows, a rotation (TransformerLens' refactor)
    eye = torch.eye(model.cfg.d_head).expand(model.cfg.n_heads, -1, -1)
    torch.testing.assert_close(w_o @ w_o.transpose(-1, -2), eye, atol=1e-4, rtol=0)


@pytest.mark.real
def test_smollm2_processed_keeps_log_probs(smollm2):
    model = copy.deepcopy(smollm2)
    model.enable_compatibility_mode()
    tokens = smollm2.to_tokens("When Mary and John went to the store, John gave a drink to")
    torch.testing.assert_close(model(tokens).log_softmax(-1), smollm2(tokens).log_softmax(-1), atol=1e-4, rtol=1e-4)
    assert model.weight_processing.applied == ("fold_ln", "center_unembed", "fold_value_biases")


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gpt_neox"])
def test_processing_keeps_float64(family):
    """Processing computes at the model's precision: in float64 each step moves the centred logits by float64
    reassociation (~1e-13 on SmolLM2), not by a float32 round trip (1.4e-6 on SmolLM2 before). (Gemma's norms
    multiply by γ in float32 inside HF's own forward, a rounding that folding γ into float64 weights cannot
    reproduce: ~1e-6 there.)"""
    base = perturb_(make_bridge(family)).to(torch.float64)
    with torch.no_grad():
        hf = base.hf_model(TOKENS).logits
    centred = hf - hf.mean(-1, keepdim=True)
    for steps in ({"fold_ln": True}, {"fold_ln": True, "center_writing_weights": True, "center_unembed": True,
                                      "fold_value_biases": True}):  # fmt: skip
        model = processed(base, **steps)
        with torch.no_grad():
            out = model(TOKENS)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out - out.mean(-1, keepdim=True), centred, atol=1e-12, rtol=0)
    gamma = base.hf_model.get_output_embeddings().weight.T * base.ln_final.w[:, None]
    assert base.W_U.dtype == torch.float64 and torch.equal(base.W_U, gamma)
