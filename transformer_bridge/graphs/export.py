"""A pruned graph in the graph JSON that circuit-tracer writes and Neuronpedia's viewer reads.

Layout: ``metadata`` (slug, scan, transcoder_list, prompt_tokens, prompt, node_threshold, schema_version),
``qParams`` (the viewer's pinned / supernode state, empty), ``nodes`` and ``links`` (source, target, weight). Node
ids: features ``{layer}_{feature}_{pos}``, errors ``0_{layer}_{pos}``, tokens ``E_{token}_{pos}``, targets
``{n_layers + 1}_{token}_{pos}`` (a direction target gets the virtual token ``d_vocab + i``). Targets may sit at
any position: each keeps its own ``ctx_idx``.
"""

import json
from pathlib import Path

from .influence import prune


def _pair(a: int, b: int) -> int:
    """Cantor's pairing: one integer for (layer, feature), the viewer's feature key."""
    return (a + b) * (a + b + 1) // 2 + b


def graph_json(
    graph, *, slug: str = "graph", node_threshold: float = 0.8, edge_threshold: float = 0.98,
    tokenizer=None, d_vocab: int | None = None,
) -> dict:  # fmt: skip
    """The graph, pruned at the thresholds, as circuit-tracer's JSON object."""
    kept = prune(graph, node_threshold, edge_threshold)
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    vocab = d_vocab if d_vocab is not None else int(max(graph.tokens.max(), graph.target_tokens.max())) + 1
    top_target = int(graph.target_weights.argmax()) if graph.n_targets else -1
    nodes, ids = [], {}
    for node in kept.node_mask.nonzero()[:, 0].tolist():
        info = graph.node_info(node)
        base = dict(ctx_idx=info["pos"], token_prob=0.0, is_target_logit=False, run_idx=0, reverse_ctx_idx=0,
                    clerp="", influence=float(kept.cumulative[node]), activation=None)  # fmt: skip
        if info["kind"] == "feature":
            layer, feat, pos = info["layer"], info["feature"], info["pos"]
            entry = dict(base, node_id=f"{layer}_{feat}_{pos}", feature=_pair(layer, feat), layer=str(layer),
                         feature_type="cross layer transcoder", jsNodeId=f"{layer}_{feat}-0",
                         activation=info["activation"])  # fmt: skip
        elif info["kind"] == "error":
            layer, pos = info["layer"], info["pos"]
            entry = dict(base, node_id=f"0_{layer}_{pos}", feature=-1, layer=str(layer),
                         feature_type="mlp reconstruction error", jsNodeId=f"{layer}_{pos}-0")  # fmt: skip
        elif info["kind"] == "token":
            tok, pos = info["token"], info["pos"]
            entry = dict(base, node_id=f"E_{tok}_{pos}", feature=pos, layer="E", feature_type="embedding",
                         jsNodeId=f"E_{tok}-{pos}")  # fmt: skip
        else:
            t = node - graph.target_offset
            tok = info["token"] if info["token"] >= 0 else vocab + t
            layer = str(graph.n_layers + 1)
            entry = dict(base, node_id=f"{layer}_{tok}_{info['pos']}", feature=tok, layer=layer, feature_type="logit",
                         token_prob=info["weight"], is_target_logit=t == top_target, jsNodeId=f"L_{tok}-{info['pos']}",
                         clerp=f'Output "{info["label"]}" (p={info["weight"]:.3f})', influence=None)  # fmt: skip
        ids[node] = entry["node_id"]
        nodes.append(entry)
    rows, cols = graph.edge_index[:, kept.edge_mask]
    weights = graph.edge_weight[kept.edge_mask].tolist()
    links = [{"source": ids[c], "target": ids[r], "weight": w}
             for r, c, w in zip(rows.tolist(), cols.tolist(), weights, strict=True)
             if r in ids and c in ids]  # fmt: skip
    linked = {x for link in links for x in (link["source"], link["target"])}
    nodes = [n for n in nodes if n["node_id"] in linked or n["feature_type"] in ("embedding", "logit")]
    tokens = graph.tokens.tolist()
    metadata = dict(slug=slug, scan=graph.meta.get("scan") or "custom", transcoder_list=[],
                    prompt_tokens=[decode(t) for t in tokens], prompt="".join(decode(t) for t in tokens),
                    node_threshold=node_threshold, schema_version=1)  # fmt: skip
    qparams = dict(pinnedIds=[], supernodes=[], linkType="both", clickedId="", sg_pos="")
    return {"metadata": metadata, "qParams": qparams, "nodes": nodes, "links": links}


def to_json(graph, path: str | Path, **kwargs) -> Path:
    """Write `graph_json` to ``path``; returns the path.

    Example:
        >>> to_json(graph, "graph.json", slug="capital", tokenizer=model.tokenizer)
    """
    path = Path(path)
    path.write_text(json.dumps(graph_json(graph, **kwargs), indent=1))
    return path
