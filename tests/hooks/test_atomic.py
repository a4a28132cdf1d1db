"""Registration and removal are atomic: a KeyboardInterrupt (or any exception) injected at each step
of adding or removing hooks leaves the old state or the new one, never half of each, and every
point keeps working afterwards."""

import contextlib

import pytest
import torch
from _clean import PROBE, assert_clean
from conftest import make_bridge
from torch.utils.hooks import RemovableHandle

STEPS = [  # (object, attribute, when): the calls registration and removal are made of
    (torch.nn.Module, "register_forward_hook", "before"),
    (torch.nn.Module, "register_forward_pre_hook", "before"),
    (RemovableHandle, "remove", "before"),
    (RemovableHandle, "remove", "after"),
]


class Injector:
    """Raises KeyboardInterrupt at the ``fail_at``-th step call (counting from 0)."""

    def __init__(self, monkeypatch, fail_at: int) -> None:
        self.calls, self.fail_at, self.fired = 0, fail_at, False
        for owner, attr, when in STEPS:
            original = getattr(owner, attr)
            monkeypatch.setattr(owner, attr, self._wrap(original, when), raising=True)

    def _wrap(self, original, when):
        def step(*args, **kwargs):
            if when == "before":
                self._tick()
            out = original(*args, **kwargs)
            if when == "after":
                self._tick()
            return out

        return step

    def _tick(self) -> None:
        index, self.calls = self.calls, self.calls + 1
        if index == self.fail_at:
            self.fired = True
            raise KeyboardInterrupt(f"injected at step {index}")


def state(model):
    """Registered entries and torch hooks per module (attention routing is a pre-hook, so counted)."""
    entries = sorted(
        (p.name, e.dir, getattr(e.fn, "__name__", "?"), e.permanent)
        for p in model.hook_dict.values()
        for e in [*p.fwd_hooks, *p.bwd_hooks]
    )
    torch_hooks = tuple(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.hf_model.modules())
    return entries, torch_hooks


def keep(x, hook):
    return None


def edit(x, hook):
    return x * 1.5


def perm(x, hook):
    return None


def _with_ctx(model):
    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", keep), ("blocks.1.attn.hook_q", edit)]):
        model(PROBE)


OPS = {
    "add_one": lambda m: m.add_hook("blocks.0.attn.hook_pattern", edit),
    "add_predicate": lambda m: m.add_hook(lambda n: "resid" in n or "rot" in n or "scale" in n, keep),
    "add_fused_neighbour": lambda m: m.add_hook("blocks.0.attn.hook_k", edit),
    "add_list": lambda m: m.add_hook(["blocks.0.attn.hook_v", ("resid_mid", 1), "pattern"], keep),
    "hooks_context": _with_ctx,
    "reset_hooks": lambda m: m.reset_hooks(),
    "reset_including_permanent": lambda m: m.reset_hooks(including_permanent=True),
    "run_with_cache": lambda m: m.run_with_cache(PROBE, names_filter=lambda n: "pattern" in n or "resid" in n),
    "run_with_hooks": lambda m: m.run_with_hooks(PROBE, fwd_hooks=[("blocks.0.attn.hook_attn_scores", edit)]),
    "generate_return_cache": lambda m: m.generate(PROBE, max_new_tokens=2, return_cache=True, names_filter="pattern"),
}


def _setup(model) -> None:
    """Some hooks already there, so removal and shared sites are exercised."""
    model.add_hook("blocks.0.attn.hook_q", keep)
    model.add_hook("blocks.1.hook_resid_post", perm, is_permanent=True)
    model.add_hook("blocks.1.attn.hook_rot_k" if "blocks.1.attn.hook_rot_k" in model.hook_dict else
                   "blocks.1.attn.hook_pattern", keep)  # fmt: skip


@pytest.mark.parametrize("family", ["gpt2", "llama", "phi3"])
@pytest.mark.parametrize("op", list(OPS))
def test_fault_at_every_step_leaves_old_or_new_state(family, op, monkeypatch):
    model = make_bridge(family)
    if op == "add_list" and "blocks.1.hook_resid_mid" not in model.hook_dict:
        pytest.skip("parallel-block family")
    _setup(model)
    old = state(model)
    OPS[op](model)
    new = state(model)
    _restore(model)
    assert state(model) == old
    fail_at = 0
    while True:
        with monkeypatch.context() as patch:
            injector = Injector(patch, fail_at)
            with contextlib.suppress(KeyboardInterrupt):
                OPS[op](model)
        after = state(model)
        assert after in (old, new), f"{op}: fault at step {fail_at} left a half state"
        if not injector.fired:
            assert after == new
            break
        _restore(model)
        assert state(model) == old
        fail_at += 1
    # A neighbour on an already-attached fused site needs no torch call at all (fail_at stays 0).
    assert fail_at > 0 or op == "add_fused_neighbour"
    _points_still_work(model)
    model.reset_hooks(including_permanent=True)
    assert_clean(model)


def _restore(model) -> None:
    """Back to the state `_setup` makes (the state before each operation)."""
    model.reset_hooks(including_permanent=True)
    _setup(model)


def _points_still_work(model) -> None:
    """No point is dead: each one a fault touched fires again."""
    model.reset_hooks(including_permanent=True)
    for name in ("blocks.0.attn.hook_q", "blocks.1.attn.hook_pattern", "blocks.1.hook_resid_post", "hook_embed"):
        seen: list[str] = []
        with torch.no_grad(), model.hooks(fwd_hooks=[(name, lambda x, hook, seen=seen: seen.append(hook.name))]):
            model(PROBE)
        assert seen == [name], f"{name} no longer fires"


def test_keyboard_interrupt_inside_a_hook_leaves_the_model_clean():
    model = make_bridge("llama")

    def interrupt(x, hook):
        raise KeyboardInterrupt

    for run in (
        lambda: model.run_with_hooks(PROBE, fwd_hooks=[("blocks.1.attn.hook_pattern", interrupt)]),
        lambda: (
            model.run_with_cache(PROBE, names_filter=["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"])
            if model.add_hook("blocks.1.attn.hook_pattern", interrupt)
            else None
        ),
    ):
        with contextlib.suppress(KeyboardInterrupt):
            run()
        model.reset_hooks()
        assert_clean(model)
    assert model.ctx is None
    assert not model._stash
