"""`generate(..., return_cache=True)`: one recompute forward, bitwise equal to `run_with_cache` on the output."""

import pytest
import torch
from conftest import FAMILIES, make_bridge

from transformer_bridge import ActivationCache
from transformer_bridge.generation import GenerationOutput

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def steer(resid, hook):
    at = (hook.ctx.positions == 2) & ~hook.ctx.pad_mask
    return resid + 30.0 * at[..., None] * torch.linspace(-1, 1, resid.shape[-1])


def assert_same_cache(a: ActivationCache, b: ActivationCache) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert a[name].device == b[name].device
    assert torch.equal(a.attention_mask, b.attention_mask)


@pytest.mark.parametrize("rows", [1, 3])
def test_cache_equals_run_with_cache_bitwise(model, rows):
    tokens, mask = model.to_tokens_and_mask(PROMPTS[:rows], padding_side="left")
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=8, stop_at_eos=False, return_dict=True)
    eos = free.new_tokens[0, 2].item()  # row 0 stops early: the recompute sees right padding too
    out, cache = model.generate(tokens, attention_mask=mask, max_new_tokens=8, eos_token_id=eos,
                                return_dict=True, return_cache=True)  # fmt: skip
    logits, expect = model.run_with_cache(out.sequences, attention_mask=out.attention_mask)
    assert_same_cache(cache, expect)
    assert torch.equal(cache.prompt_lengths, mask.sum(-1))
    # Greedy tokens are the argmax of the recomputed logits at every real generated position.
    predicted = logits[:, out.prompt_width - 1 : -1].argmax(-1)
    real = out.attention_mask[:, out.prompt_width :].bool()
    assert torch.equal(predicted[real], out.new_tokens[real])


def test_cache_under_steering_hooks_equals_run_with_cache_under_them(model):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern", "ln_final.hook_normalized"]
    names = [n for n in names if n in model.hook_dict]  # Falcon has no pattern point
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", steer)]):
        out, cache = model.generate(tokens, attention_mask=mask, max_new_tokens=6, return_dict=True,
                                    return_cache=True, names_filter=names, device="cpu")  # fmt: skip
        logits, expect = model.run_with_cache(out.sequences, attention_mask=out.attention_mask, names_filter=names,
                                              device="cpu")  # fmt: skip
    assert list(cache) == names
    assert_same_cache(cache, expect)
    real = out.attention_mask[:, out.prompt_width :].bool()
    assert torch.equal(logits[:, out.prompt_width - 1 : -1].argmax(-1)[real], out.new_tokens[real])
    plain = model.generate(tokens, attention_mask=mask, max_new_tokens=6)
    assert not torch.equal(plain, out.sequences)  # the hook steered both the tokens and the cache


def test_return_shapes_and_shared_storage():
    model = make_bridge("llama")
    text, cache = model.generate("Hello", max_new_tokens=4, return_cache=True, names_filter=lambda n: "resid" in n)
    assert isinstance(text, str) and isinstance(cache, ActivationCache)
    assert cache["resid_pre", 1].data_ptr() == cache["resid_post", 0].data_ptr()  # stored once
    tokens, cache = model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=4, return_cache=True)
    assert isinstance(tokens, torch.Tensor) and cache["resid_post", 0].shape[:2] == tokens.shape
    out, cache = model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=4, return_cache=True, return_dict=True)
    assert isinstance(out, GenerationOutput) and cache["resid_post", 0].shape[:2] == out.sequences.shape


def test_cache_after_beam_search_and_use_cache_false():
    model = make_bridge("gemma2")
    tokens, mask = model.to_tokens_and_mask(PROMPTS[:2], padding_side="left")
    for kw in [dict(num_beams=3, num_return_sequences=2), dict(use_cache=False)]:
        out, cache = model.generate(tokens, attention_mask=mask, max_new_tokens=5, return_dict=True,
                                    return_cache=True, names_filter="blocks.1.hook_mlp_out", **kw)  # fmt: skip
        _, expect = model.run_with_cache(out.sequences, attention_mask=out.attention_mask,
                                         names_filter="blocks.1.hook_mlp_out")  # fmt: skip
        assert_same_cache(cache, expect)


def test_bad_cache_arguments_raise_before_generating():
    model = make_bridge("llama")
    typo = "blocks.0.hook_resid_pots"
    with pytest.raises(KeyError, match="hook_resid_post"):  # the suggestion
        model.generate(torch.tensor([[1, 5]]), max_new_tokens=2, return_cache=True, names_filter=typo)
    with pytest.raises(ValueError, match="`device`"):
        model.generate(torch.tensor([[1, 5]]), max_new_tokens=2, return_cache=True, device="nonsense")


@pytest.mark.real
def test_smollm2_batched_cache_equals_run_with_cache(smollm2):
    tokens, mask = smollm2.to_tokens_and_mask(["The capital of France is", "Hi"], padding_side="left")
    names = ["blocks.5.hook_resid_post", "blocks.20.attn.hook_z"]
    out, cache = smollm2.generate(tokens, attention_mask=mask, max_new_tokens=6, return_dict=True,
                                  return_cache=True, names_filter=names)  # fmt: skip
    _, expect = smollm2.run_with_cache(out.sequences, attention_mask=out.attention_mask, names_filter=names)
    assert_same_cache(cache, expect)
