"""NanoChat: one norm module (``model.norm``) serves the embedding norm (``ln_embed.*``, its first call in a
forward) and the final norm (``ln_final.*``, its second). The per-family sets cover exactness; these check
what is particular to the shared module."""

import torch
from conftest import make_bridge, perturb_

from transformer_bridge.activations.plan import needed_layers
from transformer_bridge.sites.module_paths import get_module

TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3], [1, 9, 9, 33, 71, 12]])


def _model():
    return perturb_(make_bridge("nanochat"))


def test_each_call_of_the_shared_norm_has_its_own_points():
    model = _model()
    norm = get_module(model.hf_model, model.adapter.ln_final)
    outputs: list[torch.Tensor] = []
    handle = norm.register_forward_hook(lambda m, args, out: outputs.append(out))
    try:
        _, cache = model.run_with_cache(TOKENS)
    finally:
        handle.remove()
    assert len(outputs) == 2
    torch.testing.assert_close(cache["ln_embed.hook_normalized"], outputs[0])  # weightless: normalized is the output
    torch.testing.assert_close(cache["ln_final.hook_normalized"], outputs[1])
    assert torch.equal(cache["blocks.0.hook_resid_pre"], outputs[0])  # block 0 reads the normalised embedding
    order = list(cache.keys())
    assert order.index("hook_embed") < order.index("ln_embed.hook_scale") < order.index("blocks.0.hook_resid_pre")
    # Direct calls of the module outside a forward (a logit lens) count as the final norm.
    seen: list[str] = []
    names = ("ln_embed.hook_scale", "ln_final.hook_scale")
    with model.hooks(fwd_hooks=[(n, lambda x, hook: seen.append(hook.name)) for n in names]):
        model(TOKENS)
        assert seen == ["ln_embed.hook_scale", "ln_final.hook_scale"]
        norm(cache["blocks.1.hook_resid_post"])
    assert seen[-1] == "ln_final.hook_scale"


def test_stop_at_the_last_layer_stops_at_the_final_norm_not_the_embedding_norm():
    model = _model()
    _, cache = model.run_with_cache(TOKENS)
    n = model.cfg.n_layers
    assert torch.equal(model(TOKENS, stop_at_layer=n), cache[f"blocks.{n - 1}.hook_resid_post"])
    assert torch.equal(model(TOKENS, stop_at_layer=0), cache["blocks.0.hook_resid_pre"])


def test_harvest_of_the_embedding_norm_stops_before_block_0():
    assert needed_layers(["ln_embed.hook_normalized", "hook_embed", "hook_tokens"]) == 0
    assert needed_layers(["ln_final.hook_normalized"]) is None
