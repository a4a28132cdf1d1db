"""`compat.direct_logit_attribution`, TransformerLens 4.3's DLA tool: the parts sum to the model's own logit minus the
unembedding bias (HF's logits; the bias read from the HF modules), on LayerNorm and RMSNorm families, processed or
not; head rows against a manual projection of ``hook_z``; cache reuse, positions, batches and the argument errors."""

import copy

import pytest
import torch
from conftest import SSM_CONFIGS, char_tokenizer, make_bridge, perturb_
from transformers import AutoModelForCausalLM

from transformer_bridge import ActivationCache, TransformerBridge
from transformer_bridge.compat import DirectLogitAttribution, direct_logit_attribution
from transformer_bridge.sites.module_paths import get_module

PROMPTS = ["Hello world, this is", "A test"]  # a batch of two, which the tool left-pads
UNITS = ["component", "head", "layer"]
TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2", "gpt_neox"])
def base(request):
    return perturb_(make_bridge(request.param))  # perturbed: zero biases and unit norms would hide a missing term


@pytest.fixture(scope="module")
def gpt2():
    return perturb_(make_bridge("gpt2"))


def processed(model):
    model = copy.deepcopy(model)
    model.enable_compatibility_mode()
    return model


def total(result):
    """What the attributions add up to: the sum of the parts; the last row of the cumulative ``layer`` unit."""
    return result.attribution[-1] if result.unit == "layer" else result.attribution.sum(0)


def logit_minus_bias(model, logits, ids):
    """The oracle: the model's logit at the last position (the bridge with no hooks: HF's own, bitwise), before
    Gemma 2's soft-cap, minus the constant terms the unembedding adds (its bias, and the final norm's ``β`` read
    through it), taken from the HF modules."""
    hf = model.hf_model
    logits = logits[:, -1].double()
    cap = getattr(hf.config, "final_logit_softcapping", None)
    if cap:
        logits = cap * torch.atanh(logits / cap)
    unembed = hf.get_output_embeddings()
    beta = getattr(get_module(hf, model.adapter.ln_final), "bias", None)
    bias = torch.zeros(model.cfg.d_vocab, dtype=torch.float64)
    bias = bias if beta is None else bias + unembed.weight.double() @ beta.double()
    bias = bias if unembed.bias is None else bias + unembed.bias.double()
    ids = torch.as_tensor(ids).expand(logits.shape[0])
    return (logits.gather(-1, ids[:, None])[:, 0] - bias[ids]).float()


@pytest.mark.parametrize("weights", ["unprocessed", "compatibility_mode"])
@pytest.mark.parametrize("unit", UNITS)
def test_parts_sum_to_the_logit_minus_the_bias(base, unit, weights):
    model = base if weights == "unprocessed" else processed(base)
    with torch.no_grad():
        logits = model(PROMPTS, padding_side="left")
        single = direct_logit_attribution(model, PROMPTS, answer_tokens=5, unit=unit)
        diff = direct_logit_attribution(model, PROMPTS, answer_tokens=5, incorrect_tokens=40, unit=unit)
        expected = logit_minus_bias(model, logits, 5)
        expected_diff = expected - logit_minus_bias(model, logits, 40)
    assert single.attribution.shape == (len(single.labels), 2) and single.attribution.dtype == torch.float32
    torch.testing.assert_close(total(single), expected, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(total(diff), expected_diff, atol=5e-5, rtol=1e-4)


def test_processing_keeps_the_logit_difference_attributions(base):
    """Without `enable_compatibility_mode()` the final norm's γ is still in the direction: the same numbers."""
    for unit in ("component", "layer"):
        kwargs = dict(answer_tokens=" ", incorrect_tokens="e", unit=unit)
        plain, compat = (direct_logit_attribution(m, PROMPTS, **kwargs) for m in (base, processed(base)))
        assert plain.labels == compat.labels
        torch.testing.assert_close(plain.attribution, compat.attribution, atol=1e-4, rtol=1e-4)


def test_labels(gpt2):
    n, heads = gpt2.cfg.n_layers, gpt2.cfg.n_heads
    component = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5)
    assert component.unit == "component"
    assert component.labels == ["embed", "pos_embed"] + [f"{i}_{k}_out" for i in range(n) for k in ("attn", "mlp")]
    head = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5, unit="head")
    assert head.labels == [f"L{i}H{h}" for i in range(n) for h in range(heads)] + ["remainder"]
    layer = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5, unit="layer")
    assert layer.labels == [x for i in range(n) for x in (f"{i}_pre", f"{i}_mid")] + ["final_post"]
    llama = direct_logit_attribution(make_bridge("llama"), "Hi", answer_tokens=5)
    assert llama.labels == ["embed"] + [f"{i}_{k}_out" for i in range(n) for k in ("attn", "mlp")]  # rotary


def test_head_rows_are_each_heads_output_read_along_the_answer(gpt2):
    """Manual oracle from HF's GPT-2 modules: ``z_h @ c_proj.weight[h rows]``, centred, divided by the cached final
    scale, dotted with ``ln_f.weight * lm_head.weight[answer]``."""
    _, cache = gpt2.run_with_cache(PROMPTS, padding_side="left")
    result = direct_logit_attribution(gpt2, answer_tokens=7, cache=cache, unit="head")
    hf, d_head = gpt2.hf_model, gpt2.cfg.d_head
    direction = hf.transformer.ln_f.weight * hf.lm_head.weight[7]
    scale = cache["ln_final.hook_scale"][:, -1]  # [batch, 1]
    for layer in range(gpt2.cfg.n_layers):
        w_o = hf.transformer.h[layer].attn.c_proj.weight  # Conv1D: [in = head * d_head, out = d_model]
        for h in range(gpt2.cfg.n_heads):
            out = cache["z", layer][:, -1, h] @ w_o[h * d_head : (h + 1) * d_head]
            out = (out - out.mean(-1, keepdim=True)) / scale
            row = result.labels.index(f"L{layer}H{h}")
            torch.testing.assert_close(result.attribution[row], (out * direction).sum(-1).detach(), **TOL)


def test_a_supplied_cache_is_read_without_a_forward(gpt2):
    _, cache = gpt2.run_with_cache(PROMPTS, padding_side="left")
    calls = []
    handle = gpt2.hf_model.register_forward_hook(lambda *args: calls.append(1))
    try:
        for unit in UNITS:
            fresh = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5, incorrect_tokens=6, unit=unit)
            n = len(calls)
            reused = direct_logit_attribution(gpt2, answer_tokens=5, incorrect_tokens=6, cache=cache, unit=unit)
            assert len(calls) == n and reused.labels == fresh.labels
            torch.testing.assert_close(reused.attribution, fresh.attribution, **TOL)
    finally:
        handle.remove()
    orphan = ActivationCache(dict(cache.cache_dict))  # no model attached: the tool attaches its own
    torch.testing.assert_close(direct_logit_attribution(gpt2, answer_tokens=5, cache=orphan).attribution,
                               direct_logit_attribution(gpt2, answer_tokens=5, cache=cache).attribution)  # fmt: skip
    one_row = gpt2.run_with_cache("Hi")[1].remove_batch_dim()
    assert direct_logit_attribution(gpt2, answer_tokens=5, cache=one_row).attribution.shape == (6,)


def test_positions_and_per_row_answers(gpt2):
    n_pos = gpt2.to_tokens(PROMPTS).shape[1]
    last = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5)
    every = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5, pos=None)
    assert every.attribution.shape == (6, 2, n_pos)
    torch.testing.assert_close(every.attribution[..., -1], last.attribution, **TOL)
    some = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5, pos=[1, 3])
    torch.testing.assert_close(some.attribution, every.attribution[..., [1, 3]], **TOL)
    per_row = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=[" ", "e"], incorrect_tokens=torch.tensor([6, 7]))
    for row, (answer, wrong) in enumerate([(" ", 6), ("e", 7)]):
        alone = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=answer, incorrect_tokens=wrong)
        torch.testing.assert_close(per_row.attribution[:, row], alone.attribution[:, row], **TOL)
    grid = torch.arange(2 * n_pos).reshape(2, n_pos) + 4  # one answer per row and position
    per_pos = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=grid, pos=None)
    alone = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=int(grid[1, 2]), pos=2)
    torch.testing.assert_close(per_pos.attribution[:, 1, 2], alone.attribution[:, 1], **TOL)


def test_top_and_result(gpt2):
    result = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5, incorrect_tokens=6, unit="head")
    assert isinstance(result, DirectLogitAttribution)
    top = result.top(3)
    assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    means = result.attribution.mean(-1)
    assert top[0] == (result.labels[int(means.argmax())], pytest.approx(means.max().item()))
    assert len(result.top(100)) == len(result.labels)
    with pytest.raises(ValueError, match="`k` must be a positive int, got 0"):
        result.top(0)


def test_a_steering_edit_is_a_component_and_a_final_edit_is_refused(gpt2):
    vector = torch.randn(gpt2.cfg.d_model, generator=torch.Generator().manual_seed(0))
    with gpt2.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x + vector)]):
        logits = gpt2(PROMPTS, padding_side="left")
        result = direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5)
    assert "edit:blocks.0.hook_resid_post" in result.labels
    torch.testing.assert_close(total(result), logits[:, -1, 5] - gpt2.b_U[5].detach(), atol=5e-5, rtol=1e-4)
    doubled = [("ln_final.hook_normalized", lambda x, hook: x * 2)]
    with gpt2.hooks(fwd_hooks=doubled), pytest.raises(ValueError, match="differs from the model's own logits"):
        direct_logit_attribution(gpt2, PROMPTS, answer_tokens=5)


def test_state_space_model():
    torch.manual_seed(0)
    model = TransformerBridge(AutoModelForCausalLM.from_config(SSM_CONFIGS["mamba"]()).eval(), char_tokenizer())
    perturb_(model)
    expected = logit_minus_bias(model, model("Hello").detach(), 5)
    result = direct_logit_attribution(model, "Hello", answer_tokens=5)
    assert result.labels == ["embed", "0_mixer_out", "1_mixer_out"]
    torch.testing.assert_close(total(result), expected, atol=5e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"`unit`='head' needs attention heads in every layer.*unit='component'"):
        direct_logit_attribution(model, "Hello", answer_tokens=5, unit="head")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(unit="neuron"), ValueError, r"Unknown `unit`='neuron': unit must be one of 'component', 'layer', 'head'"),
        (dict(answer_tokens=None), ValueError, "answer_tokens is required"),
        (dict(input=None), ValueError, r"either `input` .* or a precomputed `cache`"),
        (dict(answer_tokens="Hello"), ValueError, r"`answer_tokens`: 'Hello' must be exactly one token"),
        (dict(incorrect_tokens=99), ValueError, r"`incorrect_tokens` holds token id 99, outside .* 0\.\.98"),
        (dict(answer_tokens=torch.tensor([1.0])), TypeError, r"`answer_tokens` as a tensor must hold integer ids"),
        (dict(answer_tokens=[1, 2, 3]), ValueError, r"`answer_tokens` has shape \(3,\).*\(2,\) \(one per row\)"),
        (dict(answer_tokens=[True]), TypeError, r"`answer_tokens` must hold one-token strings or token ids"),
        (dict(pos=50), IndexError, r"`pos`=50 is out of range"),
        (dict(cache="not a cache"), TypeError, r"`cache` must be an ActivationCache"),
    ],
)
def test_bad_arguments(gpt2, kwargs, error, match):
    with pytest.raises(error, match=match):
        direct_logit_attribution(gpt2, **{"input": PROMPTS, "answer_tokens": 5, **kwargs})


def test_refusals(gpt2):
    with pytest.raises(TypeError, match="`model` must be a TransformerBridge, got Linear"):
        direct_logit_attribution(torch.nn.Linear(2, 2), "Hi", answer_tokens=5)
    other = make_bridge("gpt2", seed=1)
    with pytest.raises(ValueError, match="`cache` belongs to another model"):
        direct_logit_attribution(other, answer_tokens=5, cache=gpt2.run_with_cache("Hi")[1])
    training = copy.deepcopy(gpt2)
    training.hf_model.train()
    with pytest.raises(ValueError, match=r"training mode .* model\.eval\(\)"):
        direct_logit_attribution(training, "Hi", answer_tokens=5)
