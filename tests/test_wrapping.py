"""Wrapping is harmless and robust: several bridges over one HF model, deep copies, an attention
implementation changed after wrapping, forwards run from inside hooks, the HF config left alone."""

import copy

import pytest
import torch
from _clean import assert_clean, torch_hooks
from conftest import FAMILIES, V, char_tokenizer, make_bridge, make_hf

from transformer_bridge import TransformerBridge

TOKENS = torch.randint(4, V, (2, 5), generator=torch.Generator().manual_seed(7))
PATTERN = "blocks.1.attn.hook_pattern"


def _zero_key_0(pattern, hook):
    pattern[..., 0] = 0


@pytest.mark.parametrize("family", FAMILIES)
def test_wrapping_leaves_the_hf_config_alone(family):
    hf = make_hf(family)
    before = hf.config._attn_implementation
    bridge = TransformerBridge(hf, char_tokenizer())
    name = PATTERN if PATTERN in bridge.hook_dict else "blocks.1.attn.hook_z"  # Falcon has no pattern point
    with bridge.hooks(fwd_hooks=[(name, _zero_key_0)]):
        bridge(TOKENS)
    assert hf.config._attn_implementation == before
    assert bridge.unwrap() is hf
    assert torch_hooks(hf) == 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_two_bridges_over_one_model_both_see_their_hooks(family):
    hf = make_hf(family)
    first, second = TransformerBridge(hf, char_tokenizer()), TransformerBridge(hf, char_tokenizer())
    seen = []
    first.add_hook(PATTERN, lambda x, hook: seen.append("first"))
    second.add_hook(PATTERN, lambda x, hook: seen.append("second"))
    with torch.no_grad():
        first(TOKENS)
        assert seen == ["first", "second"]  # hooks live on the model, in registration order
        seen.clear()
        expected = first.run_with_hooks(TOKENS, fwd_hooks=[(PATTERN, _zero_key_0)])
        first.reset_hooks()
        assert seen == ["first", "second"]
        seen.clear()
        # An edit through the second bridge takes effect while the first still has hooks there.
        first.add_hook(PATTERN, lambda x, hook: seen.append("first"))
        got = second.run_with_hooks(TOKENS, fwd_hooks=[(PATTERN, _zero_key_0)])
        assert torch.allclose(got, expected, atol=1e-6)
    first.reset_hooks()
    second.reset_hooks()
    assert_clean(first)
    assert_clean(second)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "gemma2"])
def test_deepcopy_is_an_independent_bridge_with_the_same_hooks(family):
    bridge = make_bridge(family)
    calls = []
    bridge.add_hook("blocks.0.hook_resid_mid" if family != "gpt_neox" else "blocks.0.hook_attn_out",
                    lambda x, hook: calls.append(hook.name), is_permanent=True)  # fmt: skip
    twin = copy.deepcopy(bridge)
    assert twin.hf_model is not bridge.hf_model
    assert [p.name for p in twin.hook_dict.values() if p.active] == ["blocks.0.hook_resid_mid"]
    with torch.no_grad():
        twin(TOKENS)
    assert calls == ["blocks.0.hook_resid_mid"]
    bridge.reset_hooks(including_permanent=True)
    twin.reset_hooks(including_permanent=True)
    # Norm edits on the copy read the copy's weights: change them and compare with the copy's HF model.
    with torch.no_grad():
        norm = twin.hf_model.get_submodule(f"{twin.adapter.blocks}.1.{twin.adapter.ln2}")
        norm.weight.add_(0.5)
        edit = [("blocks.1.ln2.hook_scale", lambda s, hook: s * 2)]
        expected = _manual_scale_edit(twin)
        got = twin.run_with_hooks(TOKENS, fwd_hooks=edit)
        assert torch.allclose(got, expected, atol=1e-5)
        assert not torch.allclose(bridge(TOKENS), twin(TOKENS))
    assert_clean(bridge)
    assert_clean(twin)


def _manual_scale_edit(model):
    """Doubling ln2's scale halves its output (bias-free RMS norms) — computed by a plain torch hook."""
    norm = model.hf_model.get_submodule(f"{model.adapter.blocks}.1.{model.adapter.ln2}")
    bias = getattr(norm, "bias", None)

    def halve(module, args, out):
        return out * 0.5 if bias is None else (out - bias) * 0.5 + bias

    handle = norm.register_forward_hook(halve)
    try:
        return model.hf_model(TOKENS).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_attention_implementation_changed_after_wrapping(family):
    bridge = make_bridge(family)
    bridge.hf_model.set_attn_implementation("eager")
    seen = []
    with torch.no_grad(), bridge.hooks(fwd_hooks=[(PATTERN, lambda x, hook: seen.append(x.shape))]):
        logits = bridge(TOKENS)
    assert seen, "pattern hooks must keep firing after the HF model switched to eager"
    assert torch.equal(logits, bridge.hf_model(TOKENS).logits)
    assert bridge.hf_model.config._attn_implementation == "eager"
    bridge.hf_model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"):
        bridge(TOKENS)
    bridge.hf_model.config._attn_implementation = "sdpa"
    assert_clean(bridge)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_forward_from_inside_a_hook(family):
    bridge = make_bridge(family)
    inner = {}

    def probe(resid, hook):
        if not inner:
            inner["logits"] = None
            inner["logits"] = bridge(TOKENS[:1])  # a nested forward through the same bridge
        return resid

    with torch.no_grad():
        expected = bridge.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_resid_mid", lambda x, h: x * 1.5)]) \
            if "blocks.1.hook_resid_mid" in bridge.hook_dict else None  # fmt: skip
        hooks = [("blocks.0.hook_resid_pre", probe)]
        if expected is not None:
            hooks.append(("blocks.1.hook_resid_mid", lambda x, h: x * 1.5))
        got = bridge.run_with_hooks(TOKENS, fwd_hooks=hooks)
    if expected is not None:
        assert torch.allclose(got, expected, atol=1e-6)
    assert inner["logits"].shape == (1, TOKENS.shape[1], bridge.cfg.d_vocab)
    assert_clean(bridge)


def test_stopped_forward_from_inside_a_hook_does_not_upset_the_outer_one():
    """A nested forward that stops early leaves later sites unrun; the outer forward still ran them all."""
    bridge = make_bridge("llama")
    inner = []

    def probe(resid, hook):
        if not inner:
            inner.append(bridge(TOKENS[:1], stop_at_layer=0))
        return resid * 1.5

    with torch.no_grad():
        expected = bridge.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_resid_post", lambda x, h: x * 1.5)])
        bridge.add_hook("blocks.0.hook_resid_post", lambda x, h: None)  # a site the inner forward never reaches
        got = bridge.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_resid_post", probe)])
    assert torch.equal(got, expected)
    assert inner[0].shape == (1, TOKENS.shape[1], bridge.cfg.d_model)
    bridge.reset_hooks()
    assert_clean(bridge)
