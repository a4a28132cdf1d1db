"""HF's logits processors and warpers give HF's tokens on every loop: the plain KV-cached loop, the compiled
step, `generate_stream`, prompt lookup, an assistant model, a (pass-through) controller and beam search.

The oracle is HF's own ``generate`` with the same option, greedy (and, for the two sampling warpers HF added,
seeded sampling from the same global seed). The declared paths of each option (`declare.OPTIONS`) are checked
against what the loops do: an option runs on each path it declares, and `generate_stream` refuses the others.
"""

import pytest
import torch
from conftest import make_bridge

from transformer_bridge.generation.declare import BY_NAME, OPTIONS, PATHS

PROMPTS = ["Hello there", "Hi"]
N = 6


@pytest.fixture(scope="module")
def model():
    return make_bridge("llama")


@pytest.fixture(scope="module")
def assistant():
    return make_bridge("llama", seed=1)


def _prompt(model):
    return model.to_tokens_and_mask(PROMPTS, padding_side="left")


def _free(model):
    tokens, mask = _prompt(model)
    return model.generate(tokens, attention_mask=mask, max_new_tokens=N, stop_at_eos=False)[:, tokens.shape[1] :]


def _cases(model) -> dict[str, dict]:
    """Each new option at a value that changes the greedy tokens of these prompts (or, for the guards, at one
    that must change nothing)."""
    free = _free(model)
    first, second = int(free[0, 0]), int(free[0, 1])
    return {
        "suppress_tokens": {"suppress_tokens": [first, int(free[1, 2])]},
        "begin_suppress_tokens": {"begin_suppress_tokens": [first, int(free[1, 0])]},
        "sequence_bias": {"sequence_bias": {(first, second): -50.0, (int(free[1, 1]),): -50.0}},
        "forced_eos_token_id": {"forced_eos_token_id": 7, "stop_at_eos": True},
        "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (1, 40.0), "eos_token_id": 9},
        "remove_invalid_values": {"remove_invalid_values": True},
        "renormalize_logits": {"renormalize_logits": True},
    }


def _hf(model, tokens, mask, **options):
    options = {k: v for k, v in options.items() if k != "stop_at_eos"}
    if "sequence_bias" in options:
        options["sequence_bias"] = [[list(k), v] for k, v in options["sequence_bias"].items()]
    return model.hf_model.generate(tokens, attention_mask=mask, max_new_tokens=N, do_sample=False,
                                   pad_token_id=model.pad_token_id, **options)  # fmt: skip


def _assert_equal(ours, hf, mask_width):
    assert ours.shape == hf.shape, (ours.shape, hf.shape)
    assert torch.equal(ours, hf), (ours.tolist(), hf.tolist())


CASES = ["suppress_tokens", "begin_suppress_tokens", "sequence_bias", "forced_eos_token_id",
         "exponential_decay_length_penalty", "remove_invalid_values", "renormalize_logits"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["eager", "stream", "lookup", "assistant", "controller"])
def test_each_hf_processor_equals_hf_greedy_on_each_path(model, assistant, case, path):
    options = _cases(model)[case]
    tokens, mask = _prompt(model)
    hf = _hf(model, tokens, mask, **options)
    options = {"stop_at_eos": False, **options}
    if case == "forced_eos_token_id" or "eos_token_id" in options:
        options["stop_at_eos"] = True
    kw = dict(attention_mask=mask, max_new_tokens=N, **options)
    if path == "stream":
        ours = torch.cat(list(model.generate_stream(tokens, **kw)), dim=1)
    else:
        extra = {"lookup": {"prompt_lookup_num_tokens": 2}, "assistant": {"assistant_model": assistant},
                 "controller": {"controller": lambda view: None}}.get(path, {})  # fmt: skip
        ours = model.generate(tokens, **kw, **extra)
    real = (ours != model.pad_token_id) | (torch.arange(ours.shape[1]) < tokens.shape[1])
    assert ours.shape[1] <= hf.shape[1]
    assert torch.equal(ours[real], hf[:, : ours.shape[1]][real]), (ours.tolist(), hf.tolist())


def test_every_hf_processor_together_on_beams_and_the_compiled_step(model):
    cases = _cases(model)
    together = {**cases["suppress_tokens"], **cases["begin_suppress_tokens"], **cases["sequence_bias"],
                **cases["remove_invalid_values"], **cases["renormalize_logits"]}  # fmt: skip
    tokens, mask = _prompt(model)
    hf = _hf(model, tokens, mask, **together)
    compiled = model.generate(tokens, attention_mask=mask, max_new_tokens=N, stop_at_eos=False, compile=True,
                              **together)  # fmt: skip
    assert torch.equal(compiled, hf[:, : compiled.shape[1]])
    for case in ("suppress_tokens", "sequence_bias", "exponential_decay_length_penalty"):
        options = cases[case]
        beams = model.generate(tokens, attention_mask=mask, max_new_tokens=N, num_beams=3, return_dict=True,
                               **options)  # fmt: skip
        hf_beams = _hf(model, tokens, mask, num_beams=3, **options)
        real = beams.attention_mask.bool()
        assert beams.sequences.shape == hf_beams.shape
        assert torch.equal(beams.sequences[real], hf_beams[real]), case


def test_forced_bos_on_a_one_token_prompt_equals_hf(model):
    tokens = torch.tensor([[1]])
    ours = model.generate(tokens, max_new_tokens=4, forced_bos_token_id=11)
    hf = model.hf_model.generate(tokens, max_new_tokens=4, do_sample=False, forced_bos_token_id=11)
    assert torch.equal(ours, hf) and int(ours[0, 1]) == 11
    # begin_suppress_tokens moves one position later after a forced BOS, as in HF.
    ours = model.generate(tokens, max_new_tokens=4, forced_bos_token_id=11, begin_suppress_tokens=[int(hf[0, 2])])
    hf = model.hf_model.generate(tokens, max_new_tokens=4, do_sample=False, forced_bos_token_id=11,
                                 begin_suppress_tokens=[int(hf[0, 2])])  # fmt: skip
    assert torch.equal(ours, hf)


@pytest.mark.parametrize("warper", [{"epsilon_cutoff": 0.02}, {"eta_cutoff": 0.05}, {"epsilon_cutoff": 0.01,
                                    "top_k": 20, "top_p": 0.9, "temperature": 0.8}])  # fmt: skip
def test_epsilon_and_eta_sampling_equal_hf_with_the_same_global_seed(model, warper):
    tokens, mask = _prompt(model)
    torch.manual_seed(3)
    hf = model.hf_model.generate(tokens, attention_mask=mask, max_new_tokens=N, do_sample=True,
                                 pad_token_id=model.pad_token_id, **warper)  # fmt: skip
    torch.manual_seed(3)
    ours = model.generate(tokens, attention_mask=mask, max_new_tokens=N, do_sample=True, **warper)
    real = ours != model.pad_token_id
    assert torch.equal(ours[real], hf[:, : ours.shape[1]][real])


def test_renormalized_scores_are_log_probabilities_as_in_hf(model):
    tokens, mask = _prompt(model)
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=3, renormalize_logits=True, return_dict=True,
                         output_scores=True)  # fmt: skip
    scores = torch.stack(list(out.scores), 1) if isinstance(out.scores, tuple) else out.scores
    assert torch.allclose(scores.exp().sum(-1), torch.ones(scores.shape[:2]), atol=1e-5)


def test_bad_values_name_the_option(model):
    tokens = torch.tensor([[1, 5, 6]])
    for kw, match in [({"suppress_tokens": [500]}, r"`suppress_tokens` token ids must be ints in \[0, 99\)"),
                      ({"sequence_bias": {(): 1.0}}, "`sequence_bias` entries are"),
                      ({"exponential_decay_length_penalty": (1, -2.0)}, "`exponential_decay_length_penalty` must"),
                      ({"forced_eos_token_id": "x"}, "`forced_eos_token_id` must be a list of token ids"),
                      ({"remove_invalid_values": "yes"}, "`remove_invalid_values` must be True or False"),
                      ({"epsilon_cutoff": 1.5, "do_sample": True}, r"`epsilon_cutoff` must be a float in \[0, 1\)"),
                      ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            model.generate(tokens, max_new_tokens=2, **kw)


def test_declared_paths_hold(model, assistant):
    """Each option runs on every path it declares (a representative value), and `generate_stream` refuses the
    options whose paths lack "stream", naming what to do instead."""
    assert set(PATHS) == {"eager", "compiled", "stream", "lookup", "assistant", "controller", "beams"}
    assert all(o.paths <= set(PATHS) and (o.paths == set(PATHS) or o.elsewhere) for o in OPTIONS)
    tokens = torch.tensor([[1, 5, 6, 7]])
    for name in ("return_dict", "top_logprobs", "return_cache", "num_beams", "controller", "compile"):
        value = {"top_logprobs": 2, "num_beams": 2, "controller": lambda view: None}.get(name, True)
        with pytest.raises(TypeError, match=f"does not take `{name}`"):
            model.generate_stream(tokens, max_new_tokens=2, **{name: value})
    assert "stream" in BY_NAME["suppress_tokens"].paths and "stream" not in BY_NAME["num_beams"].paths
