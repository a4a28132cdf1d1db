"""`attnlrp` and `cp_lrp`: layer-wise relevance propagation as gradient × input with rule hooks.

What they compute: the relevance of each source position for an explained token's target,
``R_i = Σ_d x_{i,d} · ∂̃f/∂x_{i,d}`` at the input of the first block (token plus position
embedding, Gemma's √d scaling included), where ``∂̃`` is the gradient with the rules of
`rules.lrp_hooks` applied.

- ``attnlrp`` (Achtibat et al., ICML 2024): uniform rule on both attention products, softmax
  gradient as is, identity rule on activations, uniform rule on ``gate × up``, constant norm
  scales. Not conservative: Σ R differs from the target; the difference is reported
  (``conservation_error``), never hidden.
- ``cp_lrp`` (Ali et al., ICML 2022): the attention pattern (through q and k), the gate
  activation and the norm scales are constants, which makes the network linear in its input, so
  on bias-free families Σ R equals the target's logit (Euler's theorem). Biases, Gemma 2's soft-caps
  and a ``logprob`` target break exact conservation.

State-space (Mamba) models raise a `ValueError`: the rules cover attention, MLPs, norms and mixtures of
experts, not the mixer (its causal convolution's activation has no hook point for the identity rule, and
the convolution has a bias), so neither variant would be what its name says. ``grad_x_input``,
``integrated_gradients``, ``grad_norm``, ``dla`` and ``logit_lens`` run on Mamba.

Cost: one forward plus one backward per round (one explained token per batch row), about
1.5–2.5 forwards per explained token.
"""

from jaxtyping import Float
from torch import Tensor

from .backprop import backprop_scores, grad_times_input
from .protocol import Method, Request
from .result import MethodOutput
from .rules import Variant, lrp_hooks, softcap_identity

INPUT_POINT = "blocks.0.hook_resid_pre"


def lrp(request: Request, variant: Variant = "attnlrp") -> MethodOutput:
    """Relevance of every source position for each explained token, by ``variant`` rules.

    Example:
        >>> out = lrp(Request(model, tokens, mask, (ExplainedToken(0, 5, int(tokens[0, 5])),), Target()), "cp_lrp")
        >>> out.scores.shape   # [explained, pos]
    """
    model = request.model
    if model.adapter.has_mixers:  # Mamba; hybrids' state-space and convolution layers
        raise ValueError(
            f"Method {variant!r} has no LRP rules for the state-space mixer (or convolution) layers of this "
            f"{model.cfg.model_type!r} model "
            "(see transformer_bridge.relevance.lrp); use 'grad_x_input', 'integrated_gradients', 'dla' or "
            "'logit_lens'."
        )
    cap = getattr(model.hf_model.config, "final_logit_softcapping", None)
    scores, values = backprop_scores(
        request,
        leaf=INPUT_POINT,
        reduce=grad_times_input,
        hooks=lrp_hooks(model, variant),
        logits_fn=softcap_identity(cap) if cap else None,
    )
    return MethodOutput(scores, values, conservation_error=relative_gap(scores.sum(-1), values))


def attnlrp(request: Request) -> MethodOutput:
    """AttnLRP (see module docstring); one forward and one backward per round."""
    return lrp(request, "attnlrp")


def cp_lrp(request: Request) -> MethodOutput:
    """Conservative propagation (CP-LRP); Σ relevance = logit on bias-free families."""
    return lrp(request, "cp_lrp")


ATTNLRP = Method("attnlrp", attnlrp, "attention-aware LRP (gradient × input with AttnLRP rules)")
CP_LRP = Method("cp_lrp", cp_lrp, "conservative LRP: attention, gates and norm scales constant")


def relative_gap(total: Float[Tensor, "explained"], value: Float[Tensor, "explained"]) -> Float[Tensor, "explained"]:
    """``|Σ R − f| / |f|``: 0 for a conservative method."""
    return (total - value).abs() / value.abs().clamp_min(1e-12)
