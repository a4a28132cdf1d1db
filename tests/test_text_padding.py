"""Text batches are laid out as `to_tokens` lays them out (issue #32): right-padded by default
(``cfg.default_padding_side``, TransformerLens' default), with the attention mask, in `forward`, `run_with_hooks`,
`run_with_cache` and the loss; ``padding_side=`` overrides per call; `generate` keeps left padding. The oracle is HF's
own forward: on the same right-padded batch with its mask the logits are bitwise HF's (HF's default positions are right
for right padding), and each row's real positions equal that row run alone up to HF's own batch-shape rounding
(≤ 1e-6: the bare HF model differs by ~5e-8 between a batch and a single row, even for an unpadded row), in rotary and
learned-position families.
"""

import pytest
import torch
from conftest import make_bridge

TEXTS = ["Hi", "The capital of France", "abc de"]
FAMILIES = ["gpt2", "llama", "qwen2", "gemma2", "gpt_neox", "opt", "phi", "gptj"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _alone(model, text: str) -> torch.Tensor:
    ids = model.to_tokens(text)
    with torch.no_grad():
        return model.hf_model(ids).logits[0]


def test_forward_pads_as_to_tokens_and_rows_are_bitwise_hf(model):
    tokens, mask = model.to_tokens_and_mask(TEXTS)
    assert torch.equal(tokens, model.to_tokens(TEXTS))
    assert bool(mask[:, 0].all()), "right padding: every row starts with a real token"
    with torch.no_grad():
        logits = model(TEXTS)
        hf = model.hf_model(tokens, attention_mask=mask).logits
    assert torch.equal(logits[mask.bool()], hf[mask.bool()])
    for i, text in enumerate(TEXTS):
        n = int(mask[i].sum())
        _close(logits[i, :n], _alone(model, text))


def test_run_with_cache_and_run_with_hooks_pad_as_to_tokens(model):
    mask = model.to_tokens_and_mask(TEXTS)[1]
    logits, cache = model.run_with_cache(TEXTS, names_filter="blocks.0.hook_resid_post")
    assert torch.equal(cache.attention_mask.cpu(), mask.cpu())
    last = mask.sum(-1) - 1  # TL's recipe: each row's last real token, from to_tokens
    with torch.no_grad():
        hooked = model.run_with_hooks(TEXTS, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: None)])
    assert torch.equal(hooked, logits)
    for i, text in enumerate(TEXTS):
        _close(logits[i, last[i]], _alone(model, text)[-1])


def test_padding_side_overrides_per_call(model):
    _, mask = model.to_tokens_and_mask(TEXTS, padding_side="left")
    _, cache = model.run_with_cache(TEXTS, names_filter="blocks.0.hook_resid_post", padding_side="left")
    assert torch.equal(cache.attention_mask.cpu(), mask.cpu())
    with torch.no_grad():
        logits = model(TEXTS, padding_side="left")
    for i, text in enumerate(TEXTS):
        n = int(mask[i].sum())
        _close(logits[i, -n:], _alone(model, text))


def test_default_padding_side_left_is_honoured():
    model = make_bridge("llama")
    model.cfg.default_padding_side = "left"
    _, cache = model.run_with_cache(TEXTS, names_filter="blocks.0.hook_resid_post")
    assert bool(cache.attention_mask[:, -1].all())


def test_loss_on_texts_counts_real_tokens_only():
    model = make_bridge("gpt2")
    with torch.no_grad():
        losses = torch.stack([model(t, return_type="loss") for t in TEXTS])
        per_token = model(TEXTS, return_type="loss", loss_per_token=True)
    mask = model.to_tokens_and_mask(TEXTS)[1]
    for i in range(len(TEXTS)):
        n = int(mask[i].sum())
        torch.testing.assert_close(per_token[i, : n - 1].mean(), losses[i])
        assert bool((per_token[i, n - 1 :] == 0).all())


def test_generate_keeps_left_padding():
    model = make_bridge("llama")
    out = model.generate(TEXTS, max_new_tokens=3, temperature=0, return_type="tokens", verbose=False)
    left = model.to_tokens(TEXTS, padding_side="left")
    assert torch.equal(out[:, : left.shape[1]], left)
