"""Hook bookkeeping: contexts, permanence, handles, leaks after exceptions, unknown names, hook.ctx."""

import pytest
import torch
from conftest import make_bridge

from transformer_bridge import UnknownHookError

NAME = "blocks.0.hook_resid_post"
TOKENS = torch.tensor([[5, 6, 7, 8]])


def _torch_hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.hf_model.modules())


@pytest.fixture
def model():
    return make_bridge("llama")


def test_no_torch_hooks_until_needed(model):
    assert _torch_hook_count(model) == 0
    handle = model.add_hook(NAME, lambda x, hook: None)
    assert _torch_hook_count(model) == 1
    handle.remove()
    assert _torch_hook_count(model) == 0


def test_context_removes_exactly_its_hooks(model):
    calls = []
    permanent = model.add_hook(NAME, lambda x, hook: calls.append("perm"), is_permanent=True)
    other = model.add_hook(NAME, lambda x, hook: calls.append("other"))
    with model.hooks(fwd_hooks=[(NAME, lambda x, hook: calls.append("ctx"))]):
        model(TOKENS)
    assert calls == ["perm", "other", "ctx"]
    calls.clear()
    model(TOKENS)
    assert calls == ["perm", "other"]
    model.reset_hooks()
    calls.clear()
    model(TOKENS)
    assert calls == ["perm"]
    model.reset_hooks(including_permanent=True)
    assert not model.hook_dict[NAME].active and _torch_hook_count(model) == 0
    del permanent, other


def test_exception_inside_hook_leaves_model_clean(model):
    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), model.hooks(fwd_hooks=[(lambda n: "attn" in n, boom)]):
        model(TOKENS)
    assert _torch_hook_count(model) == 0
    assert not any(p.active for p in model.hook_dict.values())
    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.attn.hook_pattern", boom)])
    assert _torch_hook_count(model) == 0
    with torch.no_grad():
        assert torch.equal(model(TOKENS), model.hf_model(TOKENS).logits)


def test_predicate_and_handle(model):
    seen = []
    handle = model.add_hook(lambda n: n.endswith("hook_resid_pre"), lambda x, hook: seen.append(hook.name))
    model(TOKENS)
    assert seen == ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]
    handle.remove()
    seen.clear()
    model(TOKENS)
    assert seen == []


def test_hook_layer_and_name(model):
    point = model.hook_dict["blocks.1.attn.hook_pattern"]
    assert point.layer() == 1 and point.name == "blocks.1.attn.hook_pattern"
    with pytest.raises(ValueError, match="not inside a block"):
        model.hook_dict["hook_embed"].layer()


def test_unknown_name_suggests_close_matches(model):
    with pytest.raises(KeyError) as info:
        model.add_hook("blocks.0.hook_resid_psot", lambda x, hook: None)
    assert isinstance(info.value, UnknownHookError)
    assert "blocks.0.hook_resid_post" in str(info.value)
    with pytest.raises(KeyError, match=r"attn\.hook_pattern"):
        model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.attn.hook_patern", lambda x, hook: None)])
    assert _torch_hook_count(model) == 0


def test_bad_hook_arguments(model):
    with pytest.raises(ValueError, match="`dir`"):
        model.add_hook(NAME, lambda x, hook: None, dir="up")
    with pytest.raises(TypeError, match="callable"):
        model.add_hook(NAME, 3)
    with pytest.raises(TypeError, match="must return a Tensor"):
        model.run_with_hooks(TOKENS, fwd_hooks=[(NAME, lambda x, hook: 3)])
    with pytest.raises(ValueError, match="keep the shape"):
        model.run_with_hooks(TOKENS, fwd_hooks=[(NAME, lambda x, hook: x[:, :1])])
    assert _torch_hook_count(model) == 0


def test_ctx_forward_positions_with_left_padding(model):
    seen = {}

    def record(x, hook):
        seen["ctx"] = hook.chunk  # hook.ctx reads the chunk only while the call runs; hook.chunk can be kept
        assert hook.ctx.positions is hook.chunk.positions

    model.run_with_hooks(["Hi", "Hello"], fwd_hooks=[("blocks.0.hook_resid_pre", record)], padding_side="left")
    ctx = seen["ctx"]
    assert ctx.phase == "forward" and ctx.step == 0
    # "<bos>Hi" is 3 tokens, "<bos>Hello" 6: the first row has 3 pads on the left.
    assert ctx.positions.tolist() == [[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert ctx.pad_mask.tolist() == [[True] * 3 + [False] * 3, [False] * 6]
    assert not ctx.is_generated.any()
    assert model.ctx is None  # only set while the forward runs


def test_position_specific_steering_is_padding_independent(model):
    """A hook that edits absolute position 1 changes the same token in a padded batch as alone."""

    def steer(x, hook):
        return x + 5.0 * (hook.ctx.positions == 1)[..., None]

    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", steer)]):
        alone = model("Hi")[0]
        batch = model(["Hi", "Hello there"], padding_side="left")[0, -alone.shape[0] :]
        right = model(["Hi", "Hello there"])[0, : alone.shape[0]]  # as to_tokens pads: the row first
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=1e-5)
