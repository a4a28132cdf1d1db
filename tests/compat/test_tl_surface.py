"""TransformerLens surface measured missing by its own test suite (benchmarks/results/tl_suite.md), each
checked against an independent computation: run_with_cache's forward keywords, QK / OV circuits and
composition scores from the raw per-head weights, get_params, the padding helpers of utils, TransformerLens
4's component-I/O spellings of hook points, and components called as their HF modules.
"""

import copy

import pytest
import torch
from conftest import make_bridge, perturb_

from transformer_bridge import utils
from transformer_bridge.compat.factored import FactoredMatrix
from transformer_bridge.sites.module_paths import get_module

FAMILIES = ["gpt2", "llama", "gpt_neox", "qwen2"]
TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3, 60], [1, 9, 9, 33, 71, 12, 4]])


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return perturb_(make_bridge(request.param))


# -- run_with_cache keywords -------------------------------------------------------------------------
def test_run_with_cache_return_types_match_forward(model):
    logits = model(TOKENS)
    loss, cache = model.run_with_cache(TOKENS, return_type="loss")
    assert torch.equal(loss, model(TOKENS, return_type="loss"))
    per_token, _ = model.run_with_cache(TOKENS, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, TOKENS.shape[1] - 1)
    manual = -logits[:, :-1].log_softmax(-1).gather(-1, TOKENS[:, 1:, None])[..., 0]
    torch.testing.assert_close(per_token, manual)
    (both_logits, both_loss), _ = model.run_with_cache(TOKENS, return_type="both")
    assert torch.equal(both_logits, logits) and torch.equal(both_loss, loss)
    none, cache2 = model.run_with_cache(TOKENS, return_type=None, names_filter="resid_post")
    assert none is None and torch.equal(cache2["resid_post", 1], cache["resid_post", 1])


def test_run_with_cache_plain_dict_and_contexts(model):
    _, cache = model.run_with_cache(TOKENS, names_filter="pattern")
    _, plain = model.run_with_cache(TOKENS, names_filter="pattern", return_cache_object=False)
    assert isinstance(plain, dict) and set(plain) == set(cache.keys())  # a CachingDict: TL 4 spellings read too
    assert all(torch.equal(plain[k], cache[k]) for k in plain)
    point = model.hook_dict["blocks.0.attn.hook_pattern"]
    point.ctx["seen"] = 1
    model.run_with_cache(TOKENS, names_filter="pattern")
    assert point.ctx["seen"] == 1
    model.run_with_cache(TOKENS, names_filter="pattern", clear_contexts=True)
    assert "seen" not in point.ctx


def test_run_with_cache_keyword_errors(model):
    with pytest.raises(ValueError, match="return_type"):
        model.run_with_cache(TOKENS, return_type="logit")
    with torch.no_grad(), pytest.raises(ValueError, match="gradient tracking is off"):
        model.run_with_cache(TOKENS, incl_bwd=True)
    with pytest.raises((TypeError, ValueError), match="reset_hooks_end"):
        model.run_with_cache(TOKENS, reset_hooks_end="no")


def test_original_model_is_the_hf_model(model):
    assert model.original_model is model.hf_model


# -- circuits ------------------------------------------------------------------------------------------
def test_qk_ov_are_the_per_head_products(model):
    n, h = model.cfg.n_layers, model.cfg.n_heads
    qk, ov = model.QK, model.OV
    assert qk.shape == ov.shape == (n, h, model.cfg.d_model, model.cfg.d_model)
    for layer in range(n):
        attn = model.blocks[layer].attn  # per-layer views of the HF weights (GQA: W_K / W_V over kv heads)
        wq, wk, wv, wo = attn.W_Q, attn.W_K, attn.W_V, attn.W_O
        group = h // wk.shape[0]  # query head `head` reads kv head `head // group` (HF's repeat_kv)
        assert wk.shape[0] == wv.shape[0] == model.cfg.n_kv_heads
        for head in range(h):
            kv = head // group
            torch.testing.assert_close(qk.AB[layer, head], wq[head] @ wk[kv].T)
            torch.testing.assert_close(ov.AB[layer, head], wv[kv] @ wo[head])
            torch.testing.assert_close(qk[layer, head].AB, wq[head] @ wk[kv].T)


def test_factored_matrix_algebra():
    torch.manual_seed(0)
    a, b = torch.randn(3, 10, 4), torch.randn(3, 4, 7)
    m, full = FactoredMatrix(a, b), a @ b
    torch.testing.assert_close(m.AB, full)
    torch.testing.assert_close(m.T.AB, full.transpose(-2, -1))
    torch.testing.assert_close(m.norm(), torch.linalg.matrix_norm(full), rtol=1e-4, atol=1e-5)
    u, s, v = m.svd()  # TransformerLens' convention: V, not Vᵀ
    torch.testing.assert_close(u @ torch.diag_embed(s) @ v.transpose(-2, -1), full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m.collapse_r() @ v.transpose(-2, -1), full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(u @ m.collapse_l(), full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m.make_even().AB, full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m[1, 2:5, -1].AB, full[1, 2:5, -1:])
    torch.testing.assert_close(m[..., [0, 3], :].AB, full[..., [0, 3], :])
    torch.testing.assert_close(m[None, 0].AB, full[None, 0])
    torch.testing.assert_close(m[0, :, None].AB, full[0, :, None])  # rows become a leading axis
    torch.testing.assert_close(m[0, :, :, None].AB, full[0, :, :, None])
    torch.testing.assert_close((m @ torch.ones(7)), full @ torch.ones(7), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close((torch.ones(10) @ m), torch.ones(10) @ full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, torch.linalg.svdvals(full)[..., :4], rtol=1e-4, atol=1e-5)
    other = FactoredMatrix(torch.randn(3, 7, 2), torch.randn(3, 2, 5))
    torch.testing.assert_close((m @ other).AB, full @ other.AB, rtol=1e-4, atol=1e-4)
    x = torch.randn(7, 6)
    torch.testing.assert_close((m @ x).AB, full @ x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close((x.T @ m.T).AB, x.T @ full.transpose(-2, -1), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="mdim"):
        FactoredMatrix(torch.randn(3, 4), torch.randn(5, 6))


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_composition_scores_from_full_matrices(model, mode):
    scores = model.all_composition_scores(mode)
    n, h = model.cfg.n_layers, model.cfg.n_heads
    assert scores.shape == (n, h, n, h) and scores.head_labels == model.all_head_labels
    assert model.all_head_labels[: h + 1] == [f"L0H{i}" for i in range(h)] + ["L1H0"]
    ov, qk = model.OV.AB, model.QK.AB
    right = {"Q": qk, "K": qk.transpose(-2, -1), "V": ov}[mode]
    for l1 in range(n):
        for l2 in range(n):
            for h1, h2 in ((0, 1), (h - 1, 0)):
                left, r = ov[l1, h1], right[l2, h2]
                expected = (left @ r).norm() / left.norm() / r.norm() if l1 < l2 else torch.tensor(0.0)
                torch.testing.assert_close(scores[l1, h1, l2, h2], expected, rtol=1e-4, atol=1e-6)
    assert torch.equal(scores.scores, scores.as_subclass(torch.Tensor))
    with pytest.raises(ValueError, match="mode"):
        model.all_composition_scores("X")


def test_get_params_names_and_values(model):
    params = model.get_params()
    assert torch.equal(params["embed.W_E"], model.W_E)
    assert torch.equal(params["unembed.W_U"], model.W_U) and torch.equal(params["unembed.b_U"], model.b_U)
    for layer in range(model.cfg.n_layers):
        for name in ("W_Q", "W_O", "b_Q", "b_O"):
            assert torch.equal(params[f"blocks.{layer}.attn.{name}"], getattr(model.blocks[layer].attn, name))
        group = model.cfg.n_heads // model.cfg.n_kv_heads  # GQA: query head h reads kv head h // group
        for name in ("W_K", "W_V", "b_K", "b_V"):
            kv = getattr(model.blocks[layer].attn, name)
            expanded = params[f"blocks.{layer}.attn.{name}"]
            assert expanded.shape[0] == model.cfg.n_heads
            assert all(torch.equal(expanded[h], kv[h // group]) for h in range(model.cfg.n_heads))
        for name in ("W_in", "W_out", "b_out"):
            assert torch.equal(params[f"blocks.{layer}.mlp.{name}"], getattr(model.blocks[layer].mlp, name))
        for norm in ("ln1", "ln2"):  # the norms' weights, as the components give them
            if hasattr(model.blocks[layer], norm):
                assert params[f"blocks.{layer}.{norm}.w"] is getattr(model.blocks[layer], norm).w
    assert params["ln_final.w"] is model.ln_final.w
    # TransformerLens 4's order: a block's attention, its MLP (W_in, W_out, b_in, b_out, W_gate), its norms; then
    # ln_final and the unembedding.
    block0 = [k.removeprefix("blocks.0.") for k in params if k.startswith("blocks.0.")]
    assert block0[:8] == [f"attn.{n}" for n in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")]
    mlp = [k for k in block0 if k.startswith("mlp.")]
    assert mlp == [f"mlp.{n}" for n in ("W_in", "W_out", "b_in", "b_out", "W_gate")][: len(mlp)]
    tail = ["ln_final.w", *(["ln_final.b"] if model.ln_final.b is not None else []), "unembed.W_U", "unembed.b_U"]
    assert block0[-1].startswith(("ln1.", "ln2.")) and list(params)[-len(tail) :] == tail
    assert ("pos_embed.W_pos" in params) == (model.cfg.positional_embedding_type == "standard")
    assert all(isinstance(v, torch.Tensor) for v in params.values())  # no None for a weight the family lacks
    # TransformerLens checks cfg.n_layers against the blocks in get_params; here cfg.n_layers cannot drift.
    with pytest.raises(ValueError, match=r"cfg\.n_layers` cannot be assigned"):
        model.cfg.n_layers = model.cfg.n_layers + 1


def test_tl_parameters_and_n_params_total(model):
    """TransformerLens 4's names: ``tl_parameters()`` / ``tl_named_parameters()`` are `get_params`;
    ``n_params_total`` counts the HF model's parameters once each (oracle: the distinct storages of its
    state dict, so a tied unembedding counts once)."""
    params = model.tl_parameters()
    assert params.keys() == model.get_params().keys()
    assert all(torch.equal(params[k], v) for k, v in model.tl_named_parameters())
    distinct = {t.data_ptr(): t.numel() for t in model.hf_model.state_dict().values() if t.is_floating_point()}
    buffers = {b.data_ptr() for b in model.hf_model.buffers()}
    assert model.n_params_total == sum(n for ptr, n in distinct.items() if ptr not in buffers)
    processed = copy.deepcopy(model)
    processed.enable_compatibility_mode()  # unties the unembedding and may add zero biases: not new parameters
    assert processed.n_params_total == model.n_params_total
    assert sum(p.numel() for p in processed.hf_model.parameters()) >= model.n_params_total


# -- utils padding helpers -------------------------------------------------------------------------------
def test_get_attention_mask_matches_the_tokenizer_mask():
    model = make_bridge("llama")
    tok = model.tokenizer
    for side in ("left", "right"):
        enc = tok(["ab", "abcdef"], padding=True, return_tensors="pt", padding_side=side)
        got = utils.get_attention_mask(tok, enc.input_ids, prepend_bos=True, padding_side=side)
        assert torch.equal(got, enc.attention_mask)
    assert torch.equal(utils.get_attention_mask(None, TOKENS, True), torch.ones_like(TOKENS))


def test_get_offset_position_ids():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert utils.get_offset_position_ids(0, mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert utils.get_offset_position_ids(3, mask).tolist() == [[1, 2], [3, 4]]


# -- TransformerLens 4 spellings and components ---------------------------------------------------------
def test_tl4_spellings_name_the_same_points(model):
    _, cache = model.run_with_cache(TOKENS)
    pairs = {
        "blocks.1.hook_in": "blocks.1.hook_resid_pre",
        "blocks.1.hook_out": "blocks.1.hook_resid_post",
        "blocks.0.attn.q.hook_out": "blocks.0.attn.hook_q",
        "blocks.0.attn.o.hook_in": "blocks.0.attn.hook_z",
        "blocks.0.mlp.hook_out": "blocks.0.hook_mlp_out",
        "embed.hook_out": "hook_embed",
    }
    for tl4, canonical in pairs.items():
        assert cache[tl4] is cache[canonical]
    _, grads = model.run_with_cache(TOKENS, names_filter="blocks.1.hook_out", incl_bwd=True, return_type="loss")
    assert grads["blocks.1.hook_out_grad"] is grads["blocks.1.hook_resid_post_grad"]
    assert "blocks.1.hook_out_grad" in grads and "blocks.0.hook_out_grad" not in grads
    assert model.blocks[0].mlp.hook_out is model.hook_dict["blocks.0.hook_mlp_out"]
    assert model.blocks[1].ln1.hook_in is model.hook_dict["blocks.1.hook_resid_pre"]
    seen = []
    model.run_with_hooks(TOKENS, fwd_hooks=[("embed.hook_out", lambda x, hook: seen.append(hook.name))])
    assert seen == ["hook_embed"]


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "olmo2"])
def test_tl4_spellings_that_depend_on_the_family(family):
    """TransformerLens 4 spells a gated MLP's up projection ``mlp.in`` (``hook_pre_linear``; its ``gate`` is
    ``hook_pre``), an ungated MLP's ``mlp.in`` ``hook_pre``; a sublayer's output ``attn.hook_out`` / ``attn.o.hook_out``
    is ``hook_attn_out`` only where no post-norm follows (Gemma 2, OLMo 2: TransformerLens 4's attn.hook_out is
    before ln1_post, where this bridge has no point, so the spelling is unknown, never the post-norm tensor)."""
    model = make_bridge(family)
    _, cache = model.run_with_cache(TOKENS)
    gated = "blocks.0.mlp.hook_pre_linear" in model.hook_dict
    post_normed = "blocks.0.ln1_post.hook_normalized" in model.hook_dict
    assert gated == (family != "gpt2") and post_normed == (family in ("gemma2", "olmo2"))
    expected = {"blocks.0.mlp.in.hook_out": "blocks.0.mlp.hook_pre_linear" if gated else "blocks.0.mlp.hook_pre",
                "blocks.0.mlp.gate.hook_out": "blocks.0.mlp.hook_pre" if gated else None,
                "blocks.0.attn.hook_out": None if post_normed else "blocks.0.hook_attn_out",
                "blocks.0.attn.o.hook_out": None if post_normed else "blocks.0.hook_attn_out",
                "blocks.0.mlp.hook_out": None if post_normed else "blocks.0.hook_mlp_out",
                "blocks.0.mlp.out.hook_out": None if post_normed else "blocks.0.hook_mlp_out",
                "blocks.1.attn.k.hook_in": "blocks.1.attn.hook_in", "hook_unembed": "unembed.hook_out",
                "ln_final.hook_in": f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"}  # fmt: skip
    for tl4, canonical in expected.items():
        if canonical is None:
            assert tl4 not in cache, tl4
            with pytest.raises(KeyError, match="Unknown hook point"):
                model.run_with_hooks(TOKENS, fwd_hooks=[(tl4, lambda x, hook: None)])
            with pytest.raises(KeyError):
                cache[tl4]
        else:
            assert cache[tl4] is cache[canonical], tl4
            seen = []
            model.run_with_hooks(TOKENS, fwd_hooks=[(tl4, lambda x, hook, seen=seen: seen.append(hook.name))])
            assert seen == [canonical], tl4
    held, fwd, _ = model.get_caching_hooks(names_filter=["blocks.0.mlp.hook_pre", "blocks.0.hook_attn_out"])
    model.run_with_hooks(TOKENS, fwd_hooks=fwd)  # TransformerLens' dict of the caching hooks reads the same way
    assert ("blocks.0.mlp.gate.hook_out" in held) == gated and ("blocks.0.attn.hook_out" in held) != post_normed


def test_dotted_paths_reach_hook_points(model):
    """Walking ``"blocks.0.attn.hook_k"`` with getattr, as code written for TransformerLens' modules does."""
    for name, point in model.hook_dict.items():
        current = model
        for part in name.split("."):
            current = getattr(current, part)
        assert current is point, name


def test_components_call_their_hf_module(model):
    x = torch.randn(2, 3, model.cfg.d_model)
    mlp = model.blocks[0].mlp
    assert torch.equal(mlp(x), mlp.module(x))


def test_retain_grad_in_a_hook_gets_the_true_gradient(model):
    """TransformerLens' idiom: keep an activation from a hook, ``retain_grad()``, backpropagate, read
    ``.grad``. Oracle: the activation made a leaf by a replacing hook, differentiated by autograd."""
    names = ["blocks.0.attn.hook_pattern", "blocks.1.hook_resid_post", "blocks.0.ln1.hook_scale"]
    # Points whose read-only hooks otherwise leave the model on its fused kernel (SDPA), off their tensor.
    names += [n for n in ("blocks.0.attn.hook_attn_scores", "blocks.1.attn.hook_rot_q", "blocks.1.attn.hook_rot_k")
              if n in model.hook_dict]  # fmt: skip
    kept = {}

    def keep(x, hook):
        x.retain_grad()
        kept[hook.name] = x

    with model.hooks(fwd_hooks=[(n, keep) for n in names]):
        loss = model(TOKENS, return_type="loss")
    loss.backward()
    model.hf_model.zero_grad(set_to_none=True)
    for name in names:
        leaf = {}

        def as_leaf(x, hook, leaf=leaf):
            leaf["x"] = x.detach().clone().requires_grad_(True)
            return leaf["x"]

        with model.hooks(fwd_hooks=[(name, as_leaf)]):
            reference_loss = model(TOKENS, return_type="loss")
        torch.testing.assert_close(reference_loss, loss)
        (grad,) = torch.autograd.grad(reference_loss, leaf["x"])
        assert kept[name].grad is not None, name
        torch.testing.assert_close(kept[name].grad, grad, atol=1e-7, rtol=1e-5)
    model.hf_model.zero_grad(set_to_none=True)
    assert torch.equal(model(TOKENS), model.hf_model(TOKENS).logits)


def test_run_with_cache_resumes_from_a_layer(model):
    """Resuming from the cached residual entering block K gives the full run's logits and, for block K
    on, its cache, bitwise; nothing before K (embeddings included) is cached."""
    logits, full = model.run_with_cache(TOKENS)
    resumed, cache = model.run_with_cache(full["resid_pre", 1], start_at_layer=1)
    assert torch.equal(resumed, logits)
    assert cache.keys() and all(torch.equal(cache[k], full[k]) for k in cache)
    assert {k for k in full if k.startswith(("blocks.1.", "ln_final", "unembed."))} == set(cache.keys())
    loss, _ = model.run_with_cache(full["resid_pre", 1], start_at_layer=1, tokens=TOKENS, return_type="loss")
    assert torch.equal(loss, model(TOKENS, return_type="loss"))
    resid, part = model.run_with_cache(full["resid_pre", 0], start_at_layer=0, stop_at_layer=1)
    assert torch.equal(resid, full["resid_post", 0]) and not any(k.startswith("blocks.1.") for k in part)


def test_tuple_pos_slice_is_a_slice(model):
    """TransformerLens reads a tuple as ``slice(*tuple)`` and a list as positions."""
    _, full = model.run_with_cache(TOKENS, names_filter=["resid_post", "pattern"])
    _, by_tuple = model.run_with_cache(TOKENS, names_filter=["resid_post", "pattern"], pos_slice=(1, 4))
    _, by_list = model.run_with_cache(TOKENS, names_filter=["resid_post", "pattern"], pos_slice=[1, 4])
    assert torch.equal(by_tuple["resid_post", 0], full["resid_post", 0][:, 1:4])
    assert torch.equal(by_tuple["pattern", 0], full["pattern", 0][:, :, 1:4])
    assert torch.equal(by_list["resid_post", 0], full["resid_post", 0][:, [1, 4]])


# -- ActivationCache: Slice, batch slicing, projections -----------------------------------------------------
def test_slice_objects_select_like_their_contents(model):
    _, cache = model.run_with_cache(TOKENS)
    for spec in (-1, (1, 4), [0, 5], None):
        assert torch.equal(cache.decompose_resid(pos_slice=utils.Slice(spec)), cache.decompose_resid(pos_slice=spec))
    x = torch.arange(24).reshape(2, 3, 4)
    assert torch.equal(utils.Slice(-1).apply(x, dim=1), x[:, -1])
    assert torch.equal(utils.Slice((0, 2)).apply(x, dim=2), x[:, :, 0:2])
    assert torch.equal(utils.Slice([2, 0]).apply(x, dim=1), x[:, [2, 0]])
    assert utils.Slice((1, 3)).indices(5).tolist() == [1, 2] and utils.Slice(-1).indices(5).tolist() == [
        -1
    ]  # TL's number


def test_apply_slice_to_batch_dim(model):
    _, cache = model.run_with_cache(TOKENS)
    row = cache.apply_slice_to_batch_dim(1)
    assert not row.has_batch_dim and torch.equal(row["resid_post", 0], cache["resid_post", 0][1])
    torch.testing.assert_close(row.decompose_resid(), cache.decompose_resid()[:, 1])
    torch.testing.assert_close(row.accumulated_resid(apply_ln=True), cache.accumulated_resid(apply_ln=True)[:, 1])
    rows = cache.apply_slice_to_batch_dim([1, 0])
    assert rows.has_batch_dim and torch.equal(rows["pattern", 1], cache["pattern", 1][[1, 0]])
    assert rows["resid_post", 0] is rows["resid_pre", 1]  # aliases stay one tensor
    with pytest.raises(ValueError, match="batch axis"):
        row.apply_slice_to_batch_dim(0)


def test_project_output_onto_contracts_d_model(model):
    _, cache = model.run_with_cache(TOKENS)
    v, m = torch.randn(model.cfg.d_model), torch.randn(model.cfg.d_model, 3)
    full = cache.stack_neuron_results(1, apply_ln=True, incl_remainder=True)
    torch.testing.assert_close(
        cache.stack_neuron_results(1, apply_ln=True, incl_remainder=True, project_output_onto=v), full @ v
    )
    torch.testing.assert_close(cache.get_neuron_results(0, project_output_onto=m), cache.get_neuron_results(0) @ m)
    stack, labels = cache.get_full_resid_decomposition(return_labels=True)
    projected, same = cache.get_full_resid_decomposition(return_labels=True, project_output_onto=v)
    assert same == labels
    torch.testing.assert_close(projected, stack @ v)
    with pytest.raises(TypeError, match="project_output_onto"):
        cache.get_neuron_results(0, project_output_onto=torch.randn(5))


# -- caching hooks (HookedRootModule) ------------------------------------------------------------------
def test_caching_hooks_fill_a_dict_like_run_with_cache(model):
    _, ref = model.run_with_cache(TOKENS)
    cache, fwd, bwd = model.get_caching_hooks(["resid_post", "pattern"], pos_slice=(1, 4))
    assert bwd == []
    with model.hooks(fwd_hooks=fwd):
        model(TOKENS)
    assert set(cache) == set(model.names_matching(["resid_post", "pattern"]))
    assert torch.equal(cache["blocks.0.hook_resid_post"], ref["resid_post", 0][:, 1:4])
    assert torch.equal(cache["blocks.1.attn.hook_pattern"], ref["pattern", 1][:, :, 1:4])
    kept = model.add_caching_hooks("blocks.1.hook_resid_post")
    model(TOKENS[:1])
    # A batch of one takes other BLAS blocking than the batch of two (with several threads): close, not bitwise.
    torch.testing.assert_close(kept["blocks.1.hook_resid_post"], ref["resid_post", 1][:1])
    model.reset_hooks()
    kept.clear()
    model(TOKENS)
    assert kept == {}
    with pytest.warns(DeprecationWarning):
        everything = model.cache_all({}, remove_batch_dim=True)
    model(TOKENS[:1])
    model.reset_hooks()
    # every point but the head results, which fire only when named (use_attn_result=False, as TransformerLens' do)
    assert set(everything) == {n for n in model.hook_dict if not n.endswith(".attn.hook_result")}
    torch.testing.assert_close(everything["blocks.0.hook_resid_pre"], ref["resid_pre", 0][0])


def test_caching_hooks_gradients_match_run_with_cache(model):
    _, ref = model.run_with_cache(TOKENS, names_filter="resid_pre", incl_bwd=True, return_type="loss")
    cache, fwd, bwd = model.get_caching_hooks("resid_pre", incl_bwd=True)
    with model.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
        model(TOKENS, return_type="loss").backward()
    model.hf_model.zero_grad(set_to_none=True)
    for layer in range(model.cfg.n_layers):
        name = f"blocks.{layer}.hook_resid_pre"
        torch.testing.assert_close(cache[name + "_grad"], ref[name + "_grad"])


# -- hook levels (TransformerLens' HookedRootModule) ---------------------------------------------------
def test_hook_levels(model):
    fired = []

    def note(tag):
        return lambda x, hook: fired.append(tag)

    point = model.hook_dict["blocks.0.hook_resid_post"]
    model.add_hook(point.name, note("outer"), level=7)
    point.add_hook(note("untagged"))
    assert model.context_level == 0
    with model.hooks(fwd_hooks=[(point.name, note("ctx1"))]):
        assert model.context_level == 1
        with model.hooks(fwd_hooks=[(point.name, note("ctx2"))]):
            assert model.context_level == 2 and [e.level for e in point.fwd_hooks] == [7, None, 1, 2]
        model(TOKENS)
    assert model.context_level == 0 and fired == ["outer", "untagged", "ctx1"]
    with pytest.raises(RuntimeError), model.hooks(fwd_hooks=[(point.name, note("x"))]):
        raise RuntimeError
    assert model.context_level == 0
    model.reset_hooks(level=7)
    assert [e.level for e in point.fwd_hooks] == [None]
    point.add_hook(note("again"), level=3)
    point.remove_hooks(level=3)
    assert [e.level for e in point.fwd_hooks] == [None]
    model.reset_hooks()
    assert not point.fwd_hooks
    with pytest.raises(TypeError, match="level"):
        model.add_hook(point.name, note("bad"), level="1")


def test_apply_ln_to_stack_recompute_ln(model):
    """``recompute_ln=True`` at the final norm: each component normalised by its own statistics (oracle:
    torch's layer_norm / an RMS norm without weight); its last row is the cached ``hook_normalized``."""
    _, cache = model.run_with_cache(TOKENS)
    stack = cache.accumulated_resid()
    own = cache.apply_ln_to_stack(stack, recompute_ln=True)
    norm = get_module(model.hf_model, model.adapter.ln_final)
    eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", None)
    if model.cfg.normalization == "layernorm":
        expected = torch.nn.functional.layer_norm(stack, (model.cfg.d_model,), eps=eps)
    else:
        expected = stack * torch.rsqrt(stack.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(own, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(own[-1], cache["ln_final.hook_normalized"], atol=1e-5, rtol=1e-5)
    cached = cache.apply_ln_to_stack(stack)
    assert not torch.allclose(own[0], cached[0])  # the first layer's own scale is not the final one
    assert torch.equal(cache.apply_ln_to_stack(stack, layer=1, recompute_ln=True), cache.apply_ln_to_stack(stack, 1))


def test_incl_bwd_on_a_frozen_model_says_why():
    model = make_bridge("llama")
    for p in model.hf_model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no grad_fn"):
        model.run_with_cache(TOKENS, incl_bwd=True, return_type="loss")


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [({}, "return_type='logits'"), ({"return_type": "both"}, "return_type='both'"),
     ({"return_type": "loss", "loss_per_token": True}, "return_type='loss', loss_per_token=True")],
)  # fmt: skip
def test_incl_bwd_needs_a_scalar_output_or_a_metric(kwargs, shown):
    """TransformerLens' rule: backward() on the output, which must be a scalar; `metric=` picks another scalar."""
    model = make_bridge("llama")
    with pytest.raises(ValueError, match=rf"`incl_bwd=True` calls backward\(\) on a scalar output, and {shown}"):
        model.run_with_cache(TOKENS, incl_bwd=True, **kwargs)
    loss, cache = model.run_with_cache(
        TOKENS, names_filter="blocks.0.hook_resid_post", incl_bwd=True, return_type="loss"
    )
    assert torch.equal(loss, model(TOKENS, return_type="loss"))
    _, by_metric = model.run_with_cache(
        TOKENS,
        names_filter="blocks.0.hook_resid_post",
        incl_bwd=True,
        metric=lambda logits: logits.log_softmax(-1)[..., 3].sum(),
    )
    assert not torch.equal(cache["blocks.0.hook_resid_post_grad"], by_metric["blocks.0.hook_resid_post_grad"])
    assert not any(point.fwd_hooks or point.bwd_hooks for point in model.hook_dict.values())  # nothing left
