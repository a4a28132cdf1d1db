"""Every bad input to the relevance entry points raises the builtin a user would catch, with a message naming
the parameter and the value, and leaves the model clean."""

import numpy as np
import pytest
import torch
from _clean import assert_clean
from _models import V, make_bridge

from transformer_bridge.relevance import (
    ClearedRunError,
    ExplainedToken,
    MissingHookError,
    RelevanceRun,
    attribution_patching,
    explain,
    explained_from_positions,
    relevance_hooks,
)

TOKENS = torch.tensor([[1, 5, 17, 42, 8, 11, 30]])
_RUNS: dict[int, RelevanceRun] = {}


def run_of(model) -> RelevanceRun:
    """One generated run per model: 3 tokens after a 4-token prompt, every hook point cached."""
    if id(model) not in _RUNS:
        _RUNS[id(model)] = model.forward_pass(TOKENS[:, :4], max_new_tokens=3, stop_at_eos=False)
    return _RUNS[id(model)]


def rel(**kwargs):
    """A `relevance_pass` on the model's run."""
    return lambda m: run_of(m).relevance_pass(**kwargs)


def patch(**kwargs):
    """`attribution_patching` of the clean ``TOKENS`` against a one-token corruption, overridable."""
    corrupted = TOKENS.clone()
    corrupted[0, 2] = 50
    args = {"clean_tokens": TOKENS, "corrupted_tokens": corrupted, "metric": lambda logits: logits[0, -1, 3]}
    return lambda m: attribution_patching(m, **{**args, **kwargs})


CORRUPTED = "attribution_patching"


def corrupt(edit):
    """Attribution patching as a method, with ``edit(run.sequences)`` as the corrupted tokens."""
    return lambda m: run_of(m).relevance_pass(method=CORRUPTED, corrupted_tokens=edit(run_of(m).sequences))


CASES = [
    # integrated gradients' options
    ("ig_internal_batch_size_0", rel(method="integrated_gradients", internal_batch_size=0), ValueError,
     r"`internal_batch_size`.*>= 1, got 0"),
    ("ig_internal_batch_size_negative", rel(method="integrated_gradients", internal_batch_size=-2), ValueError,
     r"`internal_batch_size`.*got -2"),
    ("ig_internal_batch_size_float", rel(method="integrated_gradients", internal_batch_size=2.0), TypeError,
     r"`internal_batch_size`.*got 2\.0"),
    ("ig_steps_0", rel(method="integrated_gradients", steps=0), ValueError, r"`steps`.*>= 1, got 0"),
    ("ig_steps_float", rel(method="integrated_gradients", steps=8.0), TypeError, r"`steps`.*got 8\.0"),
    ("ig_steps_bool", rel(method="integrated_gradients", steps=True), TypeError, r"`steps`.*got True"),
    ("ig_keep_first_str", rel(method="integrated_gradients", keep_first="yes"), TypeError, r"`keep_first`.*'yes'"),
    # token_indices
    ("token_indices_float", rel(token_indices=1.0), TypeError, r"`token_indices`.*got 1\.0"),
    ("token_indices_float_in_list", rel(token_indices=[0, 1.5]), TypeError, r"`token_indices`.*\[0, 1\.5\]"),
    ("token_indices_str", rel(token_indices="0"), TypeError, r"`token_indices`.*got '0'"),
    ("token_indices_float_tensor", rel(token_indices=torch.tensor([1.0])), TypeError, r"`token_indices`.*float32"),
    ("token_indices_past_end", rel(token_indices=3), IndexError, r"`token_indices`.*0\.\.2.*\[3\]"),
    ("token_indices_before_start", rel(token_indices=[0, -4]), IndexError, r"`token_indices`.*-3\.\.-1.*\[-4\]"),
    ("token_indices_empty", rel(token_indices=[]), ValueError, r"`token_indices` is empty"),
    # method names and options
    ("method_typo", rel(method="attnlpr"), ValueError, r"`method`='attnlpr'.*Did you mean 'attnlrp'"),
    ("method_int", rel(method=5), TypeError, r"`method`.*got 5"),
    ("option_typo", rel(method="integrated_gradients", step=4), TypeError, r"`step`.*Did you mean 'steps'"),
    ("option_of_another_method", rel(method="dla", steps=4), TypeError, r"'dla'.*`steps`.*no options"),
    ("attention_mode", rel(method="attention", mode="first"), ValueError, r"`mode`='first'.*\('last', 'rollout'\)"),
    ("random_seed_negative", rel(method="random", seed=-1), ValueError, r"`seed`.*got -1"),
    ("random_seed_str", rel(method="random", seed="0"), TypeError, r"`seed`.*got '0'"),
    # targets
    ("target_unknown", rel(target="probability"), ValueError, r"`target`='probability'"),
    ("target_contrast_past_vocab", rel(target=("logit_diff", V)), IndexError, rf"`target`.*{V}.*\[0, {V - 1}\]"),
    ("target_contrast_float", rel(target=("logit_diff", 1.5)), TypeError, r"`target`.*1\.5"),
    ("target_fn_wrong_shape", rel(target=lambda logits, token: logits), ValueError,
     r"`target` function <lambda>.*one value per row.*shape \(1,\)"),
    ("target_fn_returns_ints", rel(target=lambda logits, token: token), TypeError,
     r"`target` function <lambda>.*float tensor.*int64"),
    ("dla_nonlinear_target", rel(method="dla", target="logprob"), ValueError, r"`target`='logprob'"),
    # attribution patching as a method: the corrupted tokens
    ("corrupted_missing", rel(method=CORRUPTED), ValueError, r"`corrupted_tokens`"),
    ("corrupted_float", corrupt(lambda seqs: seqs.float()), TypeError, r"`corrupted_tokens`.*integer.*float32"),
    ("corrupted_past_vocab", corrupt(lambda seqs: seqs + V), ValueError,
     rf"`corrupted_tokens`.*token id \d+, outside the vocabulary \[0, {V - 1}\]"),
    ("corrupted_wrong_shape", rel(method=CORRUPTED, corrupted_tokens=TOKENS[:, :5]), ValueError,
     r"`corrupted_tokens`.*\(1, 7\).*\(1, 5\)"),
    ("corrupted_float_list", corrupt(lambda seqs: seqs.float().tolist()), TypeError, r"`corrupted_tokens`.*float32"),
    ("corrupted_ragged_list", corrupt(lambda seqs: [[1, 2], [3]]), TypeError,
     r"`corrupted_tokens`.*\[\[1, 2\], \[3\]\]"),
    ("patching_names_unknown", rel(method=CORRUPTED, corrupted_tokens=TOKENS, names=["blocks.0.hook_resid_prex"]),
     KeyError, r"'blocks\.0\.hook_resid_prex'.*blocks\.0\.hook_resid_pre"),
    # attribution patching as a function: tokens, metric, names
    ("patching_metric_not_scalar", patch(metric=lambda logits: logits[0, -1]), ValueError,
     rf"`metric`.*scalar.*shape \({V},\)"),
    ("patching_metric_float", patch(metric=lambda logits: 1.0), TypeError, r"`metric`.*got 1\.0"),
    ("patching_metric_constant", patch(metric=lambda logits: torch.tensor(1.0)), ValueError, r"`metric`.*no gradient"),
    ("patching_metric_not_callable", patch(metric="logit"), TypeError, r"`metric`.*got 'logit'"),
    ("patching_clean_float", patch(clean_tokens=TOKENS.float()), TypeError, r"`clean_tokens`.*float32"),
    ("patching_clean_past_vocab", patch(clean_tokens=TOKENS + V), ValueError, r"`clean_tokens`.*token id 141"),
    ("patching_corrupted_shape", patch(corrupted_tokens=TOKENS[:, 1:]), ValueError, r"`corrupted_tokens`.*\(1, 6\)"),
    ("patching_names_int", patch(names=5), TypeError, r"`names`.*got 5"),
    ("patching_names_empty", patch(names=[]), ValueError, r"`names`.*empty"),
    ("patching_mask_shape", patch(attention_mask=torch.ones(1, 3)), ValueError, r"`attention_mask`.*\(1, 3\)"),
    ("patching_clean_cache", patch(clean_cache={"x": 1}), TypeError, r"`clean_cache`.*\{'x': 1\}"),
    # the two-step API
    ("forward_pass_return_dict", lambda m: m.forward_pass(TOKENS, max_new_tokens=2, return_dict=False), TypeError,
     r"`return_dict=True`.*got `return_dict=False`"),
    ("forward_pass_max_new_tokens_0", lambda m: m.forward_pass(TOKENS, max_new_tokens=0), ValueError,
     r"`max_new_tokens`.*got 0"),
    ("forward_pass_keyword_typo", lambda m: m.forward_pass(TOKENS, max_new_tokens=2, temprature=0.5), TypeError,
     r"\['temprature'\].*Did you mean 'temperature'"),
    ("forward_pass_mask_shape",
     lambda m: m.forward_pass(TOKENS, attention_mask=torch.ones(1, 6, dtype=torch.long)),
     ValueError, r"`attention_mask` shape \(1, 6\) does not match the prompt shape \(1, 7\)"),
    ("relevance_not_a_run", lambda m: m.relevance("nonsense"), TypeError, r"`cache_or_run`.*str"),
    ("relevance_cache_without_tokens", lambda m: m.relevance(run_of(m).cache), ValueError, r"`tokens=`"),
    ("relevance_tokens_not_tensor", lambda m: m.relevance(run_of(m).cache, tokens=[[1, 2]]), TypeError,
     r"`tokens`.*\[\[1, 2\]\]"),
    ("relevance_run_and_tokens", lambda m: m.relevance(run_of(m), tokens=TOKENS), ValueError, r"`tokens=`"),
    ("run_float_sequences", lambda m: RelevanceRun(m, TOKENS.float(), None, 4), TypeError, r"`sequences`.*float32"),
    ("run_prompt_width_0", lambda m: RelevanceRun(m, TOKENS, None, 0), ValueError, r"`prompt_width`.*\[1, 7\].*got 0"),
    ("run_prompt_width_float", lambda m: RelevanceRun(m, TOKENS, None, 2.0), TypeError, r"`prompt_width`.*got 2\.0"),
    ("run_mask_shape", lambda m: RelevanceRun(m, TOKENS, torch.ones(1, 3), 4), ValueError,
     r"`attention_mask`.*\(1, 3\)"),
    ("run_no_tokens_generated", lambda m: RelevanceRun(m, TOKENS, None, 7).relevance_pass(), ValueError,
     r"generated no tokens"),
    ("positions_out_of_range", lambda m: explained_from_positions(TOKENS, torch.ones_like(TOKENS), [(0, 7)]),
     IndexError, r"`positions`.*position 7.*1\.\.6"),
    ("positions_not_pairs", lambda m: explained_from_positions(TOKENS, torch.ones_like(TOKENS), [3]), TypeError,
     r"`positions`.*got 3"),
    ("explain_token_out_of_range", lambda m: explain(m, TOKENS, None, [ExplainedToken(1, 3, 42)]), IndexError,
     r"`explained`.*batch_index=1.*rows 0\.\.0"),
    ("explain_not_explained_tokens", lambda m: explain(m, TOKENS, None, [(0, 3)]), TypeError,
     r"`explained`.*ExplainedToken.*\(0, 3\)"),
    ("relevance_hooks_option_typo", lambda m: relevance_hooks(m, "attention", mdoe="rollout"), TypeError,
     r"`mdoe`.*Did you mean 'mode'"),
    ("relevance_hooks_bad_mode", lambda m: relevance_hooks(m, "attention", mode="all"), ValueError, r"`mode`='all'"),
    ("relevance_hooks_unknown_method", lambda m: relevance_hooks(m, "dlla"), ValueError, r"`method`='dlla'.*'dla'"),
]  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return make_bridge(request.param)


@pytest.mark.parametrize(("call", "error", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_parameter_and_leaves_the_model_clean(model, call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(model)
    assert_clean(model)


def test_the_table_has_at_least_35_distinct_rows():
    assert len(CASES) >= 35 and len({c[0] for c in CASES}) == len(CASES)


def test_missing_hooks_and_cleared_runs_keep_their_errors():
    model = make_bridge("llama")
    run = model.forward_pass(TOKENS[:, :4], max_new_tokens=2, names_filter="resid_post")
    with pytest.raises(MissingHookError, match="hook_z") as info:
        run.relevance_pass(method="dla")
    assert isinstance(info.value, KeyError)
    run.clear()
    with pytest.raises(ClearedRunError, match="forward_pass"):
        run.relevance_pass()
    assert_clean(model)


def test_numpy_and_tensor_integers_are_accepted_as_ints():
    model = make_bridge("llama")
    run = run_of(model)
    ig = dict(method="integrated_gradients", steps=4, internal_batch_size=2)
    plain = run.relevance_pass(1, target=("logit_diff", 3), **ig)
    for index in (np.int64(1), [np.int32(1)], torch.tensor(1), torch.tensor([1]), np.array([1])):
        same = run.relevance_pass(index, target=("logit_diff", np.int64(3)), method="integrated_gradients",
                                  steps=np.int64(4), internal_batch_size=np.int16(2))  # fmt: skip
        torch.testing.assert_close(same.scores, plain.scores)
    assert [s.step_index for s in run.relevance_pass(np.array([0, -1]), method="random", seed=np.int64(0))] == [0, 2]
