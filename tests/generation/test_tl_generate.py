"""TransformerLens' generate extras: ``return_input_tokens``, a bare ``StoppingCriteria``, generating from
embeddings (HF's ``inputs_embeds``) and ``return_type="embeds"``, and ``hf_generate`` (HF's own loop, hooks on).
Oracles: HF's ``generate`` on the same inputs; `to_tokens`; the model's input embeddings."""

import pytest
import torch
from conftest import make_bridge
from transformers import StoppingCriteria, StoppingCriteriaList

FAMILIES = ["llama", "gpt2", "qwen3"]


pytestmark = pytest.mark.filterwarnings("ignore:Passing `.*` with `inputs_embeds`:UserWarning")  # HF's, as it says


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def test_return_input_tokens_gives_what_the_model_was_fed(model):
    text, fed = model.generate("Hello", max_new_tokens=3, return_input_tokens=True)
    assert text == model.generate("Hello", max_new_tokens=3) and torch.equal(fed, model.to_tokens("Hello"))
    _, fed = model.generate(["Hi", "Hello there"], max_new_tokens=3, return_input_tokens=True)
    assert torch.equal(fed, model.to_tokens_and_mask(["Hi", "Hello there"], padding_side="left")[0])
    out, cache, fed = model.generate("Hi", max_new_tokens=3, return_cache=True, return_input_tokens=True,
                                     names_filter="resid_post")  # fmt: skip
    assert isinstance(out, str) and "blocks.0.hook_resid_post" in cache and torch.equal(fed, model.to_tokens("Hi"))
    with pytest.raises(ValueError, match="`return_input_tokens` must be True or False"):
        model.generate("Hi", max_new_tokens=1, return_input_tokens="yes")


class StopAfter(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_a_bare_stopping_criterion_is_taken_as_a_list_of_one(model):
    tokens = torch.tensor([[1, 5, 6, 7]])
    bare = model.generate(tokens, max_new_tokens=8, stopping_criteria=StopAfter(7), stop_at_eos=False)
    listed = model.generate(tokens, max_new_tokens=8, stopping_criteria=StoppingCriteriaList([StopAfter(7)]),
                            stop_at_eos=False)  # fmt: skip
    assert torch.equal(bare, listed) and bare.shape[1] == 7


def _embeds(model, tokens):
    return model.hf_model.get_input_embeddings()(tokens).detach()


def test_rows_stopping_apart_need_a_pad_id_and_never_get_token_0():
    """A batch whose rows stop at different steps fills finished rows with a pad id; a model with none anywhere is
    refused (TransformerLens refuses too), not filled with token 0; with `pad_token_id=` the rows are HF's."""
    model = make_bridge("llama")
    model.tokenizer = None
    for config in (model.hf_model.generation_config, model.hf_model.config):
        config.pad_token_id = config.eos_token_id = None

    class FirstRowAt5(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return (torch.arange(input_ids.shape[0]) == 0) & (input_ids.shape[1] >= 5)

    prompts = torch.tensor([[1, 5, 6], [1, 7, 8]])
    with pytest.raises(ValueError, match=r"padding token.*Pass `pad_token_id=`"):
        model.generate(prompts, max_new_tokens=5, stopping_criteria=FirstRowAt5())
    with pytest.raises(ValueError, match="padding token"):
        model.generate(prompts, max_new_tokens=5, stop_strings=["x"], tokenizer=make_bridge("llama").tokenizer)
    out = model.generate(prompts, max_new_tokens=5, stopping_criteria=FirstRowAt5(), pad_token_id=3)
    hf = model.hf_model.generate(prompts, max_new_tokens=5, do_sample=False)
    assert torch.equal(out[1], hf[1]) and torch.equal(out[0, :5], hf[0, :5]) and out[0, 5:].tolist() == [3, 3, 3]
    one = model.generate(prompts[:1], max_new_tokens=5, stopping_criteria=FirstRowAt5())  # one row: nothing to fill
    assert torch.equal(one, hf[:1, :5])


def test_generating_from_embeddings_equals_hf_inputs_embeds(model):
    tokens, mask = model.to_tokens_and_mask(["Hi", "Hello there"], padding_side="left")
    embeds = _embeds(model, tokens)
    ours = model.generate(embeds, attention_mask=mask, max_new_tokens=6, return_type="tokens", stop_at_eos=False)
    hf = model.hf_model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                 pad_token_id=model.pad_token_id, eos_token_id=None)  # fmt: skip
    assert torch.equal(ours, hf)
    # Processors see the generated tokens only, as in HF. (Unpadded rows: with left padding HF's repetition penalty
    # skips as many *generated* tokens as the row has padding columns, its `prompt_ignore_length` meant for ids.)
    embeds = _embeds(model, torch.tensor([[1, 5, 6, 7], [1, 8, 9, 10]]))
    ours = model.generate(embeds, max_new_tokens=6, return_type="tokens", stop_at_eos=False,
                          repetition_penalty=1.5, no_repeat_ngram_size=2)  # fmt: skip
    hf = model.hf_model.generate(inputs_embeds=embeds, max_new_tokens=6, do_sample=False,
                                 pad_token_id=model.pad_token_id, eos_token_id=None, repetition_penalty=1.5,
                                 no_repeat_ngram_size=2)  # fmt: skip
    assert torch.equal(ours, hf)
    embeds = _embeds(model, tokens)
    # Embeddings in → embeddings out (the prompt's as given, then the new tokens'); "str" decodes the new tokens.
    out = model.generate(embeds, attention_mask=mask, max_new_tokens=4, stop_at_eos=False)
    new = model.generate(embeds, attention_mask=mask, max_new_tokens=4, stop_at_eos=False, return_type="tokens")
    assert torch.equal(out[:, : embeds.shape[1]], embeds) and torch.equal(
        out[:, embeds.shape[1] :], _embeds(model, new)
    )
    texts = model.generate(embeds, attention_mask=mask, max_new_tokens=4, stop_at_eos=False, return_type="str")
    assert texts == [model.tokenizer.decode(row) for row in new]


def test_return_type_embeds_round_trips(model):
    tokens = torch.tensor([[1, 5, 6, 7]])
    embeds = model.generate(tokens, max_new_tokens=3, stop_at_eos=False, return_type="embeds")
    sequence = model.generate(tokens, max_new_tokens=3, stop_at_eos=False)
    assert torch.equal(embeds, _embeds(model, sequence))
    more = model.generate(embeds, max_new_tokens=2, stop_at_eos=False, return_type="tokens")
    assert torch.equal(more, model.generate(sequence, max_new_tokens=2, stop_at_eos=False)[:, sequence.shape[1] :])


def test_embeddings_refuse_what_needs_token_ids(model):
    embeds = _embeds(model, torch.tensor([[1, 5, 6]]))
    for kw, name in [({"num_beams": 2}, "num_beams"), ({"controller": lambda view: None}, "controller"),
                     ({"prompt_lookup_num_tokens": 2}, "prompt_lookup_num_tokens"),
                     ({"return_cache": True}, "return_cache"), ({"use_cache": False}, "use_cache")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"`{name}`=.*cannot be combined with a prompt given as embeddings"):
            model.generate(embeds, max_new_tokens=2, **kw)
    with pytest.raises(ValueError, match=r"embeddings \[batch, pos, d_model=32\], got shape \(1, 3, 5\)"):
        model.generate(torch.zeros(1, 3, 5), max_new_tokens=2)
    with pytest.raises(ValueError, match="`generate_stream` takes token ids or text"):
        model.generate_stream(embeds, max_new_tokens=2)


def test_hf_generate_is_hf_s_loop_with_tl_s_signature_and_the_hooks_on(model):
    tokens = torch.tensor([[1, 5, 6, 7]])
    greedy = model.hf_generate(tokens, max_new_tokens=5, do_sample=False)
    assert torch.equal(greedy, model.hf_model.generate(tokens, max_new_tokens=5, do_sample=False,
                                                      pad_token_id=model.pad_token_id))  # fmt: skip
    assert model.hf_generate("Hello", max_new_tokens=3, do_sample=False) == model.generate("Hello", max_new_tokens=3)
    torch.manual_seed(0)
    sampled = model.hf_generate(tokens, max_new_tokens=4)  # TransformerLens' default: sampling
    torch.manual_seed(0)
    assert torch.equal(sampled, model.hf_model.generate(tokens, max_new_tokens=4, do_sample=True, temperature=1.0,
                                                       pad_token_id=model.pad_token_id))  # fmt: skip
    seen = []
    point = next(n for n in ("blocks.0.attn.hook_pattern", "blocks.0.hook_resid_post") if n in model.hook_dict)
    with model.hooks(fwd_hooks=[(point, lambda x, hook: seen.append(x.shape))]):
        out = model.hf_generate("Hello", max_new_tokens=3, do_sample=False, output_attentions=True,
                                return_dict_in_generate=True)  # fmt: skip
    assert len(seen) == 3 and len(out.attentions) == 3
    zero = model.hf_generate(tokens, max_new_tokens=3, do_sample=False)
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: x * 0)]):
        ablated = model.hf_generate(tokens, max_new_tokens=3, do_sample=False)
    assert not torch.equal(zero, ablated)  # an edit changes HF's loop too
    assert torch.equal(model.hf_generate(tokens, max_new_tokens=3, do_sample=False), zero)  # and is gone after


def test_stop_at_eos_true_needs_an_eos_id():
    """An explicit ``stop_at_eos=True`` that nothing could honour is refused; unset, generation runs to the budget
    (as HF's generate does without an EOS id); ``eos_token_id=`` gives it one."""
    model = make_bridge("llama")
    model.cfg.eos_token_id = None  # written through to the generation config: no EOS anywhere
    prompt = torch.tensor([[1, 40, 41]])
    with pytest.raises(ValueError, match=r"`stop_at_eos=True` needs an EOS id") as caught:
        model.generate(prompt, max_new_tokens=3, stop_at_eos=True, do_sample=False)
    assert isinstance(caught.value, AssertionError)  # TransformerLens raises an AssertionError here
    free = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert free.shape == (1, 6)
    assert torch.equal(model.generate(prompt, max_new_tokens=3, stop_at_eos=False, do_sample=False), free)
    past_vocab = model.generate(prompt, max_new_tokens=3, stop_at_eos=True, eos_token_id=10**6, do_sample=False)
    assert torch.equal(past_vocab, free)  # an EOS id past the vocabulary is named (HF accepts it), never produced
    first = int(free[0, 3])
    stopped = model.generate(prompt, max_new_tokens=3, stop_at_eos=True, eos_token_id=first, do_sample=False)
    assert stopped.shape == (1, 4) and int(stopped[0, -1]) == first


def test_hf_generate_stop_at_eos_false_stops_at_no_eos():
    """``stop_at_eos=False`` must not stop at the EOS of HF's generation config, whatever ``eos_token_id`` says
    (it was silently ignored); True stops at the explicit id, else the tokenizer's. Oracle: a model whose weights
    are all zero predicts token 0 (its EOS) at every step; HF's own loop with ``eos_token_id=None``."""
    model = make_bridge("gpt2")
    with torch.no_grad():
        for p in model.hf_model.parameters():
            p.zero_()
    model.hf_model.generation_config.eos_token_id = 0
    model.tokenizer = None
    tokens = torch.tensor([[1, 5]])
    for explicit in (None, 0, 1):
        free = model.hf_generate(tokens, max_new_tokens=3, do_sample=False, stop_at_eos=False, eos_token_id=explicit)
        assert free.tolist() == [[1, 5, 0, 0, 0]]
        stopping = model.hf_generate(tokens, max_new_tokens=3, do_sample=False, eos_token_id=explicit)
        assert stopping.shape[1] == (5 if explicit == 1 else 3)  # EOS 1 never comes; 0 ends it after one token
    ref = model.hf_model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=3, do_sample=False,
                                  eos_token_id=None, pad_token_id=model.pad_token_id)  # fmt: skip
    assert torch.equal(model.hf_generate(tokens, max_new_tokens=3, do_sample=False, stop_at_eos=False), ref)
    assert model.hf_model.generation_config.eos_token_id == 0  # the model's config is left as it was
