"""`assert_clean`: after any failure the model must be as if nothing had happened."""

import torch

from transformer_bridge import TransformerBridge

PROBE = torch.tensor([[5, 17, 3, 42, 8, 11]])


def torch_hooks(module: torch.nn.Module) -> int:
    """Number of torch forward / pre-forward hooks on ``module`` and its children."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def assert_clean(model: TransformerBridge, *, permanent_ok: bool = False) -> None:
    """No hook left on any point, no torch hook left on the HF model (attention routing is one of
    them), and the next plain forward is bitwise the HF model's own."""
    if not permanent_ok:
        active = [p.name for p in model.hook_dict.values() if p.active]
        assert not active, f"hooks left behind on {active[:5]}"
        assert torch_hooks(model.hf_model) == 0, "torch hooks left on the HF model"
    with torch.no_grad():
        ours = model(PROBE.to(model.device))
        theirs = model.hf_model(PROBE.to(model.device)).logits
    assert torch.equal(ours, theirs), "plain forward differs from the HF model after the failure"
