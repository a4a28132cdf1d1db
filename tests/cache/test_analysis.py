"""TransformerLens `ActivationCache` analysis on every family, against identities and the bridge's own hooks.

Decompositions must sum to the residual they decompose; heads computed from ``hook_z`` must equal the
bridge's ``hook_result``; neurons must sum to ``hook_mlp_out`` minus ``b_out``. Every parameter is
perturbed first (HF initialises biases to 0 and norm weights to 1, which would hide a missing term).
"""

import ast
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIGS, FAMILIES, V, adapted_config, char_tokenizer, normalized_input, perturb_
from transformers import AutoModelForCausalLM

from transformer_bridge import ActivationCache, TransformerBridge, utils
from transformer_bridge.sites.module_paths import get_module

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(3))
TOL = dict(atol=2e-5, rtol=1e-5)


def make(family: str, **config) -> TransformerBridge:
    cfg = adapted_config(family, CONFIGS[family])  # a skip where the installed transformers has no adapter for it
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return perturb_(TransformerBridge(AutoModelForCausalLM.from_config(cfg).eval(), char_tokenizer()))


@pytest.fixture(scope="module", params=FAMILIES)
def run(request):
    model = make(request.param)
    return model, model.run_with_cache(TOKENS)[1]


def resid_into(model, cache, layer: int, mlp_input: bool = False) -> torch.Tensor:
    n = model.cfg.n_layers
    if layer == n:
        return cache["resid_post", n - 1]
    return cache["resid_mid" if mlp_input and not model.cfg.parallel_attn_mlp else "resid_pre", layer]


def test_full_decomposition_sums_to_the_residual(run):
    model, cache = run
    n, heads, d_mlp = model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_mlp
    embeds = ["embed", "pos_embed"] if "hook_pos_embed" in model.hook_dict else ["embed"]
    for layer in range(n + 1):
        for mlp_input in (False, True) if layer < n else (False,):
            stack, labels = cache.get_full_resid_decomposition(layer, mlp_input=mlp_input, return_labels=True)
            torch.testing.assert_close(stack.sum(0), resid_into(model, cache, layer, mlp_input), **TOL)
            attn_layers = layer + (mlp_input and not model.cfg.parallel_attn_mlp)
            assert labels[: attn_layers * heads] == [f"L{i}H{h}" for i in range(attn_layers) for h in range(heads)]
            moe = [f"blocks.{i}.mlp.hook_post" not in model.hook_dict for i in range(layer)]  # one row per MoE block
            assert labels[attn_layers * heads :] == [
                *(
                    label
                    for i in range(layer)
                    for label in ([f"{i}_mlp_out"] if moe[i] else (f"L{i}N{j}" for j in range(d_mlp)))
                ),
                *embeds,
                "bias",
            ]
            mlps, labels = cache.get_full_resid_decomposition(
                layer, mlp_input, expand_neurons=False, return_labels=True
            )
            torch.testing.assert_close(mlps.sum(0), resid_into(model, cache, layer, mlp_input), **TOL)
            assert [lab for lab in labels if "mlp" in lab] == [f"{i}_mlp_out" for i in range(layer)]
    normed = cache.get_full_resid_decomposition(apply_ln=True)
    torch.testing.assert_close(normed.sum(0), cache["ln_final.hook_normalized"], atol=1e-4, rtol=1e-4)
    last = cache.get_full_resid_decomposition(1, pos_slice=-1)  # an int drops the position axis, as in TL
    torch.testing.assert_close(last, cache.get_full_resid_decomposition(1)[:, :, -1])


@pytest.mark.parametrize("family, config", [("llama", dict(attention_bias=True, mlp_bias=True)),
                                            ("gemma2", dict(attention_bias=True))])  # fmt: skip
def test_bias_row_with_output_biases(family, config):
    """Biases on o_proj / down_proj, and (Gemma 2) a bias that enters the stream through a sandwich norm."""
    model = make(family, **config)
    _, cache = model.run_with_cache(TOKENS)
    stack, labels = cache.get_full_resid_decomposition(return_labels=True)
    torch.testing.assert_close(stack.sum(0), cache["resid_post", -1], **TOL)
    blocks = get_module(model.hf_model, model.adapter.blocks)
    b_o = [get_module(b, model.adapter.o_proj).bias for b in blocks]
    b_out = [get_module(b, model.adapter.mlp_down).bias for b in blocks]
    expected = b_o[0] + b_o[1] + (b_out[0] + b_out[1] if family == "llama" else 0)
    torch.testing.assert_close(cache.accumulated_bias(None), expected)
    torch.testing.assert_close(cache.accumulated_bias(1, mlp_input=True, include_mlp_biases=False), b_o[0] + b_o[1])
    if family == "llama":  # no sandwich norm: the bias row is the accumulated bias at every position
        torch.testing.assert_close(stack[labels.index("bias")], expected.expand_as(stack[0]))


def test_accumulated_bias_is_zero_without_biases():
    model = make("llama")
    _, cache = model.run_with_cache(TOKENS, names_filter="blocks.0.hook_resid_pre")
    assert torch.equal(cache.accumulated_bias(-1), torch.zeros(model.cfg.d_model))


def test_heads_from_z_equal_the_bridge_hook_result(run):
    model, cache = run
    heads, labels = cache.stack_head_results(return_labels=True)
    assert labels == [f"L{i}H{h}" for i in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
    _, z_only = model.run_with_cache(TOKENS, names_filter=lambda n: "hook_z" in n or "scale" in n)
    torch.testing.assert_close(z_only.stack_head_results(), heads, atol=1e-6, rtol=1e-6)
    z_only.compute_head_results()
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(z_only["result", layer], cache["result", layer], atol=1e-6, rtol=1e-6)
        per_head = heads[layer * model.cfg.n_heads : (layer + 1) * model.cfg.n_heads]
        r = model.adapter.residual_scale(model.hf_model.config)  # Granite: parts are what enters the stream
        if not model.adapter.sandwich and r == 1:  # the rows are hook_result itself
            assert torch.equal(per_head, cache["result", layer].movedim(-2, 0))
        b_o = get_module(get_module(model.hf_model, model.adapter.blocks)[layer], model.adapter.o_proj).bias
        expected = (cache["attn_out", layer] - (b_o if b_o is not None else 0)) * r  # Gemma 2: through ln1_post
        torch.testing.assert_close(per_head.sum(0), expected, **TOL)


def test_neurons_sum_to_mlp_out_minus_b_out(run):
    model, cache = run
    blocks = get_module(model.hf_model, model.adapter.blocks)
    if any(f"blocks.{i}.mlp.hook_post" not in model.hook_dict for i in range(model.cfg.n_layers)):
        with pytest.raises(KeyError, match=r"mlp\.hook_post"):  # a mixture-of-experts block has no neurons
            cache.get_neuron_results(1)
        return
    for layer in range(model.cfg.n_layers):
        b_out = get_module(blocks[layer], model.adapter.mlp_down).bias
        neurons = cache.get_neuron_results(layer)
        assert neurons.shape == (*TOKENS.shape, model.cfg.d_mlp, model.cfg.d_model)
        r = model.adapter.residual_scale(model.hf_model.config)  # Granite: neurons are what enters the stream
        torch.testing.assert_close(
            neurons.sum(-2), (cache["mlp_out", layer] - (b_out if b_out is not None else 0)) * r, **TOL
        )
        assert torch.equal(cache.get_neuron_results(layer, neuron_slice=3), neurons[..., 3, :])
        assert torch.equal(cache.get_neuron_results(layer, neuron_slice=[5, 1], pos_slice=-1), neurons[:, -1, [5, 1]])
    stack, labels = cache.stack_neuron_results(2, neuron_slice=slice(0, 4), return_labels=True, incl_remainder=True)
    assert labels == [f"L{i}N{j}" for i in range(2) for j in range(4)] + ["remainder"]
    torch.testing.assert_close(stack.sum(0), cache["resid_post", 1], **TOL)
    assert cache.stack_neuron_results(0, return_labels=True)[1] == []


def test_stack_head_results_tl_args(run):
    model, cache = run
    heads, labels = cache.stack_head_results(1, return_labels=True, incl_remainder=True)
    assert labels == [f"L0H{h}" for h in range(model.cfg.n_heads)] + ["remainder"]
    torch.testing.assert_close(heads.sum(0), cache["resid_pre", 1], **TOL)
    assert cache.stack_head_results(0).shape == (0, *TOKENS.shape, model.cfg.d_model)
    only, labels = cache.stack_head_results(0, return_labels=True, incl_remainder=True)
    assert labels == ["remainder"] and torch.equal(only[0], cache["resid_post", -1])  # the whole model
    normed = cache.stack_head_results(1, incl_remainder=True, apply_ln=True)
    torch.testing.assert_close(normed.sum(0), normalized_input(model, cache, 1), **TOL)


def test_layer_zero_and_negative_layers_of_neuron_stacks(run):
    """TransformerLens 4.3's contract: at layer 0 the remainder is the whole model, the final residual stream
    (``resid_mid[0]`` with ``mlp_input``), read by the final norm under ``apply_ln``; below -1 the remainder is
    refused; without it, negative layers count from the end."""
    model, cache = run
    if any(f"blocks.{i}.mlp.hook_post" not in model.hook_dict for i in range(model.cfg.n_layers)):
        pytest.skip("a mixture-of-experts block has no neurons")
    last = model.cfg.n_layers - 1
    only, labels = cache.stack_neuron_results(0, incl_remainder=True, return_labels=True)
    assert labels == ["remainder"] and torch.equal(only[0], cache["resid_post", last])
    normed = cache.stack_neuron_results(0, incl_remainder=True, apply_ln=True)
    torch.testing.assert_close(normed[0], cache.apply_ln_to_stack(only, None)[0], **TOL)
    mid = cache.stack_neuron_results(0, incl_remainder=True, mlp_input=True)
    assert torch.equal(mid[0], resid_into(model, cache, 0, mlp_input=True))
    for mlp_input in (False, True):
        with pytest.raises(ValueError, match="incl_remainder=True"):
            cache.stack_neuron_results(-2, incl_remainder=True, mlp_input=mlp_input)
        with pytest.raises(ValueError, match="incl_remainder=True"):
            cache.stack_head_results(-3, incl_remainder=True)
    assert torch.equal(cache.stack_neuron_results(-2), cache.stack_neuron_results(last))
    assert cache.stack_neuron_results(-1).shape[0] == model.cfg.n_layers * model.cfg.d_mlp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_layer_zero_stacks_follow_the_cache_dtype(dtype):
    model = make("llama")
    _, run_cache = model.run_with_cache(TOKENS)
    cache = ActivationCache({k: v.to(dtype) for k, v in run_cache.cache_dict.items()}, model)
    for empty in (cache.stack_head_results(0), cache.stack_neuron_results(0)):
        assert empty.shape == (0, *TOKENS.shape, model.cfg.d_model) and empty.dtype == dtype
    for direction in (torch.randn(model.cfg.d_model, dtype=dtype), torch.randn(model.cfg.d_model, 3, dtype=dtype)):
        for apply_ln in (True, False):
            zero, one = (cache.stack_neuron_results(layer, apply_ln=apply_ln, project_output_onto=direction)
                         for layer in (0, 1))  # fmt: skip
            assert zero.shape == (0, *one.shape[1:]) and zero.dtype == one.dtype  # float32 weights promote


@pytest.mark.parametrize("near_zero", [False, True])
def test_compute_head_results_float32_gradients_at_width(near_zero):
    """Head results and their gradients for a duck-typed model at a wide ``d_model``, against per-head float64
    matmuls with a fixed cotangent (near-cancelling columns with ``near_zero``)."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(1, 8, 8, 64, generator=gen, requires_grad=True)
    w_o = torch.randn(8, 64, 1024, generator=gen, requires_grad=True)
    grad_out = torch.randn(1, 8, 8, 1024, generator=gen)
    if near_zero:
        with torch.no_grad():
            w_o[..., 1::2] = w_o[..., 0::2]
        grad_out[..., 1::2] = -grad_out[..., 0::2] + 2**-16
    duck = SimpleNamespace(
        cfg=SimpleNamespace(n_layers=1, n_heads=8), blocks=[SimpleNamespace(attn=SimpleNamespace(W_O=w_o))]
    )
    cache = ActivationCache({"blocks.0.attn.hook_z": z}, duck)
    cache.compute_head_results()
    result = cache["blocks.0.attn.hook_result"]
    ref_z, ref_w = z.detach().double().requires_grad_(), w_o.detach().double().requires_grad_()
    expected = torch.stack([ref_z[..., h, :] @ ref_w[h] for h in range(8)], dim=-2)
    torch.testing.assert_close(result.double(), expected.detach(), rtol=2e-5, atol=2e-4)
    got = torch.autograd.grad(result, (z, w_o), grad_out)
    want = torch.autograd.grad(expected, (ref_z, ref_w), grad_out.double())
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got[1].double(), want[1], rtol=2e-5, atol=2e-4)


def test_accumulated_resid_labels_and_mlp_input(run):
    model, cache = run
    n, parallel = model.cfg.n_layers, model.cfg.parallel_attn_mlp
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == [f"{i}_pre" for i in range(n)] + ["final_post"]
    assert torch.equal(stack[-1], cache["resid_post", -1])
    assert cache.accumulated_resid(-1, return_labels=True)[1] == labels
    assert cache.accumulated_resid(1, return_labels=True)[1] == ["0_pre", "1_pre"]  # TL: includes layer's input
    mids = cache.accumulated_resid(incl_mid=True, return_labels=True)[1]
    assert mids == (labels if parallel else ["0_pre", "0_mid", "1_pre", "1_mid", "final_post"])
    stack, labels = cache.accumulated_resid(1, mlp_input=True, return_labels=True)
    assert labels == ["0_pre", "1_pre"] + ([] if parallel else ["1_mid"])
    assert torch.equal(stack[-1], resid_into(model, cache, 1, mlp_input=True))
    normed = cache.accumulated_resid(1, mlp_input=True, apply_ln=True)
    torch.testing.assert_close(normed[-1], normalized_input(model, cache, 1, mlp=True), **TOL)
    with pytest.raises(ValueError, match="`mlp_input=True` needs `layer`"):
        cache.accumulated_resid(mlp_input=True)
    with pytest.raises(IndexError, match="`layer`=3 is out of range"):
        cache.accumulated_resid(3)


def test_decompose_resid_tl_args(run):
    model, cache = run
    parts, labels = cache.decompose_resid(1, mlp_input=True, return_labels=True)
    torch.testing.assert_close(parts.sum(0), resid_into(model, cache, 1, mlp_input=True), **TOL)
    assert labels[-1] == ("0_mlp_out" if model.cfg.parallel_attn_mlp else "1_attn_out")
    no_embeds, labels = cache.decompose_resid(incl_embeds=False, mode="attn", return_labels=True)
    assert labels == ["0_attn_out", "1_attn_out"]
    r = model.adapter.residual_scale(model.hf_model.config)  # Granite's residual_multiplier
    torch.testing.assert_close(no_embeds, torch.stack([cache["attn_out", 0], cache["attn_out", 1]]) * r)


def test_apply_ln_to_stack_layers(run):
    model, cache = run
    parts = cache.decompose_resid()
    final = cache.apply_ln_to_stack(parts, layer=-1)
    assert torch.equal(final, cache.apply_ln_to_stack(parts)) and torch.equal(final, cache.apply_ln_to_stack(parts, 2))
    torch.testing.assert_close(final.sum(0), cache["ln_final.hook_normalized"], **TOL)
    before_last = cache.apply_ln_to_stack(cache.decompose_resid(-2), layer=-2)  # input of block 1
    torch.testing.assert_close(before_last.sum(0), normalized_input(model, cache, 1), **TOL)
    rows = cache.apply_ln_to_stack(parts[:, :, -2:], pos_slice=slice(4, 6), batch_slice=[1])
    torch.testing.assert_close(rows, final[:, 1:, -2:])
    one = cache.apply_ln_to_stack(parts[:, 0], has_batch_dim=False, batch_slice=0)
    torch.testing.assert_close(one, final[:, 0])
    with pytest.raises(ValueError, match="`mlp_input=True` needs"):
        cache.apply_ln_to_stack(parts, layer=-1, mlp_input=True)
    with pytest.raises(IndexError, match=r"-3\.\.-1"):
        cache.apply_ln_to_stack(parts, layer=-4)


def test_logit_attrs_tl_args(run):
    model, cache = run
    parts = cache.decompose_resid(pos_slice=-1)
    by_id = cache.logit_attrs(parts, tokens=TOKENS[:, -1], pos_slice=-1)
    assert by_id.shape == (parts.shape[0], 2)  # an int pos_slice drops the position axis, as in TL
    by_str = cache.logit_attrs(parts, "a", pos_slice=-1)
    assert torch.equal(by_str, cache.logit_attrs(parts, model.to_single_token("a"), pos_slice=-1))
    per_pos = cache.logit_attrs(cache.decompose_resid(), tokens=torch.arange(10, 16))  # one token per position
    for p in range(6):
        torch.testing.assert_close(per_pos[..., p], cache.logit_attrs(cache.decompose_resid(), 10 + p)[..., p])
    row = cache.logit_attrs(parts[:, 1], TOKENS[1, -1], pos_slice=-1, batch_slice=1, has_batch_dim=False)
    torch.testing.assert_close(row, by_id[:, 1])
    with pytest.raises(ValueError, match="same shape"):
        cache.logit_attrs(parts, TOKENS[:, -1], incorrect_tokens=5, pos_slice=-1)


def test_batchless_cache():
    model = make("gpt2")
    _, cache = model.run_with_cache(TOKENS[:1], remove_batch_dim=True)
    stack = cache.get_full_resid_decomposition(1, mlp_input=True)
    assert stack.shape[1:] == (TOKENS.shape[1], model.cfg.d_model)
    torch.testing.assert_close(stack.sum(0), cache["resid_mid", 1], **TOL)
    torch.testing.assert_close(cache.stack_head_results(incl_remainder=True).sum(0), cache["resid_post", 1], **TOL)
    assert cache.logit_attrs(cache.decompose_resid(), 5).shape == (4 + 2, TOKENS.shape[1])


def test_cache_dict_and_stack_activation():
    model = make("qwen3")
    _, cache = model.run_with_cache(TOKENS, names_filter="pattern")
    assert cache.cache_dict is cache._tensors and list(cache.keys()) == list(cache.cache_dict)
    assert torch.equal(cache.stack_activation("pattern"), torch.stack([cache["pattern", 0], cache["pattern", 1]]))
    assert cache.stack_activation("pattern", 1).shape[0] == 1
    try:
        with pytest.warns(UserWarning, match="global state"):
            cache.toggle_autodiff(False)
        assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)


def test_helpers_say_what_is_missing():
    model = make("llama")
    _, cache = model.run_with_cache(TOKENS, names_filter="blocks.0.hook_resid_pre")
    with pytest.raises(KeyError, match=r"hook_z"):
        cache.stack_head_results()
    with pytest.raises(KeyError, match=r"hook_post"):
        cache.get_neuron_results(0)
    with pytest.raises(IndexError, match="`neuron_slice`"):
        make("llama").run_with_cache(TOKENS)[1].get_neuron_results(0, neuron_slice=99)
    with pytest.raises(TypeError, match="`layer` must be an int"):
        cache.accumulated_bias("1")


# -- transformer_bridge.utils ----------------------------------------------------------------------
def test_get_act_name_tl_forms():
    assert utils.get_act_name("k", 6, "a") == "blocks.6.attn.hook_k"
    assert utils.get_act_name("pre", 2) == "blocks.2.mlp.hook_pre"
    assert utils.get_act_name("embed") == "hook_embed"
    assert utils.get_act_name("normalized", 27, "ln2") == "blocks.27.ln2.hook_normalized"
    assert utils.get_act_name("k6") == "blocks.6.attn.hook_k"
    assert utils.get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"
    assert utils.get_act_name("scale") == "ln_final.hook_scale"
    assert utils.get_act_name("attn", 1) == "blocks.1.attn.hook_pattern"
    assert utils.get_act_name("value", 0) == "blocks.0.attn.hook_v"
    assert utils.get_act_name("resid_pre", 0, "b") == "blocks.0.hook_resid_pre"
    assert utils.get_act_name("blocks.3.hook_resid_post") == "blocks.3.hook_resid_post"
    assert utils.get_act_name("resid_pr", 0) == "blocks.0.hook_resid_pr"  # TransformerLens' construction
    with pytest.raises(ValueError, match="cannot count layers from the end"):
        utils.get_act_name("resid_pre", -1)
    with pytest.raises(ValueError, match="`layer_type`"):
        utils.get_act_name("z", 0, "mlp")


def test_losses_and_small_helpers():
    model = make("llama")
    tokens = TOKENS.clone()
    mask = torch.ones_like(tokens)
    mask[0, :2] = 0  # left padding in row 0
    logits = model(tokens, attention_mask=mask)
    loss = utils.lm_cross_entropy_loss(logits, tokens, attention_mask=mask)
    torch.testing.assert_close(loss, model(tokens, attention_mask=mask, return_type="loss"))
    per_token = utils.lm_cross_entropy_loss(logits, tokens, per_token=True)
    assert per_token.shape == (2, 5)
    torch.testing.assert_close(utils.lm_cross_entropy_loss(logits, tokens), per_token.mean())
    hits = utils.lm_accuracy(logits, tokens, per_token=True)
    assert utils.lm_accuracy(logits, tokens) == hits.float().mean()
    assert utils.to_numpy(torch.ones(2, dtype=torch.bfloat16)).tolist() == [1.0, 1.0]
    assert utils.to_numpy([1, 2]).tolist() == [1, 2] and utils.to_numpy(3).item() == 3
    assert utils.remove_batch_dim(torch.zeros(1, 4)).shape == (4,)
    assert utils.remove_batch_dim(torch.zeros(2, 4)).shape == (2, 4)


def test_test_prompt_ranks(capsys):
    model = make("gpt2")
    assert utils.test_prompt("Hello", "wo", model, top_k=3) is None  # prints, as TransformerLens' does
    last = capsys.readouterr().out.splitlines()[-1]
    ranks = ast.literal_eval(last.removeprefix("Ranks of the answer tokens: "))
    assert [token for token, _ in ranks] == [" ", "w", "o"]
    assert all(0 <= rank < V for _, rank in ranks)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_accumulated_resid_apply_ln_is_the_logit_lens(family):
    """Each entry goes through the final norm with its own statistics (TransformerLens 4.3's rule): through the
    folded unembedding it gives HF's ln_final + lm_head applied to that residual stream."""
    model = make(family)
    tokens = torch.tensor([[1, 5, 9, 14, 3]])
    logits, cache = model.run_with_cache(tokens)
    lens = cache.accumulated_resid(apply_ln=True, incl_mid=True) @ model.W_U + model.b_U
    raw = cache.accumulated_resid(incl_mid=True)
    ln_final = model.hf_model.get_decoder().norm if family == "llama" else model.hf_model.transformer.ln_f
    with torch.no_grad():
        expected = model.hf_model.get_output_embeddings()(ln_final(raw))
    torch.testing.assert_close(lens, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lens[-1], logits, rtol=1e-4, atol=1e-4)
