"""The replacement model built from hook points: with error nodes its forward is the model's, on every family with
attention and an MLP point (dense, parallel blocks, sandwich norms, q/k norms, latent attention, mixtures of
experts, soft-capping); without them it differs; the frozen points cover every norm kind the bridge serves."""

import pytest
import torch
from conftest import FAMILIES, make_bridge

from transformer_bridge.graphs import TranscoderSet, replacement_hooks, replacement_logits
from transformer_bridge.graphs.replacement import frozen_points

TOKENS = torch.tensor([[1, 17, 42, 8, 11, 23, 64, 5, 90, 31]])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["plt", "clt"])
def test_forward_with_errors_reproduces_the_logits(family, kind):
    model = make_bridge(family)
    tc = TranscoderSet.random(model, kind=kind, d_transcoder=40, seed=0, skip=kind == "clt")
    with torch.no_grad():
        logits = model(TOKENS)
    replaced = replacement_logits(model, TOKENS, tc)
    assert (replaced - logits).abs().max() < 1e-5
    assert (replacement_logits(model, TOKENS, tc, errors=False) - logits).abs().max() > 1e-3


@pytest.mark.parametrize("family,expected", [
    ("llama", {"ln1", "ln2", "ln_final"}), ("gemma2", {"ln1", "ln1_post", "ln2", "ln2_post", "ln_final"}),
    ("qwen3", {"ln1", "ln2", "q_norm", "k_norm", "ln_final"}), ("olmo2", {"q_norm", "k_norm", "ln1_post",
    "ln2_post", "ln_final"}), ("deepseek_v3", {"ln1", "ln2", "q_a_layernorm", "kv_a_layernorm", "ln_final"}),
    ("nanochat", {"ln_embed", "ln1", "ln2", "q_norm", "k_norm", "ln_final"}),
])  # fmt: skip
def test_every_norm_scale_is_frozen(family, expected):
    model = make_bridge(family)
    frozen = frozen_points(model)
    norms = {n.split(".")[-2] for n in frozen if n.endswith("hook_scale")}
    assert norms == expected
    assert sum(n.endswith("attn.hook_pattern") for n in frozen) == model.cfg.n_layers


def test_state_holds_activations_errors_and_inputs():
    model = make_bridge("llama")
    tc = TranscoderSet.random(model, kind="clt", d_transcoder=30, seed=2)
    hooks, state = replacement_hooks(model, tc, skip_positions=1)
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(TOKENS)
    assert (state.acts[0][:, 0] == 0).all() and (state.acts[1][:, 1:] > 0).any()
    recon = tc.reconstruct([state.acts[0], state.acts[1]], state.inputs[1], 1)
    torch.testing.assert_close(recon + state.errors[1], state.outputs[1])


def test_refuses_transcoders_of_another_model():
    model = make_bridge("llama")
    other = TranscoderSet.random(make_bridge("gpt2"), d_transcoder=8, seed=0)
    other.input_hook = "mlp.hook_nowhere"
    with pytest.raises(ValueError, match="not a hook point"):
        replacement_hooks(model, other)


def test_refuses_models_with_mixer_layers():
    from conftest import HYBRID_CONFIGS, char_tokenizer
    from transformers import AutoModelForCausalLM

    from transformer_bridge import TransformerBridge

    torch.manual_seed(0)
    hybrid = TransformerBridge(AutoModelForCausalLM.from_config(HYBRID_CONFIGS["bamba"]()).eval(), char_tokenizer())
    tc = TranscoderSet.random(hybrid, d_transcoder=8, seed=0)
    with pytest.raises(ValueError, match="no attention pattern"):
        replacement_hooks(hybrid, tc)
