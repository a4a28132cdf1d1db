"""Run by test_parity.py in a process of its own: vLLM's Transformers backend (HF's decoder layers with vLLM's fused
projections and attention; vLLM serves OLMo 2 with it, and any family with ``model_impl="transformers"``) patches HF's
model classes in the process that builds the engine, after which an HF model of that family no longer runs there. So
the HF bridge's references are all taken first, then the engines are built."""

import pytest
import torch
from test_parity import TOKENS, assert_every_point_equals, references

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

CASES = [("olmo2", {}), ("llama", {"model_impl": "transformers"})]  # OLMo 2: vLLM has no class of its own for it


@pytest.fixture(scope="module")
def taken(oracle):
    """Per family, per row of TOKENS: the HF bridge's logits and full cache, taken before any engine exists."""
    return {family: references(oracle(family)) for family, _ in CASES}


@pytest.mark.parametrize(("family", "engine_kwargs"), CASES)
def test_every_point_equals_hf(family, engine_kwargs, taken, engine):
    model = engine(family, **engine_kwargs)
    assert model.cfg.architecture == "TransformersForCausalLM"
    assert_every_point_equals(model, taken[family])


def test_edits_and_read_only_points(taken, engine):
    """On the post-norm OLMo 2: an edit of ``hook_attn_out`` is what the layer adds (zeroed, the residual after the
    block is the one before it plus the MLP's output), an edit of the rotated keys reaches vLLM's attention (zero keys
    give a uniform pattern and other logits), and the residual between the sublayers, which HF's layer adds in
    Python, is read-only and says so."""
    model = engine("olmo2")
    row = [TOKENS[0]]
    names = ["blocks.0.hook_resid_pre", "blocks.0.hook_mlp_out", "blocks.0.hook_resid_post", "blocks.0.hook_attn_out"]
    with model.hooks(fwd_hooks=[("blocks.0.hook_attn_out", lambda x, hook: x * 0)]):
        _, cache = model.run_with_cache(row, names_filter=names)
    assert cache["blocks.0.hook_attn_out"].abs().max() == 0
    expected = cache["blocks.0.hook_resid_pre"] + cache["blocks.0.hook_mlp_out"]
    assert (cache["blocks.0.hook_resid_post"] - expected).abs().max() < 1e-5
    plain = model(row)
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_rot_k", lambda k, hook: k * 0)]):
        flat_keys, cache = model.run_with_cache(row, names_filter=["blocks.1.attn.hook_pattern"])
    pattern = cache["blocks.1.attn.hook_pattern"][0, 0]
    n = pattern.shape[-1]
    uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
    assert (pattern - uniform).abs().max() < 1e-6  # zero keys: every allowed key scores 0
    assert (flat_keys - plain).abs().max() > 1e-4
    with pytest.raises(ValueError, match="caching only"), model.hooks([("blocks.0.hook_resid_mid", print)]):
        pass
