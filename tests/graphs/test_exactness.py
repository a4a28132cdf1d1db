"""Each edge is the linear effect in the frozen replacement model, measured by perturbation (tests/graphs/
graph_oracle.py: a forward frozen by value with one source added once more), within 1e-4 in fp32, on dense,
parallel-block, sandwich-norm, q/k-norm, latent-attention, soft-capped and mixture-of-experts families, for
per-layer and cross-layer transcoders (with skip connections)."""

import pytest
import torch
from conftest import make_bridge
from graph_oracle import FrozenByValue

from transformer_bridge.graphs import TranscoderSet, attribute

# Mixtral and Qwen2-MoE: mixtures of experts; GPT-J, Phi, GPT-NeoX: parallel blocks; Gemma 2: sandwich norms and
# soft-capping; Qwen3 / OLMo 2: q/k norms (OLMo 2 post-norm only); DeepSeek-V3: latent attention and experts.
FAMILIES = ["llama", "gpt2", "gemma2", "qwen3", "phi3", "gptj", "phi", "gpt_neox", "olmo2", "mixtral", "qwen2_moe",
            "deepseek_v3", "granite", "nanochat"]  # fmt: skip
TOKENS = torch.tensor([1, 17, 42, 8, 11, 23, 64, 5, 90])


def checked_edges(graph, n_feature_rows: int, seed: int) -> list[tuple[int, int]]:
    """Pairs (target, source): every target row and some feature rows, each with its strongest sources and random
    ones (zero edges included: the oracle must find no effect there)."""
    dense = graph.dense_adjacency()
    g = torch.Generator().manual_seed(seed)
    rows = list(range(graph.target_offset, graph.n_nodes))
    rows += torch.randperm(graph.n_features, generator=g)[:n_feature_rows].tolist()
    pairs = []
    for t in rows:
        pairs += [(t, s) for s in dense[t].abs().topk(3).indices.tolist()]
        pairs += [(t, s) for s in torch.randint(0, graph.target_offset, (2,), generator=g).tolist()]
    return pairs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["plt", "clt"])
def test_edges_equal_perturbation_effects(family, kind):
    model = make_bridge(family)
    tc = TranscoderSet.random(model, kind=kind, d_transcoder=32, seed=0, skip=kind == "clt")
    graph = attribute(model, TOKENS, tc, max_n_logits=2, batch_size=16)
    assert graph.n_features > 0
    oracle = FrozenByValue(model, tc, graph)
    dense = graph.dense_adjacency()
    worst = max(abs(oracle.effect(t, s) - float(dense[t, s])) for t, s in checked_edges(graph, 6, seed=1))
    assert worst < 1e-4


def test_a_direction_target_is_the_combination_of_token_targets():
    from transformer_bridge.graphs import Target

    model = make_bridge("llama")
    tc = TranscoderSet.random(model, d_transcoder=32, seed=0)
    direction = torch.zeros(model.cfg.d_vocab)
    direction[[5, 9]] = torch.tensor([1.0, -1.0])
    graph = attribute(model, TOKENS, tc, targets=[Target(8, 5), Target(8, 9), Target(8, direction=direction)])
    dense = graph.dense_adjacency()
    t = graph.target_offset
    torch.testing.assert_close(dense[t + 2], dense[t] - dense[t + 1], atol=1e-5, rtol=1e-4)
