"""run_with_cache and ActivationCache: selection, storage, shorthand keys, analysis helpers, save/load."""

import numpy as np
import pytest
import torch
from conftest import V, make_bridge, normalized_input

from transformer_bridge import ActivationCache, get_act_name
from transformer_bridge.sites.module_paths import get_module

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(7))


def test_cache_matches_hf_hidden_states_bitwise(bridge):
    _, cache = bridge.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_resid_pre"))
    with torch.no_grad():
        hidden = bridge.hf_model(TOKENS, output_hidden_states=True).hidden_states
    for layer in range(bridge.cfg.n_layers):
        assert torch.equal(cache["resid_pre", layer], hidden[layer])


def test_all_hooks_cached_once_with_shared_aliases(bridge):
    logits, cache = bridge.run_with_cache(TOKENS)
    # every point but the head results, which use_attn_result=False (the default) computes on demand only
    assert set(cache) == {n for n in bridge.hook_dict if not n.endswith("attn.hook_result")}
    assert not any(t.requires_grad for t in cache.values())  # stored detached; the logits follow the grad mode
    post0, pre1 = cache["resid_post", 0], cache["resid_pre", 1]
    assert post0.untyped_storage().data_ptr() == pre1.untyped_storage().data_ptr()
    distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cache.values()}
    assert cache.nbytes() == sum(distinct.values())
    with torch.no_grad():  # caching hooks only read: HF's own kernels compute the output, bitwise
        assert torch.equal(logits, bridge.hf_model(TOKENS).logits)


def test_names_filter_forms():
    model = make_bridge("gpt2")
    _, c1 = model.run_with_cache(TOKENS, names_filter="blocks.0.hook_resid_post")
    _, c2 = model.run_with_cache(TOKENS, names_filter=["blocks.0.hook_resid_post", "hook_embed"])
    _, c3 = model.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_pattern"))
    assert list(c1) == ["blocks.0.hook_resid_post"]
    assert set(c2) == {"blocks.0.hook_resid_post", "hook_embed"}
    assert set(c3) == {"blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"}
    with pytest.raises(ValueError, match="matched no hook point"):
        model.run_with_cache(TOKENS, names_filter=lambda n: "nothing" in n)
    with pytest.raises(ValueError, match="is empty"):
        model.run_with_cache(TOKENS, names_filter=[])
    with pytest.raises(KeyError, match="hook_resid_post"):
        model.run_with_cache(TOKENS, names_filter="blocks.0.hook_resid_pst")


def test_shorthand_keys():
    model = make_bridge("llama")
    _, cache = model.run_with_cache(TOKENS)
    assert cache["resid_post", 1] is cache["blocks.1.hook_resid_post"]
    assert cache["resid_post", -1] is cache["blocks.1.hook_resid_post"]
    assert cache["pattern", 0] is cache["blocks.0.attn.hook_pattern"]
    assert cache["scale", 0, "ln2"] is cache["blocks.0.ln2.hook_scale"]
    assert cache["scale"] is cache["ln_final.hook_scale"]
    assert cache["embed"] is cache["hook_embed"]
    assert ("q", 0) in cache and ("nonsense", 0) not in cache
    assert get_act_name("z", 3) == "blocks.3.attn.hook_z"
    assert get_act_name("pre_linear", 1) == "blocks.1.mlp.hook_pre_linear"
    with pytest.raises(KeyError, match="needs a layer"):
        cache["resid_post"]
    assert get_act_name("resid", 0) == "blocks.0.hook_resid"  # TransformerLens' construction ...
    with pytest.raises(KeyError, match="hook_resid_p"):  # ... which the cache refuses with close matches
        cache["resid", 0]


def test_tl_layer_forms_and_names():
    """TransformerLens' cache keys: a layer as a 0-d integer tensor (what `topk` returns) or a numpy int, and any
    name its `get_act_name` builds (``"in"`` -> ``blocks.L.hook_in``, TransformerLens 4's resid_pre)."""
    model = make_bridge("llama")
    _, cache = model.run_with_cache(TOKENS)
    top = cache["resid_post", 1].norm(dim=-1).flatten().topk(1).indices[0] % 2
    assert top.ndim == 0 and cache["attn", top] is cache[f"blocks.{int(top)}.attn.hook_pattern"]
    assert cache["attn", torch.tensor(1)] is cache["pattern", 1]
    assert cache["resid_pre", np.int64(-1)] is cache["blocks.1.hook_resid_pre"]
    assert cache["in", torch.tensor(1)] is cache["blocks.1.hook_resid_pre"]
    assert cache["in", 0, "a"] is cache["blocks.0.attn.hook_in"]
    assert cache[get_act_name("in", 1)] is cache["resid_pre", 1]
    assert get_act_name("k", torch.tensor(6), "a") == "blocks.6.attn.hook_k"
    assert get_act_name("mlp_mid", 2) == "blocks.2.mlp.hook_mid" and get_act_name("in") == "hook_in"
    for bad in (torch.tensor(1.0), torch.tensor([1]), True):
        with pytest.raises(TypeError, match="layer must be an int"):
            cache["attn", bad]
    assert torch.equal(model(TOKENS, stop_at_layer=torch.tensor(1)), cache["resid_pre", 1])
    assert torch.equal(model(TOKENS, stop_at_layer=np.int64(1)), cache["resid_pre", 1])
    assert torch.equal(cache.accumulated_resid(layer=torch.tensor(1)), cache.accumulated_resid(layer=1))


def test_device_pos_slice_remove_batch_dim():
    model = make_bridge("llama")
    _, full = model.run_with_cache(TOKENS, names_filter=["blocks.0.hook_resid_post", "blocks.0.attn.hook_pattern"])
    _, last = model.run_with_cache(
        TOKENS, names_filter=["blocks.0.hook_resid_post", "blocks.0.attn.hook_pattern"], pos_slice=-1, device="cpu"
    )
    assert torch.equal(last["resid_post", 0], full["resid_post", 0][:, -1:])
    assert torch.equal(last["pattern", 0], full["pattern", 0][:, :, -1:])
    _, single = model.run_with_cache(TOKENS[:1], names_filter="blocks.0.hook_resid_post", remove_batch_dim=True)
    torch.testing.assert_close(single["resid_post", 0], full["resid_post", 0][0])  # batch size changes BLAS order
    with pytest.raises(ValueError, match="batch of one"):
        model.run_with_cache(TOKENS, remove_batch_dim=True)
    moved = full.to("cpu")
    assert torch.equal(moved["resid_post", 0], full["resid_post", 0])


def test_incl_bwd_stores_gradients():
    model = make_bridge("qwen2")
    names = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_v"]
    _, cache = model.run_with_cache(TOKENS, names_filter=names, incl_bwd=True, return_type="loss")
    model.hf_model.zero_grad()
    captured = {}

    def keep(x, hook):
        x = x.clone()
        x.retain_grad()
        captured[hook.name] = x
        return x

    with model.hooks(fwd_hooks=[(n, keep) for n in names]):
        model(TOKENS, return_type="loss").backward()
    model.hf_model.zero_grad()
    for n in names:
        torch.testing.assert_close(cache[n + "_grad"], captured[n].grad)
    _, cache = model.run_with_cache(TOKENS, names_filter=names, incl_bwd=True, metric=lambda lg: lg[0, -1, 3])
    model.hf_model.zero_grad()
    assert cache["blocks.1.hook_resid_post_grad"][1].abs().max() == 0  # row 1 does not touch the metric


def test_pos_slice_cuts_gradients_on_the_axis_of_their_point():
    """A gradient is sliced like its activation: patterns and scores on the query axis, the rest on positions."""
    model = make_bridge("llama")
    names = ["blocks.0.attn.hook_pattern", "blocks.0.attn.hook_attn_scores", "blocks.1.hook_resid_post"]
    _, full = model.run_with_cache(TOKENS, names_filter=names, incl_bwd=True, return_type="loss")
    model.hf_model.zero_grad()
    _, cut = model.run_with_cache(TOKENS, names_filter=names, incl_bwd=True, pos_slice=slice(1, 3), return_type="loss")
    model.hf_model.zero_grad()
    for n in names[:2]:
        torch.testing.assert_close(cut[n + "_grad"], full[n + "_grad"][:, :, 1:3])
    torch.testing.assert_close(cut[names[2] + "_grad"], full[names[2] + "_grad"][:, 1:3])


def test_save_load_roundtrip(tmp_path):
    model = make_bridge("gpt2")
    _, cache = model.run_with_cache(["Hi", "Hello"])
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    assert path.read_bytes()[8:9] == b"{"  # a safetensors header, not a pickle
    loaded = ActivationCache.load(path, model=model)
    assert set(loaded) == set(cache)
    for name in cache:
        assert torch.equal(loaded[name], cache[name]), name
    assert torch.equal(loaded.attention_mask, cache.attention_mask)
    # Aliases stay shared after loading, so memory is not doubled.
    assert loaded["resid_post", 0].data_ptr() == loaded["resid_pre", 1].data_ptr()
    torch.testing.assert_close(loaded.decompose_resid().sum(0), cache["resid_post", -1])


@pytest.fixture(scope="module")
def full_cache(bridge):
    return bridge.run_with_cache(TOKENS)


def test_decompose_resid_sums_to_residual(bridge, full_cache):
    _, cache = full_cache
    parts, labels = cache.decompose_resid(return_labels=True)
    n = bridge.cfg.n_layers
    assert labels[0] == "embed" and labels[-1] == f"{n - 1}_mlp_out"
    assert len(labels) == (2 if "hook_pos_embed" in bridge.hook_dict else 1) + 2 * n
    torch.testing.assert_close(parts.sum(0), cache["resid_post", -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.decompose_resid(layer=1).sum(0), cache["resid_pre", 1], atol=1e-5, rtol=1e-5)
    if "hook_pos_embed" in bridge.hook_dict and bridge.cfg.model_type == "gpt2":
        torch.testing.assert_close(parts[0], cache["hook_embed"], atol=1e-6, rtol=1e-6)
    attn_only = cache.decompose_resid(mode="attn")
    assert attn_only.shape[0] == len(labels) - n
    with pytest.raises(ValueError, match="`mode`"):
        cache.decompose_resid(mode="heads")


def test_accumulated_resid(bridge, full_cache):
    _, cache = full_cache
    resids, labels = cache.accumulated_resid(return_labels=True)
    n = bridge.cfg.n_layers
    assert labels == [f"{i}_pre" for i in range(n)] + ["final_post"]
    assert torch.equal(resids[1], cache["resid_pre", 1]) and torch.equal(resids[-1], cache["resid_post", -1])
    assert cache.accumulated_resid(layer=1).shape[0] == 2  # TransformerLens: 0_pre and 1_pre


def test_stack_head_results_and_apply_ln(bridge, full_cache):
    _, cache = full_cache
    heads, labels = cache.stack_head_results(return_labels=True)
    assert heads.shape == (bridge.cfg.n_layers * bridge.cfg.n_heads, *TOKENS.shape, bridge.cfg.d_model)
    assert labels[:2] == ["L0H0", "L0H1"]
    if not bridge.adapter.sandwich:  # times Granite's residual_multiplier (1 elsewhere)
        r = bridge.adapter.residual_scale(bridge.hf_model.config)
        torch.testing.assert_close(heads[:4].sum(0), cache["result", 0].sum(-2) * r)
    else:  # Gemma 2: each head goes through the post-attention norm at its cached scale
        torch.testing.assert_close(heads[:4].sum(0), cache["attn_out", 0], atol=1e-5, rtol=1e-5)
    normed = cache.decompose_resid(apply_ln=True)
    torch.testing.assert_close(normed.sum(0), cache["ln_final.hook_normalized"], atol=1e-5, rtol=1e-5)
    normed = cache.decompose_resid(layer=1, apply_ln=True)
    torch.testing.assert_close(normed.sum(0), normalized_input(bridge, cache, 1), atol=1e-5, rtol=1e-5)


def test_logit_attrs_sum_to_logit_minus_bias_terms(bridge, full_cache):
    logits, cache = full_cache
    target = TOKENS[:, -1]  # any token per row
    attrs = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), tokens=target, pos_slice=-1)
    assert attrs.shape == (cache.decompose_resid().shape[0], TOKENS.shape[0])  # an int pos_slice drops the axis
    norm = get_module(bridge.hf_model, bridge.adapter.ln_final)
    w_u = bridge.hf_model.get_output_embeddings().weight[target]  # [batch, d_model]
    beta = getattr(norm, "bias", None)
    bias_terms = (w_u @ beta if beta is not None else 0) + (bridge.b_U_raw[target] if bridge.b_U_raw is not None else 0)
    cap = getattr(bridge.hf_model.config, "final_logit_softcapping", None)
    rows = torch.arange(TOKENS.shape[0])
    logit = logits[rows, -1, target]
    if cap:  # Gemma 2: attributions explain the logit before soft-capping
        logit = torch.atanh(logit / cap) * cap
    torch.testing.assert_close(attrs.sum(0), logit - bias_terms, atol=1e-4, rtol=1e-4)
    # Contrast with another token: attributions of the difference.
    diff = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), tokens=5, incorrect_tokens=6, pos_slice=-1)
    expected = (logits[:, -1, 5] - logits[:, -1, 6]) if not cap else None
    if expected is not None:
        torch.testing.assert_close(diff.sum(0), expected - (
            (bridge.hf_model.get_output_embeddings().weight[5] - bridge.hf_model.get_output_embeddings().weight[6])
            @ beta if beta is not None else 0), atol=1e-4, rtol=1e-4)  # fmt: skip


def test_missing_entries_say_how_to_fix():
    model = make_bridge("llama")
    _, cache = model.run_with_cache(TOKENS, names_filter="blocks.0.hook_resid_post")
    with pytest.raises(KeyError, match="names_filter"):
        cache.decompose_resid()
    with pytest.raises(ValueError, match="no model attached"):
        ActivationCache({"hook_embed": torch.zeros(1)}).decompose_resid()
