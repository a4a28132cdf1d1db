"""Gradient baselines against hand-written autograd on the HF model itself."""

import pytest
import torch
from _models import FAMILIES, make_bridge, random_tokens, tiny_run


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def _embed_grads(model, tokens, position, scale=1.0):
    """Gradient of the logit of tokens[0, position] w.r.t. the token embedding (times ``scale``), by hand."""
    hf = model.hf_model
    emb = hf.get_input_embeddings()(tokens).detach()
    leaf = (emb * scale).requires_grad_(True)
    logits = hf(inputs_embeds=leaf).logits
    (grad,) = torch.autograd.grad(logits[0, position - 1, tokens[0, position]], leaf)
    return emb[0], grad[0], logits[0, position - 1, tokens[0, position]].detach()


def test_grad_x_input_equals_hand_autograd(model):
    tokens = random_tokens(1, 9)
    rel = tiny_run(model, tokens, prompt_width=6, cache=False).relevance_pass(method="grad_x_input")
    for i, step in enumerate(rel):
        emb, grad, value = _embed_grads(model, tokens, step.position)
        torch.testing.assert_close(rel.scores[i], (emb * grad).sum(-1), atol=1e-6, rtol=1e-5)
        assert rel.values[i].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6)


def test_grad_norm_equals_hand_autograd(model):
    tokens = random_tokens(1, 8)
    rel = tiny_run(model, tokens, prompt_width=6, cache=False).relevance_pass(method="grad_norm")
    for i, step in enumerate(rel):
        _, grad, _ = _embed_grads(model, tokens, step.position)
        want = grad.norm(dim=-1)
        want[step.position :] = 0
        torch.testing.assert_close(rel.scores[i], want, atol=1e-6, rtol=1e-5)


def test_integrated_gradients_equals_manual_riemann_sum():
    model = make_bridge("llama")
    tokens = random_tokens(1, 8)
    run = tiny_run(model, tokens, prompt_width=6, cache=False)
    rel = run.relevance_pass(method="integrated_gradients", steps=8)
    chunked = run.relevance_pass(method="integrated_gradients", steps=8, internal_batch_size=3)
    torch.testing.assert_close(chunked.scores, rel.scores, atol=1e-6, rtol=1e-5)
    for i, step in enumerate(rel):
        total = 0
        for a in ((torch.arange(8) + 0.5) / 8).tolist():
            emb, grad, _ = _embed_grads(model, tokens, step.position, scale=a)
            total = total + grad
        torch.testing.assert_close(rel.scores[i], (emb * total / 8).sum(-1), atol=1e-5, rtol=1e-4)


def test_integrated_gradients_keep_first_holds_the_first_token_on_the_path():
    model = make_bridge("llama")
    tokens = random_tokens(1, 8)
    run = tiny_run(model, tokens, prompt_width=6, cache=False)
    rel = run.relevance_pass(method="integrated_gradients", steps=8, keep_first=True)
    for i, step in enumerate(rel):
        total = 0
        for a in ((torch.arange(8) + 0.5) / 8).tolist():
            factor = torch.full((1, 8, 1), a)
            factor[0, 0] = 1.0  # the first token stays at its embedding
            emb, grad, _ = _embed_grads(model, tokens, step.position, scale=factor)
            total = total + grad
        want = (emb * total / 8).sum(-1)
        want[0] = 0.0
        torch.testing.assert_close(rel.scores[i], want, atol=1e-5, rtol=1e-4)
    # Completeness against the matching baseline (first token kept): the gap shrinks with steps.
    coarse = run.relevance_pass(method="integrated_gradients", steps=2, keep_first=True).conservation_error
    fine = run.relevance_pass(method="integrated_gradients", steps=64, keep_first=True).conservation_error
    assert (fine < coarse).all() and (fine < 2e-2).all()
    with pytest.raises(ValueError, match="keep_first"):
        run.relevance_pass(method="integrated_gradients", keep_first="yes")


def test_integrated_gradients_keep_first_finds_each_rows_first_real_token():
    model = make_bridge("qwen2")
    padded = random_tokens(2, 9)
    mask = torch.ones_like(padded)
    mask[0, :3] = 0  # row 0: three left-padding columns
    run = tiny_run(model, padded, prompt_width=6, mask=mask, cache=False)
    rel = run.relevance_pass(method="integrated_gradients", steps=4, keep_first=True)
    for i, step in enumerate(rel):
        first = 3 if step.batch_index == 0 else 0
        assert rel.scores[i, first] == 0 and rel.scores[i, first + 1 : step.position].abs().min() > 0
        alone = tiny_run(model, padded[step.batch_index : step.batch_index + 1, first:], prompt_width=6 - first,
                         cache=False).relevance_pass([step.step_index], method="integrated_gradients", steps=4,
                                                     keep_first=True)  # fmt: skip
        torch.testing.assert_close(rel.scores[i, first:], alone.scores[0], atol=1e-5, rtol=1e-4)


def test_integrated_gradients_completeness_improves_with_steps():
    model = make_bridge("gpt2")
    tokens = random_tokens(1, 8)
    run = tiny_run(model, tokens, prompt_width=7, cache=False)
    coarse = run.relevance_pass(method="integrated_gradients", steps=2).conservation_error[0]
    fine = run.relevance_pass(method="integrated_gradients", steps=64).conservation_error[0]
    assert fine < coarse and fine < 1e-2


@pytest.mark.parametrize("method", ["grad_x_input", "grad_norm", "integrated_gradients"])
def test_batched_equals_one_at_a_time(method):
    model = make_bridge("qwen2")
    run = tiny_run(model, random_tokens(1, 9), prompt_width=5, cache=False)
    together = run.relevance_pass([1, 3], method=method, **({"steps": 4} if "integrated" in method else {}))
    for i, s in enumerate([1, 3]):
        alone = run.relevance_pass([s], method=method, **({"steps": 4} if "integrated" in method else {}))
        torch.testing.assert_close(together.scores[i], alone.scores[0], atol=1e-6, rtol=1e-5)


def test_logprob_target_equals_hand_autograd():
    model = make_bridge("phi3")
    tokens = random_tokens(1, 7)
    rel = tiny_run(model, tokens, prompt_width=6, cache=False).relevance_pass(method="grad_x_input", target="logprob")
    hf = model.hf_model
    emb = hf.get_input_embeddings()(tokens).detach().requires_grad_(True)
    logprob = hf(inputs_embeds=emb).logits[0, 5].log_softmax(-1)[tokens[0, 6]]
    logprob.backward()
    torch.testing.assert_close(rel.scores[0], (emb * emb.grad).sum(-1)[0], atol=1e-6, rtol=1e-5)
    assert rel.values[0].item() == pytest.approx(logprob.item(), rel=1e-5)


def test_grad_x_input_matches_inseq():
    inseq = pytest.importorskip("inseq")
    model = make_bridge("gpt2")
    prompt = "Hello wor"
    tokens, _ = model.to_tokens_and_mask(prompt + "ld", padding_side="left")
    rel = tiny_run(model, tokens, prompt_width=tokens.shape[1] - 2, cache=False).relevance_pass(method="grad_x_input")
    attrib = inseq.load_model(model.hf_model, "input_x_gradient", tokenizer=model.tokenizer)
    out = attrib.attribute(prompt, prompt + "ld", attributed_fn="logit", step_scores=[], show_progress=False)
    theirs = out.sequence_attributions[0].target_attributions.sum(-1).T  # [step, pos], signed, unnormalised
    for i, step in enumerate(rel):
        n = step.position
        torch.testing.assert_close(rel.scores[i, :n], theirs[i, :n].float(), atol=1e-6, rtol=1e-5)
