"""Attribution graphs: transcoders, the replacement model built from hook points, graphs and their outputs.

What lives here: `TranscoderSet` (per-layer and cross-layer transcoders; circuit-tracer's and SAELens' formats),
the replacement model (`replacement` hooks: frozen attention patterns and norm scales, MLP outputs replaced by
transcoders plus error terms), `attribute` (a `Graph` of features, errors, tokens and targets from batched
backward passes, kept sparse), pruning and scores, interventions, and the graph's outputs (safetensors,
circuit-tracer's graph JSON, PNG and HTML).

What it may import: the core bridge and its public hook / cache surface (`hook_dict`, `hooks`, `run_with_cache`,
`hook.ctx`) and the public `generate`; never generation internals, relevance or compat.
"""

from .attribution import attribute
from .graph import Graph
from .influence import Pruned, node_influence, prune, scores
from .interventions import Intervention, intervention_hooks
from .replacement import freeze_hooks, replacement_hooks, replacement_logits
from .targets import Target
from .transcoders import TranscoderSet

__all__ = [
    "Graph",
    "Intervention",
    "Pruned",
    "Target",
    "TranscoderSet",
    "attribute",
    "freeze_hooks",
    "intervention_hooks",
    "node_influence",
    "prune",
    "replacement_hooks",
    "replacement_logits",
    "scores",
]
