"""The KV-cached decode loop against independent answers: HF's `generate`, a no-cache recompute, each prompt alone."""

import math

import pytest
import torch
from conftest import FAMILIES, V, make_bridge
from transformers import LogitsProcessorList, StoppingCriteria, SuppressTokensLogitsProcessor, TextStreamer

from transformer_bridge.generation import GenerationOutput
from transformer_bridge.generation.sampling import warp_logits

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def batch(model, prompts=PROMPTS):
    return model.to_tokens_and_mask(prompts, padding_side="left")


def new_tokens(out: GenerationOutput) -> list[list[int]]:
    """Each row's real generated tokens."""
    rows = out.new_tokens.tolist()
    keep = out.attention_mask[:, out.prompt_width :].bool().tolist()
    return [[t for t, k in zip(r, m, strict=True) if k] for r, m in zip(rows, keep, strict=True)]


def hf_greedy(model, tokens, mask, n, **kw):
    return model.hf_model.generate(tokens, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)


# -- exactness -------------------------------------------------------------------------------------
def test_greedy_equals_hf_single_and_left_padded_batch(model):
    tokens, mask = batch(model)
    for t, m in [(tokens[:1], mask[:1]), (tokens, mask)]:
        ours = model.generate(t, attention_mask=m, max_new_tokens=12)
        assert torch.equal(ours, hf_greedy(model, t, m, 12))


def test_greedy_equals_hf_when_rows_stop_at_different_steps(model):
    tokens, mask = batch(model)
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=10, stop_at_eos=False, return_dict=True)
    eos = free.new_tokens[0, 3].item()  # row 0 ends by its 4th token; the others if they reach it
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, return_dict=True)
    assert torch.equal(out.sequences, hf_greedy(model, tokens, mask, 10, eos_token_id=eos))
    n = free.new_tokens[0].tolist().index(eos) + 1
    assert out.finish_reasons[0] == "eos" and out.new_lengths[0] == n
    width = out.prompt_width
    assert (out.sequences[0, width + n :] == model.pad_token_id).all()  # frozen to pad
    assert not out.attention_mask[0, width + n :].any()


def test_each_row_equals_its_prompt_alone(model):
    tokens, mask = batch(model)
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=8, return_dict=True)
    for i, prompt in enumerate(PROMPTS):
        alone = model.generate(prompt, max_new_tokens=8, return_dict=True)
        assert new_tokens(alone)[0] == new_tokens(out)[i]


def test_cached_logits_equal_no_cache_recompute(model):
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=8, return_dict=True, output_logits=True)
    cached = model.generate(tokens, **kw)
    full = model.generate(tokens, use_cache=False, **kw)
    assert torch.equal(cached.sequences, full.sequences)
    torch.testing.assert_close(cached.logits, full.logits, atol=1e-4, rtol=0)


def test_sampled_tokens_equal_hf_with_the_same_global_seed(model):
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9)
    torch.manual_seed(123)
    hf = model.hf_model.generate(tokens, do_sample=True, **kw)
    torch.manual_seed(123)
    assert torch.equal(model.generate(tokens, **kw), hf)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(repetition_penalty=1.5, no_repeat_ngram_size=2),
        dict(bad_words_ids=[[5], [7, 9]], min_new_tokens=6),
        dict(logits_processor=LogitsProcessorList([SuppressTokensLogitsProcessor([3, 4, 5])])),
    ],
)
def test_processors_equal_hf(kwargs):
    model = make_bridge("qwen2")
    tokens, mask = batch(model)
    ours = model.generate(tokens, attention_mask=mask, max_new_tokens=10, **kwargs)
    assert torch.equal(ours, hf_greedy(model, tokens, mask, 10, **kwargs))


def test_penalties_never_see_left_padding():
    model = make_bridge("llama")
    pad = model.pad_token_id
    # The pad token is made the favourite: a penalty that counted left padding would ban it in padded rows only.
    kw = dict(max_new_tokens=6, logit_bias={pad: 5.0}, no_repeat_ngram_size=1, repetition_penalty=1.5,
              frequency_penalty=0.5, presence_penalty=0.5, return_dict=True)  # fmt: skip
    out = model.generate(PROMPTS, **kw)
    assert [row[0] for row in new_tokens(out)] == [pad] * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        assert new_tokens(model.generate(prompt, **kw))[0] == new_tokens(out)[i]


# -- sampling --------------------------------------------------------------------------------------
def test_same_seed_same_samples_and_global_rng_untouched():
    model = make_bridge("llama")
    tokens, mask = batch(model)
    state = torch.get_rng_state()
    a = model.generate(tokens, attention_mask=mask, max_new_tokens=10, temperature=1.0, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    b = model.generate(tokens, attention_mask=mask, max_new_tokens=10, temperature=1.0, seed=7)
    c = model.generate(tokens, attention_mask=mask, max_new_tokens=10, temperature=1.0, seed=8)
    g = torch.Generator().manual_seed(7)
    d = model.generate(tokens, attention_mask=mask, max_new_tokens=10, temperature=1.0, generator=g)
    assert torch.equal(a, b) and torch.equal(a, d) and not torch.equal(a, c)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.5, top_k=0), dict(top_k=6), dict(top_p=0.3, top_k=0),
                                    dict(min_p=0.9, temperature=3.0, top_k=0)])  # fmt: skip
def test_first_token_frequencies_follow_the_warped_distribution(kwargs):
    model = make_bridge("gpt2")
    prompt = torch.tensor([[1, 40, 50]])
    logits = model(prompt)[0, -1]
    # Sharpen the tiny model's flat distribution so truncation and temperature visibly matter.
    bias = {i: float(3 * torch.randn(1, generator=torch.Generator().manual_seed(i))) for i in range(V)}
    probs = warp_logits((logits + torch.tensor(list(bias.values())))[None], **kwargs).softmax(-1)[0]
    n = 4000
    out = model.generate(prompt, max_new_tokens=1, num_return_sequences=n, logit_bias=bias, seed=0, **kwargs)
    freq = torch.bincount(out[:, -1], minlength=V).float() / n
    assert (freq[probs == 0] == 0).all()  # truncated tokens are never drawn
    assert (freq - probs).abs().max() < 4 * math.sqrt(0.25 / n)


def test_temperature_zero_is_greedy():
    model = make_bridge("mistral")
    tokens, mask = batch(model)
    greedy = model.generate(tokens, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(model.generate(tokens, attention_mask=mask, max_new_tokens=8, temperature=0.0), greedy)
    assert torch.equal(model.generate(tokens, attention_mask=mask, max_new_tokens=8, do_sample=True,
                                      temperature=0.0), greedy)  # fmt: skip


def test_sampling_arguments_with_do_sample_false_warn_at_the_call_site():
    model = make_bridge("llama")
    with pytest.warns(UserWarning, match="`do_sample=False`") as caught:
        model.generate(torch.tensor([[1, 5]]), max_new_tokens=2, do_sample=False, temperature=0.5)
    assert caught[0].filename == __file__


# -- stopping and records --------------------------------------------------------------------------
def test_eos_list_stop_strings_criteria_and_max_time():
    model = make_bridge("llama")
    tokens, mask = batch(model)
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=10, stop_at_eos=False, return_dict=True)
    first, second = free.new_tokens[0, 2].item(), free.new_tokens[1, 5].item()
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=10, eos_token_id=[first, second],
                         return_dict=True)  # fmt: skip
    assert out.finish_reasons[0] == "eos" and out.new_lengths[0] <= 3

    text = model.to_string(free.new_tokens[2, 3:5])
    out = model.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, stop_strings=[text], return_dict=True)
    assert out.finish_reasons[2] == "stop_string" and out.new_lengths[2] <= 5
    assert text in out.text[2][len(PROMPTS[2]) :]

    class AtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= out.prompt_width + 4)

    out = model.generate(tokens, attention_mask=mask, max_new_tokens=10, stop_at_eos=False,
                         stopping_criteria=[AtLength()], return_dict=True)  # fmt: skip
    assert out.finish_reasons == ["stopping_criteria"] * 3 and out.new_tokens.shape[1] == 4
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=10, max_time=1e-9, return_dict=True)
    assert out.finish_reasons == ["max_time"] * 3 and out.new_tokens.shape[1] == 1
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=10, stop_at_eos=False, return_dict=True)
    assert out.finish_reasons == ["length"] * 3


def test_records_logprobs_top_logprobs_and_logits():
    model = make_bridge("phi3")
    tokens, mask = batch(model)
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=6, return_dict=True, top_logprobs=3,
                         output_logits=True)  # fmt: skip
    full = model(out.sequences, attention_mask=out.attention_mask).float().log_softmax(-1)
    expect = full[:, out.prompt_width - 1 : -1].gather(-1, out.new_tokens[..., None])[..., 0]
    torch.testing.assert_close(out.logprobs, expect * out.attention_mask[:, out.prompt_width :], atol=1e-4, rtol=0)
    assert torch.equal(out.top_tokens[..., 0], out.new_tokens)  # greedy picks the best
    torch.testing.assert_close(out.top_logprobs[..., 0], out.logprobs)
    torch.testing.assert_close(out.logits.log_softmax(-1).gather(-1, out.new_tokens[..., None])[..., 0], out.logprobs)
    assert model.generate(tokens, max_new_tokens=2, return_dict=True).top_logprobs is None


# -- returns and options ---------------------------------------------------------------------------
def test_return_types_follow_the_input():
    model = make_bridge("gpt_neox")
    text = model.generate("Hello", max_new_tokens=4)
    assert isinstance(text, str) and text.startswith("Hello")
    texts = model.generate(PROMPTS, max_new_tokens=4)
    assert isinstance(texts, list) and [t[: len(p)] for t, p in zip(texts, PROMPTS, strict=True)] == PROMPTS
    tokens, _ = model.to_tokens_and_mask("Hello", padding_side="left")
    out = model.generate(tokens, max_new_tokens=4, stop_at_eos=False)
    assert isinstance(out, torch.Tensor) and out.shape == (1, tokens.shape[1] + 4)
    assert torch.equal(model.generate(tokens[0], max_new_tokens=4, stop_at_eos=False), out)
    assert isinstance(model.generate(tokens, max_new_tokens=4, return_type="str"), list)
    assert isinstance(model.generate("Hello", max_new_tokens=4, return_type="tokens"), torch.Tensor)
    assert len(model.generate("Hello", max_new_tokens=4, num_return_sequences=3, temperature=1.0, seed=0)) == 3


def test_text_streamer_and_progress_bar(capsys):
    model = make_bridge("llama")
    streamer = TextStreamer(model.tokenizer, skip_special_tokens=True)
    text = model.generate("Hello", max_new_tokens=5, streamer=streamer, verbose=True)
    assert capsys.readouterr().out.strip() == text.strip()


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=200), "max_new_tokens"),
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
        (dict(num_return_sequences=0), "num_return_sequences"),
        (dict(eos_token_id=-1), "eos_token_id"),
        (dict(pad_token_id=-1), "pad_token_id"),
        (dict(logit_bias={V + 3: 1.0}), "logit_bias"),
        (dict(top_logprobs=-2), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),  # without return_dict
        (dict(max_time=0), "max_time"),
        (dict(seed=1, generator=torch.Generator()), "seed"),
        (dict(names_filter="resid_post"), "names_filter"),
        (dict(return_type="text"), "return_type"),
    ],
)
def test_bad_arguments_raise_before_any_forward(kwargs, name):
    model = make_bridge("llama")
    calls = []
    model.hf_model.register_forward_hook(lambda *a: calls.append(1))
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=f"`{name}`"):
        model.generate(torch.tensor([[1, 5, 6]]), **kwargs)
    assert calls == []


def test_an_eos_id_past_the_vocabulary_is_accepted_and_never_stops_a_row():
    """HF's generate accepts an EOS id the model cannot produce (TransformerLens tests pass GPT-2's 50256 to tiny
    models); the rows run to ``max_new_tokens``, token for token HF's."""
    model = make_bridge("llama")
    prompt = torch.tensor([[1, 5, 6, 7]])
    for stop in (True, False):
        out = model.generate(prompt, max_new_tokens=6, eos_token_id=V + 100, stop_at_eos=stop)
        assert out.shape == (1, 10)
        assert torch.equal(
            out, model.hf_model.generate(prompt, max_new_tokens=6, eos_token_id=V + 100, do_sample=False)
        )


def test_token_ids_outside_the_vocabulary_raise():
    model = make_bridge("llama")
    with pytest.raises(ValueError, match=r"`input`.*\[0, 98\]"):
        model.generate(torch.tensor([[1, V]]), max_new_tokens=2)


# -- the real model --------------------------------------------------------------------------------
@pytest.mark.real
def test_smollm2_greedy_equals_hf_single_and_batched(smollm2):
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    tokens, mask = smollm2.to_tokens_and_mask(prompts, padding_side="left")
    for t, m in [(tokens[:1, -6:], mask[:1, -6:]), (tokens, mask)]:
        assert torch.equal(smollm2.generate(t, attention_mask=m, max_new_tokens=12), hf_greedy(smollm2, t, m, 12))
