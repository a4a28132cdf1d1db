"""`model.steer`: declarative interventions against hand-written hooks and manual computations."""

import pytest
import torch
from conftest import FAMILIES, make_bridge

TOKENS = torch.tensor([[5, 17, 3, 42, 8, 11, 29]])


@pytest.fixture(scope="module", params=FAMILIES[:6])
def model(request):
    return make_bridge(request.param)


def test_add_and_scale_equal_the_hook_they_describe(model):
    point = "blocks.0.hook_resid_post"
    v = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.run_with_hooks(TOKENS, fwd_hooks=[(point, lambda x, hook: x + v)])
        with model.steer(point, add=v):
            assert torch.equal(model(TOKENS), expected)
        expected = model.run_with_hooks(TOKENS, fwd_hooks=[(point, lambda x, hook: x * 0.5)])
        with model.steer(point, scale=0.5):
            assert torch.equal(model(TOKENS), expected)
        assert not model.hook_dict[point].fwd_hooks  # removed on exit


def test_positions_and_set_touch_only_those_positions(model):
    point = "blocks.1.hook_resid_pre"
    mean = torch.randn(model.cfg.d_model)
    _, clean = model.run_with_cache(TOKENS, names_filter=[point])
    with model.steer(point, set=mean, positions=[1, 4]):
        _, cache = model.run_with_cache(TOKENS, names_filter=[point])
    got, ref = cache[point][0], clean[point][0]
    assert torch.equal(got[[1, 4]], mean.expand(2, -1))  # the hook point shows the edited value
    keep = [0, 2, 3, 5, 6]
    assert torch.equal(got[keep], ref[keep])


def test_ablate_heads_zeroes_those_heads_of_z(model):
    point = "blocks.0.attn.hook_z"
    with model.steer(point, ablate_heads=[1]):
        _, cache = model.run_with_cache(TOKENS, names_filter=[point])
    z = cache[point]  # [batch, pos, head, d_head]
    assert (z[:, :, 1] == 0).all() and (z[:, :, 0] != 0).any()


def test_update_changes_values_in_place_without_new_hooks(model):
    point = "blocks.0.hook_resid_post"
    a, b = torch.randn(model.cfg.d_model), torch.randn(model.cfg.d_model)
    with torch.no_grad():
        expected = model.run_with_hooks(TOKENS, fwd_hooks=[(point, lambda x, hook: x + b)])
        s = model.steer(point, add=a)
        hooks = list(model.hook_dict[point].fwd_hooks)
        tensor = s.value
        s.update(add=b)
        assert model.hook_dict[point].fwd_hooks == hooks and s.value is tensor
        assert torch.equal(model(TOKENS), expected)
        s.remove()
    assert not model.hook_dict[point].fwd_hooks


def test_steered_generation_equals_the_hook_and_speculation():
    model = make_bridge("llama")
    tokens, mask = model.to_tokens_and_mask(["Hello world, this is", "Hi"], padding_side="left")
    v = 3 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    point = "blocks.1.hook_resid_post"

    def hook(x, hook):
        return torch.where(torch.isin(hook.ctx.positions, torch.tensor([3, 6, 7]))[..., None], x + v, x)

    with model.hooks(fwd_hooks=[(point, hook)]):
        expected = model.generate(tokens, attention_mask=mask, max_new_tokens=10)
    with model.steer(point, add=v, positions=[3, 6, 7]):
        assert torch.equal(model.generate(tokens, attention_mask=mask, max_new_tokens=10), expected)
        fast = model.generate(tokens, attention_mask=mask, max_new_tokens=10, prompt_lookup_num_tokens=3)
        assert torch.equal(fast, expected)
    assert not torch.equal(model.generate(tokens, attention_mask=mask, max_new_tokens=10), expected)


def test_bad_steering_arguments():
    model = make_bridge("llama")
    v = torch.zeros(model.cfg.d_model)
    with pytest.raises(ValueError, match="exactly one"):
        model.steer("blocks.0.hook_resid_post", add=v, scale=2.0)
    with pytest.raises(ValueError, match="point"):
        model.steer("blocks.9.hook_resid_post", add=v)
    with pytest.raises(ValueError, match="per-head"):
        model.steer("blocks.0.hook_resid_post", ablate_heads=[0])
    with pytest.raises(ValueError, match="ablate_heads"):
        model.steer("blocks.0.attn.hook_z", ablate_heads=[7])
    with pytest.raises(ValueError, match="positions"):
        model.steer("blocks.0.hook_resid_post", add=v, positions=[-1])
    with model.steer("blocks.0.hook_resid_post", add=v) as s, pytest.raises(ValueError, match="shape"):
        s.update(add=torch.zeros(3))
    assert not model.hook_dict["blocks.0.hook_resid_post"].fwd_hooks


def test_a_new_steer_reuses_a_removed_ones_tensors_and_the_compiled_step():
    """``with model.steer(...)`` in a loop: the second intervention of the same kind takes over the first's
    tensors (so the compiled step traced with it is met again, not re-traced: torch drops a graph whose tensors
    were freed); two at once stay distinct; the results equal hand-written hooks."""
    from torch._dynamo.utils import counters

    model = make_bridge("llama")
    tokens, mask = model.to_tokens_and_mask(["Hello world, this is", "Hi"], padding_side="left")
    point = "blocks.1.hook_resid_post"
    gen = torch.Generator().manual_seed(2)
    a, b = (3 * torch.randn(model.cfg.d_model, generator=gen) for _ in range(2))
    kw = dict(attention_mask=mask, max_new_tokens=8)
    expected = []
    for v in (a, b):
        with model.hooks(fwd_hooks=[(point, lambda x, hook, v=v: x + v)]):
            expected.append(model.generate(tokens, **kw))
    outs, objects = [], []
    for v in (a, b, a):
        with model.steer(point, add=v) as s:
            outs.append(model.generate(tokens, **kw, compile=True))
            objects.append(s)
        if len(outs) == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs  # the 2nd and 3rd steer ran the 1st one's graph
    assert [torch.equal(o, e) for o, e in zip(outs, [*expected, expected[0]], strict=True)] == [True] * 3
    assert objects[0] is objects[1] is objects[2]
    with model.steer(point, add=a) as s1, model.steer(point, add=b) as s2:
        assert s1 is not s2 and not torch.equal(s1.value, s2.value)
        with model.hooks(fwd_hooks=[(point, lambda x, hook: x + a + b)]):
            both = model.generate(tokens, **kw)
        assert torch.equal(model.generate(tokens, **kw), both)
