"""Beam search against HF's own beam search: sequences, scores, early stopping, length penalty, beam sampling."""

import pytest
import torch
from conftest import FAMILIES, make_bridge

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]
CASES = [
    dict(num_beams=3, num_return_sequences=2),
    dict(num_beams=4, num_return_sequences=4, length_penalty=0.5, early_stopping=True),
    dict(num_beams=2, length_penalty=2.0, early_stopping="never"),
]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def assert_equals_hf(model, tokens, mask, n, **kw):
    ours = model.generate(tokens, attention_mask=mask, max_new_tokens=n, return_dict=True, **kw)
    hf = model.hf_model.generate(tokens, attention_mask=mask, max_new_tokens=n, do_sample=kw.pop("do_sample", False),
                                 return_dict_in_generate=True, output_scores=True, **kw)  # fmt: skip
    # HF fills a finished beam's tail with EOS (its pad id 0 is falsy); ours holds the pad token.
    real = ours.attention_mask.bool()
    assert ours.sequences.shape == hf.sequences.shape
    assert torch.equal(ours.sequences[real], hf.sequences[real])
    torch.testing.assert_close(ours.sequences_scores, hf.sequences_scores)
    return ours


@pytest.mark.parametrize("case", range(len(CASES)))
def test_beams_equal_hf(model, case):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    assert_equals_hf(model, tokens, mask, 7, **CASES[case])


def test_beams_equal_hf_when_beams_end_at_eos(model):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    greedy = model.generate(tokens, attention_mask=mask, max_new_tokens=6, stop_at_eos=False, return_dict=True)
    eos = greedy.new_tokens[:2, 0].tolist()  # tokens some beams pick first
    # A negative length penalty favours short beams, so beams ending at EOS make it into the results.
    out = assert_equals_hf(model, tokens, mask, 6, num_beams=3, num_return_sequences=3, eos_token_id=eos,
                           length_penalty=-1.0)  # fmt: skip
    for row, reason, n in zip(out.new_tokens, out.finish_reasons, out.new_lengths, strict=True):
        assert reason == ("eos" if row[n - 1].item() in eos else "length")
    assert "eos" in out.finish_reasons


def test_beam_sampling_equals_hf_with_the_same_global_seed():
    model = make_bridge("llama")
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    torch.manual_seed(5)
    hf = model.hf_model.generate(tokens, attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=True,
                                 temperature=0.7, top_k=20)  # fmt: skip
    torch.manual_seed(5)
    ours = model.generate(tokens, attention_mask=mask, max_new_tokens=6, num_beams=3, temperature=0.7, top_k=20)
    assert torch.equal(ours[ours != 0], hf[ours != 0]) and ours.shape == hf.shape


def test_beam_records_and_bad_options():
    model = make_bridge("gpt2")
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=5, num_beams=3, return_dict=True)
    full = model(out.sequences, attention_mask=out.attention_mask).log_softmax(-1)
    expect = full[:, out.prompt_width - 1 : -1].gather(-1, out.new_tokens[..., None])[..., 0]
    torch.testing.assert_close(out.logprobs, expect * out.attention_mask[:, out.prompt_width :], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="`top_logprobs`"):
        model.generate(tokens, max_new_tokens=2, num_beams=2, top_logprobs=2, return_dict=True)
    with pytest.raises(ValueError, match="`num_return_sequences`=3 must be in"):
        model.generate(tokens, max_new_tokens=2, num_beams=2, num_return_sequences=3)


@pytest.mark.real
def test_smollm2_beams_equal_hf(smollm2):
    tokens, mask = smollm2.to_tokens_and_mask(["The capital of France is", "def add(a, b):"], padding_side="left")
    assert_equals_hf(smollm2, tokens, mask, 8, num_beams=3, num_return_sequences=2)
