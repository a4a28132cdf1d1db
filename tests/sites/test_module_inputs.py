"""TransformerLens 4's ``attn.hook_in`` / ``mlp.hook_in``: what the attention module and the MLP read (the norms'
outputs, after their weights), checked against torch hooks on the HF modules themselves."""

import pytest
import torch
from conftest import FAMILIES, HYBRID_CONFIGS, V, adapted_config, char_tokenizer, make_bridge
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge
from transformer_bridge.sites.module_paths import get_module, optional_module

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(5))


def _module_input_hook(module, record=None, edit=None):
    """A pre-hook on an HF module: record its input (positional or ``hidden_states=``), or replace it."""

    def pre(mod, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if record is not None:
            record.append(x.detach().clone())
        if edit is None:
            return None
        return ((edit(x), *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": edit(x)})

    return module.register_forward_pre_hook(pre, with_kwargs=True)


def _norm_output(model, path, layer):
    seen = []
    module = get_module(model.hf_model, f"{model.adapter.blocks}.{layer}.{path}")
    handle = module.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    try:
        with torch.no_grad():
            model.hf_model(TOKENS)
    finally:
        handle.remove()
    return seen[0]


def _make(family):
    if family not in HYBRID_CONFIGS:
        return make_bridge(family)
    torch.manual_seed(0)
    return TransformerBridge(AutoModelForCausalLM.from_config(adapted_config(family, HYBRID_CONFIGS[family])).eval(),
                             char_tokenizer())  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES + list(HYBRID_CONFIGS))
def test_module_inputs_are_the_norm_outputs_and_edits_reach_the_module(family):
    model = _make(family)
    names = [n for n in model.hook_dict if n.endswith((".attn.hook_in", ".mlp.hook_in"))]
    assert any(n.endswith(".attn.hook_in") for n in names)
    with torch.no_grad():
        clean = model.hf_model(TOKENS).logits
        logits, cache = model.run_with_cache(TOKENS, names_filter=names)
    assert torch.equal(logits, clean)  # the points cost nothing to the result
    adapter, parallel = model.adapter, model.cfg.parallel_attn_mlp
    for layer in range(model.cfg.n_layers):
        if f"blocks.{layer}.attn.hook_in" not in cache:
            continue
        attn_in = cache[f"blocks.{layer}.attn.hook_in"]
        assert torch.equal(cache[f"blocks.{layer}.ln1.hook_out"], attn_in)  # TransformerLens 4's other spelling
        if adapter.ln1 is not None:
            torch.testing.assert_close(attn_in, _norm_output(model, adapter.ln1, layer), rtol=0, atol=0)
        mlp_name = f"blocks.{layer}.mlp.hook_in"
        ln2 = optional_module(get_module(model.hf_model, f"{adapter.blocks}.{layer}"), adapter.ln2, may_be_absent=True)
        if mlp_name in cache and ln2 is not None:
            # OPT's block runs the MLP on flattened token rows; the point shows them as [batch, pos, d_model]
            expected = _norm_output(model, adapter.ln2, layer).reshape(cache[mlp_name].shape)
            torch.testing.assert_close(cache[mlp_name], expected, rtol=0, atol=0)
        elif mlp_name in cache and parallel:
            assert torch.equal(cache[mlp_name], attn_in)  # one norm feeds both
    # An edit is what the module reads: the same edit made by a torch pre-hook on the HF module.
    for name in names[:2] + names[-2:]:
        module = model._sites_for[name][0].module
        handle = _module_input_hook(module, edit=lambda x: x * 0.5 + 0.25)
        try:
            with torch.no_grad():
                expected = model.hf_model(TOKENS).logits
        finally:
            handle.remove()
        with torch.no_grad():
            got = model.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda t, hook: t * 0.5 + 0.25)])
        assert torch.equal(got, expected), name
        assert not torch.equal(got, clean), name


@pytest.mark.parametrize("family", ["llama", "phi", "gptj", "olmo2"])
def test_backward_hooks_see_the_gradient_through_that_module_only(family):
    """In parallel blocks one norm's output feeds attention and the MLP, and OLMo 2's attention reads the residual
    itself: ``attn.hook_in``'s gradient is the attention's share, as a torch pre-hook feeding the module a copy
    measures it."""
    model = make_bridge(family)
    for name in ("blocks.1.attn.hook_in", "blocks.1.mlp.hook_in"):
        if name not in model.hook_dict:
            continue
        seen, expected = [], []

        def private_copy(x, expected=expected):
            x = x.clone()
            x.register_hook(lambda g: expected.append(g.detach().clone()))
            return x

        handle = _module_input_hook(model._sites_for[name][0].module, edit=private_copy)
        try:
            model.hf_model(TOKENS).logits.square().mean().backward()
        finally:
            handle.remove()
        model.zero_grad(set_to_none=True)
        logits = model.run_with_hooks(TOKENS, bwd_hooks=[(name, lambda g, hook, seen=seen: seen.append(g.clone()))])
        logits.square().mean().backward()
        model.zero_grad(set_to_none=True)
        assert len(seen) == len(expected) == 1, name
        torch.testing.assert_close(seen[0], expected[0], rtol=0, atol=0)
