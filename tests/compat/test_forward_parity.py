"""HF habits on forward (input_ids, tokenizer output, output_hidden_states / output_attentions, unknown
keywords) and TransformerLens' token helpers."""

import pytest
import torch
from conftest import make_bridge

TEXTS = ["Hi", "The capital"]


@pytest.fixture(scope="module", params=["llama", "gpt2", "gemma2"])
def model(request):
    return make_bridge(request.param)


def test_input_ids_and_tokenizer_output_like_hf(model):
    enc = model.tokenizer(TEXTS, return_tensors="pt", padding=True)
    padded = enc["attention_mask"]
    with torch.no_grad():
        ours = model(**enc)
        positions = (padded.cumsum(-1) - 1).clamp_min(0)
        hf = model.hf_model(**enc, position_ids=positions).logits
        real = padded.bool()
        assert torch.allclose(ours[real], hf[real], atol=1e-5)
        assert torch.equal(model(input_ids=enc["input_ids"][:1]), model.hf_model(enc["input_ids"][:1]).logits)
        pair = model((enc["input_ids"], padded))
        assert torch.equal(pair, ours)


def test_output_hidden_states_and_attentions(model):
    tokens = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True, output_attentions=True)
        hf = model.hf_model(tokens, output_hidden_states=True)
        _, cache = model.run_with_cache(tokens, names_filter="pattern")
    assert torch.equal(out.logits, hf.logits)
    assert len(out.hidden_states) == model.cfg.n_layers + 1
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, hf.hidden_states, strict=True))
    assert len(out.attentions) == model.cfg.n_layers
    assert torch.equal(out.attentions[1], cache["pattern", 1])


def test_unknown_forward_keyword_names_the_closest(model):
    with pytest.raises(TypeError, match="Did you mean 'attention_mask'"):
        model(torch.tensor([[5, 6]]), attension_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="`token_type_ids` must be all zeros"):
        model(torch.tensor([[5, 6]]), token_type_ids=torch.ones(1, 2, dtype=torch.long))


def test_ids_without_mask_are_all_real_unless_said_to_be_left_padded(model):
    tokens, mask = model.to_tokens_and_mask(TEXTS, padding_side="left")
    with torch.no_grad():
        expected = model(tokens, attention_mask=mask)
        assert torch.equal(model(tokens), model.hf_model(tokens).logits)  # every token real, as in HF's forward
        assert torch.equal(model(tokens, padding_side="left"), expected)  # TransformerLens' opt-in
        model.cfg.default_padding_side = "left"
        try:
            assert torch.equal(model(tokens), expected)
        finally:
            model.cfg.default_padding_side = "right"


def test_token_helpers(model):
    assert model.get_token_position("a", "banana", mode="last", prepend_bos=False) == 5
    assert model.get_token_position("a", "banana", prepend_bos=True) == 2
    with pytest.raises(ValueError, match="does not occur"):
        model.get_token_position("z", "banana")
    direction = model.tokens_to_residual_directions("a")
    assert torch.equal(direction, model.W_U[:, model.to_single_token("a")])
    assert model.tokens_to_residual_directions(torch.tensor([[5, 6]])).shape == (1, 2, model.cfg.d_model)
    assert model.to_str_tokens(["ab", "c"], prepend_bos=False) == [["a", "b"], ["c"]]
    assert model.to_str_tokens(torch.tensor([[5, 6], [7, 8]]))[1] == model.to_str_tokens(torch.tensor([7, 8]))
    right = model.to_tokens(["ab", "cde"])
    left = model.to_tokens(["ab", "cde"], padding_side="left")
    assert right[0, -1] == model.pad_token_id and left[0, 0] == model.pad_token_id
    assert model.to_tokens("abcdef", truncate=True).shape[1] == 7
    assert model.cfg.default_prepend_bos and model.to_tokens("a")[0, 0] == model.cfg.bos_token_id
    assert model.to_tokens("a", prepend_bos=False)[0, 0] != model.cfg.bos_token_id


def test_model_accumulated_bias_equals_the_cache_s(model):
    _, cache = model.run_with_cache(torch.tensor([[5, 6, 7]]), names_filter="resid_pre")
    for layer in range(model.cfg.n_layers + 1):
        assert torch.equal(model.accumulated_bias(layer), cache.accumulated_bias(layer))
    assert torch.equal(model.accumulated_bias(1, mlp_input=True), cache.accumulated_bias(1, mlp_input=True))
