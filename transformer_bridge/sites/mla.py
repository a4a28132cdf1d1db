"""Multi-head latent attention (DeepSeek-V3): the points before the attention function.

MLA has no per-head key or value projection: keys and values are expanded by ``kv_b_proj`` from a
compressed latent (cached as such) at every step, for every cached position, and one rotary key is
shared by all heads. So an MLA layer has, before the attention function:

- ``blocks.L.attn.hook_q [batch pos head d_head_qk]``: the query projection (``q_b_proj``, or ``q_proj``
  without a query low-rank), pre-RoPE; each head is ``[no-rope part | rope part]``;
- ``blocks.L.attn.hook_kv_latent [batch pos kv_lora_rank]``: the compressed key/value latent, before its
  norm, new positions only (it is what the KV cache stores, so an edit persists into decoding);
- ``blocks.L.attn.hook_k_rope [batch pos d_rope]``: the rotary key shared by every head, pre-RoPE.

``hook_k`` / ``hook_v`` do not exist. ``hook_rot_q``, ``hook_rot_k``, ``hook_attn_scores``, ``hook_pattern``,
``hook_z`` and ``hook_result`` are the usual ones (``d_head`` = the value head width); ``hook_rot_k`` shows
the keys of the new positions, expanded afresh from the latent cache at every step, so an edit of it lasts
one forward (edit ``hook_kv_latent`` / ``hook_k_rope`` to change what later steps see).
"""

import itertools
from collections.abc import Callable

import torch
from torch import Tensor, nn

Run = Callable[[str, Tensor], Tensor]


def query_heads(n_heads: int) -> Callable:
    """``[b, p, head * d]`` shown as ``[b, p, head, d]``, the head width read off the tensor."""

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        shown = x.view(*x.shape[:-1], n_heads, -1)
        out = run("", shown)
        return x if out is shown else out.reshape(x.shape)

    return process


def latent_split(kv_lora_rank: int) -> Callable:
    """``kv_a_proj_with_mqa``'s output ``[latent | rotary key]`` shown as the points ``kv_latent``, ``k_rope``."""

    def process(run: Run, x: Tensor, inp: Tensor | None) -> Tensor:
        bounds = [0, kv_lora_rank, x.shape[-1]]
        parts = [x[..., a:b] for a, b in itertools.pairwise(bounds)]  # slices: see sites.fused_qkv
        new = [run(key, part) for key, part in zip(("kv_latent", "k_rope"), parts, strict=True)]
        if all(a is b for a, b in zip(new, parts, strict=True)):
            return x
        return torch.cat(new, dim=-1)

    return process


def query_module(attn: nn.Module) -> nn.Module:
    """``q_b_proj`` (query low-rank) or ``q_proj``."""
    return attn.q_b_proj if getattr(attn, "q_b_proj", None) is not None else attn.q_proj
