"""Token ids mean what they mean to HF: without an attention mask every token is real, whatever its id.

Rows led by pad, BOS and EOS ids (document boundaries in packed rows, SAE training data) on configs where
pad = BOS = EOS (GPT-2 with ``pad_token = eos_token``), pad = EOS (SmolLM2), and a distinct pad id: forward,
``run_with_cache`` and ``run_with_hooks`` are bitwise ``hf_model(ids)``, with and without a tokenizer; greedy
``generate`` equals HF's ``generate`` on the same ids (HF's own rule: pad ids are padding only when the pad id
is not an EOS id). Left padding is read off token values only when the caller says so (TransformerLens'
``padding_side="left"``).
"""

import warnings

import pytest
import torch
from conftest import CONFIGS, char_tokenizer
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge

# (bos, eos, pad) of each special-token layout.
LAYOUTS = {"pad=bos=eos": (2, 2, 2), "pad=eos": (1, 2, 2), "distinct pad": (1, 2, 0)}
FAMILIES = ["gpt2", "llama", "qwen2", "gpt_neox", "gemma2", "opt"]


def _bridge(family: str, layout: str, tokenizer: bool) -> TransformerBridge:
    bos, eos, pad = LAYOUTS[layout]
    config = CONFIGS[family]()
    config.bos_token_id, config.eos_token_id, config.pad_token_id = bos, eos, pad
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.generation_config.bos_token_id, hf.generation_config.eos_token_id = bos, eos
    hf.generation_config.pad_token_id = pad
    return TransformerBridge(hf, char_tokenizer() if tokenizer else None)


def _rows(layout: str) -> torch.Tensor:
    bos, eos, pad = LAYOUTS[layout]
    return torch.tensor([
        [pad, 5, 6, 7, 8, 9],      # led by the pad id
        [bos, 5, 6, 7, 8, 9],      # led by BOS
        [eos, bos, 5, 6, 7, 8],    # a document boundary in a packed row
        [pad, pad, bos, 5, 6, 7],  # what left padding would look like
    ])  # fmt: skip


@pytest.mark.parametrize("tokenizer", [True, False], ids=["tokenizer", "no-tokenizer"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_led_by_special_ids_are_bitwise_hf(family, layout, tokenizer):
    model = _bridge(family, layout, tokenizer)
    ids = _rows(layout)
    with torch.no_grad():
        hf = model.hf_model(ids, output_hidden_states=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning claiming a padding rule
            assert torch.equal(model(ids), hf.logits)
        logits, cache = model.run_with_cache(ids, names_filter="resid_post")
        assert torch.equal(logits, hf.logits)
        assert torch.equal(cache["resid_post", 0], hf.hidden_states[1])
        assert torch.equal(model.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda x, hook: None)]), hf.logits)
        for row in range(ids.shape[0]):  # each row alone too
            assert torch.equal(model(ids[row : row + 1]), model.hf_model(ids[row : row + 1]).logits)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_greedy_generate_on_bare_ids_equals_hf_generate(family, layout):
    model = _bridge(family, layout, tokenizer=False)
    for ids in (_rows(layout), _rows(layout)[:1], _rows(layout)[2:3]):
        hf = model.hf_model.generate(ids, max_new_tokens=5, do_sample=False)
        ours = model.generate(ids, max_new_tokens=5, do_sample=False)
        assert torch.equal(ours, hf), (ids.tolist(), ours.tolist(), hf.tolist())


def test_left_padding_from_token_values_only_when_asked():
    model = _bridge("llama", "distinct pad", tokenizer=True)
    tokens, mask = model.to_tokens_and_mask(["Hi", "Hello"], padding_side="left")
    with torch.no_grad():
        masked = model(tokens, attention_mask=mask)
        assert torch.equal(model(tokens), model.hf_model(tokens).logits)  # all real
        assert torch.equal(model(tokens, padding_side="left"), masked)
        _, cache = model.run_with_cache(tokens, names_filter="resid_post")
        assert torch.equal(cache.attention_mask, torch.ones_like(tokens))


def test_left_padding_opt_in_with_bos_as_pad_keeps_the_bos():
    """TransformerLens' rule: when BOS is the pad id, the last leading pad is the row's BOS."""
    model = _bridge("gpt2", "pad=bos=eos", tokenizer=False)
    ids = torch.tensor([[2, 2, 2, 5, 6], [2, 5, 6, 7, 8]])
    with torch.no_grad():
        masked = model(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
        assert torch.equal(model(ids, padding_side="left", prepend_bos=True), masked)


def test_bad_padding_side_is_named():
    model = _bridge("llama", "distinct pad", tokenizer=False)
    with pytest.raises(ValueError, match="`padding_side` must be None, 'left' or 'right', got 'middle'"):
        model(torch.tensor([[5, 6]]), padding_side="middle")


@pytest.mark.real
def test_smollm2_rows_led_by_its_pad_eos_id_are_bitwise_hf(smollm2):
    pad = smollm2.hf_model.config.pad_token_id
    eos = smollm2.hf_model.config.eos_token_id
    text = smollm2.to_tokens("The capital of France is Paris, and the capital of Italy is Rome.")[0]
    ids = torch.stack([
        torch.cat([torch.tensor([pad, pad]), text[:8]]),
        torch.cat([torch.tensor([eos]), text[:9]]),
        text[:10],
    ])  # fmt: skip
    with torch.no_grad():
        hf = smollm2.hf_model(ids, output_hidden_states=True)
        assert torch.equal(smollm2(ids), hf.logits)
        _, cache = smollm2.run_with_cache(ids, names_filter=("resid_post", 10))
        assert torch.equal(cache["resid_post", 10], hf.hidden_states[11])
    ours = smollm2.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, smollm2.hf_model.generate(ids, max_new_tokens=6, do_sample=False))
