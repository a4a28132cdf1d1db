"""Records on the row driver (a controller, speculative decoding): a pass-through controller gives exactly the
plain `generate`'s output, records included; after backtrack / fast-forward / fork each token's records equal
a fresh no-KV-cache forward over the final row."""

import pytest
import torch
from conftest import make_bridge, perturb_
from test_control import Script, mixed_script

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]
FAMILIES = ["llama", "gpt2", "gemma3_text"]  # GQA, learned positions, a sliding window
RECORDS = dict(return_dict=True, top_logprobs=3, output_logits=True, output_scores=True)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return perturb_(make_bridge(request.param))


def batch(model):
    return model.to_tokens_and_mask(PROMPTS, padding_side="left")


def assert_same_output(a, b, atol=1e-5):
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.attention_mask, b.attention_mask)
    assert a.finish_reasons == b.finish_reasons
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)
    torch.testing.assert_close(a.top_logprobs, b.top_logprobs, atol=atol, rtol=0)
    assert torch.equal(a.top_tokens, b.top_tokens)
    logits = (torch.stack(x, 1) if isinstance(x, tuple) else x for x in (a.logits, b.logits))
    torch.testing.assert_close(*logits, atol=atol, rtol=0)
    assert len(a.scores) == len(b.scores)
    torch.testing.assert_close(torch.stack(a.scores, 1), torch.stack(b.scores, 1), atol=atol, rtol=0)


OPTIONS = {
    "greedy": dict(),
    "sampling": dict(do_sample=True, seed=3, stop_at_eos=False),
    "top_k_top_p": dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8, seed=5, stop_at_eos=False),
    "repetition_penalty": dict(repetition_penalty=1.5, no_repeat_ngram_size=2),
    "min_new_tokens": dict(min_new_tokens=6),  # with the EOS below: a penalty until 6 tokens
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8]]),
    "stop_strings": dict(),  # the text of a token row 0 generates at its 4th step
    "eos": dict(),  # with the EOS below: rows finish at different steps
    "num_return_sequences": dict(do_sample=True, num_return_sequences=2, seed=1, stop_at_eos=False),
    "hf_layout": dict(return_dict_in_generate=True),
}


def _fourth(model, tokens, mask):
    """The token that row 0 generates at its 4th step: as EOS or a stop string, rows finish at different steps."""
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=12, stop_at_eos=False, return_dict=True)
    return free.new_tokens[0, 3].item()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_pass_through_controller_gives_generate_s_exact_output(model, name):
    tokens, mask = batch(model)
    options = dict(OPTIONS[name])
    if name in ("min_new_tokens", "eos"):
        options["eos_token_id"] = _fourth(model, tokens, mask)
    if name == "stop_strings":
        options["stop_strings"] = [model.tokenizer.decode([_fourth(model, tokens, mask)])]
    kw = dict(attention_mask=mask, max_new_tokens=12, **RECORDS, **options)
    plain = model.generate(tokens, **kw)
    controlled = model.generate(tokens, controller=lambda view: None, **kw)
    assert_same_output(plain, controlled)
    if name == "eos":
        assert "eos" in plain.finish_reasons and "length" in plain.finish_reasons
    if name == "stop_strings":
        assert "stop_string" in plain.finish_reasons
    if not options.get("do_sample"):  # speculation: the same greedy output, records within the chunk's rounding
        for extra in ({}, {"controller": lambda view: None}):
            fast = model.generate(tokens, prompt_lookup_num_tokens=3, **kw, **extra)
            assert_same_output(plain, fast, atol=1e-4)


@pytest.mark.parametrize("k", [None, 3])
def test_records_after_backtrack_ff_fork_equal_a_fresh_forward(model, k):
    """Every generated token's records come from the logits that predicted it, as a fresh forward over the
    final row gives them: backtracked tokens' records left with them, forced tokens' came from the forward that
    fed them, forks kept their parent's."""
    tokens, mask = batch(model)
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=Script(mixed_script()),
                         prompt_lookup_num_tokens=k, **RECORDS)  # fmt: skip
    assert len(out) > 3
    checked = 0
    scores = torch.stack(out.scores, 1)
    for i in range(len(out)):
        real = out.sequences[i][out.attention_mask[i].bool()]
        n, p = int(out.new_lengths[i]), int(out.prompt_lengths[i])
        fresh = model(real[None])[0, p - 1 : p - 1 + n].float()  # the logits that predicted each generated token
        for g in range(n):
            if torch.isnan(out.logprobs[i, g]):  # a forced token the generation ended before feeding
                assert torch.isnan(out.logits[i, g]).all() and (out.top_tokens[i, g] == -1).all()
                continue
            checked += 1
            torch.testing.assert_close(out.logits[i, g], fresh[g], atol=1e-5, rtol=0)
            logp = fresh[g].log_softmax(-1)
            torch.testing.assert_close(out.logprobs[i, g], logp[real[p + g]], atol=1e-5, rtol=0)
            top = logp.topk(3)
            torch.testing.assert_close(out.top_logprobs[i, g], top.values, atol=1e-5, rtol=0)
            finite = scores[i, g].isfinite()  # greedy, no processors: the logits, -inf outside a controller's mask
            torch.testing.assert_close(scores[i, g][finite], fresh[g][finite], atol=1e-5, rtol=0)
            assert finite[real[p + g]]
        assert (out.logits[i, n:] == 0).all() and (out.logprobs[i, n:] == 0).all()
    assert checked > 30


def test_records_need_return_dict_and_a_streamer_is_refused():
    model = make_bridge("llama")
    with pytest.raises(ValueError, match="return_dict=True"):
        model.generate("Hi", max_new_tokens=3, controller=lambda v: None, top_logprobs=2)
    out = model.generate("Hi", max_new_tokens=3, controller=lambda v: None, return_dict=True, top_logprobs=2)
    assert out.top_logprobs.shape == (1, 3, 2) and out.logits is None and out.scores is None
