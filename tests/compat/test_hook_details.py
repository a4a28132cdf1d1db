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


def _torch_hook_count(model) -> int:
    """The bridge's torch hooks on the HF model (HF installs output-capturing hooks of its own, counted apart)."""
    hooks = [h for m in model.hf_model.modules() for h in [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]]
    return sum("output_capturing" not in getattr(h, "__qualname__", "") for h in hooks)


def test_invalid_direction_is_a_value_error_and_a_type_check_error(model):
    from jaxtyping import TypeCheckError

    from transformer_bridge import HookPoint

    point = model.hook_dict[POINT]
    calls = [lambda: HookPoint().has_hooks(dir="invalid"), lambda: point.remove_hooks("up")]
    calls += [lambda: model.add_hook(POINT, noop, dir="both"), lambda: model.reset_hooks(direction="x")]
    for call in calls:
        with pytest.raises(ValueError, match="must be 'fwd'") as info:
            call()
        assert isinstance(info.value, TypeCheckError)  # what TransformerLens' type-checked signatures raise
    assert _torch_hook_count(model) == 0


def test_add_hook_returns_the_listed_entry_and_removal_rebuilds_the_list(model):
    point = model.hook_dict[POINT]
    first = point.add_hook(noop)
    prepended = point.add_hook(noop, prepend=True, level=3)
    bwd = point.add_hook(noop, dir="bwd")
    assert point.fwd_hooks == [prepended, first] and point.bwd_hooks == [bwd]
    assert prepended.context_level == 3 and prepended.hook is prepended and prepended.user_hook is noop
    # A TransformerLens teardown: remove through the handle, then from the list it read before.
    held = point.fwd_hooks
    for entry in list(held):
        entry.hook.remove()
        held.remove(entry)
    assert point.fwd_hooks == [] and point.bwd_hooks == [bwd]
    bwd.remove()
    bwd.remove()  # idempotent
    assert not point.has_hooks() and _torch_hook_count(model) == 0


def test_alias_names_call_the_function_once_per_name_chaining_replacements():
    from transformer_bridge import HookPoint

    point, seen = HookPoint(), []

    def selective(x, hook):
        seen.append((hook.name, x.item()))
        return x + 10 if hook.name == "replace" else None

    point.add_hook(selective, alias_names=["replace", "observe"])
    assert point(torch.tensor(1.0)).item() == 11.0 and seen == [("replace", 1.0), ("observe", 11.0)]
    back, seen[:] = HookPoint(), []
    back.add_hook(selective, dir="bwd", alias_names=["replace", "observe"])
    x = torch.tensor(2.0, requires_grad=True)
    (back(x) * 3).backward()
    assert seen == [("replace", 3.0), ("observe", 13.0)] and x.grad.item() == 13.0  # d(3x)/dx = 3, then + 10
    with pytest.raises(TypeError, match="alias_names"):
        point.add_hook(noop, alias_names="replace")


def test_alias_names_on_a_bridge_point_edit_like_a_plain_hook(model):
    point, names = model.hook_dict[POINT], []

    def double(x, hook):
        names.append((hook.name, hook.layer(), hook.ctx.phase))
        return 2 * x if hook.name == "blocks.1.alias" else None

    entry = point.add_hook(double, alias_names=["blocks.1.alias", "blocks.0.other"])
    try:
        aliased = model(TOKENS)
    finally:
        entry.remove()
    assert names == [("blocks.1.alias", 1, "forward"), ("blocks.0.other", 0, "forward")]
    plain = model.run_with_hooks(TOKENS, fwd_hooks=[(POINT, lambda x, hook: 2 * x)])
    torch.testing.assert_close(aliased, plain, atol=0, rtol=0)


class _Halves:
    """[..., d_model] <-> [..., 2, d_model / 2], a view both ways."""

    def convert(self, x):
        return x.unflatten(-1, (2, -1))

    def revert(self, x):
        return x.flatten(-2)


class _Affine:
    def convert(self, x):
        return x * 2

    def revert(self, x):
        return x + 10


def test_enable_reshape_converts_what_hooks_see_and_reverts_what_they_return(model):
    from transformer_bridge import HookPoint

    standalone = HookPoint()
    standalone.enable_reshape(_Affine())
    entry = standalone.add_hook(lambda x, hook: x + 1)
    assert standalone(torch.tensor([1.0, 2.0])).tolist() == [13.0, 15.0]  # (2x + 1) + 10
    entry.remove()
    standalone.add_hook(noop)
    x = torch.tensor([1.0, 2.0])
    assert standalone(x) is x  # None: nothing reverted, nothing changed
    standalone.enable_reshape(None)
    assert standalone.hook_conversion is None
    with pytest.raises(TypeError, match="hook_conversion"):
        standalone.enable_reshape(object())

    point, half = model.hook_dict[POINT], model.cfg.d_model // 2

    def zero_first_half(x, hook):
        x[..., :half] = 0

    expected = model.run_with_hooks(TOKENS, fwd_hooks=[(POINT, zero_first_half)])

    def zero_first_of_two(x, hook):
        x[..., 0, :] = 0

    point.enable_reshape(_Halves())
    try:
        in_place = model.run_with_hooks(TOKENS, fwd_hooks=[(POINT, zero_first_of_two)])
        replaced = model.run_with_hooks(TOKENS, fwd_hooks=[(POINT, lambda x, hook: x * torch.tensor([[0.0], [1.0]]))])
    finally:
        point.enable_reshape(None)
    torch.testing.assert_close(in_place, expected, atol=0, rtol=0)
    torch.testing.assert_close(replaced, expected, atol=0, rtol=0)


def test_tensor_conversion_base_class(model):
    """`TensorConversion` (TransformerLens' BaseTensorConversion): ``convert`` calls ``handle_conversion``."""
    from transformer_bridge import TensorConversion

    class Halves(TensorConversion):
        def handle_conversion(self, x, *context):
            return x.unflatten(-1, (2, -1))

        def revert(self, x, *context):
            return x.flatten(-2)

    half = model.cfg.d_model // 2
    expected = model.run_with_hooks(TOKENS, fwd_hooks=[(POINT, lambda x, hook: x * (torch.arange(2 * half) >= half))])
    point = model.hook_dict[POINT]
    point.enable_reshape(Halves())
    try:
        seen = {}

        def zero_first(x, hook):
            seen["shape"] = tuple(x.shape)
            return x * torch.tensor([[0.0], [1.0]])

        got = model.run_with_hooks(TOKENS, fwd_hooks=[(POINT, zero_first)])
    finally:
        point.enable_reshape(None)
    assert seen["shape"][-2:] == (2, half)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with pytest.raises(NotImplementedError, match="handle_conversion"):
        TensorConversion().convert(torch.zeros(2))


def test_hook_registry_view_and_reset_of_every_point(model):
    registry = model._hook_registry
    assert dict(registry) == model.hook_dict
    with pytest.raises(TypeError):
        registry["x"] = None  # read-only
    with torch.no_grad():
        plain = model.hf_model(TOKENS).logits
    seen = []
    for point in registry.values():
        point.add_hook(lambda x, hook: seen.append(hook.name))
    first = next(iter(registry.values()))
    first.add_hook(noop, is_permanent=True)
    model.reset_hooks()
    assert [n for n, p in registry.items() if p.fwd_hooks] == [first.name] and first.fwd_hooks[0].is_permanent
    model.reset_hooks(including_permanent=True)
    assert not any(p.fwd_hooks or p.bwd_hooks for p in registry.values()) and _torch_hook_count(model) == 0
    with torch.no_grad():
        logits = model(TOKENS)
    assert seen == [] and torch.equal(logits, plain)


def test_run_with_cache_reset_hooks_end_false_keeps_filling_the_cache(model):
    other = TOKENS[:1, :4]
    _, cache = model.run_with_cache(TOKENS, names_filter=POINT, reset_hooks_end=False)
    _, as_dict = model.run_with_cache(TOKENS, names_filter="hook_embed", reset_hooks_end=False,
                                      return_cache_object=False)  # fmt: skip
    assert len(model.hook_dict[POINT].fwd_hooks) == 1 and model.context_level == 0
    _, fresh = model.run_with_cache(other, names_filter=[POINT, "hook_embed"])
    assert torch.equal(cache[POINT], fresh[POINT]) and torch.equal(as_dict["hook_embed"], fresh["hook_embed"])
    model.reset_hooks()
    assert not model.hook_dict[POINT].fwd_hooks and _torch_hook_count(model) == 0
    model(TOKENS)
    assert torch.equal(cache[POINT], fresh[POINT])  # no longer filled
    with pytest.raises(ValueError, match="remove_batch_dim"):
        model.run_with_cache(TOKENS[:1], names_filter=POINT, reset_hooks_end=False, remove_batch_dim=True)
    with pytest.raises(TypeError, match="reset_hooks_end"):
        model.run_with_cache(TOKENS, reset_hooks_end="no")


def test_context_level_unwinds_after_failures(model):
    with pytest.raises(ValueError, match="scalar"):
        model.run_with_cache(TOKENS, names_filter=POINT, incl_bwd=True, metric=lambda logits: logits)
    assert model.context_level == 0 and _torch_hook_count(model) == 0
    with pytest.raises(RuntimeError, match="boom"), model.hooks(fwd_hooks=[(POINT, noop)]):
        assert model.context_level == 1
        raise RuntimeError("boom")
    assert model.context_level == 0 and not model.hook_dict[POINT].fwd_hooks


def test_run_with_hooks_remove_batch_dim_shows_batch_free_tensors(model):
    """TransformerLens' ``run_with_hooks(remove_batch_dim=True)``: a batch-1 activation reaches the hook without
    its batch axis; an in-place edit, a returned tensor and a backward edit act as without the flag (oracle: the
    same hooks written for the batched layout); a larger batch reaches the hook unchanged."""
    one, shapes = TOKENS[:1], []
    observed = model.run_with_hooks(
        one, fwd_hooks=[(POINT, lambda x, hook: shapes.append(x.shape))], remove_batch_dim=True
    )
    assert shapes == [(6, model.cfg.d_model)] and torch.equal(observed, model(one))

    def zero_(x, hook):
        x[..., 2, :] = 0

    batched = model.run_with_hooks(one, fwd_hooks=[(POINT, zero_)])
    assert not torch.equal(batched, model(one))
    assert torch.equal(model.run_with_hooks(one, fwd_hooks=[(POINT, zero_)], remove_batch_dim=True), batched)
    doubled = model.run_with_hooks(one, fwd_hooks=[(POINT, lambda x, hook: x * 2)], remove_batch_dim=True)
    assert torch.equal(doubled, model.run_with_hooks(one, fwd_hooks=[(POINT, lambda x, hook: x * 2)]))

    def grads_with(flag):
        seen = []

        def double(grad, hook):
            seen.append(grad.shape)
            return (2 * grad,)

        model.hf_model.zero_grad()
        model.run_with_hooks(one, bwd_hooks=[(POINT, double)], remove_batch_dim=flag).sum().backward()
        return seen, [p.grad.clone() for p in model.blocks[0].module.parameters()]

    (seen_flag, flag), (seen_ref, ref) = grads_with(True), grads_with(False)
    model.hf_model.zero_grad()
    with model.hooks(bwd_hooks=[(POINT, lambda g, hook: 2 * g)]):  # backward inside the context: the oracle
        model(one).sum().backward()
    inside = [p.grad.clone() for p in model.blocks[0].module.parameters()]
    model.hf_model.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ref, inside, strict=True))  # run_with_hooks' backward functions ran
    assert seen_flag == [(6, model.cfg.d_model)] and seen_ref == [(1, 6, model.cfg.d_model)]
    assert all(torch.equal(a, b) for a, b in zip(flag, ref, strict=True))

    shapes.clear()
    model.run_with_hooks(TOKENS, fwd_hooks=[(POINT, lambda x, hook: shapes.append(x.shape))], remove_batch_dim=True)
    assert shapes == [(2, 6, model.cfg.d_model)]
    with pytest.raises(TypeError, match="remove_batch_dim"):
        model.run_with_hooks(one, remove_batch_dim="yes")
