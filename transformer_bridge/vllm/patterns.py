"""Attention scores and patterns recomputed from cached post-RoPE queries and keys, as the HF bridge computes them.

vLLM's attention kernels never materialise the pattern; for the layers asked for, the bridge captures
``hook_rot_q`` / ``hook_rot_k`` and computes ``scores = q kᵀ · scale`` (GQA keys repeated per query head; soft-capped
where the layer does so), shown as
-inf where a query may not look (causal, and the sliding window when the layer has one; TransformerLens' convention),
and ``pattern = softmax(scores)`` in float32 with HF's fill (the dtype's minimum) there.
"""

import torch
from jaxtyping import Float
from torch import Tensor


def scores_and_pattern(
    rot_q: Float[Tensor, "pos head d_head"],
    rot_k: Float[Tensor, "pos kv_head d_head"],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> tuple[Float[Tensor, "1 head query_pos key_pos"], Float[Tensor, "1 head query_pos key_pos"]]:
    """``(hook_attn_scores, hook_pattern)`` of one request, each ``[1, head, pos, pos]``.

    Example:
        >>> scores, pattern = scores_and_pattern(cache["rot_q", 0][0], cache["rot_k", 0][0], d_head**-0.5)
    """
    q = rot_q.transpose(0, 1)[None]  # [1, head, pos, d]
    k = rot_k.transpose(0, 1)[None]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:  # Gemma 2: soft-capped before the mask, as HF's eager attention does
        scores = torch.tanh(scores / softcap) * softcap
    n = q.shape[2]
    qi = torch.arange(n)[:, None]
    ki = torch.arange(n)[None, :]
    allowed = ki <= qi
    if sliding_window is not None:
        allowed &= qi - ki < sliding_window
    blocked = ~allowed.to(scores.device)
    filled = scores.masked_fill(blocked, torch.finfo(scores.dtype).min)  # HF's fill, for the softmax
    pattern = torch.softmax(filled, dim=-1, dtype=torch.float32).to(q.dtype)
    return scores.masked_fill(blocked, float("-inf")), pattern
