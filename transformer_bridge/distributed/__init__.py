"""Models split across devices (accelerate ``device_map``) and across processes (HF tensor parallelism).

The mechanisms live here and the core uses them: `params` reads weights that accelerate offloaded
or tensor parallelism sharded, `tensor_parallel` gathers shards for hooks and re-shards edits.
See docs/scaling.md.
"""

from .params import full_param, input_device, local_param, onloaded
from .tensor_parallel import ShardSpec, attach_shard_specs, local_shards, o_proj_weight, sum_over_ranks, tp_mesh

__all__ = [
    "ShardSpec",
    "attach_shard_specs",
    "full_param",
    "input_device",
    "local_param",
    "local_shards",
    "o_proj_weight",
    "onloaded",
    "sum_over_ranks",
    "tp_mesh",
]
