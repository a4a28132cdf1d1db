"""The batch axis of caches and caching hooks, against the tensors themselves and `run_with_cache`.

`ActivationCache.remove_batch_dim(batch_size=)` / `apply_slice_to_batch_dim` on caches that mix batched entries
with broadcast ``[1, ...]`` or position-indexed ones (TransformerLens 4's contract); `run_with_cache` taking the
batch size from its input; `get_caching_hooks(remove_batch_dim=True)` per tensor; the caching dict read under
TransformerLens 4's spellings with one entry per point; `get_hook_point`.
"""

import pytest
import torch
from conftest import make_bridge

from transformer_bridge import ActivationCache
from transformer_bridge.compat.caching_hooks import CachingDict

TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3], [1, 9, 9, 33, 71, 12], [1, 4, 8, 15, 16, 23]])
RESID, TL4_RESID = "blocks.0.hook_resid_pre", "blocks.0.hook_in"


@pytest.fixture(scope="module")
def model():
    return make_bridge("gpt2")


# -- ActivationCache ------------------------------------------------------------------------------------------
def test_remove_batch_dim_keeps_position_indexed_entries():
    resid, pattern, bias = torch.randn(1, 5, 4), torch.randn(1, 2, 5, 5), torch.randn(5, 5)
    cache = ActivationCache({RESID: resid, "blocks.0.attn.hook_pattern": pattern, "rel_pos_bias": bias})
    assert cache._batch_size() == 1  # the most common leading size
    assert cache.remove_batch_dim() is cache and not cache.has_batch_dim
    assert torch.equal(cache[RESID], resid[0]) and torch.equal(cache["blocks.0.attn.hook_pattern"], pattern[0])
    assert cache["rel_pos_bias"] is bias


def test_remove_batch_dim_refuses_a_batch_despite_a_broadcast_entry():
    cache = ActivationCache(
        {RESID: torch.randn(2, 5, 4), "hook_mlp_out": torch.randn(2, 5, 4), "idx": torch.ones(1, 5)}
    )
    with pytest.raises(ValueError, match="batch size 2") as err:
        cache.remove_batch_dim()
    assert isinstance(err.value, AssertionError)  # TransformerLens asserts here
    assert cache.has_batch_dim and cache[RESID].shape == (2, 5, 4)  # nothing changed


def test_remove_batch_dim_takes_a_given_batch_size():
    bias = torch.randn(5, 5)
    with pytest.raises(AssertionError, match="batch size 5"):  # inferred: its only entry leads with 5
        ActivationCache({"rel_pos_bias": bias}).remove_batch_dim()
    with pytest.raises(AssertionError, match="batch size 2"):
        ActivationCache({"rel_pos_bias": bias}).remove_batch_dim(batch_size=2)
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match="`batch_size`"):
            ActivationCache({"rel_pos_bias": bias}).remove_batch_dim(batch_size=bad)
    cache = ActivationCache({"rel_pos_bias": bias}).remove_batch_dim(batch_size=1)
    assert not cache.has_batch_dim and cache["rel_pos_bias"] is bias


def test_the_attention_mask_decides_the_batch_size():
    flat = torch.randn(6, 4)  # a flattened [batch * pos, ...] entry of a batch of one
    cache = ActivationCache({"router": flat}, attention_mask=torch.ones(1, 6, dtype=torch.long))
    assert cache._batch_size() == 1
    cache.remove_batch_dim()
    assert cache["router"] is flat and cache.attention_mask.shape == (6,)


def test_apply_slice_to_batch_dim_keeps_broadcast_entries():
    resid, idx = torch.randn(3, 5, 4), torch.randn(1, 5)
    cache = ActivationCache({RESID: resid, "hook_mlp_out": resid.clone(), "idx": idx})
    rows = cache.apply_slice_to_batch_dim((1, 3))
    assert torch.equal(rows[RESID], resid[1:3]) and rows["hook_mlp_out"].shape == (2, 5, 4)
    assert rows["idx"] is idx
    one = cache.apply_slice_to_batch_dim(2)
    assert not one.has_batch_dim and torch.equal(one[RESID], resid[2]) and one["idx"] is idx


# -- run_with_cache -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_object", [True, False])
def test_run_with_cache_takes_the_batch_size_from_its_input(model, as_object):
    with pytest.raises(AssertionError, match="batch size 2"):
        model.run_with_cache(TOKENS[:2], names_filter=RESID, remove_batch_dim=True, return_cache_object=as_object)
    with pytest.raises(ValueError, match="batch of one, got batch size 3"):
        model.run_with_cache(["a", "b", "c"], remove_batch_dim=True, return_cache_object=as_object)
    _, full = model.run_with_cache(TOKENS[:1], names_filter=RESID)
    _, single = model.run_with_cache(TOKENS[:1], names_filter=RESID, remove_batch_dim=True,
                                     return_cache_object=as_object)  # fmt: skip
    assert torch.equal(single[RESID], full[RESID][0])


# -- caching hooks --------------------------------------------------------------------------------------------
def _cached(model, tokens, names_filter, **kwargs):
    cache, fwd, bwd = model.get_caching_hooks(names_filter, **kwargs)
    with model.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
        if bwd:
            model(tokens, return_type="loss").backward()
        else:
            with torch.no_grad():
                model(tokens)
    return cache


@pytest.mark.parametrize("names_filter", [TL4_RESID, [TL4_RESID], RESID])
def test_caching_dict_reads_tl4_spellings_with_one_entry(model, names_filter):
    _, ref = model.run_with_cache(TOKENS, names_filter=RESID)
    cache = _cached(model, TOKENS, names_filter)
    assert isinstance(cache, CachingDict) and list(cache) == [RESID]  # one entry, under the canonical name
    assert cache[TL4_RESID] is cache[RESID] and cache.get(TL4_RESID) is cache[RESID]
    assert TL4_RESID in cache and "blocks.0.hook_out" not in cache and cache.get("blocks.0.hook_out") is None
    assert torch.equal(cache[RESID], ref[RESID])
    with pytest.raises(KeyError):
        cache["blocks.0.hook_out"]


def test_caching_dict_reads_tl4_spellings_of_gradients(model):
    _, ref = model.run_with_cache(TOKENS, names_filter=RESID, incl_bwd=True, return_type="loss")
    cache = _cached(model, TOKENS, TL4_RESID, incl_bwd=True)
    assert set(cache) == {RESID, RESID + "_grad"}
    assert cache[TL4_RESID + "_grad"] is cache[RESID + "_grad"]
    torch.testing.assert_close(cache[RESID + "_grad"], ref[RESID + "_grad"])


def test_add_caching_hooks_reads_tl4_spellings(model):
    _, ref = model.run_with_cache(TOKENS[:1], names_filter="blocks.1.hook_resid_post")
    cache = model.add_caching_hooks("blocks.1.hook_out")
    try:
        with torch.no_grad():
            model(TOKENS[:1])
    finally:
        model.reset_hooks()
    assert list(cache) == ["blocks.1.hook_resid_post"]
    assert torch.equal(cache["blocks.1.hook_out"], ref["resid_post", 1])


def test_caching_hooks_remove_batch_dim_per_tensor(model):
    names = [RESID, "blocks.0.attn.hook_pattern", "hook_tokens"]
    _, ref = model.run_with_cache(TOKENS, names_filter=names)
    batch = _cached(model, TOKENS, names, remove_batch_dim=True)
    assert all(torch.equal(batch[n], ref[n]) for n in names)  # a batch of three keeps every row
    _, ref1 = model.run_with_cache(TOKENS[:1], names_filter=names, remove_batch_dim=True)
    single = _cached(model, TOKENS[:1], names, remove_batch_dim=True)
    assert all(torch.equal(single[n], ref1[n]) for n in names) and single[RESID].dim() == 2
    cache, fwd, _ = model.get_caching_hooks(RESID, remove_batch_dim=True)
    hook = model.get_hook_point(RESID)
    for tensor in (torch.randn(6, model.cfg.d_model), torch.tensor(2.0)):  # flattened, or no batch axis: kept
        fwd[0][1](tensor, hook)
        assert torch.equal(cache[RESID], tensor)


def test_a_given_plain_dict_is_filled_under_canonical_names(model):
    mine: dict = {}
    assert _cached(model, TOKENS, TL4_RESID, cache=mine) is mine and list(mine) == [RESID]
    with pytest.raises(TypeError, match="`cache` must be a dict"):
        model.get_caching_hooks(RESID, cache=[])


def test_get_hook_point(model):
    point = model.hook_dict[RESID]
    assert model.get_hook_point(RESID) is point and model.get_hook_point(TL4_RESID) is point
    assert model.get_hook_point(("resid_pre", 0)) is point
    assert model.get_hook_point("embed.hook_in") is model.hook_dict["hook_tokens"]
    assert model.get_hook_point("blocks.0.hook_nothing") is None and model.get_hook_point("blocks.99.hook_in") is None
    with pytest.raises(TypeError, match="`hook_name`"):
        model.get_hook_point(3)


def test_run_with_cache_dicts_read_tl4_spellings(model):
    """`run_with_cache`'s dict (`return_cache_object=False`, or `cache.cache_dict`) is a `CachingDict` too."""
    _, plain = model.run_with_cache(TOKENS, names_filter=RESID, return_cache_object=False)
    _, cache = model.run_with_cache(TOKENS, names_filter=RESID)
    for d in (plain, cache.cache_dict):
        assert isinstance(d, CachingDict) and list(d) == [RESID]
        assert d[TL4_RESID] is d[RESID] and TL4_RESID in d
    assert torch.equal(plain[TL4_RESID], cache[RESID])
