"""TransformerLens' Main Demo / Exploratory Analysis / IOI idioms, written as TL users write them, run
on tiny models of several families and on SmolLM2, each checked against an independent answer.
"""

from functools import partial

import pytest
import torch
from conftest import make_bridge

from transformer_bridge import utils

FAMS = ["llama", "gpt2", "qwen3", "gpt_neox", "opt"]  # not gemma2: logit soft-capping breaks linearity
TOL = dict(atol=2e-4, rtol=1e-4)
O_PROJ = {"llama": "o_proj", "qwen3": "o_proj", "gpt2": "c_proj", "gpt_neox": "dense", "opt": "out_proj"}
CLEAN = ["a and b: b to", "x and y: y to"]
CORRUPT = ["a and b: a to", "x and y: x to"]
ANSWERS = [("a", "b"), ("x", "y")]


@pytest.fixture(scope="module", params=FAMS)
def model(request):
    m = make_bridge(request.param)
    m.family = request.param
    return m


def answer_tokens(model, answers=ANSWERS):
    return torch.tensor([[model.to_single_token(a), model.to_single_token(b)] for a, b in answers])


def logits_to_ave_logit_diff(logits, answer_tokens, per_prompt=False):
    final_logits = logits[:, -1, :]
    answer_logits = final_logits.gather(dim=-1, index=answer_tokens)
    diff = answer_logits[:, 0] - answer_logits[:, 1]
    return diff if per_prompt else diff.mean()


def bias_diff(model, answer_tokens):
    """What the residual stack cannot carry: ``b_U`` (LayerNorm's β and the unembedding bias, folded)."""
    return (model.b_U[answer_tokens[:, 0]] - model.b_U[answer_tokens[:, 1]]).mean()


@torch.no_grad()
def check_logit_lens(model, prompts, answers):
    tokens = model.to_tokens(prompts)
    answer_toks = answer_tokens(model, answers)
    logits, cache = model.run_with_cache(tokens)
    original = logits_to_ave_logit_diff(logits, answer_toks)

    answer_residual_directions = model.tokens_to_residual_directions(answer_toks)  # [batch, 2, d_model]
    logit_diff_directions = answer_residual_directions[:, 0] - answer_residual_directions[:, 1]

    def residual_stack_to_logit_diff(residual_stack, cache):
        scaled = cache.apply_ln_to_stack(residual_stack, layer=-1, pos_slice=-1)
        return torch.einsum("...bd,bd->...", scaled, logit_diff_directions) / len(prompts)

    final_token_resid = cache["resid_post", -1][:, -1, :]
    direct = residual_stack_to_logit_diff(final_token_resid, cache)
    torch.testing.assert_close(direct + bias_diff(model, answer_toks), original, **TOL)

    accumulated, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
    n_mid = 0 if model.cfg.parallel_attn_mlp else model.cfg.n_layers  # parallel blocks have no resid_mid
    assert labels[-1] == "final_post" and len(labels) == model.cfg.n_layers + n_mid + 1
    logit_lens = residual_stack_to_logit_diff(accumulated, cache)
    torch.testing.assert_close(logit_lens[-1], direct, **TOL)

    per_layer, _ = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    torch.testing.assert_close(residual_stack_to_logit_diff(per_layer, cache).sum(), direct, **TOL)

    per_head = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True)  # normed: skip apply_ln below
    head_attrs = torch.einsum("cbd,bd->c", per_head, logit_diff_directions) / len(prompts)
    full, full_labels = cache.get_full_resid_decomposition(
        pos_slice=-1, expand_neurons=False, apply_ln=True, return_labels=True
    )
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    assert full_labels[:n_heads] == [f"L{i}H{h}" for i in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
    full_attrs = torch.einsum("cbd,bd->c", full, logit_diff_directions) / len(prompts)
    torch.testing.assert_close(full_attrs[:n_heads], head_attrs, **TOL)
    torch.testing.assert_close(full_attrs.sum(), direct, **TOL)

    attrs = cache.logit_attrs(
        full, tokens=answer_toks[:, 0], incorrect_tokens=answer_toks[:, 1], pos_slice=-1, has_applied_ln=True
    )
    torch.testing.assert_close(attrs.sum() / len(prompts) + bias_diff(model, answer_toks), original, **TOL)
    return tokens, logits, cache


def test_logit_difference_and_head_attribution(model):
    check_logit_lens(model, CLEAN, ANSWERS)


def patch_residual_component(corrupted_residual_component, hook, pos, clean_cache):
    corrupted_residual_component[:, pos, :] = clean_cache[hook.name][:, pos, :]
    return corrupted_residual_component


@torch.no_grad()
def test_activation_patching_resid_pre(model):
    clean_tokens, corrupted_tokens = model.to_tokens(CLEAN), model.to_tokens(CORRUPT)
    differs = (clean_tokens != corrupted_tokens).any(0).nonzero().flatten().tolist()
    assert len(differs) == 1
    d = differs[0]
    clean_logits, clean_cache = model.run_with_cache(clean_tokens)
    corrupted_logits = model(corrupted_tokens)
    n_pos = clean_tokens.shape[1]
    patched_diff = torch.zeros(model.cfg.n_layers, n_pos)
    for layer in range(model.cfg.n_layers):
        for position in range(n_pos):
            hook_fn = partial(patch_residual_component, pos=position, clean_cache=clean_cache)
            patched_logits = model.run_with_hooks(
                corrupted_tokens, fwd_hooks=[(utils.get_act_name("resid_pre", layer), hook_fn)], return_type="logits"
            )
            patched_diff[layer, position] = logits_to_ave_logit_diff(patched_logits, answer_tokens(model))
            if position < d:  # the prompts agree there, and attention is causal: nothing changes
                torch.testing.assert_close(patched_logits, corrupted_logits, atol=0, rtol=0)
            if layer == 0 and position == d:  # the only differing embedding: the clean run exactly
                torch.testing.assert_close(patched_logits, clean_logits, **TOL)
    clean_diff = logits_to_ave_logit_diff(clean_logits, answer_tokens(model))
    corrupted_diff = logits_to_ave_logit_diff(corrupted_logits, answer_tokens(model))
    torch.testing.assert_close(patched_diff[0, d], clean_diff, **TOL)
    torch.testing.assert_close(patched_diff[0, d + 1 :], corrupted_diff.expand(n_pos - d - 1), **TOL)
    # Every position of any layer: the clean run; the last residual at the last position: the clean prediction.
    everything = model.run_with_hooks(
        corrupted_tokens, fwd_hooks=[(f"blocks.{model.cfg.n_layers - 1}.hook_resid_pre",
                                      lambda x, hook: clean_cache[hook.name])],
    )  # fmt: skip
    torch.testing.assert_close(everything, clean_logits, **TOL)
    last = model.run_with_hooks(
        corrupted_tokens,
        fwd_hooks=[(utils.get_act_name("resid_post", model.cfg.n_layers - 1),
                    partial(patch_residual_component, pos=-1, clean_cache=clean_cache))],
    )  # fmt: skip
    torch.testing.assert_close(last[:, -1], clean_logits[:, -1], **TOL)


@torch.no_grad()
def test_head_ablation_via_hook_z_equals_zeroing_o_proj_input(model):
    tokens = model.to_tokens(CLEAN)
    layer, head, d_head = 1, 2, model.cfg.d_head

    def head_ablation_hook(z, hook, head_index_to_ablate):
        z[:, :, head_index_to_ablate, :] = 0.0
        return z

    ablated = model.run_with_hooks(
        tokens, fwd_hooks=[(utils.get_act_name("z", layer), partial(head_ablation_hook, head_index_to_ablate=head))]
    )
    o_proj = getattr(model.blocks[layer].attn.module, O_PROJ[model.family])

    def zero_slice(module, args):
        x = args[0].clone()
        x[..., head * d_head : (head + 1) * d_head] = 0.0
        return (x, *args[1:])

    handle = o_proj.register_forward_pre_hook(zero_slice)
    try:
        by_hand = model(tokens)
    finally:
        handle.remove()
    torch.testing.assert_close(ablated, by_hand, **TOL)
    assert not torch.allclose(ablated, model(tokens))


@torch.no_grad()
def test_attention_patterns_are_distributions_over_real_keys(model):
    prompts = ["ab", "a longer prompt"]
    tokens, mask = model.to_tokens_and_mask(prompts)  # right-padded, as TL
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    for layer in range(model.cfg.n_layers):
        pattern = cache["pattern", layer]
        assert pattern is cache[utils.get_act_name("attn", layer)]
        assert pattern.shape == (2, model.cfg.n_heads, tokens.shape[1], tokens.shape[1])
        real = mask.bool()
        rows = pattern.sum(-1)  # [batch, head, query]
        torch.testing.assert_close(rows[real[:, None, :].expand_as(rows)], torch.ones(int(real.sum()) * 4), **TOL)
        assert pattern.triu(1).abs().max() == 0  # causal
        assert pattern[0][..., ~real[0]][:, real[0]].abs().max() == 0  # no real query reads a pad key


@torch.no_grad()
def test_generate_with_steering_hook(model):
    steering = 5.0 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))

    def steering_hook(resid_pre, hook):
        resid_pre[:, :, :] += steering

    tokens = model.to_tokens("a and b")
    plain = model.generate(tokens, max_new_tokens=6)
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", steering_hook)]):
        steered = model.generate(tokens, max_new_tokens=6)
    # Oracle: greedy decoding without a KV cache, one full hooked forward per token.
    manual = tokens
    for _ in range(6):
        logits = model.run_with_hooks(manual, fwd_hooks=[("blocks.1.hook_resid_pre", steering_hook)])
        manual = torch.cat([manual, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(steered, manual)
    assert not torch.equal(steered, plain)
    assert not model.hook_dict["blocks.1.hook_resid_pre"].has_hooks()


@torch.no_grad()
def test_int_pos_slice_drops_the_axis_like_tl(model):
    """Cache helpers drop the position axis for an int (TL's Slice); run_with_cache keeps it (TL 4's bridge)."""
    tokens = model.to_tokens(CLEAN)
    _, cache = model.run_with_cache(tokens)
    stack = cache.accumulated_resid(layer=-1, pos_slice=-1)
    assert stack.shape == (model.cfg.n_layers + 1, 2, model.cfg.d_model)
    assert torch.equal(stack, cache.accumulated_resid(layer=-1)[:, :, -1])
    assert torch.equal(cache.accumulated_resid(layer=-1, pos_slice=[-1])[:, :, 0], stack)  # a list keeps the axis
    _, last = model.run_with_cache(tokens, pos_slice=-1)
    assert torch.equal(last["resid_post", 0], cache["resid_post", 0][:, -1:])


# -- SmolLM2: the IOI prompt of the Exploratory Analysis demo, a few forwards ------------------------


@torch.no_grad()
def test_smollm2_ioi_logit_attribution_and_patching(smollm2):
    model = smollm2
    clean = "When Mary and John went to the store, John gave a drink to"
    corrupt = "When Mary and John went to the store, Mary gave a drink to"
    tokens, logits, cache = check_logit_lens(model, [clean], [(" Mary", " John")])
    assert logits_to_ave_logit_diff(logits, answer_tokens(model, [(" Mary", " John")])) > 0  # the model does IOI
    corrupted_tokens = model.to_tokens(corrupt)
    d = (tokens != corrupted_tokens)[0].nonzero().flatten().tolist()
    assert len(d) == 1
    patched = model.run_with_hooks(
        corrupted_tokens,
        fwd_hooks=[("blocks.0.hook_resid_pre", partial(patch_residual_component, pos=d[0], clean_cache=cache))],
    )
    torch.testing.assert_close(patched, logits, atol=1e-3, rtol=1e-4)
