"""Hooks during generation: what `hook.ctx` says at each step, steering by absolute position, KV edits, errors."""

import sys

import pytest
import torch
from conftest import FAMILIES, make_bridge

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def no_hooks_left(model) -> bool:
    points_clear = all(not p.fwd_hooks and not p.bwd_hooks for p in model.hook_dict.values())
    torch_clear = all(not m._forward_hooks and not m._forward_pre_hooks for m in model.hf_model.modules())
    return points_clear and torch_clear and model.ctx is None


def test_hooks_fire_at_prefill_and_every_decode_step_with_positions(model):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    lengths = mask.sum(-1)
    seen = []

    def record(resid, hook):
        c = hook.ctx
        seen.append((c.phase, c.step, tuple(resid.shape), c.positions, c.pad_mask, c.is_generated))

    n = 6
    # A second point makes OPT's flattened-MLP sites run too (they read ctx for the batch size).
    mlp = "blocks.0.mlp.hook_post" if "blocks.0.mlp.hook_post" in model.hook_dict else "blocks.0.hook_mlp_out"  # MoE
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", record), (mlp, lambda x, h: None)]):
        model.generate(tokens, attention_mask=mask, max_new_tokens=n, stop_at_eos=False)
    assert len(seen) == n  # the prefill and n - 1 decode steps (the last token is never fed back)
    phase, step, shape, positions, pad, generated = seen[0]
    assert (phase, step, shape) == ("prefill", 0, (3, tokens.shape[1], model.cfg.d_model))
    assert torch.equal(pad, mask == 0) and not generated.any()
    assert torch.equal(positions[mask.bool()], torch.cat([torch.arange(n) for n in lengths.tolist()]))
    for s, (phase, step, shape, positions, pad, generated) in enumerate(seen[1:], start=1):
        assert (phase, step, shape) == ("decode", s, (3, 1, model.cfg.d_model))
        assert torch.equal(positions[:, 0], lengths + s - 1)  # a row's first real token is position 0
        assert not pad.any() and generated.all()
    assert no_hooks_left(model)


def steer_at(position: int, scale: float = 50.0):
    """Add a fixed direction to the residual at one absolute position (whatever chunk it arrives in)."""

    def hook(resid, hook):
        at = (hook.ctx.positions == position) & ~hook.ctx.pad_mask
        direction = torch.linspace(-1, 1, resid.shape[-1])
        return resid + scale * at[..., None] * direction

    return hook


def test_position_steering_is_the_same_with_and_without_kv_cache(model):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    kw = dict(attention_mask=mask, max_new_tokens=8, stop_at_eos=False, return_dict=True, output_logits=True)
    plain = model.generate(tokens, **kw)
    # Position 1 is in every prompt; position 4 is a prompt token of row 0 and a generated one of row 1.
    hooks = [("blocks.0.hook_resid_post", steer_at(1)), ("blocks.0.hook_resid_post", steer_at(4))]
    with model.hooks(fwd_hooks=hooks):
        cached = model.generate(tokens, **kw)
        full = model.generate(tokens, use_cache=False, **kw)
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(cached.logits, full.logits, atol=1e-4, rtol=0)
    assert not torch.equal(cached.sequences, plain.sequences)  # the steering did something
    assert no_hooks_left(model)


@pytest.mark.parametrize("point", ["hook_k", "hook_v"])
def test_kv_edits_at_prefill_persist_in_the_cache(model, point):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    kw = dict(attention_mask=mask, max_new_tokens=6, stop_at_eos=False, return_dict=True, output_logits=True)

    def shift_position_1(x, hook):  # x: [batch, pos, kv_head, d_head]; a shift survives Qwen3's k-norm
        at = (hook.ctx.positions == 1).view(*hook.ctx.positions.shape, *[1] * (x.dim() - 2))
        return x + 3.0 * at * torch.linspace(-1, 1, x.shape[-1])

    if model.adapter.mla:  # DeepSeek: the cache holds the latent and the shared rotary key, not k and v
        point = {"hook_k": "hook_k_rope", "hook_v": "hook_kv_latent"}[point]
    plain = model.generate(tokens, **kw)
    with model.hooks(fwd_hooks=[(f"blocks.0.attn.{point}", shift_position_1)]):
        cached = model.generate(tokens, **kw)  # the edit runs once, at prefill; decode steps read the cache
        full = model.generate(tokens, use_cache=False, **kw)  # the edit runs again at every step
    torch.testing.assert_close(cached.logits, full.logits, atol=1e-4, rtol=0)
    # Decode steps saw it (without the edit the runs are bitwise equal; NanoChat's k-norm after the edit leaves
    # a change of ~6e-4 in its logits).
    assert not torch.allclose(cached.logits[:, 1:], plain.logits[:, 1:], atol=1e-5)


def test_an_error_in_a_hook_mid_generation_leaves_the_model_clean():
    model = make_bridge("opt")
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    before = model.generate(tokens, attention_mask=mask, max_new_tokens=6)

    def explode_at_step_3(x, hook):
        if hook.ctx.step == 3:
            raise RuntimeError("boom")

    hooks = [("blocks.1.attn.hook_pattern", explode_at_step_3)]
    with pytest.raises(RuntimeError, match="boom"), model.hooks(fwd_hooks=hooks):
        model.generate(tokens, attention_mask=mask, max_new_tokens=6)
    assert no_hooks_left(model)

    def explode_in_recompute(x, hook):
        if hook.ctx.phase == "recompute":
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # during the return_cache forward, with its caching hooks
        handle = model.add_hook("blocks.0.hook_resid_pre", explode_in_recompute)
        try:
            model.generate(tokens, attention_mask=mask, max_new_tokens=6, return_cache=True)
        finally:
            handle.remove()
    assert no_hooks_left(model)
    assert torch.equal(model.generate(tokens, attention_mask=mask, max_new_tokens=6), before)


def test_hooks_see_every_beam_row():
    model = make_bridge("qwen3")
    tokens, mask = model.to_tokens_and_mask(PROMPTS[:2], padding_side="left")
    rows = []
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: rows.append(hook.ctx.positions.clone()))]):
        model.generate(tokens, attention_mask=mask, max_new_tokens=4, num_beams=3, stop_at_eos=False)
    lengths = mask.sum(-1).repeat_interleave(3)
    assert rows[0].shape == (6, tokens.shape[1])
    for s, positions in enumerate(rows[1:], start=1):
        assert torch.equal(positions[:, 0], lengths + s - 1)


def test_a_hook_failing_at_a_decode_step_keeps_its_type_and_says_where():
    model = make_bridge("llama")
    v = torch.ones(model.cfg.d_model)

    def at_position_4(resid, hook):  # written for a whole sequence: decode steps see one position
        resid[:, 4] += v

    prompt = torch.tensor([[1, 5, 17, 42, 8, 11]])
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", at_position_4)]):
        model(prompt)  # a whole forward: the hook works
        with pytest.raises(IndexError, match=r"index 4 is out of bounds") as raised:
            model.generate(prompt, max_new_tokens=2)
    message = str(raised.value)
    for part in ("'at_position_4'", "'blocks.1.hook_resid_pre'", "phase 'decode'", "(1, 1, 32)", "hook.ctx.positions"):
        assert part in message, part

    def lookup(resid, hook):
        if hook.ctx.phase == "decode":
            raise KeyError("missing")

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lookup)]), pytest.raises(KeyError) as raised:
        model.generate(prompt, max_new_tokens=2)
    assert raised.value.args == ("missing",)  # a KeyError's message is its key: the place is a note
    if sys.version_info >= (3, 11):
        assert "hook.ctx.positions" in "".join(raised.value.__notes__)
