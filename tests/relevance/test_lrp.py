"""attnlrp and cp_lrp: conservation, rule-by-rule oracles, causality, batching and padding."""

import pytest
import torch
from _models import BIAS_FREE, FAMILIES, make_bridge, padded_pair, random_tokens, tiny_run
from _oracles import gpt2_attnlrp, llama_lrp

from transformer_bridge.relevance import ExplainedToken, Target, explain


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


@pytest.mark.parametrize("family", BIAS_FREE)
@pytest.mark.parametrize("target", ["logit", ("logit_diff", 7)])
def test_cp_lrp_conserves_on_bias_free_families(family, target):
    model = make_bridge(family)
    tokens = random_tokens(1, 10)
    rel = tiny_run(model, tokens, prompt_width=6, cache=False).relevance_pass(method="cp_lrp", target=target)
    with torch.no_grad():
        logits = model.hf_model(tokens).logits[0].float()
    for step in rel:
        want = logits[step.position - 1, step.token_id]
        if target != "logit":
            want = want - logits[step.position - 1, 7]
        assert step.relevance.sum().item() == pytest.approx(want.item(), rel=1e-4, abs=1e-5)
        assert step.conservation_error < 1e-4


def test_cp_lrp_conserves_through_a_sigmoid_gated_shared_expert():
    """Qwen2-MoE (not bias-free: q/k/v biases, zeroed here) has a shared expert under a sigmoid gate; with
    the gate held constant and the gated-MLP rule on the shared expert, cp_lrp conserves."""
    model = make_bridge("qwen2_moe")
    assert "blocks.1.mlp.hook_shared_gate" in model.hook_dict
    with torch.no_grad():
        for name, p in model.hf_model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    tokens = random_tokens(1, 10, seed=3)
    rel = tiny_run(model, tokens, prompt_width=6, cache=False).relevance_pass(method="cp_lrp")
    with torch.no_grad():
        logits = model.hf_model(tokens).logits[0].float()
    for step in rel:
        want = logits[step.position - 1, step.token_id].item()
        assert step.relevance.sum().item() == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attnlrp_equals_rule_by_rule_llama_layout(family):
    model = make_bridge(family)
    tokens = random_tokens(1, 9, seed=5)
    for variant in ("attnlrp", "cp_lrp"):
        rel = tiny_run(model, tokens, prompt_width=5, cache=False).relevance_pass(method=variant)
        for i, step in enumerate(rel):
            want = llama_lrp(model.hf_model, tokens, step.position, variant)
            torch.testing.assert_close(rel.scores[i], want, atol=2e-6, rtol=1e-4)


def test_attnlrp_equals_rule_by_rule_gpt2():
    model = make_bridge("gpt2")
    with torch.no_grad():  # non-zero biases and LayerNorm β exercise the non-conservative parts
        for name, p in model.hf_model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    tokens = random_tokens(1, 8, seed=6)
    rel = tiny_run(model, tokens, prompt_width=5, cache=False).relevance_pass(method="attnlrp")
    for i, step in enumerate(rel):
        torch.testing.assert_close(rel.scores[i], gpt2_attnlrp(model.hf_model, tokens, step.position),
                                   atol=2e-6, rtol=1e-4)  # fmt: skip


def test_attnlrp_reports_its_conservation_error(model):
    tokens = random_tokens(1, 8)
    rel = tiny_run(model, tokens, prompt_width=5, cache=False).relevance_pass(method="attnlrp")
    errors = rel.conservation_error
    assert errors is not None and errors.shape == (3,) and torch.isfinite(errors).all()
    gap = (rel.scores.sum(-1) - rel.values).abs() / rel.values.abs()
    torch.testing.assert_close(errors, gap)


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_zero_at_and_after_own_position_and_finite(model, method):
    tokens = random_tokens(1, 10)
    rel = tiny_run(model, tokens, prompt_width=5, cache=False).relevance_pass(method=method)
    for i, e in enumerate(rel.explained):
        assert (rel.scores[i, e.position :] == 0).all()
        assert torch.isfinite(rel.scores[i]).all() and rel.scores[i, : e.position].abs().sum() > 0


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_batched_equals_one_at_a_time(model, method):
    tokens = random_tokens(1, 10)
    run = tiny_run(model, tokens, prompt_width=5, cache=False)
    together = run.relevance_pass([0, 2, 4], method=method)
    for i, step in enumerate([0, 2, 4]):
        alone = run.relevance_pass([step], method=method)
        torch.testing.assert_close(together.scores[i], alone.scores[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_left_padded_batch_equals_single_rows(model, method):
    tokens, mask, width, singles = padded_pair()
    batch = tiny_run(model, tokens, prompt_width=width, mask=mask, cache=False).relevance_pass(method=method)
    assert [s.batch_index for s in batch] == [0, 0, 0, 1, 1, 1]
    for b, single in enumerate(singles):
        alone = tiny_run(model, single, prompt_width=single.shape[1] - 3, cache=False).relevance_pass(method=method)
        for j in range(3):
            got = batch[3 * b + j]
            assert got.source_tokens == alone[j].source_tokens and got.step_index == alone[j].step_index
            torch.testing.assert_close(got.relevance, alone[j].relevance, atol=2e-5, rtol=1e-4)
        assert (batch.scores[3 * b : 3 * b + 3][:, ~mask[b].bool()] == 0).all()


def test_gemma2_softcap_rule_targets_the_capped_logit():
    model = make_bridge("gemma2")
    tokens = random_tokens(1, 7)
    rel = explain(model, tokens, None, [ExplainedToken(0, 6, int(tokens[0, 6]))], "cp_lrp", Target("logit"))
    with torch.no_grad():
        capped = model.hf_model(tokens).logits[0, 5, tokens[0, 6]]
    assert rel.values[0].item() == pytest.approx(capped.item(), rel=1e-5)
    assert rel.scores[0].sum().item() == pytest.approx(capped.item(), rel=1e-4)


@pytest.mark.real
def test_cp_lrp_conserves_on_smollm2(smollm2):
    tokens, mask = smollm2.to_tokens_and_mask(
        "The capital of France is Paris, and the capital of Italy is Rome", padding_side="left"
    )
    run = tiny_run(smollm2, tokens, prompt_width=tokens.shape[1] - 3, mask=mask, cache=False)
    rel = run.relevance_pass(method="cp_lrp")
    with torch.no_grad():
        logits = smollm2.hf_model(tokens).logits[0]
    for step in rel:
        want = logits[step.position - 1, step.token_id].item()
        assert step.relevance.sum().item() == pytest.approx(want, rel=1e-4)
    attn = run.relevance_pass(method="attnlrp")
    assert (attn.conservation_error > 1e-3).all()  # not conservative, and said so
