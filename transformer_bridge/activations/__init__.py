"""Activations at dataset scale: `harvest` them to sharded safetensors on disk, read them back with
`ActivationStore` (memory-mapped, epoch-shuffled batches with bounded memory). See docs/analysis.md.

It is a function over the core bridge: it may import the core (`core`, `layers`, `checks`) and `distributed`, never
generation or relevance.
"""

from .plan import HarvestConfigError, parse_bytes
from .run import HarvestWriteError, harvest
from .shards import Shard, ShardFileError, read_shard, write_shard
from .store import ActivationStore, Permutation, Rows, load_manifest, merge_manifests
from .windows import Cursor, Window

__all__ = [
    "ActivationStore",
    "Cursor",
    "HarvestConfigError",
    "HarvestWriteError",
    "Permutation",
    "Rows",
    "Shard",
    "ShardFileError",
    "Window",
    "harvest",
    "load_manifest",
    "merge_manifests",
    "parse_bytes",
    "read_shard",
    "write_shard",
]
