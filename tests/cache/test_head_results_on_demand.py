"""``cfg.use_attn_result=False`` by default, head results on demand (issue #32): caches of all points leave
``attn.hook_result`` out, a hook or filter naming it computes it, and the cache's head analyses derive each head's
output from ``hook_z`` and ``W_O`` as TransformerLens does. Oracles: the point the model computes when asked
(the old default, through the output projection's forward hook) and a manual einsum of ``z`` and ``W_O``, on GQA,
parallel blocks (GPT-J, Phi) and a post-attention norm (Gemma 2).
"""

import pytest
import torch
from conftest import make_bridge, perturb_

from transformer_bridge.relevance.dla import dla_hooks

FAMILIES = ["gpt2", "llama", "qwen2", "gemma2", "gptj", "phi", "gpt_neox"]
TOKENS = torch.tensor([[1, 5, 9, 14, 22, 7, 3], [1, 40, 41, 42, 43, 44, 45]])
TOL = dict(rtol=0, atol=1e-6)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return perturb_(make_bridge(request.param))


def test_use_attn_result_is_false_and_full_caches_leave_results_out(model):
    assert model.cfg.use_attn_result is False
    assert "blocks.0.attn.hook_result" in model.hook_dict  # as TransformerLens: the point exists
    logits, cache = model.run_with_cache(TOKENS)
    assert not any(n.endswith("attn.hook_result") for n in cache)
    assert "blocks.0.attn.hook_z" in cache
    with pytest.raises(KeyError, match="use_attn_result"):
        cache["result", 0]
    assert torch.equal(logits, model.hf_model(TOKENS).logits)


def test_naming_the_point_computes_it(model):
    _, named = model.run_with_cache(TOKENS, names_filter=["result", "z"])
    _, pred = model.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_result"))
    seen = []
    model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.attn.hook_result", lambda x, hook: seen.append(x.shape))])
    assert seen == [(*TOKENS.shape, model.cfg.n_heads, model.cfg.d_model)]
    for layer in range(model.cfg.n_layers):
        z, w_o = named["z", layer], model.W_O[layer].detach()  # [head, d_head, d_model]
        manual = torch.einsum("bphd,hdm->bphm", z, w_o)
        torch.testing.assert_close(named["result", layer], manual, **TOL)
        assert torch.equal(pred["result", layer], named["result", layer])


def test_switched_on_full_caches_hold_results(model):
    model.set_use_attn_result(True)
    try:
        _, cache = model.run_with_cache(TOKENS)
        assert all(f"blocks.{i}.attn.hook_result" in cache for i in range(model.cfg.n_layers))
    finally:
        model.set_use_attn_result(False)
    _, cache = model.run_with_cache(TOKENS)
    assert "blocks.0.attn.hook_result" not in cache


def test_analyses_from_z_equal_the_computed_point(model):
    _, every = model.run_with_cache(TOKENS, names_filter=None)  # results left out: from hook_z and W_O
    assert "blocks.0.attn.hook_result" not in every
    _, explicit = model.run_with_cache(TOKENS, names_filter=[*every.keys(), "result"])  # the point, computed
    a, labels_a = explicit.stack_head_results(return_labels=True)
    b, labels_b = every.stack_head_results(return_labels=True)
    assert labels_a == labels_b
    torch.testing.assert_close(b, a, **TOL)
    torch.testing.assert_close(every.decompose_resid(), explicit.decompose_resid(), **TOL)
    full = every.get_full_resid_decomposition(expand_neurons=False)
    torch.testing.assert_close(full, explicit.get_full_resid_decomposition(expand_neurons=False), **TOL)
    every.compute_head_results()
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(every["result", layer], explicit["result", layer], **TOL)


def test_dla_reads_z_and_matches_the_computed_point(model):
    assert not any(n.endswith("hook_result") for n in dla_hooks(model))
    target = torch.tensor([5, 6])
    _, cache = model.run_with_cache(TOKENS)
    _, explicit = model.run_with_cache(TOKENS, names_filter=[*cache.keys(), "result"])
    attrs = cache.logit_attrs(cache.stack_head_results(), target)
    torch.testing.assert_close(attrs, explicit.logit_attrs(explicit.stack_head_results(), target), **TOL)
