"""Every bad input to `generate` raises the builtin a user would catch, with a message naming the parameter
and the value, and leaves the model clean; records grow with the steps actually run."""

import doctest
import math
import warnings

import numpy as np
import pytest
import torch
from _clean import assert_clean
from conftest import V, make_bridge

from transformer_bridge import checks
from transformer_bridge.generation import decode

PROMPT = torch.tensor([[1, 5, 17, 42]])


def gen(**kwargs):
    """A call of `generate` on ``PROMPT`` with ``kwargs`` (3 new tokens unless given)."""
    return lambda m: m.generate(PROMPT, **{"max_new_tokens": 3, **kwargs})


class PutOnly:
    def put(self, tokens): ...


def eos_bias(m):
    return {m.hf_model.config.eos_token_id: 50.0}


CASES = [
    # seeds and random sources
    ("seed_2**64", gen(seed=2**64), ValueError, r"`seed`.*18446744073709551616"),
    ("seed_negative", gen(seed=-1), ValueError, r"`seed`.*\[0, 18446744073709551615\].*got -1"),
    ("seed_float", gen(seed=1.5), TypeError, r"`seed`.*got 1\.5"),
    ("seed_bool", gen(seed=True), TypeError, r"`seed`.*got True"),
    ("seed_and_generator", gen(seed=1, generator=torch.Generator()), ValueError, r"`seed`.*`generator`"),
    ("generator_str", gen(generator="x"), TypeError, r"`generator`.*'x'"),
    # streamer
    ("streamer_str", gen(streamer="x"), TypeError, r"`streamer`.*'x'.*\['put', 'end'\]"),
    ("streamer_without_end", gen(streamer=PutOnly()), TypeError, r"`streamer`.*PutOnly.*\['end'\]"),
    # stopping criteria: the list, then each criterion's answer at the first step
    ("criteria_not_callable", gen(stopping_criteria=5), TypeError, r"`stopping_criteria` must be a Stopping.*got 5"),
    ("criteria_entry_int", gen(stopping_criteria=[5]), TypeError, r"`stopping_criteria`\[0\].*got 5"),
    ("criterion_wrong_shape", gen(stopping_criteria=[lambda i, s: torch.zeros(3, dtype=torch.bool)]),
     ValueError, r"`stopping_criteria`\[0\].*shape.*\[1\].*\(3,\)"),
    ("criterion_returns_str", gen(stopping_criteria=[lambda i, s: "yes"]), TypeError,
     r"`stopping_criteria`\[0\].*got 'yes'"),
    ("criterion_returns_none", gen(stopping_criteria=[lambda i, s: None]), TypeError,
     r"`stopping_criteria`\[0\].*got None"),
    ("criterion_returns_float", gen(stopping_criteria=[lambda i, s: torch.zeros(1)]), TypeError,
     r"`stopping_criteria`\[0\].*float32"),
    # logits processors: the list, then each processor's output at the first step
    ("processor_bare_callable", gen(logits_processor=lambda i, s: s), TypeError, r"`logits_processor`.*Wrap"),
    ("processor_entry_int", gen(logits_processor=[7]), TypeError, r"`logits_processor`\[0\].*got 7"),
    ("processor_returns_none", gen(logits_processor=[lambda i, s: None]), TypeError,
     r"`logits_processor`\[0\] \(<lambda>\).*got None"),
    ("processor_returns_list", gen(logits_processor=[lambda i, s: s.tolist()]), TypeError,
     r"`logits_processor`\[0\].*\(list\)"),
    ("processor_narrows_vocab", gen(logits_processor=[lambda i, s: s[:, :50]]), ValueError,
     rf"`logits_processor`\[0\].*\(1, {V}\).*\(1, 50\)"),
    ("processor_returns_ints", gen(logits_processor=[lambda i, s: s.long()]), TypeError,
     r"`logits_processor`\[0\].*int64"),
    # lengths and counts
    ("max_new_tokens_0", gen(max_new_tokens=0), ValueError, r"`max_new_tokens`.*>= 1, got 0"),
    ("max_new_tokens_negative", gen(max_new_tokens=-2), ValueError, r"`max_new_tokens`.*got -2"),
    ("max_new_tokens_float", gen(max_new_tokens=2.5), TypeError, r"`max_new_tokens`.*got 2\.5"),
    ("max_new_tokens_bool", gen(max_new_tokens=True), TypeError, r"`max_new_tokens`.*got True"),
    ("max_new_tokens_past_context", gen(max_new_tokens=1000), ValueError, r"`max_new_tokens`=1000.*context"),
    ("num_return_sequences_0", gen(num_return_sequences=0), ValueError, r"`num_return_sequences`.*got 0"),
    ("num_return_sequences_float", gen(num_return_sequences=2.0, temperature=1.0), TypeError,
     r"`num_return_sequences`.*got 2\.0"),
    ("num_return_sequences_greedy", gen(num_return_sequences=2), ValueError, r"`num_return_sequences`=2.*identical"),
    ("num_return_sequences_over_beams", gen(num_beams=2, num_return_sequences=3), ValueError,
     r"`num_return_sequences`=3.*`num_beams`=2"),
    ("num_beams_0", gen(num_beams=0), ValueError, r"`num_beams`.*got 0"),
    ("num_beams_str", gen(num_beams="2"), TypeError, r"`num_beams`.*got '2'"),
    ("top_logprobs_negative", gen(top_logprobs=-1, return_dict=True), ValueError, r"`top_logprobs`.*got -1"),
    ("top_logprobs_past_vocab", gen(top_logprobs=V + 1, return_dict=True), ValueError, rf"`top_logprobs`.*got {V + 1}"),
    ("top_logprobs_without_return_dict", gen(top_logprobs=2), ValueError, r"`top_logprobs`.*`return_dict=True`"),
    ("output_logits_with_beams", gen(output_logits=True, return_dict=True, num_beams=2), ValueError,
     r"`output_logits`.*`num_beams=1`"),
    ("min_new_tokens_negative", gen(min_new_tokens=-1), ValueError, r"`min_new_tokens`.*got -1"),
    ("min_new_tokens_over_max", gen(min_new_tokens=5, max_new_tokens=3), ValueError,
     r"`min_new_tokens`=5.*`max_new_tokens`=3"),
    ("min_length_over_max_length", gen(min_length=9, max_length=7, max_new_tokens=None), ValueError,
     r"`min_new_tokens`=5.*`max_new_tokens`=3"),
    ("return_dict_with_str", gen(return_dict=True, return_type="str"), ValueError,
     r"`return_dict=True`.*`return_type`='str'"),
    ("return_dict_in_generate_with_tokens", gen(return_dict_in_generate=True, return_type="tokens"), ValueError,
     r"`return_dict_in_generate=True`.*`return_type`='tokens'"),
    # sampling warpers
    ("temperature_negative", gen(temperature=-1.0), ValueError, r"`temperature`.*got -1\.0"),
    ("temperature_nan", gen(temperature=math.nan), ValueError, r"`temperature`.*got nan"),
    ("temperature_str", gen(temperature="hot"), TypeError, r"`temperature`.*got 'hot'"),
    ("top_p_0", gen(top_p=0.0), ValueError, r"`top_p`.*\(0, 1\].*got 0\.0"),
    ("top_p_above_1", gen(top_p=1.5), ValueError, r"`top_p`.*got 1\.5"),
    ("top_k_negative", gen(top_k=-1), ValueError, r"`top_k`.*got -1"),
    ("top_k_float", gen(top_k=2.5), TypeError, r"`top_k`.*got 2\.5"),
    ("min_p_above_1", gen(min_p=2.0), ValueError, r"`min_p`.*got 2\.0"),
    ("typical_p_0", gen(typical_p=0.0), ValueError, r"`typical_p`.*got 0\.0"),
    ("do_sample_str", gen(do_sample="yes"), TypeError, r"`do_sample`.*True or False.*'yes'"),
    # processors' own arguments
    ("repetition_penalty_0", gen(repetition_penalty=0.0), ValueError, r"`repetition_penalty`.*got 0\.0"),
    ("repetition_penalty_str", gen(repetition_penalty="x"), TypeError, r"`repetition_penalty`.*got 'x'"),
    ("frequency_penalty_inf", gen(frequency_penalty=math.inf), ValueError, r"`frequency_penalty`.*got inf"),
    ("logit_bias_past_vocab", gen(logit_bias={V: 1.0}), ValueError, rf"`logit_bias`.*got {V}"),
    ("logit_bias_plus_inf", gen(logit_bias={3: math.inf}), ValueError, r"`logit_bias`.*got inf"),
    ("logit_bias_list", gen(logit_bias=[(1, 2.0)]), TypeError, r"`logit_bias`.*\[\(1, 2\.0\)\]"),
    ("bad_words_past_vocab", gen(bad_words_ids=[[V]]), ValueError, rf"`bad_words_ids`.*got {V}"),
    ("bad_words_int", gen(bad_words_ids=5), TypeError, r"`bad_words_ids`.*got 5"),
    ("no_repeat_ngram_negative", gen(no_repeat_ngram_size=-1), ValueError, r"`no_repeat_ngram_size`.*got -1"),
    # token ids
    ("eos_negative", gen(eos_token_id=-1), ValueError, r"`eos_token_id`.*>= 0, got -1"),
    ("eos_str", gen(eos_token_id="</s>"), TypeError, r"`eos_token_id`.*'</s>'"),
    ("eos_list_negative", gen(eos_token_id=[2, -3], stop_at_eos=False), ValueError, r"`eos_token_id`.*got -3"),
    ("pad_past_vocab", gen(pad_token_id=V), ValueError, rf"`pad_token_id`.*got {V}"),
    ("pad_negative", gen(pad_token_id=-1), ValueError, r"`pad_token_id`.*got -1"),
    # stopping
    ("stop_strings_int", gen(stop_strings=5), TypeError, r"`stop_strings`.*got 5"),
    ("stop_strings_list_of_int", gen(stop_strings=[5]), TypeError, r"`stop_strings`.*\[5\]"),
    ("stop_strings_empty_string", gen(stop_strings=["a", ""]), ValueError, r"`stop_strings`.*\['a', ''\]"),
    ("max_time_0", gen(max_time=0), ValueError, r"`max_time`.*got 0"),
    ("max_time_nan", gen(max_time=math.nan), ValueError, r"`max_time`.*got nan"),
    ("max_time_str", gen(max_time="1s"), TypeError, r"`max_time`.*got '1s'"),
    ("stop_at_eos_str", gen(stop_at_eos="no"), TypeError, r"`stop_at_eos`.*'no'"),
    # beam options
    ("length_penalty_nan", gen(num_beams=2, length_penalty=math.nan), ValueError, r"`length_penalty`.*got nan"),
    ("early_stopping_str", gen(num_beams=2, early_stopping="sometimes"), ValueError,
     r"`early_stopping`.*got 'sometimes'"),
    # returns and flags
    ("return_type_unknown", gen(return_type="text"), ValueError, r"`return_type`.*got 'text'"),
    ("return_type_list", gen(return_type=["str"]), ValueError, r"`return_type`.*\['str'\]"),
    ("return_dict_str", gen(return_dict="yes"), TypeError, r"`return_dict`.*'yes'"),
    ("return_cache_int", gen(return_cache=1), TypeError, r"`return_cache`.*got 1"),
    ("output_logits_str", gen(output_logits="yes", return_dict=True), TypeError, r"`output_logits`.*'yes'"),
    ("use_cache_str", gen(use_cache="yes"), TypeError, r"`use_cache`.*'yes'"),
    ("verbose_int", gen(verbose=2), TypeError, r"`verbose`.*got 2"),
    ("prepend_bos_str", lambda m: m.generate("Hi", max_new_tokens=2, prepend_bos="x"), TypeError,
     r"`prepend_bos`.*'x'"),
    ("names_filter_int", gen(return_cache=True, names_filter=5), TypeError, r"`names_filter`.*5"),
    ("names_filter_without_cache", gen(names_filter="resid_post"), ValueError, r"`names_filter`.*`return_cache=True`"),
    ("device_unknown", gen(return_cache=True, device="gpu9"), ValueError, r"`device`='gpu9'"),
    # the mask (checked by `prepare_input`; generation needs left padding)
    ("mask_all_padding", gen(attention_mask=torch.tensor([[0, 0, 0, 0]])), ValueError,
     r"`attention_mask` row 0 is all padding"),
    ("mask_not_binary", gen(attention_mask=torch.tensor([[2, 1, 1, 1]])), ValueError, r"`attention_mask`.*2"),
    # unknown keywords name the closest valid one
    ("keyword_max_new_token", gen(max_new_token=3), TypeError, r"\['max_new_token'\].*Did you mean 'max_new_tokens'"),
    ("keyword_temprature", gen(temprature=0.5), TypeError, r"\['temprature'\].*Did you mean 'temperature'"),
    ("keyword_eos_id", gen(eos_id=2), TypeError, r"\['eos_id'\].*Did you mean 'eos_token_id'"),
]  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return make_bridge(request.param)


@pytest.mark.parametrize(("call", "error", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_parameter_and_leaves_the_model_clean(model, call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(model)
    assert_clean(model)


def test_the_table_has_at_least_60_distinct_rows():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


def test_type_errors_are_value_errors_too():
    """`ArgumentTypeError` is both, so code written against the old ``ValueError`` keeps working."""
    model = make_bridge("llama")
    with pytest.raises(ValueError, match="`top_k`") as info:
        model.generate(PROMPT, max_new_tokens=2, top_k=2.5)
    assert isinstance(info.value, TypeError) and isinstance(info.value, checks.ArgumentTypeError)


def test_numpy_integers_are_accepted_as_ints():
    model = make_bridge("llama")
    plain = model.generate(PROMPT, max_new_tokens=3, top_k=5, seed=3, eos_token_id=2, pad_token_id=0)
    numpy = model.generate(PROMPT, max_new_tokens=np.int64(3), top_k=np.int64(5), seed=np.int64(3),
                           eos_token_id=np.int64(2), pad_token_id=np.int32(0))  # fmt: skip
    assert torch.equal(plain, numpy)


def test_valid_criteria_and_processors_still_work():
    """Bools, 0-d, [1] and [batch] bool tensors are valid answers; a float64 processor output is valid."""
    model = make_bridge("llama")
    tokens = PROMPT.repeat(2, 1)
    for answer in (False, torch.tensor(False), torch.tensor([False]), torch.zeros(2, dtype=torch.bool)):
        out = model.generate(tokens, max_new_tokens=3, stop_at_eos=False, stopping_criteria=[lambda i, s, a=answer: a])
        assert out.shape == (2, 7)
    out = model.generate(tokens, max_new_tokens=3, logits_processor=[lambda i, s: s.double()])
    assert torch.equal(out, model.generate(tokens, max_new_tokens=3))


def test_checks_docstring_examples_run():
    assert doctest.testmod(checks).failed == 0


# -- records grow with the steps run -----------------------------------------------------------------
def _stops_at_step_3(model, max_new_tokens, **kwargs):
    """EOS is banned for 3 steps, then heavily favoured: every row ends at its 4th token."""
    return model.generate(PROMPT.repeat(2, 1), max_new_tokens=max_new_tokens, min_new_tokens=3,
                          logit_bias=eos_bias(model), return_dict=True, **kwargs)  # fmt: skip


def test_records_hold_the_steps_run_not_max_new_tokens(monkeypatch):
    model = make_bridge("llama")
    stored = []

    class Spy(decode._Records):
        def finish(self, out):
            tensors = self.logprobs + self.top_values + self.top_ids + self.logits
            stored.append((len(self.logits), sum(t.untyped_storage().nbytes() for t in tensors)))
            return super().finish(out)

    monkeypatch.setattr(decode, "_Records", Spy)
    longest = model.cfg.n_ctx - PROMPT.shape[1]
    short = _stops_at_step_3(model, 10, output_logits=True, top_logprobs=5)
    long = _stops_at_step_3(model, longest, output_logits=True, top_logprobs=5)
    assert short.finish_reasons == long.finish_reasons == ["eos", "eos"]
    assert stored[0] == stored[1] and stored[0][0] == 4  # 4 steps held, whatever max_new_tokens
    assert stored[1][1] <= 4 * 2 * (V + 1 + 5 + 5) * 8  # logits, logprob, top-5 values and ids per row and step
    assert long.logits.shape == (2, 4, V) and long.top_tokens.shape == (2, 4, 5) and long.logprobs.shape == (2, 4)


def test_records_of_an_early_stop_equal_those_of_a_run_that_ends_there():
    model = make_bridge("gpt2")
    early = _stops_at_step_3(model, 20, output_logits=True, top_logprobs=3)
    exact = _stops_at_step_3(model, 4, output_logits=True, top_logprobs=3)
    assert early.logits.shape == (2, 4, V) and early.new_tokens.shape == (2, 4)
    for name in ("logits", "logprobs", "top_logprobs", "top_tokens"):
        assert torch.equal(getattr(early, name), getattr(exact, name)), name
    raw = model(early.sequences[:, :-1])[:, PROMPT.shape[1] - 1 :]  # the logits that chose each new token
    torch.testing.assert_close(early.logits, raw)
    torch.testing.assert_close(early.logprobs, raw.log_softmax(-1).gather(-1, early.new_tokens[..., None])[..., 0])


RIGHT_PADDED = torch.tensor([[1, 5, 6, 7], [1, 5, 0, 0]])


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_right_padded_ids_without_a_mask_get_hf_generates_warning_and_keep_their_meaning(pad_is_eos):
    model = make_bridge("llama")
    tokens = RIGHT_PADDED if not pad_is_eos else RIGHT_PADDED.where(RIGHT_PADDED != 0, 2)
    ids = {"pad_token_id": 2, "eos_token_id": 2} if pad_is_eos else {}
    meaning = r"continue after their padding" if pad_is_eos else r"as padding"
    with pytest.warns(UserWarning, match=rf"Rows \[1\].*pad id.*no `attention_mask`.*{meaning}.*to_tokens_and_mask"):
        out = model.generate(tokens, max_new_tokens=3, **ids)
    # What the ids mean does not change: HF's mask for bare ids (every id real when the pad id is an EOS id).
    hf_mask = torch.ones_like(tokens) if pad_is_eos else (tokens != 0).long()
    torch.testing.assert_close(out, model.generate(tokens, attention_mask=hf_mask, max_new_tokens=3, **ids))


def test_no_padding_warning_for_a_mask_one_row_or_rows_that_all_end_alike():
    model = make_bridge("llama")
    model._warned_greedy = True  # TransformerLens' sampling default: tests/compat/test_tl_warnings.py
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(RIGHT_PADDED, attention_mask=(RIGHT_PADDED != 0).long(), max_new_tokens=2)
        model.generate(RIGHT_PADDED[1:], max_new_tokens=2)
        model.generate(torch.tensor([[1, 5, 6, 0], [1, 5, 0, 0]]), max_new_tokens=2)  # all end in it: not padding


def test_smollm2_batch_from_to_tokens_warns(smollm2):
    tokens = smollm2.to_tokens(["The capital of France is", "Hi"])
    with pytest.warns(UserWarning, match=r"Rows \[1\] .*continue after their padding") as record:
        smollm2.generate(tokens, max_new_tokens=1)
    assert record[0].filename == __file__
