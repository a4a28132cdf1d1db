"""The last silent differences from TransformerLens (issue #32, item 4), each now loud: `model.W_U` / `b_U` with the
final norm folded in, and `TransformerBridge.generate`'s greedy default, warn once per model
(`TransformerLensDifferenceWarning`) exactly where TransformerLens' number would differ, naming the way to it.

Oracles: the HF unembedding and the final norm's parameters read from the HF modules; TransformerLens' sampling
reproduced through the documented keywords under the same seed."""

import warnings

import pytest
import torch
from conftest import make_bridge, make_hf, perturb_
from transformers import GenerationConfig

import transformer_bridge
from transformer_bridge import TransformerLensDifferenceWarning

PROMPT = torch.tensor([[5, 17, 3]])


def _caught(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in seen if issubclass(w.category, TransformerLensDifferenceWarning)]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_folded_unembedding_warns_once_where_it_differs_from_the_hf_matrix(family):
    model = make_bridge(family)
    norm = model.hf_model.get_output_embeddings()  # the raw matrix, for the oracle below
    ln = dict(model.hf_model.named_modules())[model.adapter.ln_final]
    # A fresh model's final norm is γ = 1, β = 0: W_U is the HF matrix, nothing to say.
    (w_u, _), said = _caught(lambda: (model.W_U, model.b_U))
    assert said == [] and torch.equal(w_u, norm.weight.T)
    perturb_(model)
    (w_u, _), said = _caught(lambda: (model.W_U, model.b_U))
    assert len(said) == 1 and "W_U_raw" in str(said[0].message) and said[0].filename == __file__
    gamma = ln.weight.detach()
    torch.testing.assert_close(w_u, gamma[:, None] * norm.weight.detach().T, rtol=1e-6, atol=0)
    # Once per model; the raw readings never warn.
    _, again = _caught(lambda: (model.W_U, model.unembed.W_U, model.tokens_to_residual_directions(3), model.W_U_raw))
    assert again == []


def test_b_u_alone_warns_where_beta_is_not_zero():
    model = make_bridge("gpt2")
    ln = dict(model.hf_model.named_modules())[model.adapter.ln_final]
    with torch.no_grad():
        ln.bias.add_(0.5)  # γ stays 1: only b_U differs from TransformerLens 4's unprocessed b_U
    _, said = _caught(lambda: model.b_U)
    assert len(said) == 1 and "b_U" in str(said[0].message)


def test_processed_weights_do_not_warn():
    """After fold_ln the final norm is the identity: W_U is the HF matrix, as in TransformerLens."""
    model = perturb_(make_bridge("llama"))
    model.enable_compatibility_mode()
    (w_u, _), said = _caught(lambda: (model.W_U, model.b_U))
    assert said == [] and torch.equal(w_u, model.W_U_raw)


def test_greedy_default_warns_once_and_only_where_tl_would_sample():
    bridge = make_bridge("llama")
    greedy, said = _caught(lambda: bridge.generate(PROMPT, max_new_tokens=4))
    assert len(said) == 1 and "do_sample=True, top_k=0" in str(said[0].message)
    assert said[0].filename == __file__
    _, again = _caught(lambda: bridge.generate(PROMPT, max_new_tokens=4))
    assert again == []
    # Said by the caller in a keyword or a config, beam search, or a model whose config samples: no warning.
    for kwargs in ({"do_sample": False}, {"generation_config": GenerationConfig(do_sample=False)}, {"num_beams": 2},
                   {"temperature": 0.7, "top_k": 0}):  # fmt: skip
        fresh = make_bridge("llama")
        _, said = _caught(lambda fresh=fresh, kwargs=kwargs: fresh.generate(PROMPT, max_new_tokens=4, **kwargs))
        assert said == [], kwargs
    sampling = make_bridge("llama")
    sampling.hf_model.generation_config.do_sample = True
    _, said = _caught(lambda: sampling.generate(PROMPT, max_new_tokens=4))
    assert ["greedily" in str(w.message) for w in said] == [False]  # only the config's top-k is said (below)
    # HookedTransformer samples by default, as TransformerLens: nothing to warn about; and the greedy tokens are
    # the ones `do_sample=False` gives.
    hooked = transformer_bridge.HookedTransformer(make_bridge("llama").hf_model)
    _, said = _caught(lambda: hooked.generate(PROMPT, max_new_tokens=4))
    assert said == []
    assert torch.equal(greedy, bridge.generate(PROMPT, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compatibility_mode_names_the_attention_kernel(family):
    """TransformerLens 4's bridge forces HF's eager attention; here the model's kernel stays (HF's logits). Asking for
    TransformerLens' numbers (`enable_compatibility_mode`) on another kernel says so once; on eager, or with
    `disable_warnings=True`, nothing is said. The eager model's logits are what the warning promises: the sdpa
    model's within float summation order, and TransformerLens' kernel."""
    sdpa = make_bridge(family)
    _, said = _caught(lambda: sdpa.enable_compatibility_mode(no_processing=True))
    assert len(said) == 1 and "attn_implementation='eager'" in str(said[0].message) and "'sdpa'" in str(said[0].message)
    assert said[0].filename == __file__
    assert _caught(lambda: sdpa.enable_compatibility_mode(no_processing=True))[1] == []
    assert _caught(lambda: make_bridge(family).enable_compatibility_mode(True, no_processing=True))[1] == []
    hf = make_hf(family)
    hf.config._attn_implementation = "eager"
    eager = transformer_bridge.TransformerBridge(hf)
    assert _caught(lambda: eager.enable_compatibility_mode(no_processing=True))[1] == []
    tokens = torch.tensor([[5, 17, 3, 42, 8, 9]])
    torch.testing.assert_close(eager(tokens), sdpa(tokens), atol=1e-4, rtol=0)


def test_use_attn_result_says_once_that_tl_sums_the_heads_instead():
    """With use_attn_result on, TransformerLens 4 computes attention's output as the sum of the heads' results (its
    logits move); here the logits stay the model's: the first switch on says so, and the logits are HF's bitwise."""
    model = make_bridge("llama")
    tokens = torch.tensor([[5, 17, 3, 42, 8, 9]])
    before = model(tokens)
    _, said = _caught(lambda: model.set_use_attn_result(True))
    assert len(said) == 1 and "sum of its heads' results" in str(said[0].message)
    assert said[0].filename == __file__
    assert _caught(lambda: model.set_use_attn_result(True))[1] == []
    assert _caught(lambda: make_bridge("llama").set_use_attn_result(False))[1] == []
    logits, cache = model.run_with_cache(tokens)
    assert torch.equal(logits, before) and "blocks.0.attn.hook_result" in cache


def test_sampling_from_the_configs_top_k_warns_once_where_tl_samples_the_whole_distribution():
    """HF's generation config samples from the top 50 tokens unless told otherwise; TransformerLens from all of
    them. Sampling without `top_k` warns once per model; `top_k` given (0: every token) is silent."""
    bridge = make_bridge("llama")
    prompt = PROMPT.repeat(400, 1)
    sampled, said = _caught(lambda: bridge.generate(prompt, max_new_tokens=1, temperature=5.0))
    assert len(said) == 1 and "top_k=0" in str(said[0].message) and "50 most likely" in str(said[0].message)
    assert said[0].filename == __file__
    assert sampled[:, -1].unique().numel() <= 50  # what the warning says: HF's top 50 of 99
    _, again = _caught(lambda: bridge.generate(prompt, max_new_tokens=1, temperature=5.0))
    assert again == []
    for kwargs in ({"top_k": 0}, {"top_k": 50}, {"generation_config": GenerationConfig(do_sample=True, top_k=0)}):
        fresh = make_bridge("llama")
        _, said = _caught(lambda fresh=fresh, kwargs=kwargs: fresh.generate(prompt, max_new_tokens=1, **kwargs))
        assert said == [], kwargs
    whole, _ = _caught(lambda: make_bridge("llama").generate(prompt, max_new_tokens=1, temperature=5.0, top_k=0))
    assert whole[:, -1].unique().numel() > 50  # TransformerLens' reading: every token may be drawn
    # HookedTransformer keeps TransformerLens' defaults for what the call leaves out: `temperature` alone samples
    # the whole distribution there too (it once brought in HF's top 50), and there is nothing to warn about.
    hooked = transformer_bridge.HookedTransformer(make_bridge("llama").hf_model)
    tl_sampled, said = _caught(lambda: hooked.generate(prompt, max_new_tokens=1, temperature=5.0, verbose=False))
    assert said == [] and tl_sampled[:, -1].unique().numel() > 50


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_right_padded_text_warns_once_where_padding_positions_differ_from_tl(family):
    """TransformerLens runs right-padded text unmasked (the same numbers as its tokens); here the tokenizer's
    mask is used, as HF reads it: real positions equal, padding positions (and a loss) not, so it warns once."""
    model = make_bridge(family)
    texts = ["Hello there world", "Hi"]
    tokens, mask = model.to_tokens_and_mask(texts)
    real = mask.bool()
    logits, said = _caught(lambda: model(texts))
    assert len(said) == 1 and "model(model.to_tokens(texts))" in str(said[0].message)
    assert said[0].filename == __file__
    unmasked = model(tokens)  # TransformerLens' reading of the same text
    assert torch.equal(logits[real], unmasked[real])
    assert not torch.allclose(logits[~real], unmasked[~real])
    # Once per model; nothing to say for a batch without padding, one text, or left padding (masked in both).
    _, again = _caught(lambda: model.run_with_cache(texts))
    assert again == []
    fresh = make_bridge(family)
    _, said = _caught(lambda: (fresh(["ab", "cd"]), fresh("Hello"), fresh(texts, padding_side="left")))
    assert said == []


def test_left_padded_embeddings_warn_once_that_positions_come_from_the_mask():
    """TransformerLens leaves the positions of embeddings input alone (0, 1, ...); here a left-padded mask gives
    them as for token ids, so the first such call warns, and position_ids=arange gives TransformerLens' numbers
    (HF's own forward on the same embeddings and mask)."""
    model = make_bridge("gpt2")  # learned positions: the positions change the numbers
    tokens = torch.tensor([[7, 8, 9, 10], [5, 6, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    embeds = model.hf_model.get_input_embeddings()(tokens).detach()
    derived, said = _caught(lambda: model(embeds, attention_mask=mask))
    assert len(said) == 1 and "position_ids=torch.arange(pos)" in str(said[0].message)
    assert said[0].filename == __file__
    assert torch.equal(derived, model(tokens, attention_mask=mask))  # the token ids' positions
    arange = torch.arange(4).expand(2, 4)
    as_tl, said = _caught(lambda: model(embeds, attention_mask=mask, position_ids=arange))
    assert said == []
    with torch.no_grad():
        hf = model.hf_model(inputs_embeds=embeds, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(as_tl[real], hf[real], rtol=0, atol=1e-6)
    assert not torch.allclose(derived[0, 2:], as_tl[0, 2:])
    fresh = make_bridge("gpt2")
    _, said = _caught(lambda: (fresh(embeds), fresh(embeds, attention_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))))
    assert said == []
