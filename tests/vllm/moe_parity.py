"""Run by test_parity.py in a process of its own (vLLM creates its expert-parallel group with a process's first
engine): the mixtures of experts against the HF bridge. Qwen3-MoE and Mixtral serve the router's points
(``hook_router_logits``, editable; ``hook_expert_weights``, recomputed by the HF bridge's routing rule); the experts
run inside vLLM's fused kernel, so their points are listed as fused and raise."""

import pytest
import torch
from test_parity import TOKENS, assert_every_point_equals, references

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

from transformer_bridge.vllm import FusedPointError


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_every_point_equals_hf(family, engine, oracle):
    model = engine(family)
    assert "blocks.1.mlp.hook_expert_result" in model.names.fused
    assert_every_point_equals(model, references(oracle(family)))


def test_router_edit_reroutes_as_in_hf(engine, oracle):
    """Banning an expert through ``hook_router_logits`` re-routes vLLM's fused experts as it re-routes the HF
    bridge's; the experts' own points raise, naming the fused kernel."""
    model, ref = engine("qwen3_moe"), oracle("qwen3_moe")
    point = "blocks.0.mlp.hook_router_logits"

    def ban(logits, hook):
        logits = logits.clone()
        logits[..., 0] = float("-inf")
        return logits

    row = TOKENS[0]
    plain = model([row])
    _, cache = model.run_with_cache([row], names_filter="blocks.0.mlp.hook_expert_weights")
    with model.hooks(fwd_hooks=[(point, ban)]):
        banned = model([row])
    expected = ref.run_with_hooks(torch.tensor([row]), fwd_hooks=[(point, ban)])
    assert (banned - expected).abs().max() < 1e-5 and (banned - plain).abs().max() > 1e-3
    assert (cache["blocks.0.mlp.hook_expert_weights"] > 0).sum(-1).eq(2).all()  # top 2 of 4, dense
    with pytest.raises(FusedPointError, match=r"blocks\.0\.mlp\.hook_expert_post.*fused away"):
        model.run_with_cache([row], names_filter=["blocks.0.mlp.hook_expert_post"])
    with pytest.raises(ValueError, match="caching only"), model.hooks([("blocks.0.mlp.hook_expert_weights", print)]):
        pass
