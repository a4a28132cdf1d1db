"""Mamba (state space): forward, hook points, edits against plain torch hooks, greedy generate against HF."""

import pytest
import torch
from conftest import SSM_CONFIGS, V, char_tokenizer, perturb_
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge
from transformer_bridge.hooks.names import UnknownHookError
from transformer_bridge.sites.module_paths import get_module

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(3))
LAYER, D, D_INNER, D_STATE, DT_RANK = 1, 32, 64, 8, 2


def make_mamba(seed: int = 0) -> TransformerBridge:
    config = SSM_CONFIGS["mamba"]()  # d_model 32, d_state 8, dt_rank 2, d_inner 64
    torch.manual_seed(seed)
    # Larger weights than the init so greedy continuations vary (the init repeats one token).
    return perturb_(TransformerBridge(AutoModelForCausalLM.from_config(config).eval(), char_tokenizer()), scale=0.5)


@pytest.fixture(scope="module")
def model():
    return make_mamba()


SHAPES = {
    "hook_embed": (D,), "blocks.1.hook_resid_pre": (D,), "blocks.1.ln1.hook_scale": (1,),
    "blocks.1.ln1.hook_normalized": (D,), "blocks.1.mixer.hook_in": (D_INNER,), "blocks.1.mixer.hook_gate": (D_INNER,),
    "blocks.1.mixer.hook_dt": (DT_RANK,), "blocks.1.mixer.hook_B": (D_STATE,), "blocks.1.mixer.hook_C": (D_STATE,),
    "blocks.1.mixer.hook_y": (D_INNER,), "blocks.1.hook_mixer_out": (D,), "blocks.1.hook_resid_post": (D,),
    "ln_final.hook_scale": (1,), "ln_final.hook_normalized": (D,),
}  # fmt: skip


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _manual(model, path, fn, pre=False):
    """HF logits with a plain torch hook on one module (the oracle)."""
    module = get_module(model.hf_model, path)
    if pre:
        handle = module.register_forward_pre_hook(lambda m, args: (fn(args[0]), *args[1:]))
    else:
        handle = module.register_forward_hook(lambda m, args, out: fn(out))
    try:
        with torch.no_grad():
            return model.hf_model(TOKENS).logits
    finally:
        handle.remove()


def test_forward_and_cache_are_hf_bitwise_with_the_documented_shapes(model):
    with torch.no_grad():
        theirs = model.hf_model(TOKENS).logits
        assert torch.equal(model(TOKENS), theirs)
        logits, cache = model.run_with_cache(TOKENS)
    assert torch.equal(logits, theirs)
    assert (model.cfg.n_heads, model.cfg.d_mlp) == (0, D_INNER)
    assert {n for n in model.hook_dict if not n.startswith("blocks.0.")} == set(SHAPES)
    for name, tail in SHAPES.items():
        assert cache[name].shape == (*TOKENS.shape, *tail), name
    assert torch.equal(cache["resid_post", 0], cache["resid_pre", 1])
    _close(cache["resid_pre", 1] + cache["mixer_out", 1], cache["resid_post", 1])
    for name in ("blocks.1.attn.hook_pattern", "blocks.1.mlp.hook_post", "blocks.1.hook_attn_out"):
        with pytest.raises(UnknownHookError):
            model.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda x, h: None)])


@pytest.mark.parametrize(
    ("name", "path", "pre", "part"),
    [("hook_resid_pre", "", True, None), ("hook_mixer_out", "mixer", False, None),
     ("mixer.hook_y", "mixer.out_proj", True, None), ("mixer.hook_in", "mixer.in_proj", False, slice(0, D_INNER)),
     ("mixer.hook_gate", "mixer.in_proj", False, slice(D_INNER, None)),
     ("mixer.hook_dt", "mixer.x_proj", False, slice(0, DT_RANK)),
     ("mixer.hook_B", "mixer.x_proj", False, slice(DT_RANK, DT_RANK + D_STATE)),
     ("mixer.hook_C", "mixer.x_proj", False, slice(DT_RANK + D_STATE, None))],
)  # fmt: skip
def test_edits_equal_plain_torch_hooks(model, name, path, pre, part):
    def manual(x):
        x = x.clone()
        x[..., part or slice(None)] *= 1.5
        return x

    expected = _manual(model, f"backbone.layers.{LAYER}" + (f".{path}" if path else ""), manual, pre=pre)
    assert not torch.allclose(expected, model.hf_model(TOKENS).logits)
    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.{name}", lambda x, h: x * 1.5)])
    _close(got, expected)


def test_norm_scale_edit_halves_the_normed_input(model):
    expected = _manual(model, f"backbone.layers.{LAYER}.norm", lambda out: out / 2)
    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.ln1.hook_scale", lambda s, h: s * 2)])
    _close(got, expected)


def test_in_place_edits_and_read_only_hooks(model):
    def returned(x, hook):
        return x * 0.5 + 0.1  # the shift: a final norm undoes a pure scale of the last residual

    def in_place(x, hook):
        x.mul_(0.5).add_(0.1)

    with torch.no_grad():
        plain = model(TOKENS)
        for name in SHAPES:
            expected = model.run_with_hooks(TOKENS, fwd_hooks=[(name, returned)])
            assert not torch.allclose(expected, plain), name
            _close(model.run_with_hooks(TOKENS, fwd_hooks=[(name, in_place)]), expected)
        seen = []
        read = model.run_with_hooks(TOKENS, fwd_hooks=[(lambda n: True, lambda x, h: seen.append(h.name))])
    assert torch.equal(read, plain) and set(seen) == set(model.hook_dict)


PROMPTS = torch.tensor([[1, 40, 50, 60], [1, 7, 9, 11]])


def test_greedy_generate_equals_hf(model):
    theirs = model.hf_model.generate(PROMPTS, max_new_tokens=10, do_sample=False)
    ours = model.generate(PROMPTS, max_new_tokens=10, temperature=0, stop_at_eos=False)
    assert len(set(theirs[0, 4:].tolist())) > 3  # a continuation that varies, so the recurrent state matters
    assert torch.equal(ours, theirs)


def test_left_padded_generate_equals_each_row_alone(model):
    padded = torch.tensor([[0, 0, 50, 60], [1, 7, 9, 11]])
    mask = (padded != 0).long()
    both = model.generate(padded, attention_mask=mask, max_new_tokens=10, temperature=0, stop_at_eos=False)
    for row, prompt in ((0, padded[:1, 2:]), (1, padded[1:])):
        alone = model.generate(prompt, max_new_tokens=10, temperature=0, stop_at_eos=False)
        assert torch.equal(both[row, -10:], alone[0, -10:])


def test_steering_during_generate_equals_hf_generate_with_the_same_hook(model):
    delta = torch.linspace(-2, 2, D)
    handle = get_module(model.hf_model, "backbone.layers.1.mixer").register_forward_hook(lambda m, a, o: o + delta)
    try:
        theirs = model.hf_model.generate(PROMPTS, max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()
    seen = []

    def steer(x, hook):
        seen.append((hook.ctx.phase, x.shape[1]))
        return x + delta

    with model.hooks(fwd_hooks=[("blocks.1.hook_mixer_out", steer)]):
        ours = model.generate(PROMPTS, max_new_tokens=8, temperature=0, stop_at_eos=False)
    assert torch.equal(ours, theirs)
    assert seen[0] == ("prefill", 4) and all(s == ("decode", 1) for s in seen[1:])


def test_return_cache_equals_run_with_cache(model):
    out, cache = model.generate(PROMPTS, max_new_tokens=5, temperature=0, stop_at_eos=False, return_cache=True)
    _, expected = model.run_with_cache(out)
    assert set(cache) == set(expected)
    for name in expected:
        assert torch.equal(cache[name], expected[name]), name
