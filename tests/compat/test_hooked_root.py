"""`HookedRootModule` (compat/hooked_root.py): a 2-block toy model with hook points in its child modules.

Oracles: the forward computed by hand from the same modules (what each point sees, what an edit changes),
gradients from autograd on that hand computation, TransformerLens' documented reset / permanent / level rules.
"""

import pytest
import torch
from torch import nn

from transformer_bridge import ActivationCache, HookedRootModule, HookPoint
from transformer_bridge.compat.hooked_root import SetupError
from transformer_bridge.hooks.names import NotCachedError, UnknownHookError

NAMES = ["hook_embed", "blocks.0.hook_pre", "blocks.0.hook_post", "blocks.1.hook_pre", "blocks.1.hook_post"]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x):
        return x + self.hook_post(torch.tanh(self.hook_pre(self.lin(x))))


class Toy(HookedRootModule):
    """d_in 3, d 5, 2 blocks, d_out 2; ``reduce=True`` returns the summed output (a scalar, for incl_bwd)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 5)
        self.hook_embed = HookPoint()
        self.blocks = nn.ModuleList([Block(5), Block(5)])
        self.unembed = nn.Linear(5, 2)
        self.setup()

    def forward(self, x, reduce=False):
        resid = self.hook_embed(self.embed(x))
        for block in self.blocks:
            resid = block(resid)
        out = self.unembed(resid)
        return out.sum() if reduce else out


def by_hand(model: Toy, x, zero_post0: bool = False):
    """The forward without hook points: every activation a point sees, and the output."""
    acts = {"hook_embed": model.embed(x)}
    resid = acts["hook_embed"]
    for i, block in enumerate(model.blocks):
        acts[f"blocks.{i}.hook_pre"] = pre = block.lin(resid)
        post = torch.tanh(pre)
        acts[f"blocks.{i}.hook_post"] = post
        resid = resid + (post * 0 if zero_post0 and i == 0 else post)
    return acts, model.unembed(resid)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Toy()


X = torch.linspace(-1, 1, 12).reshape(4, 3)


def test_setup_names_points_by_attribute_path(model):
    assert list(model.hook_dict) == NAMES
    assert [p.name for p in model.hook_points()] == NAMES
    assert model.hook_dict["blocks.1.hook_pre"] is model.blocks[1].hook_pre
    assert model.blocks[1].hook_pre.layer() == 1
    assert model.mod_dict["blocks.0.lin"] is model.blocks[0].lin and model.blocks[0].lin.name == "blocks.0.lin"
    assert model.mod_dict["blocks.0.hook_post"] is model.blocks[0].hook_post
    assert model.context_level == 0


def test_points_in_a_list_and_a_shared_point_are_named_once():
    class Listed(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.heads = [HookPoint(), HookPoint()]
            self.again = self.heads[0]
            self.setup()

    m = Listed()
    assert list(m.hook_dict) == ["heads.0", "heads.1"] and m.heads[0].name == "heads.0"


def test_hooks_see_the_hand_computed_activations_and_leave_no_hook(model):
    seen = {}
    out = model.run_with_hooks(X, fwd_hooks=[(lambda n: True, lambda t, hook: seen.__setitem__(hook.name, t.clone()))])
    acts, expected = by_hand(model, X)
    assert list(seen) == NAMES
    for name in NAMES:
        assert torch.equal(seen[name], acts[name]), name
    assert torch.equal(out, expected) and torch.equal(model(X), expected)
    assert model.list_hooks() == {}


def test_an_edit_changes_the_output_as_by_hand(model):
    _, expected = by_hand(model, X, zero_post0=True)
    for edit in (lambda t, hook: t * 0, lambda t, hook: t.zero_()):  # a replacement, an in-place edit
        out = model.run_with_hooks(X, fwd_hooks=[("blocks.0.hook_post", edit)])
        assert torch.equal(out, expected)
    assert torch.equal(model(X), by_hand(model, X)[1])


def test_run_with_cache_holds_what_the_points_saw(model):
    acts, expected = by_hand(model, X)
    with torch.no_grad():
        out, cache = model.run_with_cache(X)
    assert isinstance(cache, ActivationCache) and cache.model is model and cache.has_batch_dim
    assert list(cache) == NAMES and torch.equal(out, expected)
    for name in NAMES:
        assert torch.equal(cache[name], acts[name]) and not cache[name].requires_grad
    _, plain = model.run_with_cache(X, names_filter=["blocks.1.hook_pre"], return_cache_object=False)
    assert isinstance(plain, dict) and list(plain) == ["blocks.1.hook_pre"]
    _, some = model.run_with_cache(X, names_filter=lambda n: n.endswith("hook_post"), device="cpu")
    assert list(some) == ["blocks.0.hook_post", "blocks.1.hook_post"]
    assert "blocks.0.hook_post" in some and "nope" not in some
    with pytest.raises(NotCachedError):
        some["hook_embed"]
    with pytest.raises(UnknownHookError):
        some["blocks.0.hook_psot"]
    assert model.list_hooks() == {}


def test_run_with_cache_sees_the_active_edits(model):
    with model.hooks(fwd_hooks=[("blocks.0.hook_post", lambda t, hook: t * 0)]):
        _, cache = model.run_with_cache(X, names_filter=["blocks.0.hook_post", "blocks.1.hook_pre"])
    assert torch.equal(cache["blocks.0.hook_post"], torch.zeros(4, 5))
    resid = model.embed(X)
    assert torch.equal(cache["blocks.1.hook_pre"], model.blocks[1].lin(resid))


def test_remove_batch_dim(model):
    x1 = X[:1]
    acts, _ = by_hand(model, x1)
    _, cache = model.run_with_cache(x1, remove_batch_dim=True)
    assert not cache.has_batch_dim
    for name in NAMES:
        assert torch.equal(cache[name], acts[name][0])
    with pytest.raises(AssertionError, match="batch size 4"):
        model.run_with_cache(X, remove_batch_dim=True)
    with pytest.raises(ValueError, match="batch size 4"):
        model.run_with_cache(X, remove_batch_dim=True)
    assert model.list_hooks() == {}


def test_add_caching_hooks_fill_on_later_forwards_until_reset(model):
    cache = model.add_caching_hooks(["hook_embed", "blocks.1.hook_post"], remove_batch_dim=True)
    assert cache == {}
    model(X)  # a batch of 4 keeps its rows on the hook path
    acts, _ = by_hand(model, X)
    assert list(cache) == ["hook_embed", "blocks.1.hook_post"]
    assert torch.equal(cache["hook_embed"], acts["hook_embed"])
    model(X[:1])
    assert torch.equal(cache["hook_embed"], acts["hook_embed"][0])
    model.reset_hooks()
    model(X)
    assert cache["hook_embed"].shape == (5,) and model.list_hooks() == {}


def test_incl_bwd_gradients_equal_autograd_by_hand(model):
    out, cache = model.run_with_cache(X, reduce=True, incl_bwd=True)
    leaves = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    acts, expected = by_hand(model, X)
    grads = torch.autograd.grad(expected.sum(), [acts[n] for n in NAMES], retain_graph=True)
    assert torch.equal(out.detach(), expected.sum().detach())
    assert set(cache) == {*NAMES, *(n + "_grad" for n in NAMES)}
    for name, grad in zip(NAMES, grads, strict=True):
        torch.testing.assert_close(cache[name + "_grad"], grad, rtol=1e-6, atol=1e-7)
    expected.sum().backward()
    for got, want in zip(leaves, model.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad, rtol=1e-6, atol=1e-7)
    assert model.list_hooks() == {}


def test_incl_bwd_refuses_what_it_cannot_backpropagate(model):
    with pytest.raises(ValueError, match="one-element tensor"):
        model.run_with_cache(X, incl_bwd=True)
    with torch.no_grad(), pytest.raises(ValueError, match="gradient tracking is off"):
        model.run_with_cache(X, reduce=True, incl_bwd=True)
    assert model.list_hooks() == {}


def test_backward_hooks_edit_the_gradient(model):
    with model.hooks(bwd_hooks=[("blocks.1.hook_post", lambda g, hook: g * 0)]):
        model(X).sum().backward()
    got = model.blocks[1].lin.weight.grad
    assert torch.equal(got, torch.zeros_like(got))
    with pytest.warns(UserWarning, match="bwd_hooks"):
        model.run_with_hooks(X, bwd_hooks=[("hook_embed", lambda g, hook: None)])


def test_temporary_permanent_and_levels(model):
    fn = lambda t, hook: None  # noqa: E731
    model.add_hook("hook_embed", fn, is_permanent=True)
    model.add_hook("hook_embed", fn)
    with model.hooks(fwd_hooks=[("blocks.0.hook_pre", fn)]):
        assert model.context_level == 1
        assert [e.context_level for e in model.blocks[0].hook_pre.fwd_hooks] == [1]
        model.add_hook("blocks.1.hook_pre", fn)  # not added by the context: it stays
    assert model.context_level == 0 and not model.blocks[0].hook_pre.fwd_hooks
    assert len(model.blocks[1].hook_pre.fwd_hooks) == 1
    model.reset_hooks()
    assert [e.is_permanent for e in model.hook_embed.fwd_hooks] == [True] and not model.blocks[1].hook_pre.fwd_hooks
    model.reset_hooks(including_permanent=True)
    assert model.list_hooks() == {}
    model.hook_embed.add_hook(fn, is_permanent=True, level=1)  # on the point itself, as TransformerLens
    model.hook_embed.add_hook(fn, is_permanent=True, level=2)
    model.reset_hooks(including_permanent=True, level=2)
    assert [e.context_level for e in model.hook_embed.fwd_hooks] == [1]


def test_hook_context_dict_is_cleared_by_reset(model):
    model.run_with_hooks(X, fwd_hooks=[("hook_embed", lambda t, hook: hook.ctx.__setitem__("n", t.shape[0]))])
    assert model.hook_embed.ctx == {"n": 4}
    model.reset_hooks()
    assert model.hook_embed.ctx == {}


def test_check_hooks_to_add_can_refuse_and_nothing_is_added():
    class NoBackward(Toy):
        def check_hooks_to_add(self, hook_point, hook_point_name, hook, dir="fwd", **kw):
            if dir == "bwd":
                raise ValueError(f"no backward hooks on {hook_point_name}")

    torch.manual_seed(0)
    m = NoBackward()
    fn = lambda t, hook: None  # noqa: E731
    hooks = m.hooks(fwd_hooks=[("hook_embed", fn)], bwd_hooks=[("hook_embed", fn)])
    with pytest.raises(ValueError, match="no backward hooks on hook_embed"), hooks:
        pass
    assert m.list_hooks() == {}


def test_bad_inputs(model):
    fn = lambda t, hook: None  # noqa: E731
    with pytest.raises(UnknownHookError, match=r"blocks\.0\.hook_pre"):
        model.add_hook("blocks.0.hook_pr", fn)
    with pytest.raises(ValueError, match="matched no hook point"):
        model.run_with_cache(X, names_filter=lambda n: "attn" in n)
    with pytest.raises(ValueError, match="`dir`"):
        model.add_hook("hook_embed", fn, dir="backward")
    with pytest.raises(TypeError, match="pos_slice"):
        model.run_with_cache(X, pos_slice=-1)
    with pytest.raises(ValueError, match="`incl_bwd`"):
        model.run_with_cache(X, incl_bwd="yes")
    assert model.list_hooks() == {}

    class Forgot(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.hook_a = HookPoint()

    with pytest.raises(SetupError, match=r"self\.setup\(\)"):
        Forgot().run_with_cache(X)


class _ModulePoint(nn.Module):
    """TransformerLens' HookPoint is an nn.Module: the oracle's order is torch's `named_modules()` over these."""

    def forward(self, x):
        return x


def _layouts(point):
    """Two classes built by the same assignments, ``point()`` making each point: a module's own points before,
    between and after its children with points, a list of points, nested blocks, a child without points."""

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.hook_a = point()
            self.lin = nn.Linear(2, 2)
            self.hook_b = point()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.hook_mid = point()
            self.attn = Inner()
            self.hook_out = point()

    def build(root: nn.Module) -> nn.Module:
        root.embed = nn.Linear(2, 2)
        root.hook_embed = point()
        root.blocks = nn.ModuleList([Block(), Block()])
        root.hook_final = point()
        root.heads = nn.ModuleList([point(), point()]) if point is _ModulePoint else [point(), point()]
        root.ln = Inner()
        return root

    return build


def test_hook_dict_and_mod_dict_follow_transformerlens_named_modules_order():
    class Ours(HookedRootModule):
        def __init__(self):
            super().__init__()
            _layouts(HookPoint)(self)
            self.setup()

    oracle = _layouts(_ModulePoint)(nn.Module())
    expected = [name for name, m in oracle.named_modules() if isinstance(m, _ModulePoint)]
    ours = Ours()
    assert list(ours.hook_dict) == expected
    assert expected.index("hook_final") > expected.index("blocks.1.hook_out")  # a point after a child with points
    # mod_dict: every child module and point; points and the modules holding points in the same order (a module
    # without points, `lin`, can't be placed among its parent's points: no creation rank; the oracle's ModuleList
    # of points adds a `heads` entry, which a plain list has not)
    expected_mods = [name for name, _ in oracle.named_modules() if name and name != "heads"]
    assert sorted(ours.mod_dict) == sorted(expected_mods)
    placed = [name for name in expected_mods if not name.endswith("lin") and name != "embed"]
    assert [name for name in ours.mod_dict if name in placed] == placed
