"""Models split across devices (accelerate ``device_map``) and across processes (HF tensor parallelism).

The mechanisms live here and the core uses them (this package imports only `hook_points` from the
bridge, so `core` and `sites` can import it without a cycle): `params` reads weights that accelerate
offloaded or tensor parallelism sharded, `tensor_parallel` gathers shards for hooks and re-shards
edits. The user-facing opt-in is `local_shards`. See docs/scaling.md.

It may import only `hooks`, `adapters` and `versions`, so the core and `sites` may use it.
"""

from .params import full_param, input_device, local_param, onloaded
from .tensor_parallel import (
    ShardSpec,
    attach_shard_specs,
    check_tensor_parallel,
    check_tp_plan,
    local_shards,
    o_proj_weight,
    sum_over_ranks,
    tp_mesh,
)

__all__ = [
    "ShardSpec",
    "attach_shard_specs",
    "check_tensor_parallel",
    "check_tp_plan",
    "full_param",
    "input_device",
    "local_param",
    "local_shards",
    "o_proj_weight",
    "onloaded",
    "sum_over_ranks",
    "tp_mesh",
]
