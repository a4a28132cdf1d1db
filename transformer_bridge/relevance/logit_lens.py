"""`logit_lens`: the explained token's probability and rank after every layer.

What it computes: each cached ``blocks.L.hook_resid_post`` at the predicting position is passed
through the model's own final norm (its scale recomputed from that residual, not the cached final
one) and unembedding (and Cohere's logit scale, Gemma 2's soft-cap). ``scores`` holds the token's
probability per layer; ``extras["rank"]`` its rank (0 = top) and ``extras["target"]`` the target per
layer. The last layer reproduces the model's output distribution. Cost: ``n_layers`` unembeddings of
the explained rows.
"""

import torch

from ..cache.decompose import logit_multiplier
from ..core import BridgeCore
from ..sites.module_paths import get_module
from .cache_access import require
from .protocol import Method, Request
from .result import MethodOutput


def logit_lens_hooks(model: BridgeCore) -> list[str]:
    """The hook points `logit_lens` reads from the cache."""
    return [f"blocks.{layer}.hook_resid_post" for layer in range(model.cfg.n_layers)]


@torch.no_grad()
def logit_lens(request: Request) -> MethodOutput:
    """Probability (``scores``), rank and target of each explained token after each layer.

    Example:
        >>> out = logit_lens(Request(model, tokens, mask, explained, Target(), cache))
        >>> out.extras["rank"][:, -1]   # 0 for greedy tokens
    """
    model, explained, target = request.model, request.explained, request.target
    names = logit_lens_hooks(model)
    acts = require(request.cache, names, "logit_lens")
    rows = torch.tensor([e.batch_index for e in explained])
    cols = torch.tensor([e.logit_position for e in explained])
    ids = torch.tensor([e.token_id for e in explained], device=model.device)
    norm = get_module(model.hf_model, model.adapter.ln_final)
    unembed = model.hf_model.get_output_embeddings()
    cap = getattr(model.hf_model.config, "final_logit_softcapping", None)
    scale = logit_multiplier(model)  # Cohere's logit_scale, Granite's 1 / logits_scaling
    probs, ranks, values = [], [], []
    for name in names:
        resid = acts[name][rows.to(acts[name].device), cols.to(acts[name].device)].to(model.device)
        logits = unembed(norm(resid[:, None]))[:, 0].float() * scale
        if cap:
            logits = torch.tanh(logits / cap) * cap
        picked = logits.gather(-1, ids[:, None])
        probs.append(logits.softmax(-1).gather(-1, ids[:, None])[:, 0])
        ranks.append((logits > picked).sum(-1))
        values.append(target(logits, ids).float())
    extras = {"rank": torch.stack(ranks, 1).cpu(), "target": torch.stack(values, 1).cpu()}
    labels = [f"L{layer}" for layer in range(model.cfg.n_layers)]
    return MethodOutput(torch.stack(probs, 1).cpu(), kind="layers", labels=labels, extras=extras)


LOGIT_LENS = Method(
    "logit_lens",
    logit_lens,
    "token probability and rank per layer",
    reads=lambda model, options: logit_lens_hooks(model),
)
