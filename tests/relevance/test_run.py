"""The two-step API (forward_pass → relevance_pass → clear), model.relevance, and bad input."""

from types import SimpleNamespace

import pytest
import torch
from _models import make_bridge, random_tokens, tiny_run

from transformer_bridge import ActivationCache
from transformer_bridge import relevance as relevance_package
from transformer_bridge.relevance import METHODS, ClearedRunError, MissingHookError, RelevanceRun


@pytest.fixture()
def model(monkeypatch):
    """A tiny Llama whose real `generate` records each call (to prove explaining never regenerates)."""
    m = make_bridge("llama")
    m.calls = []
    real = relevance_package.generate

    def recording_generate(*args, **kwargs):
        m.calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(relevance_package, "generate", recording_generate)
    return m


def test_forward_pass_then_relevance_pass(model):
    run = model.forward_pass(["Hi", "The capital"], max_new_tokens=5, top_k=3, seed=0, stop_at_eos=False)
    assert model.calls[0]["device"] == "cpu" and model.calls[0]["top_k"] == 3 and model.calls[0]["names_filter"] is None
    assert run.prompt_width == 12 and run.n_generated == 5 and run.sequences.shape == (2, 17)
    rel = run.relevance_pass(token_indices=[0, 4])
    assert [(s.batch_index, s.step_index) for s in rel] == [(0, 0), (0, 4), (1, 0), (1, 4)]
    step = rel[1]
    assert step.token_id == int(run.sequences[0, 16]) and step.token == model.to_str_tokens(run.sequences[0])[16]
    assert step.source_tokens == model.to_str_tokens(run.sequences[0])[9:16]  # "<bos>Hi" + steps 0..3
    assert step.relevance.shape == (7,) and rel.matrix.shape == (4, 17)
    n_calls = len(model.calls)
    for method in ("cp_lrp", "dla", "logit_lens", "attention"):
        run.relevance_pass([1], method=method)
    assert len(model.calls) == n_calls  # explaining never regenerates


def test_all_tokens_by_default_and_negative_indices(model):
    run = model.forward_pass("Hello", max_new_tokens=4)
    assert [s.step_index for s in run.relevance_pass(method="random")] == [0, 1, 2, 3]
    assert [s.step_index for s in run.relevance_pass(-1, method="random")] == [3]


def test_model_relevance_accepts_run_pair_and_cache(model):
    run = model.forward_pass("Hello", max_new_tokens=3)
    by_run = model.relevance(run, method="grad_x_input", token_indices=[2])
    pair = (SimpleNamespace(sequences=run.sequences), run.cache)  # widths from the cache's prompt_lengths
    by_pair = model.relevance(pair, method="grad_x_input", token_indices=[2])
    by_output = model.relevance((run.output, run.cache), method="grad_x_input", token_indices=[2])
    torch.testing.assert_close(by_output.scores, by_run.scores)
    by_cache = model.relevance(run.cache, method="grad_x_input", token_indices=[2], tokens=run.sequences)
    torch.testing.assert_close(by_pair.scores, by_run.scores)
    torch.testing.assert_close(by_cache.scores, by_run.scores)
    with pytest.raises(ValueError, match="tokens="):
        model.relevance(run.cache, method="dla")
    with pytest.raises(TypeError, match="RelevanceRun"):
        model.relevance("nonsense")


def test_token_indices_outside_generated_range(model):
    run = model.forward_pass("Hello", max_new_tokens=3)
    for bad in ([3], [0, -4], [1.5], []):
        with pytest.raises(ValueError, match=r"0\.\.2"):
            run.relevance_pass(bad)


def test_unknown_method_lists_the_valid_ones(model):
    run = model.forward_pass("Hello", max_new_tokens=2)
    with pytest.raises(ValueError, match="Did you mean 'attnlrp'") as info:
        run.relevance_pass(method="attnlpr")
    assert all(name in str(info.value) for name in METHODS)
    with pytest.raises(TypeError, match=r"accepts.*steps"):
        run.relevance_pass(method="integrated_gradients", step=4)
    with pytest.raises(ValueError, match="`target`"):
        run.relevance_pass(target="probability")


def test_missing_hooks_say_which_and_how(model):
    run = model.forward_pass("Hello", max_new_tokens=2, names_filter=lambda n: "resid" in n)
    with pytest.raises(MissingHookError, match=r"hook_z.*names_filter=relevance_hooks\(model, 'dla'\)") as info:
        run.relevance_pass(method="dla")
    assert "blocks.0.attn.hook_z" in info.value.missing and isinstance(info.value, KeyError)
    with pytest.raises(MissingHookError, match="hook_pattern"):
        run.relevance_pass(method="attention", mode="rollout")
    run.relevance_pass(method="logit_lens")  # resid_post is there
    no_cache = RelevanceRun(model, run.sequences, run.attention_mask, run.prompt_width)
    with pytest.raises(MissingHookError, match="no cache was given"):
        no_cache.relevance_pass(method="dla")


def test_clear_frees_and_later_use_fails_clearly(model):
    run = model.forward_pass("Hello", max_new_tokens=2)
    run.clear()
    assert repr(run) == "RelevanceRun(cleared)"
    with pytest.raises(ClearedRunError, match="forward_pass"):
        run.relevance_pass()
    with pytest.raises(ClearedRunError):
        _ = run.sequences
    with pytest.raises(ClearedRunError):
        model.relevance(run)


def test_rows_that_stopped_early_skip_their_padding():
    model = make_bridge("llama")
    tokens = random_tokens(2, 8)
    mask = torch.ones_like(tokens)
    mask[0, 7] = 0  # row 0 finished after step 1 of 3
    rel = tiny_run(model, tokens, prompt_width=5, mask=mask, cache=False).relevance_pass(method="random")
    assert [(s.batch_index, s.step_index) for s in rel] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]


def test_a_mask_with_padding_between_real_tokens_is_taken_as_generate_takes_it():
    """As HF's (and the bridge's) generate: the masked token stays in place and is skipped; the explanations
    give it no entry, as for padding."""
    model = make_bridge("llama")
    tokens, mask = torch.tensor([[1, 5, 17, 42, 8, 11, 30]]), torch.tensor([[1, 1, 0, 1, 1, 1, 1]])
    run = model.forward_pass(tokens, attention_mask=mask, max_new_tokens=3, temperature=0)
    assert torch.equal(run.sequences, model.generate(tokens, attention_mask=mask, max_new_tokens=3, temperature=0))
    for method in ("grad_x_input", "attnlrp"):
        step = run.relevance_pass([0], method=method)[0]
        assert step.source_tokens == model.to_str_tokens(torch.tensor([1, 5, 42, 8, 11, 30]))
        assert step.relevance.shape == (6,) and bool(step.relevance.isfinite().all())


def test_forward_pass_generates_then_explains():
    model = make_bridge("gpt2")
    run = model.forward_pass(["Hi", "Hello there"], max_new_tokens=4, temperature=0)
    assert isinstance(run.cache, ActivationCache)
    rel = run.relevance_pass([0, 3], method="cp_lrp")
    assert len(rel) == 4 and (rel.conservation_error < 1e-4).all()
    assert all(s.relevance.shape[0] == len(s.source_tokens) for s in rel)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_every_method_runs_in_bfloat16(family):
    """Accelerator users run bf16 models: every method gives finite float32 scores, cp_lrp still ≈ conserves."""
    model = make_bridge(family)
    model.hf_model.to(torch.bfloat16)
    run = model.forward_pass("Hello wor", max_new_tokens=3, do_sample=False, stop_at_eos=False)
    corrupted = run.sequences.clone()
    corrupted[0, 2] = (corrupted[0, 2] + 1) % model.cfg.d_vocab
    for method in METHODS:
        options = {"corrupted_tokens": corrupted} if method == "attribution_patching" else {}
        rel = run.relevance_pass(method=method, **options)
        assert rel.scores.dtype == torch.float32 and torch.isfinite(rel.scores).all(), method
    if family != "gpt2":  # bias-free: conservation up to bf16 rounding of the forward
        assert (run.relevance_pass(method="cp_lrp").conservation_error < 0.02).all()
