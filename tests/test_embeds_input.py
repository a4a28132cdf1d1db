"""Token embeddings as the input (HF's ``inputs_embeds``; a float ``input`` as in TransformerLens 4): the logits are
``hf_model(inputs_embeds=...)``'s, hooks after the embedding fire, and the loss needs targets."""

import pytest
import torch
from conftest import make_bridge

FAMILIES = ["gpt2", "llama", "gemma2", "opt", "gpt_neox", "qwen3_moe", "falcon"]
TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_give_hfs_logits_and_the_points_after_the_embedding(family):
    model = make_bridge(family)
    hf = model.hf_model
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(TOKENS) * 0.9  # not the ids' embeddings: a soft prompt
        expected = hf(inputs_embeds=embeds).logits
        assert torch.equal(model(embeds), expected)
        assert torch.equal(model(inputs_embeds=embeds), expected)
        # a left-padded mask: positions counted from each row's first real token, as for ids
        positions = (MASK.cumsum(-1) - 1).clamp_min(0)
        padded = hf(inputs_embeds=embeds, attention_mask=MASK, position_ids=positions).logits
        got = model(embeds, attention_mask=MASK)
        torch.testing.assert_close(got[MASK.bool()], padded[MASK.bool()], rtol=0, atol=0)
        logits, cache = model.run_with_cache(embeds, names_filter=lambda n: "resid" in n or n == "hook_embed")
    assert torch.equal(logits, expected)
    assert "hook_embed" not in cache and "blocks.0.hook_resid_pre" in cache
    # hooks edit what the model computes from the embeddings
    edited = model.run_with_hooks(embeds, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x * 0)])
    assert not torch.equal(edited, expected)
    # the loss of embeddings whose targets are the ids equals the ids' own loss
    exact = hf.get_input_embeddings()(TOKENS)
    with torch.no_grad():
        torch.testing.assert_close(
            model(exact, return_type="loss", labels=TOKENS), model(TOKENS, return_type="loss"), rtol=0, atol=0
        )
        assert torch.equal(model(exact, return_type="loss", tokens=TOKENS), model(TOKENS, return_type="loss"))


def test_bad_embeddings_are_refused_by_name():
    model = make_bridge("llama")
    embeds = torch.randn(1, 4, model.cfg.d_model)
    with pytest.raises(ValueError, match="`inputs_embeds` must be a float tensor"):
        model(inputs_embeds=torch.randn(1, 4, model.cfg.d_model + 1))
    with pytest.raises(ValueError, match="needs the targets"):
        model(embeds, return_type="loss")
    with pytest.raises(ValueError, match="not both"):
        model(TOKENS, inputs_embeds=embeds)
    with pytest.raises(ValueError, match="not both"):
        model(embeds, inputs_embeds=embeds)
    with pytest.raises(ValueError, match="embeddings' shape"):
        model(embeds, tokens=TOKENS, return_type="loss")
    with pytest.raises(ValueError, match="incl_bwd"):
        model.run_with_cache(embeds, incl_bwd=True, return_type="loss")
    with pytest.raises(ValueError, match="hook_embed"):  # a hooked point the embeddings skip is named
        model.run_with_hooks(embeds, fwd_hooks=[("hook_embed", lambda x, hook: x)])
    assert torch.equal(model(TOKENS), model.hf_model(TOKENS).logits)  # clean afterwards
