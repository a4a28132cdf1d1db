"""The contract SAELens relies on, checked with an SAE built in memory (sae-lens itself is not a
dependency: it requires transformer-lens, which pins its own torch and transformers).

SAELens attaches an SAE at a hook point by replacing the activation with ``decode(encode(x))``,
optionally plus the error term ``x - decode(encode(x))``; it trains on activations read with
``run_with_cache(names_filter=[hook], stop_at_layer=L + 1)``.
"""

import pytest
import torch
from conftest import make_bridge

TOKENS = torch.randint(4, 99, (2, 7), generator=torch.Generator().manual_seed(7))
TOL = dict(atol=1e-5, rtol=1e-5)
LAYER = 0


class SAE(torch.nn.Module):
    """A ReLU SAE: ``encode(x) = relu((x - b_dec) @ W_enc + b_enc)``, ``decode(f) = f @ W_dec + b_dec``."""

    def __init__(self, d_model: int, d_sae: int = 53, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W_enc = torch.nn.Parameter(torch.randn(d_model, d_sae, generator=g) / d_model**0.5)
        self.b_enc = torch.nn.Parameter(0.1 * torch.randn(d_sae, generator=g))
        self.W_dec = torch.nn.Parameter(torch.randn(d_sae, d_model, generator=g) / d_sae**0.5)
        self.b_dec = torch.nn.Parameter(0.1 * torch.randn(d_model, generator=g))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W_dec + self.b_dec

    def splice_hook(self, use_error_term: bool):
        def hook(x, hook):
            recon = self.decode(self.encode(x))
            return recon + (x - recon).detach() if use_error_term else recon

        return hook


@pytest.fixture(scope="module", params=["llama", "gpt2", "gemma2", "qwen3"])
def model(request):
    return make_bridge(request.param)


@pytest.fixture(scope="module")
def sae(model):
    return SAE(model.cfg.d_model)


@torch.no_grad()
def test_splice_with_error_term_is_the_identity(model, sae):
    name = f"blocks.{LAYER}.hook_resid_post"
    spliced = model.run_with_hooks(TOKENS, fwd_hooks=[(name, sae.splice_hook(use_error_term=True))])
    torch.testing.assert_close(spliced, model(TOKENS), **TOL)


@torch.no_grad()
def test_splice_without_error_term_equals_reconstruction_by_hand(model, sae):
    name = f"blocks.{LAYER}.hook_resid_post"
    spliced = model.run_with_hooks(TOKENS, fwd_hooks=[(name, sae.splice_hook(use_error_term=False))])
    resid = model(TOKENS, stop_at_layer=LAYER + 1)
    by_hand = model(sae.decode(sae.encode(resid)), start_at_layer=LAYER + 1, tokens=TOKENS)
    torch.testing.assert_close(spliced, by_hand, **TOL)
    assert not torch.allclose(spliced, model(TOKENS), atol=1e-3)


def test_splice_gradients_reach_the_sae(model, sae):
    """SAELens fine-tunes through the spliced model: the loss must backpropagate into the SAE."""
    name = f"blocks.{LAYER}.hook_resid_post"
    sae.zero_grad()
    loss = model.run_with_hooks(TOKENS, fwd_hooks=[(name, sae.splice_hook(False))], return_type="loss")
    loss.backward()
    assert sae.W_enc.grad is not None and sae.W_enc.grad.abs().sum() > 0
    model.hf_model.zero_grad()


@torch.no_grad()
def test_training_activations_stop_early(model):
    name = f"blocks.{LAYER}.hook_resid_post"
    later = []
    with model.hooks(fwd_hooks=[(f"blocks.{LAYER + 1}.hook_resid_pre", lambda x, hook: later.append(1)),
                                (f"blocks.{LAYER + 1}.attn.hook_q", lambda x, hook: later.append(2))]):  # fmt: skip
        out, cache = model.run_with_cache(TOKENS, names_filter=[name], stop_at_layer=LAYER + 1)
    assert later == [] and list(cache) == [name]
    _, full = model.run_with_cache(TOKENS, names_filter=[name])
    torch.testing.assert_close(cache[name], full[name], atol=0, rtol=0)
    torch.testing.assert_close(out, full[name], atol=0, rtol=0)  # resid_pre of L+1 is resid_post of L
    assert cache[name].shape == (2, 7, model.cfg.d_model)


def test_attributes_saelens_reads(model):
    assert f"blocks.{LAYER}.hook_resid_post" in model.hook_dict
    assert isinstance(model.cfg.d_model, int) and model.cfg.device == torch.device("cpu")
    tokens = model.to_tokens(["some text", "more"])
    assert tokens.dtype == torch.long and tokens.shape[0] == 2
    assert model.cfg.n_ctx >= 1 and model.tokenizer is not None
