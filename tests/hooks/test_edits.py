"""Edits always take effect: a hook that returns a new tensor, edits in place and returns it, or
edits in place and returns None changes the model's computation identically, on every hook point
of every family, with and without autograd. Read-only hooks leave the logits bitwise HF's."""

import pytest
import torch
from _clean import assert_clean
from conftest import FAMILIES, V, make_bridge

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(5))
MASK = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


def _edit_inplace(x: torch.Tensor) -> None:
    if not x.is_floating_point():  # hook_tokens: token ids, edited to other ids
        x[..., -1] = (x[..., -1] + 1) % V
        return
    x[..., 0] *= 0.5
    x[..., -1] += 0.25


def returned(x, hook):
    y = x.clone()
    _edit_inplace(y)
    return y


def inplace_return(x, hook):
    _edit_inplace(x)
    return x


def inplace_none(x, hook):
    _edit_inplace(x)


STYLES = {"inplace_return": inplace_return, "inplace_none": inplace_none}


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def _names(model):
    # Layer 1's points and the model-level ones: every kind of point once (layer 0 is the same kind).
    return [n for n in model.hook_dict if not n.startswith("blocks.0.")]


def _run(model, name, fn, grad: bool):
    with torch.set_grad_enabled(grad):
        logits = model.run_with_hooks(TOKENS, fwd_hooks=[(name, fn)], attention_mask=MASK)
        if grad:
            logits.float().pow(2).mean().backward()
            grads = {n: p.grad.clone() for n, p in model.hf_model.named_parameters() if p.grad is not None}
            model.hf_model.zero_grad(set_to_none=True)
            return logits.detach(), grads
    return logits, {}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_inplace_edit_equals_returned_edit_on_every_point(model, grad):
    with torch.no_grad():
        plain = model(TOKENS, attention_mask=MASK)
    failures = []
    for name in _names(model):
        expected, expected_grads = _run(model, name, returned, grad)
        if torch.allclose(expected, plain, atol=1e-6):
            failures.append(f"{name}: the reference edit changed nothing")
            continue
        for style, fn in STYLES.items():
            got, got_grads = _run(model, name, fn, grad)
            if not torch.allclose(got, expected, atol=1e-6, rtol=1e-5):
                failures.append(f"{name} {style}: max diff {(got - expected).abs().max().item():.3g}")
            for param, g in expected_grads.items():
                if not torch.allclose(got_grads.get(param, torch.zeros_like(g)), g, atol=1e-5, rtol=1e-4):
                    failures.append(f"{name} {style}: gradient of {param} differs")
                    break
    assert not failures, failures
    assert_clean(model)


def test_read_only_hooks_on_every_point_keep_logits_bitwise(model):
    seen = []

    def read(x, hook):
        seen.append(hook.name)
        _ = x.sum()

    with torch.no_grad():
        ours = model.run_with_hooks(TOKENS, fwd_hooks=[(list(model.hook_dict), read)], attention_mask=MASK)
        positions = (MASK.cumsum(-1) - 1).clamp_min(0)
        if model.adapter.positions_from_mask:  # OPT derives its positions from the mask itself
            positions = None
        theirs = model.hf_model(TOKENS, attention_mask=MASK, position_ids=positions).logits
    assert torch.equal(ours, theirs)
    assert set(seen) == set(model.hook_dict)


def test_inplace_edit_under_inference_mode_takes_effect(model):
    name = "blocks.1.attn.hook_pattern"
    if name not in model.hook_dict:  # Falcon: no pattern point
        name = "blocks.1.attn.hook_z"
    with torch.inference_mode():
        expected = model.run_with_hooks(TOKENS, fwd_hooks=[(name, returned)])
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(name, inplace_none)])
        plain = model(TOKENS)
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.allclose(got, plain, atol=1e-4)


def test_two_hooks_in_place_then_returned_compose(model):
    name = "blocks.1.hook_resid_mid" if "blocks.1.hook_resid_mid" in model.hook_dict else "blocks.1.hook_attn_out"

    def double(x, hook):
        return x * 2

    with torch.no_grad():
        expected = model.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda x, h: double(returned(x, h), h))])
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(name, inplace_none), (name, double)])
    assert torch.allclose(got, expected, atol=1e-6)


def test_hooks_that_do_not_edit_keep_the_kernel_path_under_autograd(model):
    """A hook that may edit but does not (no read_only promise) leaves the logits bitwise HF's, autograd on."""

    def look(x, hook):
        _ = x.sum()

    logits = model.run_with_hooks(TOKENS, fwd_hooks=[(lambda n: True, look)], attention_mask=MASK)
    positions = None if model.adapter.positions_from_mask else (MASK.cumsum(-1) - 1).clamp_min(0)
    assert torch.equal(logits, model.hf_model(TOKENS, attention_mask=MASK, position_ids=positions).logits)
