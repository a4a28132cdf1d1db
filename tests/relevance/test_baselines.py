"""attention (last layer, rollout), random, and attribution patching against manual computations."""

import pytest
import torch
from _models import make_bridge, random_tokens, tiny_run

from transformer_bridge.relevance import attribution_patching


def test_attention_last_layer_is_head_mean_of_the_pattern():
    model = make_bridge("mistral")
    tokens = random_tokens(1, 8)
    run = tiny_run(model, tokens, prompt_width=5)
    rel = run.relevance_pass(method="attention")
    pattern = run.cache["pattern", -1][0].mean(0)
    for i, step in enumerate(rel):
        want = torch.zeros(8)
        want[: step.position] = pattern[step.position - 1, : step.position]
        torch.testing.assert_close(rel.scores[i], want)


def test_attention_rollout_matches_manual_product():
    model = make_bridge("gpt_neox")
    tokens = random_tokens(1, 7)
    run = tiny_run(model, tokens, prompt_width=6)
    rel = run.relevance_pass(method="attention", mode="rollout")
    flow = torch.eye(7)
    for layer in range(model.cfg.n_layers):
        a = 0.5 * run.cache["pattern", layer][0].mean(0) + 0.5 * torch.eye(7)
        flow = (a / a.sum(-1, keepdim=True)) @ flow
    torch.testing.assert_close(rel.scores[0, :6], flow[5, :6])
    assert rel.scores[0, 6] == 0


def test_random_is_seeded_and_causal():
    model = make_bridge("llama")
    run = tiny_run(model, random_tokens(1, 8), prompt_width=5, cache=False)
    a, b = run.relevance_pass(method="random", seed=3), run.relevance_pass(method="random", seed=3)
    c = run.relevance_pass(method="random", seed=4)
    assert torch.equal(a.scores, b.scores) and not torch.equal(a.scores, c.scores)
    for i, e in enumerate(a.explained):
        assert (a.scores[i, e.position :] == 0).all() and (a.scores[i, : e.position] > 0).all()


def test_attribution_patching_matches_manual_linear_estimate():
    model = make_bridge("qwen2")
    clean, corrupted = random_tokens(1, 7, seed=1), random_tokens(1, 7, seed=1)
    corrupted[0, 2] = 50
    tok = int(clean[0, 6])

    def metric(logits):
        return logits[0, 5, tok]

    names = ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z"]
    scores = attribution_patching(model, clean, corrupted, metric, names=names)
    _, clean_cache = model.run_with_cache(clean, names_filter=names)
    acts, grads = {}, {}
    fwd = [(n, lambda x, hook: acts.__setitem__(hook.name, x.detach())) for n in names]
    bwd = [(n, lambda g, hook: grads.__setitem__(hook.name, g)) for n in names]
    with model.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
        metric(model(corrupted)).backward()
    for name in names:
        want = ((clean_cache[name] - acts[name]) * grads[name]).flatten(2).sum(-1)
        torch.testing.assert_close(scores[name], want, atol=1e-6, rtol=1e-5)
    assert scores["blocks.1.hook_resid_pre"][0, :2].abs().max() == 0  # before the corrupted token: same activations


def test_attribution_patching_as_relevance_method():
    model = make_bridge("llama")
    tokens = random_tokens(1, 8)
    run = tiny_run(model, tokens, prompt_width=6)
    same = run.relevance_pass(method="attribution_patching", corrupted_tokens=tokens)
    assert same.kind == "hooks" and same.scores.shape == (2, model.cfg.n_layers, 8)
    assert same.scores.abs().max() == 0  # identical runs: nothing to patch
    corrupted = tokens.clone()
    corrupted[0, 1] = 40
    rel = run.relevance_pass(method="attribution_patching", corrupted_tokens=corrupted)
    assert rel.scores[:, 0, 1].abs().min() > 0 and rel.labels == [f"blocks.{i}.hook_resid_pre" for i in range(2)]
    with pytest.raises(ValueError, match="corrupted_tokens"):
        run.relevance_pass(method="attribution_patching")
