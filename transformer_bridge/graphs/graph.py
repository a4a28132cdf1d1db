"""`Graph`: the nodes and sparse edges of an attribution graph, saved and loaded with safetensors.

Node order is circuit-tracer's: features ``[0, n_features)``, error nodes ``(layer, pos)`` layer-major, one per
token position, then the targets. Edges are a sparse ``[node, node]`` matrix, rows the targets of an edge and
columns its sources; only rows of features and targets have entries.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jaxtyping import Float, Int
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from . import export, viz
from . import influence as _influence


@dataclass
class Graph:
    """An attribution graph over one sequence.

    Attributes:
        tokens: ``[pos]`` the sequence attributed.
        features: ``[feature_node, 3]`` (layer, pos, feature index) of each feature node.
        activations: ``[feature_node]`` their activations.
        n_layers: the model's layers (error nodes are ``n_layers * pos``).
        target_pos: ``[target]`` the position each target is read at.
        target_tokens: ``[target]`` its token id, or -1 for a direction.
        target_weights: ``[target]`` its weight in influence (a token's probability, or what the caller gave).
        target_labels: a label per target.
        edge_index: ``[2, edge]`` (target node, source node) of each kept edge; ``edge_weight`` ``[edge]`` its
            direct effect.
        meta: strings and numbers describing the run (model, transcoders' scan, prompt length, ...).

    Example:
        >>> graph = attribute(model, "The capital of France is", tc)
        >>> graph.save("g.safetensors"); Graph.load("g.safetensors").n_nodes == graph.n_nodes
        True
    """

    tokens: Int[Tensor, " pos"]
    features: Int[Tensor, "feature_node 3"]
    activations: Float[Tensor, " feature_node"]
    n_layers: int
    target_pos: Int[Tensor, " target"]
    target_tokens: Int[Tensor, " target"]
    target_weights: Float[Tensor, " target"]
    target_labels: list[str]
    edge_index: Int[Tensor, "2 edge"]
    edge_weight: Float[Tensor, " edge"]
    meta: dict = field(default_factory=dict)

    @property
    def n_pos(self) -> int:
        return len(self.tokens)

    @property
    def n_features(self) -> int:
        return len(self.features)

    @property
    def n_errors(self) -> int:
        return self.n_layers * self.n_pos

    @property
    def n_targets(self) -> int:
        return len(self.target_pos)

    @property
    def error_offset(self) -> int:
        return self.n_features

    @property
    def token_offset(self) -> int:
        return self.n_features + self.n_errors

    @property
    def target_offset(self) -> int:
        return self.token_offset + self.n_pos

    @property
    def n_nodes(self) -> int:
        return self.target_offset + self.n_targets

    def adjacency(self) -> Float[Tensor, "node node"]:
        """The edges as a sparse COO matrix, rows targets and columns sources."""
        return torch.sparse_coo_tensor(self.edge_index, self.edge_weight, (self.n_nodes, self.n_nodes)).coalesce()

    def dense_adjacency(self) -> Float[Tensor, "node node"]:
        """The edges as a dense matrix (small graphs only: it is ``n_nodes²``)."""
        dense = torch.zeros(self.n_nodes, self.n_nodes, dtype=self.edge_weight.dtype)
        dense[self.edge_index[0], self.edge_index[1]] = self.edge_weight
        return dense

    def node_kind(self, node: int) -> str:
        """``"feature"``, ``"error"``, ``"token"`` or ``"target"``."""
        if not 0 <= node < self.n_nodes:
            raise IndexError(f"`node` must be 0..{self.n_nodes - 1}, got {node}")
        for kind, end in (("feature", self.error_offset), ("error", self.token_offset),
                          ("token", self.target_offset)):  # fmt: skip
            if node < end:
                return kind
        return "target"

    def node_info(self, node: int) -> dict:
        """Layer, position and identity of a node."""
        kind = self.node_kind(node)
        if kind == "feature":
            layer, pos, feat = self.features[node].tolist()
            return dict(kind=kind, layer=layer, pos=pos, feature=feat, activation=float(self.activations[node]))
        if kind == "error":
            layer, pos = divmod(node - self.error_offset, self.n_pos)
            return dict(kind=kind, layer=layer, pos=pos)
        if kind == "token":
            pos = node - self.token_offset
            return dict(kind=kind, layer=-1, pos=pos, token=int(self.tokens[pos]))
        t = node - self.target_offset
        return dict(kind=kind, layer=self.n_layers, pos=int(self.target_pos[t]), token=int(self.target_tokens[t]),
                    weight=float(self.target_weights[t]), label=self.target_labels[t])  # fmt: skip

    def feature_node(self, layer: int, pos: int, feature: int) -> int:
        """The node index of feature ``feature`` of ``layer`` at ``pos`` (KeyError if it is not a node)."""
        hit = ((self.features == torch.tensor([layer, pos, feature])).all(-1)).nonzero()
        if len(hit) == 0:
            raise KeyError(f"feature {feature} of layer {layer} at position {pos} is not a node of this graph")
        return int(hit[0, 0])

    def edge(self, target: int, source: int) -> float:
        """The weight of edge source → target (0 where none was kept)."""
        hit = ((self.edge_index[0] == target) & (self.edge_index[1] == source)).nonzero()
        return float(self.edge_weight[hit[0, 0]]) if len(hit) else 0.0

    def influence(self) -> Float[Tensor, " node"]:
        """Each node's influence on the weighted targets (see `influence.node_influence`)."""
        return _influence.node_influence(self)

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> _influence.Pruned:
        """Node and edge masks that keep the given shares of influence (see `influence.prune`)."""
        return _influence.prune(self, node_threshold, edge_threshold)

    def scores(self) -> tuple[float, float]:
        """``(replacement, completeness)`` scores (see `influence.scores`)."""
        return _influence.scores(self)

    def to_json(self, path: str | Path, **kwargs) -> Path:
        """Write circuit-tracer's graph JSON (what Neuronpedia's viewer reads), pruned; see `export.graph_json`."""
        return export.to_json(self, path, **kwargs)

    def save_png(self, path: str | Path, **kwargs) -> Path:
        """Draw the pruned graph into a PNG (see `viz.save_png`)."""
        return viz.save_png(self, path, **kwargs)

    def to_html(self, path: str | Path, **kwargs) -> Path:
        """Write the pruned graph as a self-contained HTML page (see `viz.to_html`)."""
        return viz.to_html(self, path, **kwargs)

    def save(self, path: str | Path) -> None:
        """Write the graph as one safetensors file (tensors, with labels and meta as JSON metadata; no pickle)."""
        tensors = {name: getattr(self, name).contiguous() for name in _TENSORS}
        info = {"n_layers": self.n_layers, "target_labels": self.target_labels, "meta": self.meta}
        save_file(tensors, str(path), metadata={"graph": json.dumps(info)})

    @classmethod
    def load(cls, path: str | Path) -> "Graph":
        """Read a graph written by `save`."""
        with safe_open(str(path), framework="pt") as f:
            info = json.loads(f.metadata()["graph"])
            tensors = {name: f.get_tensor(name) for name in _TENSORS}
        return cls(**tensors, n_layers=info["n_layers"], target_labels=info["target_labels"], meta=info["meta"])


_TENSORS = ("tokens", "features", "activations", "target_pos", "target_tokens", "target_weights", "edge_index",
            "edge_weight")  # fmt: skip
