"""GPT-OSS's expert internals (``hook_expert_pre`` / ``hook_expert_post``) from its fused, interleaved, biased weights.

Oracles: an edit of an expert's gate pre-activation by a factor is the same as scaling that expert's gate columns
and gate bias in HF's weights; an edit of its ``act(gate)`` output by a factor is scaling its down projection (not
its bias); read-only hooks leave HF's logits bitwise; the weighted results sum to ``hook_mlp_out``.
"""

import pytest
import torch
from conftest import V, make_bridge, perturb_

from transformer_bridge.sites.module_paths import get_module

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(3))
LAYER, EXPERT = 1, 1


@pytest.fixture(scope="module")
def model():
    return perturb_(make_bridge("gpt_oss"), scale=0.3)


def _experts(model):
    return get_module(model.hf_model, f"{model.adapter.blocks}.{LAYER}.{model.adapter.moe.experts}")


def _scale_expert(x, hook):
    x = x.clone()
    x[:, :, EXPERT] *= 1.5
    return x


def _hf_with_weights(model, scale_gate: bool):
    """HF's logits with the expert's gate (columns and bias) or its down projection scaled by 1.5, then restored."""
    experts = _experts(model)
    saved = [p.detach().clone() for p in (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj)]
    try:
        with torch.no_grad():
            if scale_gate:  # gate and up are interleaved: the gate is every even column
                experts.gate_up_proj[EXPERT, :, ::2] *= 1.5
                experts.gate_up_proj_bias[EXPERT, ::2] *= 1.5
            else:
                experts.down_proj[EXPERT] *= 1.5
            return model.hf_model(TOKENS).logits
    finally:
        with torch.no_grad():
            for p, s in zip((experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj), saved, strict=True):
                p.copy_(s)


def test_points_exist_and_read_only_hooks_keep_hf_logits(model):
    with torch.no_grad():
        theirs = model.hf_model(TOKENS).logits
        logits, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.startswith(f"blocks.{LAYER}."))
    assert torch.equal(logits, theirs)
    n, d_mlp = model.cfg.num_experts, model.cfg.d_mlp
    p = f"blocks.{LAYER}.mlp."
    assert cache[p + "hook_expert_pre"].shape == cache[p + "hook_expert_post"].shape == (*TOKENS.shape, n, d_mlp)
    summed = cache[p + "hook_expert_result"].sum(-2)
    torch.testing.assert_close(summed, cache[f"blocks.{LAYER}.hook_mlp_out"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("point", ["hook_expert_pre", "hook_expert_post"])
def test_edits_equal_scaled_hf_weights(model, point):
    want = _hf_with_weights(model, scale_gate=point == "hook_expert_pre")
    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.{point}", _scale_expert)])
        assert not torch.allclose(got, model.hf_model(TOKENS).logits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
