"""Relevance on a state-space model (Mamba): dla over the embedding and each mixer's output, the gradient
methods against autograd on HF's model, and clear errors where a method has no meaning (LRP, attention)."""

import pytest
import torch
from _models import random_tokens, tiny_run
from sites.test_ssm import make_mamba  # tests/ is on the path (conftest.py); tests/sites is a namespace package

from transformer_bridge.relevance import relevance_hooks


@pytest.fixture(scope="module")
def model():
    return make_mamba()


@pytest.mark.parametrize("target", ["logit", ("logit_diff", 7)])
def test_dla_is_embedding_plus_each_mixer_through_the_final_norm(model, target):
    """Each component is its cached residual part ÷ the cached final-norm scale, on γ ⊙ W_U[:, t] (computed
    here by hand), and they sum to HF's logit."""
    tokens = random_tokens(1, 9)
    rel = tiny_run(model, tokens, prompt_width=6).relevance_pass(method="dla", target=target)
    assert rel.labels == ["embed", *[f"L{i}.mixer" for i in range(model.cfg.n_layers)]]
    _, cache = model.run_with_cache(tokens)
    hf = model.hf_model
    with torch.no_grad():
        logits = hf(tokens).logits[0]
    for i, step in enumerate(rel):
        p = step.position - 1
        direction = hf.backbone.norm_f.weight * hf.lm_head.weight[step.token_id]
        want_logit = logits[p, step.token_id]
        if target != "logit":
            direction = direction - hf.backbone.norm_f.weight * hf.lm_head.weight[7]
            want_logit = want_logit - logits[p, 7]
        parts = [cache["blocks.0.hook_resid_pre"][0, p]]
        parts += [cache[f"blocks.{layer}.hook_mixer_out"][0, p] for layer in range(model.cfg.n_layers)]
        scale = cache["ln_final.hook_scale"][0, p]
        want = torch.stack([(part / scale) @ direction for part in parts])
        torch.testing.assert_close(rel.scores[i], want, atol=1e-5, rtol=1e-5)
        assert rel.scores[i].sum().item() == pytest.approx(want_logit.item(), rel=1e-4, abs=1e-5)


def test_dla_hooks_are_the_mixer_outputs(model):
    names = relevance_hooks(model, "dla")
    assert [n for n in names if "mixer" in n] == [f"blocks.{i}.hook_mixer_out" for i in range(model.cfg.n_layers)]
    assert all(name in model.hook_dict for name in names)


def test_grad_x_input_equals_autograd_on_hf(model):
    tokens = random_tokens(1, 8, seed=3)
    rel = tiny_run(model, tokens, prompt_width=5, cache=False).relevance_pass(method="grad_x_input")
    for i, step in enumerate(rel):
        embeds = model.hf_model.get_input_embeddings()(tokens).detach().requires_grad_(True)
        logit = model.hf_model(inputs_embeds=embeds).logits[0, step.position - 1, step.token_id]
        (grad,) = torch.autograd.grad(logit, embeds)
        want = (grad * embeds).sum(-1)[0].detach()
        want[step.position :] = 0
        torch.testing.assert_close(rel.scores[i], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["integrated_gradients", "grad_norm", "logit_lens", "random"])
def test_other_methods_run(model, method):
    tokens = random_tokens(1, 8, seed=4)
    rel = tiny_run(model, tokens, prompt_width=5).relevance_pass(method=method)
    assert len(rel) == 3 and torch.isfinite(rel.scores).all() and rel.scores.abs().sum() > 0


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_lrp_says_it_has_no_rules_for_the_mixer(model, method):
    run = tiny_run(model, random_tokens(1, 8), prompt_width=5, cache=False)
    with pytest.raises(ValueError, match=rf"'{method}' has no LRP rules for the state-space mixer.*grad_x_input"):
        run.relevance_pass(method=method)


def test_attention_says_there_is_no_pattern(model):
    run = tiny_run(model, random_tokens(1, 8), prompt_width=5)
    with pytest.raises(
        ValueError,
        match=r"'attention' reads hook points that this 'mamba' model does not have.*hook_pattern.*grad_x_input",
    ):
        run.relevance_pass(method="attention")
