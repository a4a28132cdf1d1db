"""Graphs end to end on a tiny Llama: targets at any positions and over a generation, sparse rows, feature
budgets, save / load, pruning and scores, interventions (the graph's predictions against the model), JSON and
pictures."""

import json

import pytest
import torch
from conftest import make_bridge

from transformer_bridge.graphs import Graph, Intervention, Target, TranscoderSet, attribute, intervention_hooks

TOKENS = torch.tensor([1, 17, 42, 8, 11, 23, 64, 5, 90, 31, 12])


@pytest.fixture(scope="module")
def llama():
    return make_bridge("llama")


@pytest.fixture(scope="module")
def tc(llama):
    return TranscoderSet.random(llama, kind="clt", d_transcoder=40, seed=0)


@pytest.fixture(scope="module")
def graph(llama, tc):
    return attribute(llama, TOKENS, tc, max_n_logits=3, batch_size=8)


def test_rows_do_not_depend_on_which_other_targets_share_the_graph(llama, tc, graph):
    both = attribute(llama, TOKENS, tc, targets=[Target(4, 7), Target(10, 9)], batch_size=8)
    alone = attribute(llama, TOKENS, tc, targets=[Target(10, 9)], batch_size=8)
    a, b = both.dense_adjacency(), alone.dense_adjacency()
    torch.testing.assert_close(
        a[both.target_offset + 1, : both.target_offset], b[alone.target_offset, : alone.target_offset]
    )
    assert a[both.target_offset, both.token_offset + 5 :].abs().sum() == 0  # nothing after position 4 reaches it
    n = both.target_offset
    torch.testing.assert_close(a[: both.n_features, :n], b[: alone.n_features, :n])


def test_a_generation_gives_a_target_per_generated_token(llama, tc):
    out, cache = llama.generate(TOKENS[None, :6], max_new_tokens=5, do_sample=False, return_cache=True)
    graph = attribute(llama, (out, cache), tc, batch_size=16)
    assert graph.target_pos.tolist() == [5, 6, 7, 8, 9]
    assert graph.target_tokens.tolist() == out[0, 6:].tolist()
    whole = attribute(llama, out[0], tc, targets=[Target(p, int(out[0, p + 1])) for p in range(5, 10)])
    torch.testing.assert_close(graph.dense_adjacency(), whole.dense_adjacency())


def test_sparse_rows_and_feature_budget(llama, tc, graph):
    top = attribute(llama, TOKENS, tc, max_n_logits=3, edges_per_node=5)
    per_row = torch.bincount(top.edge_index[0], minlength=top.n_nodes)
    assert per_row.max() <= 5
    dense = graph.dense_adjacency()
    for r, c, w in zip(*top.edge_index.tolist(), top.edge_weight.tolist(), strict=True):
        assert abs(w - float(dense[r, c])) < 1e-6
    small = attribute(llama, TOKENS, tc, max_n_logits=3, max_feature_nodes=10, batch_size=4)
    assert small.n_features == 10
    assert set(map(tuple, small.features.tolist())) <= set(map(tuple, graph.features.tolist()))


def test_save_load_round_trip(graph, tmp_path):
    graph.save(tmp_path / "g.safetensors")
    back = Graph.load(tmp_path / "g.safetensors")
    assert back.target_labels == graph.target_labels and back.meta == graph.meta and back.n_layers == graph.n_layers
    for name in ("tokens", "features", "activations", "target_pos", "target_tokens", "edge_index", "edge_weight"):
        assert torch.equal(getattr(back, name), getattr(graph, name))


def test_pruning_and_scores(graph):
    kept = graph.prune(0.8, 0.98)
    assert kept.node_mask[graph.token_offset :].all()
    rows, cols = graph.edge_index[:, kept.edge_mask]
    assert kept.node_mask[rows].all() and kept.node_mask[cols].all()
    assert 0 < int(kept.node_mask[: graph.n_features].sum()) < graph.n_features
    replacement, completeness = graph.scores()
    assert 0 < replacement < 1 and 0 < completeness < 1
    infl = graph.influence()
    assert infl[: graph.n_features].max() > 0 and infl[graph.target_offset :].abs().sum() == 0


def test_direct_interventions_match_the_graph(llama, tc, graph):
    """Ablating a feature in the model frozen at the clean forward moves each target by minus its edge."""
    dense = graph.dense_adjacency()
    t = graph.target_offset
    source = int(dense[t, : graph.n_features].abs().argmax())
    layer, pos, feat = graph.features[source].tolist()
    seen = {}
    read = ("unembed.hook_out", lambda x, hook: seen.__setitem__("u", x[0, int(graph.target_pos[0])].clone()))
    with torch.no_grad():
        hooks = intervention_hooks(llama, tc, [], direct=True, tokens=TOKENS[None])
        with llama.hooks(fwd_hooks=[*hooks, read]):
            llama(TOKENS[None])
        clean = seen["u"]
        hooks = intervention_hooks(
            llama, tc, [Intervention(layer, feat, 0.0, pos=pos)], direct=True, tokens=TOKENS[None]
        )
        with llama.hooks(fwd_hooks=[*hooks, read]):
            llama(TOKENS[None])
    tok = int(graph.target_tokens[0])
    change = (seen["u"][tok] - seen["u"].mean()) - (clean[tok] - clean.mean())
    assert abs(float(change) + float(dense[t, source])) < 1e-4


def test_interventions_during_generate_equal_the_forward(llama, tc):
    edit = [Intervention(1, 3, 5.0, pos=7), Intervention(0, 11, 2.0, mode="scale")]
    with torch.no_grad(), llama.hooks(fwd_hooks=intervention_hooks(llama, tc, edit)):
        out = llama.generate(TOKENS[None, :6], max_new_tokens=4, do_sample=False)
        logits = llama(out)
    assert torch.equal(logits[0, 5:-1].argmax(-1), out[0, 6:])
    with torch.no_grad():
        plain = llama.generate(TOKENS[None, :6], max_new_tokens=4, do_sample=False)
        edited_forward_differs = not torch.allclose(llama(out), logits)
    assert edited_forward_differs and plain.shape == out.shape


def test_json_matches_circuit_tracers_schema(graph, llama, tmp_path):
    path = graph.to_json(tmp_path / "g.json", slug="tiny", tokenizer=llama.tokenizer)
    data = json.loads(path.read_text())
    assert set(data) == {"metadata", "qParams", "nodes", "links"}
    assert data["metadata"]["prompt_tokens"][0] == "<bos>" and data["metadata"]["schema_version"] == 1
    ids = {n["node_id"] for n in data["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in data["links"])
    kinds = {n["feature_type"] for n in data["nodes"]}
    assert {"embedding", "logit", "cross layer transcoder"} <= kinds
    assert sum(n["is_target_logit"] for n in data["nodes"]) == 1


def test_pictures(graph, llama, tmp_path):
    png = graph.save_png(tmp_path / "g.png", tokenizer=llama.tokenizer)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = graph.to_html(tmp_path / "g.html", tokenizer=llama.tokenizer).read_text()
    assert "<svg" in page and "replacement score" in page


def test_bad_inputs_are_named(llama, tc):
    with pytest.raises(ValueError, match="`positions`"):
        attribute(llama, TOKENS, tc, positions=[40])
    with pytest.raises(ValueError, match="`batch_size`"):
        attribute(llama, TOKENS, tc, batch_size=0)
    with pytest.raises(ValueError, match="exactly one"):
        Target(3)
    with pytest.raises(ValueError, match="`mode`"):
        Intervention(0, 1, 1.0, mode="add")


def test_a_generation_output_object_is_read_too(llama, tc):
    out, cache = llama.generate(TOKENS[None, :6], max_new_tokens=3, do_sample=False, return_cache=True,
                                return_dict=True)  # fmt: skip
    graph = attribute(llama, (out, cache), tc, batch_size=16)
    assert graph.target_tokens.tolist() == out.sequences[0, 6:].tolist()
    assert graph.meta["prompt_length"] == 6
