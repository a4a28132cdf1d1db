"""Influence over a sparse graph, pruning, and the replacement / completeness scores (circuit-tracer's definitions,
computed on sparse edges: no dense ``node × node`` matrix).

With ``Â`` the row-normalised ``|A|`` (rows targets, columns sources) and ``w`` the target weights, a node's influence
is ``(w Â + w Â² + ...)`` at that node: the graph is acyclic, so the series ends after as many terms as its depth.
"""

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float
from torch import Tensor


def _normalized(rows: Tensor, cols: Tensor, vals: Tensor, n: int) -> Tensor:
    mag = vals.abs().double()
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, rows, mag)
    return mag / sums[rows].clamp(min=1e-10)


def _propagate(rows: Tensor, cols: Tensor, norm: Tensor, start: Tensor, max_iter: int = 10_000) -> Tensor:
    """``Σ_{k>=1} start Â^k``."""
    total, x = torch.zeros_like(start), start
    for _ in range(max_iter):
        x = torch.zeros_like(start).index_add_(0, cols, x[rows] * norm)
        if not x.any():
            return total
        total += x
    raise RuntimeError(f"influence did not converge in {max_iter} steps: the graph has a cycle")


def partial_influence(rows: Tensor, cols: Tensor, vals: Tensor, weights: Tensor, n_cols: int) -> Tensor:
    """Influence on targets of each node from the rows computed so far (target rows have ids ``n_cols + t``)."""
    n = n_cols + len(weights)
    start = torch.zeros(n, dtype=torch.float64)
    start[n_cols:] = weights.double()
    return _propagate(rows, cols, _normalized(rows, cols, vals, n), start)


def node_influence(graph) -> Float[Tensor, " node"]:
    """Each node's influence on the weighted targets."""
    rows, cols = graph.edge_index
    start = torch.zeros(graph.n_nodes, dtype=torch.float64)
    start[graph.target_offset :] = graph.target_weights.double()
    return _propagate(rows, cols, _normalized(rows, cols, graph.edge_weight, graph.n_nodes), start)


def _threshold(scores: Tensor, fraction: float) -> float:
    """The score above which the largest scores sum to ``fraction`` of the total."""
    ordered = scores.sort(descending=True).values
    cum = ordered.cumsum(0) / ordered.sum().clamp(min=1e-30)
    i = min(int(torch.searchsorted(cum, torch.tensor(fraction, dtype=cum.dtype))), len(ordered) - 1)
    return float(ordered[i])


class Pruned(NamedTuple):
    """Which nodes and edges survive pruning, and each node's cumulative influence rank (0..1]."""

    node_mask: Bool[Tensor, " node"]
    edge_mask: Bool[Tensor, " edge"]
    cumulative: Float[Tensor, " node"]


def prune(graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """Keep the nodes that carry ``node_threshold`` of the influence on the targets, then the edges that carry
    ``edge_threshold`` of it, then drop features and errors left without an outgoing (features: or incoming) edge,
    until nothing changes. Tokens and targets are always kept (circuit-tracer's rule).

    Example:
        >>> kept = prune(graph, node_threshold=0.8, edge_threshold=0.98)
        >>> int(kept.node_mask.sum()), int(kept.edge_mask.sum())
    """
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"`{name}` must be in [0, 1], got {value}")
    infl = node_influence(graph)
    node_mask = infl >= _threshold(infl, node_threshold)
    node_mask[graph.token_offset :] = True
    rows, cols = graph.edge_index
    alive = node_mask[rows] & node_mask[cols]
    r, c, v = rows[alive], cols[alive], graph.edge_weight[alive]
    norm = _normalized(r, c, v, graph.n_nodes)
    start = torch.zeros(graph.n_nodes, dtype=torch.float64)
    start[graph.target_offset :] = graph.target_weights.double()
    pruned_infl = _propagate(r, c, norm, start) + start
    scores = torch.zeros(len(rows), dtype=torch.float64)
    scores[alive] = norm * pruned_infl[r]
    edge_mask = alive & (scores >= _threshold(scores[alive], edge_threshold)) if alive.any() else alive
    inner = torch.zeros(graph.n_nodes, dtype=torch.bool)
    inner[: graph.token_offset] = True
    is_feature = torch.zeros(graph.n_nodes, dtype=torch.bool)
    is_feature[: graph.n_features] = True
    while True:
        has_out = torch.zeros(graph.n_nodes, dtype=torch.bool)
        has_out[cols[edge_mask]] = True
        has_in = torch.zeros(graph.n_nodes, dtype=torch.bool)
        has_in[rows[edge_mask]] = True
        new = node_mask & ~(inner & ~has_out) & ~(is_feature & ~has_in)
        if torch.equal(new, node_mask):
            break
        node_mask = new
        edge_mask = edge_mask & node_mask[rows] & node_mask[cols]
    order = infl.argsort(descending=True)
    cumulative = torch.zeros_like(infl)
    cumulative[order] = infl[order].cumsum(0) / infl.sum().clamp(min=1e-30)
    return Pruned(node_mask, edge_mask, cumulative.float())


def scores(graph) -> tuple[float, float]:
    """``(replacement, completeness)``: the share of token-to-target influence that does not pass through error
    nodes, and the influence-weighted share of each node's input that does not come from error nodes.

    Example:
        >>> replacement, completeness = scores(graph)
    """
    rows, cols = graph.edge_index
    norm = _normalized(rows, cols, graph.edge_weight, graph.n_nodes)
    start = torch.zeros(graph.n_nodes, dtype=torch.float64)
    start[graph.target_offset :] = graph.target_weights.double()
    infl = _propagate(rows, cols, norm, start)
    tokens = infl[graph.token_offset : graph.target_offset].sum()
    errors = infl[graph.error_offset : graph.token_offset].sum()
    replacement = float(tokens / (tokens + errors).clamp(min=1e-30))
    from_error = (cols >= graph.error_offset) & (cols < graph.token_offset)
    error_share = torch.zeros(graph.n_nodes, dtype=torch.float64).index_add_(0, rows[from_error], norm[from_error])
    out_infl = infl + start
    completeness = float(((1 - error_share) * out_infl).sum() / out_infl.sum().clamp(min=1e-30))
    return replacement, completeness
