"""Tiny seeded models (the lead's conftest fixtures) and helpers that build relevance runs from them."""

import torch
from conftest import FAMILIES, V, make_bridge

from transformer_bridge.relevance import RelevanceRun

__all__ = ["BIAS_FREE", "FAMILIES", "V", "make_bridge", "padded_pair", "random_tokens", "tiny_run"]

# Families whose linear maps have no bias (so cp_lrp must conserve exactly); Gemma 2's soft-caps
# are handled by the identity rule and its sandwich norms by constant ratios.
BIAS_FREE = ["llama", "mistral", "qwen3", "phi3", "gemma2"]


def random_tokens(batch: int = 1, pos: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, V, (batch, pos), generator=torch.Generator().manual_seed(seed))


def tiny_run(model, tokens: torch.Tensor, prompt_width: int, mask: torch.Tensor | None = None, cache: bool = True):
    """A RelevanceRun over given sequences, as if the columns after ``prompt_width`` had been generated."""
    c = None
    if cache:
        _, c = model.run_with_cache(tokens, attention_mask=mask)
    return RelevanceRun(model, tokens, mask, prompt_width, cache=c)


def padded_pair(seed: int = 2, short: int = 6, long: int = 9, generated: int = 3):
    """Two sequences (prompt + ``generated`` tokens) left-padded into one batch, and each alone."""
    a = random_tokens(1, short + generated, seed)
    b = random_tokens(1, long + generated, seed + 1)
    width = long + generated
    tokens = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    tokens[0, width - a.shape[1] :], mask[0, width - a.shape[1] :] = a[0], 1
    tokens[1], mask[1] = b[0], 1
    return tokens, mask, long, [a, b]
