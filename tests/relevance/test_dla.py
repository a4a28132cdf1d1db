"""Direct logit attribution and logit lens against the model's own logits."""

import pytest
import torch
from _models import FAMILIES, make_bridge, random_tokens, tiny_run
from conftest import declared_adapter

from transformer_bridge.relevance import RelevanceRun, relevance_hooks
from transformer_bridge.sites.module_paths import get_module


def _randomise_biases(model):
    with torch.no_grad():  # HF initialises biases to zero; non-zero ones exercise the bias terms
        for name, p in model.hf_model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return _randomise_biases(make_bridge(request.param))


def _logits(model, tokens, mask=None):
    with torch.no_grad():
        logits = model(tokens, attention_mask=mask).float()  # the bridge passes left-padding positions
    cap = getattr(model.hf_model.config, "final_logit_softcapping", None)
    # Gemma 2: components sum to the logit before the final soft-cap.
    return torch.atanh(logits / cap) * cap if cap else logits


@pytest.mark.parametrize("target", ["logit", ("logit_diff", 11)])
def test_dla_components_sum_to_the_logit(model, target):
    tokens = random_tokens(1, 9)
    rel = tiny_run(model, tokens, prompt_width=5).relevance_pass(method="dla", target=target)
    logits = _logits(model, tokens)
    n = model.cfg.n_layers
    has_bias = any(lbl.startswith("bias:") for lbl in rel.labels)
    assert rel.kind == "components" and rel.scores.shape[1] == len(rel.labels)
    last_mlp = f"L{n - 1}.mlp_rest" if f"L{n - 1}E0" in rel.labels else f"L{n - 1}.mlp"  # a mixture: by expert
    assert rel.labels[0] == "embed" and "L1H3" in rel.labels and last_mlp in rel.labels
    final_norm_bias = getattr(get_module(model.hf_model, model.adapter.ln_final), "bias", None)  # none in OLMo
    assert has_bias == (final_norm_bias is not None or model.b_U_raw is not None)
    for i, step in enumerate(rel):
        want = logits[0, step.position - 1, step.token_id]
        if target != "logit":
            want = want - logits[0, step.position - 1, 11]
        assert rel.scores[i].sum().item() == pytest.approx(want.item(), abs=1e-4, rel=1e-5)


def test_dla_heads_sum_to_attention_output_direct_effect():
    model = make_bridge("llama")
    tokens = random_tokens(1, 7)
    run = tiny_run(model, tokens, prompt_width=6)
    rel = run.relevance_pass(method="dla")
    cache = run.cache
    attn = cache["attn_out", 0][0, 5] / cache["ln_final.hook_scale"][0, 5]
    direct = (attn * model.unembed_directions(int(tokens[0, 6]))).sum()
    heads = sum(rel.scores[0, rel.labels.index(f"L0H{h}")] for h in range(4))
    assert heads.item() == pytest.approx(direct.item(), abs=1e-5)


def test_dla_works_on_padded_batches():
    model = _randomise_biases(make_bridge("gpt2"))
    tokens = random_tokens(2, 9)
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    rel = tiny_run(model, tokens, prompt_width=6, mask=mask).relevance_pass(method="dla")
    logits = _logits(model, tokens, mask)
    for i, step in enumerate(rel):
        assert rel.scores[i].sum().item() == pytest.approx(
            logits[step.batch_index, step.position - 1, step.token_id].item(), abs=1e-4
        )


def test_dla_rejects_logprob_target():
    model = make_bridge("llama")
    run = tiny_run(model, random_tokens(1, 6), prompt_width=5)
    with pytest.raises(ValueError, match=r"linear read-out.*'logit'"):
        run.relevance_pass(method="dla", target="logprob")


def test_logit_lens_last_layer_is_the_model_output(model):
    tokens = random_tokens(1, 8)
    rel = tiny_run(model, tokens, prompt_width=5).relevance_pass(method="logit_lens")
    with torch.no_grad():
        probs = model.hf_model(tokens).logits.float().softmax(-1)
    assert rel.kind == "layers" and rel.scores.shape == (3, model.cfg.n_layers)
    for i, step in enumerate(rel):
        p = probs[0, step.position - 1]
        assert rel.scores[i, -1].item() == pytest.approx(p[step.token_id].item(), rel=1e-4, abs=1e-7)
        assert rel.extras["rank"][i, -1] == (p > p[step.token_id]).sum()


def test_relevance_hooks_name_what_cache_methods_read():
    model = make_bridge("gpt2")
    assert relevance_hooks(model, "attnlrp") == []
    dla_names = relevance_hooks(model, "dla")
    assert "hook_pos_embed" in dla_names and "blocks.1.attn.hook_z" in dla_names  # heads from z and W_O
    assert not any(n.endswith("hook_result") for n in dla_names)
    assert relevance_hooks(model, "attention", mode="last") == ["blocks.1.attn.hook_pattern"]
    tokens = random_tokens(1, 7)
    _, cache = model.run_with_cache(tokens, names_filter=dla_names)
    from transformer_bridge.relevance import RelevanceRun

    rel = RelevanceRun(model, tokens, None, 5, cache=cache).relevance_pass(method="dla")
    assert len(rel) == 2


MOE = [f for f in FAMILIES if declared_adapter(f).moe is not None]


@pytest.mark.parametrize("family", MOE)
def test_dla_splits_mixtures_by_expert_when_the_cache_has_them(family):
    model = make_bridge(family)
    tokens = random_tokens(1, 8)
    rel = tiny_run(model, tokens, prompt_width=5).relevance_pass(method="dla")  # everything cached
    _, cache = model.run_with_cache(tokens)
    logits = _logits(model, tokens)
    moe_layers = [i for i in range(model.cfg.n_layers) if f"blocks.{i}.mlp.hook_expert_result" in cache]
    assert moe_layers
    for i, step in enumerate(rel):
        scores = dict(zip(rel.labels, rel.scores[i].tolist(), strict=True))
        assert rel.scores[i].sum().item() == pytest.approx(logits[0, step.position - 1, step.token_id].item(), abs=1e-4)
        for layer in moe_layers:
            weights = cache[f"blocks.{layer}.mlp.hook_expert_weights"][0, step.position - 1]
            experts = [scores[f"L{layer}E{e}"] for e in range(weights.shape[-1])]
            assert f"L{layer}.mlp" not in scores and f"L{layer}.mlp_rest" in scores
            assert all(v == 0.0 for v, w in zip(experts, weights.tolist(), strict=True) if w == 0.0)  # not routed
            assert sum(v != 0.0 for v in experts) > 0
    whole = RelevanceRun(model, tokens, None, 5, cache=model.run_with_cache(tokens, names_filter=relevance_hooks(
        model, "dla"))[1]).relevance_pass(method="dla")  # fmt: skip
    for i in range(len(rel)):
        by_label = dict(zip(whole.labels, whole.scores[i].tolist(), strict=True))
        for layer in moe_layers:
            split = sum(v for k, v in zip(rel.labels, rel.scores[i].tolist(), strict=True)
                        if k.startswith(f"L{layer}E") or k == f"L{layer}.mlp_rest")  # fmt: skip
            assert split == pytest.approx(by_label[f"L{layer}.mlp"], abs=1e-5)
