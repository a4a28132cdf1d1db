"""TransformerLens behaviours added for issue #9's third round, each checked against an independent computation:
``forward(position_ids=)`` (HF's logits with the same positions), duck-typed ``compute_head_results``
(per-head matmuls in float64), head results cached once (TL's warning), errors that are also
``AssertionError`` where TransformerLens asserts, GQA ``W_K`` / ``W_V`` over kv heads, and small ``utils``."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_bridge, perturb_

from transformer_bridge import ActivationCache, utils
from transformer_bridge.compat.factored import FactoredMatrix
from transformer_bridge.compat.weights import W_K, W_V

TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3, 60], [1, 9, 9, 33, 71, 12, 4]])
ALREADY = "Tried to compute head results when they were already cached"


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2"])
def model(request):
    return perturb_(make_bridge(request.param))


# -- position_ids ---------------------------------------------------------------------------------------------
def test_position_ids_give_hf_logits_and_hook_positions(model):
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
    seen = []
    with torch.no_grad():
        expected = model.hf_model(input_ids=TOKENS, position_ids=positions).logits
        default = model.hf_model(input_ids=TOKENS).logits
        got = model.run_with_hooks(
            TOKENS, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: seen.append(hook.ctx.positions.clone()))]
        )
        assert torch.equal(got, default)  # no position_ids: HF's default positions
        got = model(TOKENS, position_ids=positions)
        with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: seen.append(hook.ctx.positions))]):
            model(TOKENS, position_ids=positions)
    assert torch.equal(got, expected)  # bitwise HF's, shifted positions included
    assert not torch.allclose(got[1], default[1])  # the shift matters (rotary and learned positions alike)
    assert torch.equal(seen[-1], positions)


def test_position_ids_bad_shape_names_the_parameter(model):
    with pytest.raises(ValueError, match="position_ids"):
        model(TOKENS, position_ids=torch.arange(3)[None])


# -- compute_head_results -------------------------------------------------------------------------------------
def _reference(z: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """Each head's ``z @ W_O[h]`` in float64, one head at a time."""
    return torch.stack([z[..., h, :].double() @ w_o[h].double() for h in range(w_o.shape[0])], dim=-2)


@pytest.mark.parametrize("has_batch_dim", [True, False])
def test_compute_head_results_duck_typed_model(has_batch_dim):
    gen = torch.Generator().manual_seed(0)
    w_o = torch.randn(3, 4, 8, generator=gen, requires_grad=True)
    z = torch.randn(*((2,) if has_batch_dim else ()), 5, 3, 4, generator=gen)
    duck = SimpleNamespace(
        cfg=SimpleNamespace(n_layers=1, n_heads=3), blocks=[SimpleNamespace(attn=SimpleNamespace(W_O=w_o))]
    )
    cache = ActivationCache({"blocks.0.attn.hook_z": z}, duck, has_batch_dim=has_batch_dim)
    cache.compute_head_results()
    result = cache["blocks.0.attn.hook_result"]
    torch.testing.assert_close(result.double(), _reference(z, w_o.detach()), rtol=1e-5, atol=1e-6)
    # The weights are used as the model gives them, so gradients reach them (as TransformerLens).
    (grad,) = torch.autograd.grad(result.sum(), w_o)
    torch.testing.assert_close(grad, torch.einsum("...hd->hd", z)[..., None].expand_as(w_o))


def test_head_results_are_computed_once(model, caplog):
    _, full = model.run_with_cache(TOKENS)
    z_only = {k: v for k, v in full.cache_dict.items() if "hook_result" not in k}
    cache = ActivationCache(z_only, model)
    with caplog.at_level(logging.WARNING):
        first = cache.stack_head_results()
        second = cache.stack_head_results()
    assert ALREADY not in caplog.messages
    torch.testing.assert_close(first, second)
    for layer in range(model.cfg.n_layers):  # stored by stack_head_results, equal to the per-head matmul
        z, w_o = full["z", layer], model.blocks[layer].attn.W_O
        torch.testing.assert_close(cache["result", layer].double(), _reference(z, w_o.detach()), rtol=1e-5, atol=1e-6)
    with caplog.at_level(logging.WARNING):
        cache.compute_head_results()
    assert ALREADY in caplog.messages


def test_malformed_cached_head_result_is_recomputed(model):
    _, full = model.run_with_cache(TOKENS)
    tensors = {k: v for k, v in full.cache_dict.items() if "hook_result" not in k}
    tensors["blocks.0.attn.hook_result"] = torch.zeros(2, 7, 1, model.cfg.d_model)  # wrong head count
    kept = tensors["blocks.1.attn.hook_result"] = torch.ones(2, 7, model.cfg.n_heads, model.cfg.d_model)
    cache = ActivationCache(tensors, model)
    cache.compute_head_results()
    expected = _reference(full["z", 0], model.blocks[0].attn.W_O.detach())
    torch.testing.assert_close(cache["result", 0].double(), expected, rtol=1e-5, atol=1e-6)
    assert cache["result", 1] is kept


# -- AssertionError-compatible errors -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        lambda m: m * torch.randn(2),
        lambda m: torch.randn(2, 2) * m,
        lambda m: m @ torch.randn(5, 6),
        lambda m: torch.randn(5, 7) @ m,
        lambda m: m.BA,
    ],
)
def test_factored_matrix_misuse_is_also_an_assertion_error(bad):
    m = FactoredMatrix(torch.randn(3, 4), torch.randn(4, 6))
    with pytest.raises(ValueError) as err:
        bad(m)
    assert isinstance(err.value, AssertionError)


def test_factored_matrix_numpy_index_and_too_long_index():
    a, b = torch.randn(2, 5, 3), torch.randn(2, 3, 4)
    m = FactoredMatrix(a, b)
    torch.testing.assert_close(m[0, np.int64(2)].AB, (a @ b)[0, 2:3])
    torch.testing.assert_close(m[np.int64(1), :, np.int64(3)].AB, (a @ b)[1, :, 3:4])
    with pytest.raises(ValueError, match="too long an index"):
        m[..., 0, 0, 0, 0]
    v = torch.randn(4)  # a vector goes through unsqueeze / squeeze: the product is a vector
    torch.testing.assert_close(m @ v, (a @ b) @ v)
    u = torch.randn(5)
    torch.testing.assert_close(u @ m, u @ (a @ b))


def test_lm_cross_entropy_loss_masks_nan_and_checks_the_mask():
    logits = torch.tensor([[[torch.nan, torch.nan], [0.0, 2.0], [1.0, 0.0]]])
    tokens = torch.tensor([[0, 1, 0]])
    mask = torch.tensor([[0, 1, 1]])
    per_token = utils.lm_cross_entropy_loss(logits, tokens, mask, per_token=True)
    expected = -torch.log_softmax(torch.tensor([0.0, 2.0]), -1)[0]  # position 1 predicts token 0
    torch.testing.assert_close(per_token, torch.stack([torch.tensor(0.0), expected])[None])
    torch.testing.assert_close(utils.lm_cross_entropy_loss(logits, tokens, mask), expected)
    with pytest.raises(AssertionError, match="attention_mask"):
        utils.lm_cross_entropy_loss(logits, tokens, torch.ones(1, 5, dtype=torch.long))


def test_utils_transpose():
    t = torch.randn(2, 3, 5)
    assert torch.equal(utils.transpose(t), t.permute(0, 2, 1))


def test_start_at_layer_out_of_range_is_index_and_value_error(model):
    resid = torch.zeros(1, 3, model.cfg.d_model)
    with pytest.raises(IndexError, match="out of range") as err:
        model(resid, start_at_layer=model.cfg.n_layers)
    assert isinstance(err.value, ValueError)


def test_remove_batch_dim_of_a_batch_is_also_an_assertion_error(model):
    _, cache = model.run_with_cache(TOKENS)
    with pytest.raises(AssertionError, match="batch size 1"):
        cache.remove_batch_dim()


# -- GQA ------------------------------------------------------------------------------------------------------
def test_gqa_kv_weights_are_over_kv_heads_and_circuits_pair_query_heads():
    model = perturb_(make_bridge("llama"))
    c = model.cfg
    assert c.n_kv_heads < c.n_heads, "the llama fixture must be GQA for this test"
    group = c.n_heads // c.n_kv_heads
    assert model.W_K.shape == (c.n_layers, c.n_kv_heads, c.d_model, c.d_head)
    assert model.b_V.shape == (c.n_layers, c.n_kv_heads, c.d_head)
    # Independent: the HF projection's rows, kv head j = rows j * d_head ... (j + 1) * d_head.
    k_proj = model.hf_model.model.layers[1].self_attn.k_proj.weight
    for j in range(c.n_kv_heads):
        torch.testing.assert_close(model.W_K[1, j], k_proj[j * c.d_head : (j + 1) * c.d_head].T)
    repeated = W_V(model, 1, kv_heads=False)
    assert repeated.shape[0] == c.n_heads
    for h in range(c.n_heads):
        torch.testing.assert_close(repeated[h], W_V(model, 1)[h // group])
        torch.testing.assert_close(model.QK.AB[1, h], model.W_Q[1, h] @ W_K(model, 1)[h // group].T)
        torch.testing.assert_close(model.OV.AB[1, h], model.W_V[1, h // group] @ model.W_O[1, h])


# -- component hooks ------------------------------------------------------------------------------------------
def test_component_add_hook_is_the_output_point(model):
    def halve(x, hook):
        return x * 0.5

    with torch.no_grad():
        plain = model(TOKENS)
        expected = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_attn_out", halve)])
        model.blocks[0].attn.add_hook(halve)
        try:
            got = model(TOKENS)
        finally:
            model.blocks[0].attn.remove_hooks()
        after = model(TOKENS)
    assert torch.equal(got, expected) and not torch.allclose(got, plain)
    assert torch.equal(after, plain)  # remove_hooks took it off
    # a norm's output (TransformerLens 4's ln1.hook_out) is what the attention module reads: attn.hook_in
    with torch.no_grad():
        expected = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.attn.hook_in", halve)])
        model.blocks[0].ln1.add_hook(halve)
        try:
            got = model(TOKENS)
        finally:
            model.blocks[0].ln1.remove_hooks()
    assert torch.equal(got, expected) and not torch.allclose(got, plain)
    with pytest.raises(AttributeError, match="no output hook point"):
        model.ln_final.add_hook(halve)


def test_remove_batch_dim_is_in_place(model):
    _, cache = model.run_with_cache(TOKENS[:1])
    before = {k: v.clone() for k, v in cache.cache_dict.items()}
    assert cache.remove_batch_dim() is cache and not cache.has_batch_dim
    assert all(torch.equal(cache.cache_dict[k], v[0]) for k, v in before.items())
    assert cache["resid_post", 0].shape == (TOKENS.shape[1], model.cfg.d_model)


def test_compact_names_and_set_use_attn_result(model):
    model.set_use_attn_result(True)
    _, cache = model.run_with_cache(TOKENS)
    assert cache["scale1ln1"] is cache["blocks.1.ln1.hook_scale"]
    assert cache["k0"] is cache["blocks.0.attn.hook_k"]
    # hook_result is the per-head output projection of hook_z, bias excluded
    expected = _reference(cache["z", 1], model.blocks[1].attn.W_O.detach())
    torch.testing.assert_close(cache["result", 1].double(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="use_attn_result"):
        model.set_use_attn_result("yes")


# -- KV-cached forward ----------------------------------------------------------------------------------------
def test_logits_and_cache_then_cached_steps_match_hf_without_cache(model):
    prompt = torch.tensor([[5, 17, 42, 98, 3]])
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    positions_seen = []
    with torch.no_grad():
        logits, kv = model(padded, attention_mask=mask, return_type="logits_and_cache")
        torch.testing.assert_close(logits[:, 3:], model.hf_model(input_ids=prompt).logits, rtol=1e-4, atol=1e-4)
        sequence = prompt
        for _ in range(3):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            sequence, mask = torch.cat([sequence, nxt], 1), torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], 1)
            with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: positions_seen.append(hook.ctx.positions))]):
                logits = model(nxt, attention_mask=mask, past_key_values=kv)
            # Oracle: HF on the unpadded sequence, no cache at all.
            expected = model.hf_model(input_ids=sequence).logits[:, -1:]
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert [p.item() for p in positions_seen] == [5, 6, 7]  # counted from the first real token
    assert kv.get_seq_length() == padded.shape[1] + 3


def test_cached_step_checks_its_mask(model):
    with torch.no_grad():
        _, kv = model(TOKENS, return_type="logits_and_cache")
        with pytest.raises(ValueError, match="attention_mask"):
            model(TOKENS[:, :1], attention_mask=torch.ones(2, 3, dtype=torch.long), past_key_values=kv)
        with pytest.raises(ValueError, match="stop_at_layer"):
            model(TOKENS, return_type="logits_and_cache", stop_at_layer=1)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "gemma2"])
def test_ln2_hook_in_is_what_the_mlp_norm_reads(family):
    model = perturb_(make_bridge(family))
    norm = model.blocks[1].ln2.module
    seen = {}
    handle = norm.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0].detach().clone()))
    try:
        _, cache = model.run_with_cache(TOKENS, names_filter=model.blocks[1].ln2.hook_in.name)
    finally:
        handle.remove()
    torch.testing.assert_close(cache[model.blocks[1].ln2.hook_in.name], seen["x"])


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "gemma2"])
@pytest.mark.parametrize("apply_ln", [False, True])
def test_projected_neuron_stack_equals_projecting_the_full_stack(family, apply_ln):
    model = perturb_(make_bridge(family))
    _, cache = model.run_with_cache(TOKENS)
    gen = torch.Generator().manual_seed(3)
    for direction in (torch.randn(model.cfg.d_model, generator=gen), torch.randn(model.cfg.d_model, 3, generator=gen)):
        for layer, kwargs in ((-1, {}), (-1, {"pos_slice": -1}), (1, {"neuron_slice": [0, 5, 7], "mlp_input": True})):
            full = cache.stack_neuron_results(layer, apply_ln=apply_ln, **kwargs)  # [neuron, ..., d_model]
            got = cache.stack_neuron_results(layer, apply_ln=apply_ln, project_output_onto=direction, **kwargs)
            torch.testing.assert_close(got, full @ direction, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("apply_ln", [False, True])
def test_layer_zero_projected_neuron_stack_has_the_dtype_of_later_layers(apply_ln):
    model = perturb_(make_bridge("gpt2"))
    _, cache = model.run_with_cache(TOKENS)
    half = ActivationCache({k: v.to(torch.bfloat16) for k, v in cache.cache_dict.items()}, model)
    direction = torch.randn(model.cfg.d_model)
    empty, later = (half.stack_neuron_results(i, apply_ln=apply_ln, project_output_onto=direction) for i in (0, 1))
    assert empty.shape == (0, *later.shape[1:]) and empty.dtype == later.dtype == torch.float32
    # the float32 weights promote the bf16 activations, as in the unfused computation
    torch.testing.assert_close(later, half.stack_neuron_results(1, apply_ln=apply_ln).float() @ direction)


def test_tokenizer_padding_side_set_after_wrapping_is_honoured_as_in_tl():
    """TransformerLens pads text as its tokenizer's ``padding_side`` says (set to the default when attached), and
    reads left-padded ids with a mask when it is "left". Setting it afterwards does the same here; without that,
    ``cfg.default_padding_side`` decides."""
    model = make_bridge("llama")
    texts = ["ab", "abcde"]
    right = model.to_tokens(texts)
    assert right[0, -1] == model.pad_token_id  # right-padded: the default
    model.tokenizer.padding_side = "left"
    try:
        left = model.to_tokens(texts)
        assert left[0, 0] == model.pad_token_id and torch.equal(left[1], right[1])
        alone = model(model.to_tokens(texts[0]))[0, -1]
        torch.testing.assert_close(model(texts)[0, -1], alone, atol=1e-5, rtol=1e-5)  # the last column is real
        torch.testing.assert_close(model(left)[0, -1], alone, atol=1e-5, rtol=1e-5)  # ids read with the mask
        assert torch.equal(model.to_tokens(texts, padding_side="right"), right)  # the argument still wins
    finally:
        model.tokenizer.padding_side = "right"
    assert torch.equal(model.to_tokens(texts), right)
