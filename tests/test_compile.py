"""`torch.compile` and the bridge: what compiled calls compute, with hooks added before and after compiling.

Every check compares with an uncompiled bridge over the same weights: HF's own logits without hooks, the
same hooks otherwise. The backend is ``eager``: dynamo's tracing, guards and graph breaks, which decide
whether a hook runs, are the same for every backend; only the kernels differ (inductor agrees to ~1e-7).

The bridge's hooks are torch hooks present only while a point has a function, and dynamo does not guard on
torch hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), so code traced without a hook can run
after the hook is added. The bridge therefore checks after each forward that every hooked site ran: when
it recompiles (compiling the bridge) hooks take effect; when it cannot (compiling `hf_model`), it raises.
"""

import pytest
import torch
from conftest import make_bridge

TOKENS = torch.tensor([[5, 17, 3, 42, 8, 11]])
RESID = "blocks.0.hook_resid_post"

# The ways to compile a bridge: the wrapper torch.compile returns, the bridge compiled in place, and the
# HF model compiled in place under the bridge (`TransformerBridge(torch.compile(hf_model))` behaves
# like the last).
WRAPPER, IN_PLACE, HF_MODEL = "torch.compile(model)", "model.compile()", "model.hf_model.compile()"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_bridge(model, way: str):
    """Compile ``model`` one of the three ways; returns what the user calls."""
    if way == WRAPPER:
        return torch.compile(model, backend="eager")
    if way == IN_PLACE:
        model.compile(backend="eager")
        return model
    model.hf_model.compile(backend="eager")
    return model


def times(factor: float):
    def hook(x, hook):
        return x * factor

    return hook


def expected(hooks, family: str = "llama"):
    """Logits of an uncompiled bridge over the same weights under ``hooks``."""
    oracle = make_bridge(family)
    with torch.no_grad(), oracle.hooks(fwd_hooks=hooks):
        return oracle(TOKENS)


# -- no hooks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "way"), [("gpt2", IN_PLACE), ("llama", HF_MODEL)])
def test_compiled_forward_without_hooks_is_hf_bitwise(family, way):
    model = make_bridge(family)
    with torch.no_grad():
        want = model.hf_model(TOKENS).logits
        call = compile_bridge(model, way)
        assert torch.equal(call(TOKENS), want)
        assert torch.equal(call(TOKENS), want)  # the cached compiled code, not a second trace


# -- hooks added before the first compiled call ---------------------------------------------------


def test_hooks_added_before_compiling_take_effect_and_their_removal_is_seen():
    model = make_bridge("llama")
    store = {}
    edit = model.add_hook(RESID, times(2.0))
    model.add_hook(RESID, lambda x, hook: store.__setitem__(hook.name, x.clone()))
    call = compile_bridge(model, WRAPPER)
    with torch.no_grad():
        assert torch.equal(call(TOKENS), expected([(RESID, times(2.0))]))
        _, cache = make_bridge("llama").run_with_cache(TOKENS, names_filter=RESID)
        assert torch.equal(store[RESID], cache[RESID] * 2)  # the caching hook saw the edited tensor
        edit.remove()
        # The traced hook code reads the point's hook list, which dynamo guards: removing one recompiles.
        assert torch.equal(call(TOKENS), expected([]))


def test_attention_hooks_added_before_compiling_run_once_in_their_own_layer():
    model = make_bridge("llama")
    calls = []

    def halve(x, hook):
        calls.append(hook.name)
        return x * 0.5

    hooks = [("blocks.0.attn.hook_pattern", halve), ("blocks.1.attn.hook_z", halve)]
    for name, fn in hooks:
        model.add_hook(name, fn)
    call = compile_bridge(model, HF_MODEL)
    with torch.no_grad():
        got = call(TOKENS)
    assert sorted(calls) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_z"]
    assert torch.equal(got, expected([(name, times(0.5)) for name, _ in hooks]))


def test_graph_breaking_hook_in_a_later_layer_takes_effect_or_raises():
    model = make_bridge("llama")
    seen = []

    def record_and_halve(x, hook):
        seen.append(float(x.sum()))  # `.item()`: dynamo cannot trace it
        return x * 0.5

    model.add_hook("blocks.1.mlp.hook_post", record_and_halve)
    call = compile_bridge(model, HF_MODEL)
    with torch.no_grad():
        try:
            got = call(TOKENS)
        except RuntimeError as e:
            assert "torch.compile" in str(e)
            return
    assert len(seen) == 1
    assert torch.equal(got, expected([("blocks.1.mlp.hook_post", times(0.5))]))


# -- hooks added after the first compiled call ----------------------------------------------------


@pytest.mark.parametrize("way", [WRAPPER, IN_PLACE, HF_MODEL])
def test_hook_added_after_compiling_takes_effect_or_raises(way):
    model = make_bridge("llama")
    call = compile_bridge(model, way)
    with torch.no_grad():
        call(TOKENS)
        model.add_hook(RESID, times(2.0))
        try:
            got = call(TOKENS)
        except RuntimeError as e:
            assert "torch.compile" in str(e)
            return
    assert torch.equal(got, expected([(RESID, times(2.0))]))


def test_run_with_cache_over_a_compiled_hf_model_is_complete_or_raises():
    model = make_bridge("llama")
    compile_bridge(model, HF_MODEL)
    with torch.no_grad():
        model(TOKENS)
    try:
        _, cache = model.run_with_cache(TOKENS, names_filter=RESID)
    except RuntimeError as e:
        assert "torch.compile" in str(e)
        return
    _, want = make_bridge("llama").run_with_cache(TOKENS, names_filter=RESID)
    assert torch.equal(cache[RESID], want[RESID])


def test_methods_of_the_compiled_wrapper_run_uncompiled_and_see_new_hooks():
    """``torch.compile(model).run_with_cache`` (and the other methods) are the bridge's own methods."""
    model, oracle = make_bridge("llama"), make_bridge("llama")
    call = compile_bridge(model, WRAPPER)
    with torch.no_grad():
        assert torch.equal(call(TOKENS), model.hf_model(TOKENS).logits)  # the wrapper's own call: compiled
        logits, cache = call.run_with_cache(TOKENS)
        want_logits, want_cache = oracle.run_with_cache(TOKENS)
        assert torch.equal(logits, want_logits)
        assert list(cache) == list(want_cache)
        assert all(torch.equal(cache[k], want_cache[k]) for k in want_cache)
        hooked = call.run_with_hooks(TOKENS, fwd_hooks=[(RESID, times(2.0))])
        assert torch.equal(hooked, expected([(RESID, times(2.0))]))
        with call.hooks(fwd_hooks=[(RESID, times(2.0))]), oracle.hooks(fwd_hooks=[(RESID, times(2.0))]):
            assert torch.equal(call.generate(TOKENS, max_new_tokens=4), oracle.generate(TOKENS, max_new_tokens=4))


def test_compiler_reset_after_adding_hooks_makes_the_compiled_call_see_them():
    """The documented workaround: `torch.compiler.reset()` after changing the hooks of a compiled model."""
    model = make_bridge("llama")
    call = compile_bridge(model, HF_MODEL)
    with torch.no_grad():
        call(TOKENS)
        model.add_hook(RESID, times(2.0))
        torch.compiler.reset()
        assert torch.equal(call(TOKENS), expected([(RESID, times(2.0))]))
