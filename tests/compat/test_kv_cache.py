"""TransformerLens' KV-cache object (`compat.kv_cache`): incremental decoding by hand against the uncached
forward (the oracle), freezing, masks over the new tokens only, padded prefixes, the entry API, errors."""

import pytest
import torch
from conftest import make_bridge, perturb_

from transformer_bridge.compat.kv_cache import (
    TransformerLensKeyValueCache,
    TransformerLensKeyValueCacheEntry,
    get_pos_offset,
)

TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3, 60, 7, 21], [1, 9, 9, 33, 71, 12, 4, 50, 8]])


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2", "gpt_neox", "qwen2", "opt"])
def model(request):
    return perturb_(make_bridge(request.param))


def new_cache(model, batch=2):
    return TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch)


def test_chunks_and_single_tokens_equal_the_uncached_forward(model):
    ref = model(TOKENS)
    cache = new_cache(model)
    parts = [model(TOKENS[:, :4], past_kv_cache=cache)]
    parts += [model(TOKENS[:, i : i + 1], past_kv_cache=cache) for i in range(4, 7)]
    parts.append(model(TOKENS[:, 7:], past_kv_cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), ref, atol=1e-5, rtol=1e-5)
    assert cache.pos_so_far == 9 == get_pos_offset(cache, 2)
    assert cache.previous_attention_mask.shape == (2, 9)
    kv = model.cfg.n_kv_heads
    assert [tuple(e.past_keys.shape) for e in cache] == [(2, 9, kv, model.cfg.d_head)] * model.cfg.n_layers


def test_entries_hold_the_keys_the_model_computed(model):
    _, act = model.run_with_cache(TOKENS, names_filter=["blocks.0.attn.hook_v"])
    cache = new_cache(model)
    model(TOKENS, past_kv_cache=cache)
    # hook_v is [batch, pos, kv_head, d_head] before any rotary: the stored values exactly.
    torch.testing.assert_close(cache[0].past_values, act["blocks.0.attn.hook_v"], atol=1e-6, rtol=1e-6)


def test_frozen_cache_is_a_reusable_prefix(model):
    cache = new_cache(model)
    model(TOKENS[:, :5], past_kv_cache=cache)
    cache.freeze()
    a = model(TOKENS[:, 5:7], past_kv_cache=cache)
    b = model(TOKENS[:, 5:7], past_kv_cache=cache)
    assert torch.equal(a, b) and cache.pos_so_far == 5 and cache.previous_attention_mask.shape[1] == 5
    torch.testing.assert_close(a, model(TOKENS[:, :7])[:, 5:], atol=1e-5, rtol=1e-5)
    cache.unfreeze()
    model(TOKENS[:, 5:7], past_kv_cache=cache)
    assert cache.pos_so_far == 7 and not any(e.frozen for e in cache)


def test_mask_over_new_tokens_skips_a_token(model):
    cache = new_cache(model)
    model(TOKENS[:, :4], past_kv_cache=cache)
    got = model(TOKENS[:, 4:7], attention_mask=torch.tensor([[1, 0, 1], [1, 0, 1]]), past_kv_cache=cache)
    expected = model(torch.cat([TOKENS[:, :5], TOKENS[:, 6:7]], 1))
    torch.testing.assert_close(got[:, -1], expected[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_prefix_steps_to_the_unpadded_logits(model, side):
    pad = model.pad_token_id
    short = TOKENS[1, :3]
    prefix = torch.full((2, 5), pad)
    prefix[0] = TOKENS[0, :5]
    if side == "left":
        prefix[1, 2:] = short
    else:
        prefix[1, :3] = short
    cache = new_cache(model)
    model(prefix, past_kv_cache=cache, padding_side=side)
    step = model(TOKENS[:, 5:6], past_kv_cache=cache)
    alone = model(torch.cat([short, TOKENS[1, 5:6]])[None])
    torch.testing.assert_close(step[1, -1], alone[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[0, -1], model(TOKENS[:1, :6])[0, -1], atol=1e-5, rtol=1e-5)


def test_hooks_see_the_new_positions(model):
    seen = []
    cache = new_cache(model)
    model(TOKENS[:, :4], past_kv_cache=cache)

    def record(x, hook):
        seen.append((x.shape, hook.ctx.phase, hook.ctx.positions))

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", record)]):
        model(TOKENS[:, 4:6], past_kv_cache=cache)
    shape, phase, positions = seen[0]
    assert shape[:2] == (2, 2) and phase == "decode" and positions.tolist() == [[4, 5], [4, 5]]


def test_text_and_loss(model):
    cache = new_cache(model, 1)
    logits = model("Hi th", past_kv_cache=cache)
    more, loss = model(" ere", past_kv_cache=cache, return_type="both")
    whole = model("Hi th ere")
    torch.testing.assert_close(torch.cat([logits, more], 1), whole, atol=1e-5, rtol=1e-5)
    assert loss.shape == ()


def test_entry_api_follows_cfg():
    cfg = make_bridge("llama").cfg
    entry = TransformerLensKeyValueCacheEntry.init_cache_entry(cfg, "cpu", batch_size=3)
    assert entry.past_keys.shape == (3, 0, cfg.n_kv_heads, cfg.d_head) and entry.past_keys.dtype == cfg.dtype
    k = torch.randn(3, 2, cfg.n_kv_heads, cfg.d_head)
    keys, values = entry.append(k, k + 1)
    assert torch.equal(entry.past_keys, k) and torch.equal(values, k + 1)
    entry.frozen = True
    keys, _ = entry.append(k, k)
    assert keys.shape[1] == 4 and entry.past_keys.shape[1] == 2
    cache = TransformerLensKeyValueCache([entry], torch.empty((3, 0), dtype=torch.int))
    assert get_pos_offset(cache, 3) == 2 and get_pos_offset(None, 1) == 0
    assert cache.append_attention_mask(torch.ones(3, 2)).shape == (3, 2)


def test_errors_name_the_problem(model):
    cache = new_cache(model)
    with pytest.raises(ValueError, match="batch of 2"):
        model(TOKENS[:1], past_kv_cache=cache)
    with pytest.raises(ValueError, match="return_type"):
        model(TOKENS, past_kv_cache=cache, return_type="logits_and_cache")
    with pytest.raises(ValueError, match="stop_at_layer"):
        model(TOKENS, past_kv_cache=cache, stop_at_layer=1)
    with pytest.raises(ValueError, match="new tokens only"):
        model(TOKENS[:, :2], past_kv_cache=cache, attention_mask=torch.ones(2, 5))
    with pytest.raises(TypeError, match="TransformerLensKeyValueCache"):
        model(TOKENS, past_kv_cache={"not": "a cache"})
    with pytest.raises(ValueError, match="batch_size"):
        TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", 0)
    assert cache.pos_so_far == 0
