"""TransformerLens' HookPoint details: ``has_hooks(level=)``, hook entries with ``is_permanent`` /
``context_level`` / ``user_hook`` / ``hook.remove()``, ``list_hooks``, a hook point called like a module, a
backward hook returning ``(grad,)``; and the points ``hook_tokens``, ``unembed.hook_in`` / ``hook_out``
(oracles: the HF model's logits and its final norm's output, a forward on other tokens)."""

import pytest
import torch
from conftest import make_bridge, perturb_

TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3], [1, 9, 9, 33, 71, 12]])
POINT = "blocks.0.hook_resid_post"


def noop(x, hook):
    return None


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2", "opt"])
def model(request):
    return perturb_(make_bridge(request.param))


def test_has_hooks_by_level_direction_and_permanence(model):
    point = model.hook_dict[POINT]
    assert not point.has_hooks()
    model.add_perma_hook(POINT, noop)
    with model.hooks(fwd_hooks=[(POINT, noop)], bwd_hooks=[(POINT, noop)]):
        level = model.context_level
        assert point.has_hooks(level=level) and point.has_hooks("bwd", level=level)
        assert not point.has_hooks(level=level + 1)
        entries = point.fwd_hooks
        assert [(e.is_permanent, e.context_level) for e in entries] == [(True, None), (False, level)]
        assert all(e.user_hook is noop for e in entries)
        assert list(model.list_hooks()) == [POINT] and len(model.list_hooks(including_permanent=False)[POINT]) == 2
    assert point.has_hooks() and not point.has_hooks(including_permanent=False)
    point.fwd_hooks[0].hook.remove()  # TransformerLens' LensHandle.hook.remove()
    assert not point.has_hooks() and model.list_hooks() == {}
    with pytest.raises(TypeError, match="level"):
        point.has_hooks(level="1")


def test_hook_point_called_like_a_module(model):
    point = model.hook_dict[POINT]
    x = torch.ones(1, 2, model.cfg.d_model)
    assert point(x) is x
    with model.hooks(fwd_hooks=[(POINT, lambda t, hook: t * 3)]):
        assert torch.equal(point(x), 3 * x) and torch.equal(point.forward(x), 3 * x)
    with pytest.raises(TypeError, match="activation tensor"):
        point("x")


def test_backward_hook_may_return_a_tuple(model):
    def double(grad, hook):
        return (2 * grad,)

    def block0_grads(bwd):
        with model.hooks(bwd_hooks=bwd):
            model(TOKENS).sum().backward()
        grads = [p.grad.clone() for p in model.blocks[0].module.parameters()]
        model.hf_model.zero_grad()
        return grads

    # Every path from the logits to block 0 goes through the last block's output (n_layers = 2).
    for plain, doubled in zip(block0_grads([]), block0_grads([("blocks.1.hook_resid_post", double)]), strict=True):
        torch.testing.assert_close(doubled, 2 * plain, atol=1e-5, rtol=1e-4)


def test_hook_tokens_sees_and_replaces_the_ids(model):
    seen = []
    other = torch.full_like(TOKENS, 7)
    got = model.run_with_hooks(TOKENS, fwd_hooks=[("hook_tokens", lambda t, hook: seen.append(t.clone()) or other)])
    assert torch.equal(seen[0], TOKENS)
    torch.testing.assert_close(got, model(other), atol=0, rtol=0)
    _, cache = model.run_with_cache(TOKENS, names_filter="embed.hook_in")  # TransformerLens 4's spelling
    assert torch.equal(cache["hook_tokens"], TOKENS)


def test_unembed_points_are_lm_heads_input_and_output(model):
    logits, cache = model.run_with_cache(TOKENS)
    with torch.no_grad():
        out = model.hf_model(TOKENS, output_hidden_states=True)
    if getattr(model.hf_model.config, "final_logit_softcapping", None) is None:
        assert torch.equal(cache["unembed.hook_out"], logits)
    assert torch.equal(logits, out.logits)
    # The last hidden state HF returns is the final norm's output: what lm_head reads.
    torch.testing.assert_close(cache["unembed.hook_in"], out.hidden_states[-1], atol=0, rtol=0)
    halve = model.run_with_hooks(TOKENS, fwd_hooks=[("unembed.hook_in", lambda x, hook: x * 0.5)])
    assert not torch.allclose(halve, logits)


def test_standalone_hook_point_is_an_identity_with_hooks():
    from transformer_bridge import HookPoint

    point = HookPoint()
    assert repr(point) == "HookPoint()" and not point.has_hooks()
    point.add_hook(lambda x, hook: x + 1, level=2)
    point.add_hook(noop, dir="bwd", is_permanent=True)
    assert repr(point) == "HookPoint(1 fwd, 1 bwd)"
    assert point.has_hooks(level=2) and not point.has_hooks("bwd", including_permanent=False)
    assert torch.equal(point(torch.zeros(2)), torch.ones(2))
    point.remove_hooks("both", including_permanent=True)
    assert not point.has_hooks() and torch.equal(point(torch.zeros(2)), torch.zeros(2))


def test_transformer_lens_4_components_and_accessors(model):
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert attn.q.hook_out is model.hook_dict["blocks.0.attn.hook_q"]
    assert attn.o.hook_in is model.hook_dict["blocks.0.attn.hook_z"] and attn.o.original_component is not None
    assert mlp.out.hook_in is model.hook_dict["blocks.0.mlp.hook_post"]
    assert model.blocks[0].original_component is model.blocks[0].module
    if model.cfg.positional_embedding_type == "standard":
        assert torch.equal(model.W_E_pos, torch.cat([model.W_E, model.W_pos]))
    model.set_use_attn_result(True)
    assert model.cfg.use_attn_result is True
    with pytest.raises(AssertionError, match="does not occur"):  # TransformerLens asserts; also a ValueError
        model.get_token_position(98, TOKENS[0, :3])
    assert model.list_hooks(lambda n: False) == {}
