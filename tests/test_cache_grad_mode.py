"""`run_with_cache` runs under the caller's grad mode, as TransformerLens' does (issue #32): the cache holds detached
tensors, stored once each; the output carries the graph, so TransformerLens' attribution-patching recipe
(``output, cache = model.run_with_cache(...)``, then ``metric(output).backward()`` with backward hooks caching
gradients) runs. Under ``torch.no_grad()`` / ``inference_mode`` nothing changes. The oracle for the gradients is
a plain forward whose hooks hand the model each activation as a leaf (``torch.autograd.grad``)."""

import pytest
import torch
from conftest import make_bridge

TOKENS = torch.tensor([[1, 5, 9, 14, 22, 7], [1, 40, 41, 42, 43, 44]])
POINTS = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.hook_mlp_out"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    return make_bridge(request.param)


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5].sum() - logits[:, -1, 6].sum()


def test_attribution_patching_recipe(model):
    grads = {}

    def keep(grad, hook):
        grads[hook.name] = grad.detach()

    with model.hooks(bwd_hooks=[(n, keep) for n in POINTS]):  # as in TransformerLens: on during the forward
        logits, cache = model.run_with_cache(TOKENS, names_filter=POINTS)
        assert logits.requires_grad and not any(t.requires_grad for t in cache.values())
        assert len({t.data_ptr() for t in cache.values()}) == len(cache)  # once each
        metric(logits).backward()
    assert sorted(grads) == sorted(POINTS)
    model.zero_grad(set_to_none=True)

    kept = {}

    def leaf(x, hook):
        kept[hook.name] = x.detach().clone().requires_grad_(True)
        return kept[hook.name]

    for name in POINTS:  # the oracle: one forward per point, the model going on from a leaf there
        with model.hooks(fwd_hooks=[(name, leaf)]):
            (want,) = torch.autograd.grad(metric(model(TOKENS)), [kept[name]])
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6)
        assert torch.equal(cache[name], kept[name].detach())


def test_add_hook_bwd_then_backward(model):
    grads = []
    model.add_hook("blocks.0.hook_resid_post", lambda g, hook: grads.append(g.shape), dir="bwd")
    try:
        logits, _ = model.run_with_cache(TOKENS, names_filter="resid_post")
        metric(logits).backward()
    finally:
        model.reset_hooks()
        model.zero_grad(set_to_none=True)
    assert grads == [(*TOKENS.shape, model.cfg.d_model)]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_build_no_graph(model, mode):
    with torch.no_grad():
        expected, reference = model.run_with_cache(TOKENS)
    with mode():
        logits, cache = model.run_with_cache(TOKENS)
    assert not logits.requires_grad and logits.grad_fn is None
    assert torch.equal(logits, expected)
    assert cache.keys() == reference.keys()
    assert all(torch.equal(cache[n], reference[n]) for n in cache)
    grad_logits, grad_cache = model.run_with_cache(TOKENS)  # the same numbers with the graph
    assert torch.equal(grad_logits.detach(), expected)
    assert all(torch.equal(grad_cache[n], reference[n]) for n in grad_cache)


def test_generate_return_cache_builds_no_graph_and_equals_run_with_cache(model):
    out, cache = model.generate(TOKENS[:1], max_new_tokens=3, temperature=0, return_cache=True, verbose=False)
    logits, expected = model.run_with_cache(out)
    assert logits.requires_grad and not any(t.requires_grad for t in cache.values())
    for name in expected:
        assert torch.equal(cache[name], expected[name]), name
