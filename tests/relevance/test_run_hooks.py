"""A run's relevance explains that run: gradient methods recompute under the forward hooks the generation ran
under, whatever hooks are active when they are called (those are set aside, with a warning naming them).

Oracle: ``dla`` reads the target logit off the generation's own cache; every gradient method's target value must
equal it within 1e-5, called inside the hooks' ``with`` block, after it, and under other hooks.
"""

import warnings

import pytest
import torch
from _clean import assert_clean
from _models import make_bridge

GRADIENT_METHODS = ["attnlrp", "cp_lrp", "grad_x_input", "integrated_gradients", "grad_norm", "attribution_patching"]
STEPS = [0, 2]


def _steer(model):
    direction = 3.0 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))

    def add(resid, hook):
        return resid + direction

    return model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", add)])


def _ablate(model):
    return model.steer("blocks.1.attn.hook_z", ablate_heads=[0, 2])


def _other(model):
    def halve(resid, hook):
        return resid * 0.5

    return model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", halve)])


def _values(run, method):
    options = {"corrupted_tokens": run.sequences} if method == "attribution_patching" else {}
    if method == "integrated_gradients":
        options = {"steps": 2}
    rel = run.relevance_pass(STEPS, method=method, **options)
    return rel.values


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("intervention", [_steer, _ablate])
def test_gradient_methods_explain_the_generated_run_inside_and_outside_the_with_block(family, intervention):
    model = make_bridge(family)
    with intervention(model):
        run = model.forward_pass(["Hello there", "Hi"], max_new_tokens=3, stop_at_eos=False)
        logits = run.relevance_pass(STEPS, method="dla").values
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the generation's own hooks are no reason to warn
            inside = {m: _values(run, m) for m in GRADIENT_METHODS}
    plain = model.forward_pass(["Hello there", "Hi"], max_new_tokens=3, stop_at_eos=False)
    assert not torch.allclose(plain.relevance_pass(STEPS, method="grad_x_input").values[:1], logits[:1])
    assert_clean(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outside = {m: _values(run, m) for m in GRADIENT_METHODS}
    assert_clean(model)
    for method in GRADIENT_METHODS:
        torch.testing.assert_close(inside[method], logits, atol=1e-5, rtol=0, msg=f"{method} inside")
        torch.testing.assert_close(outside[method], logits, atol=1e-5, rtol=0, msg=f"{method} outside")


@pytest.mark.parametrize("method", GRADIENT_METHODS)
def test_hooks_active_at_call_time_are_ignored_with_a_warning_and_restored(method):
    model = make_bridge("llama")
    with _steer(model):
        run = model.forward_pass("Hello there", max_new_tokens=3, stop_at_eos=False)
    logits = run.relevance_pass(STEPS, method="dla").values
    with _other(model), _ablate(model):
        before = {name: list(entries) for name, entries in model.list_hooks().items()}
        with pytest.warns(UserWarning, match=r"blocks\.1\.hook_resid_pre \(halve\).*blocks\.1\.attn\.hook_z"):
            values = _values(run, method)
        assert {name: list(entries) for name, entries in model.list_hooks().items()} == before
    torch.testing.assert_close(values, logits, atol=1e-5, rtol=0)
    assert_clean(model)


def test_a_run_without_hooks_is_explained_without_the_hooks_active_later():
    model = make_bridge("llama")
    out, cache = model.generate(torch.tensor([[1, 5, 17, 42]]), max_new_tokens=3, return_cache=True)
    logits = model.relevance((out, cache), method="dla", token_indices=STEPS).values
    with _steer(model), pytest.warns(UserWarning, match=r"blocks\.0\.hook_resid_post \(add\)") as record:
        values = model.relevance((out, cache), method="attnlrp", token_indices=STEPS).values
    assert record[0].filename == __file__  # the warning points at the caller's line
    torch.testing.assert_close(values, logits, atol=1e-5, rtol=0)
    assert_clean(model)


def test_the_hooks_come_back_after_an_error_in_the_method():
    model = make_bridge("llama")

    def fails_when_explained(resid, hook):
        if hook.ctx.phase == "forward":
            raise RuntimeError("boom")

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", fails_when_explained)]):
        run = model.forward_pass("Hello there", max_new_tokens=2, stop_at_eos=False)
    with _other(model):
        before = {name: list(entries) for name, entries in model.list_hooks().items()}
        with pytest.warns(UserWarning, match="halve"), pytest.raises(RuntimeError, match="boom"):
            run.relevance_pass(STEPS[:1], method="grad_x_input")
        assert {name: list(entries) for name, entries in model.list_hooks().items()} == before
    assert_clean(model)
