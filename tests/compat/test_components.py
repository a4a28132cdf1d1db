"""TransformerLens' component tree (``model.blocks[i].attn.hook_pattern``, ``.attn.W_Q`` …) and its
hook-point API, and the TL forward options, on several families against independent answers.
"""

import pytest
import torch
from conftest import make_bridge

from transformer_bridge import utils

FAMS = ["llama", "gpt2", "gemma2", "qwen3", "phi3", "opt", "gpt_neox"]
TOKENS = torch.randint(4, 99, (2, 7), generator=torch.Generator().manual_seed(5))
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=FAMS)
def model(request):
    return make_bridge(request.param)


@pytest.fixture(autouse=True)
def _clean(request):
    yield
    if "model" in request.fixturenames:
        request.getfixturevalue("model").reset_hooks(including_permanent=True)


@torch.no_grad()
def test_component_hook_fires_on_its_layer_and_edits_take_effect(model):
    seen = []

    def flatten(pattern, hook):
        seen.append((hook.name, hook.layer(), tuple(pattern.shape)))
        return torch.full_like(pattern, 0.0).tril_() + torch.eye(pattern.shape[-1])  # attend to self only

    clean = model(TOKENS)
    model.blocks[1].attn.hook_pattern.add_hook(flatten)
    edited = model(TOKENS)
    model.reset_hooks()
    by_name = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.attn.hook_pattern", flatten)])
    assert seen[0] == ("blocks.1.attn.hook_pattern", 1, (2, model.cfg.n_heads, 7, 7))
    assert len(seen) == 2
    assert not torch.allclose(edited, clean)
    torch.testing.assert_close(edited, by_name, atol=0, rtol=0)
    torch.testing.assert_close(model(TOKENS), clean, atol=0, rtol=0)


def test_has_remove_and_permanent_hooks(model):
    point, calls = model.blocks[0].hook_resid_post, []
    assert point is model.hook_dict["blocks.0.hook_resid_post"]
    assert not point.has_hooks()
    point.add_hook(lambda x, hook: calls.append("temp"))
    point.add_perma_hook(lambda x, hook: calls.append("perma"))
    assert point.has_hooks() and point.has_hooks(including_permanent=False)
    model.reset_hooks()
    assert point.has_hooks() and not point.has_hooks(including_permanent=False)
    model(TOKENS)
    assert calls == ["perma"]
    point.remove_hooks()  # keeps permanent hooks, as in TL
    assert point.has_hooks(dir="fwd") and not point.has_hooks(dir="bwd")
    point.remove_hooks(including_permanent=True)
    assert not point.has_hooks()
    model.add_perma_hook("blocks.0.hook_resid_post", lambda x, hook: calls.append("perma2"))
    model.reset_hooks(including_permanent=True)
    model(TOKENS)
    assert calls == ["perma"]


def test_ctx_persists_until_cleared(model):
    point = model.blocks[1].attn.hook_z
    phases = []

    def count(z, hook):
        hook.ctx["n"] = hook.ctx.get("n", 0) + 1
        phases.append(hook.ctx.phase)

    point.add_hook(count)
    model(TOKENS)
    model(TOKENS)
    assert point.ctx == {"n": 2} and len(phases) == 2
    point.clear_context()
    assert point.ctx == {}
    model(TOKENS)
    model.remove_all_hook_fns()  # keeps contexts
    assert point.ctx == {"n": 1} and not point.has_hooks()
    model.reset_hooks(clear_contexts=False)
    assert point.ctx == {"n": 1}
    model.reset_hooks()  # clear_contexts=True by default
    assert point.ctx == {}


def test_prepend_runs_first(model):
    order = []
    point = model.blocks[0].ln1.hook_scale
    point.add_hook(lambda x, hook: order.append("a"))
    point.add_hook(lambda x, hook: order.append("b"))
    point.add_hook(lambda x, hook: order.append("first"), prepend=True)
    model.add_hook("blocks.0.ln1.hook_scale", lambda x, hook: order.append("zeroth"), prepend=True)
    model(TOKENS)
    assert order == ["zeroth", "first", "a", "b"]


@pytest.mark.parametrize("family", FAMS)
@torch.no_grad()
def test_component_weights_are_views_of_the_model(family):
    model = make_bridge(family)
    for i in range(model.cfg.n_layers):
        torch.testing.assert_close(model.blocks[i].attn.W_Q, model.W_Q[i], atol=0, rtol=0)
        torch.testing.assert_close(model.blocks[i].attn.W_O, model.W_O[i], atol=0, rtol=0)
        torch.testing.assert_close(model.blocks[i].mlp.W_in, model.W_in[i], atol=0, rtol=0)
        torch.testing.assert_close(model.blocks[i].mlp.W_out, model.W_out[i], atol=0, rtol=0)
    torch.testing.assert_close(model.embed.W_E, model.W_E, atol=0, rtol=0)
    torch.testing.assert_close(model.unembed.W_U, model.W_U, atol=0, rtol=0)
    torch.testing.assert_close(model.unembed.W_U_raw, model.hf_model.get_output_embeddings().weight.T, atol=0, rtol=0)
    assert model.embed.module is model.hf_model.get_input_embeddings()
    clean = model(TOKENS)
    w_q = model.blocks[1].attn.W_Q
    w_q[2].mul_(3.0)  # TL users edit weights in place; the HF parameter must change
    assert not torch.allclose(model(TOKENS), clean)
    torch.testing.assert_close(model.W_Q[1][2], w_q[2], atol=0, rtol=0)
    w_q[2].div_(3.0)
    torch.testing.assert_close(model(TOKENS), clean, **TOL)


def test_dir_and_unknown_attribute(model):
    names = dir(model.blocks[0])
    assert {"hook_resid_pre", "hook_resid_post", "attn", "mlp", "ln1"} <= set(names)
    assert {"hook_pattern", "hook_z", "W_Q", "W_O"} <= set(dir(model.blocks[0].attn))
    assert {"hook_post", "W_in", "W_out"} <= set(dir(model.blocks[0].mlp))
    assert len(model.blocks) == model.cfg.n_layers == len(list(model.blocks))
    assert model.hook_embed is model.hook_dict["hook_embed"]
    with pytest.raises(AttributeError, match="hook_resid_pre"):
        model.blocks[0].hook_resid_preee  # noqa: B018
    with pytest.raises(AttributeError, match="hook_pattern"):
        model.blocks[0].attn.hook_patern  # noqa: B018
    with pytest.raises(AttributeError):
        model.hook_nonexistent  # noqa: B018


@torch.no_grad()
def test_stop_at_layer_returns_resid_pre_and_skips_later_layers(model):
    _, cache = model.run_with_cache(TOKENS, names_filter="resid_pre")
    fired = []
    for stop in range(model.cfg.n_layers):
        resid = model.run_with_hooks(
            TOKENS, fwd_hooks=[(f"blocks.{stop}.hook_resid_pre", lambda x, hook: fired.append(hook.name))],
            stop_at_layer=stop,
        )  # fmt: skip
        torch.testing.assert_close(resid, cache["resid_pre", stop], atol=0, rtol=0)
    assert fired == []  # resid_pre of the stop layer is the stop point, not computed by that layer
    later = []
    model.blocks[1].attn.hook_pattern.add_hook(lambda x, hook: later.append(1))
    out, partial = model.run_with_cache(TOKENS, stop_at_layer=1)
    assert later == [] and "blocks.1.attn.hook_pattern" not in partial
    torch.testing.assert_close(out, cache["resid_pre", 1], atol=0, rtol=0)


@torch.no_grad()
def test_start_at_layer_and_input_to_embed_reproduce_the_logits(model):
    clean = model(TOKENS)
    for layer in range(model.cfg.n_layers):
        resid = model(TOKENS, stop_at_layer=layer)
        torch.testing.assert_close(model(resid, start_at_layer=layer, tokens=TOKENS), clean, **TOL)
    residual, tokens, shortformer, mask = model.input_to_embed(TOKENS)
    assert shortformer is None and torch.equal(tokens, TOKENS) and bool(mask.all())
    _, cache = model.run_with_cache(TOKENS, names_filter=("resid_pre", 0))
    torch.testing.assert_close(residual, cache["resid_pre", 0], atol=0, rtol=0)
    torch.testing.assert_close(model(residual, start_at_layer=0, tokens=tokens), clean, **TOL)
    # A hook before the start layer does not see (or change) anything.
    hit = []
    model.run_with_hooks(
        model(TOKENS, stop_at_layer=1), start_at_layer=1, tokens=TOKENS,
        fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: hit.append(1))],
    )  # fmt: skip
    assert hit == []


@torch.no_grad()
def test_return_type_none_and_losses(model):
    fired = []
    out = model.run_with_hooks(
        TOKENS, return_type=None, fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: fired.append(1))]
    )
    assert out is None and fired == [1]
    logits, loss = model(TOKENS, return_type="both")
    per_token = model(TOKENS, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 6)
    torch.testing.assert_close(per_token, utils.lm_cross_entropy_loss(logits, TOKENS, per_token=True), **TOL)
    torch.testing.assert_close(loss, per_token.mean(), **TOL)
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten())
    torch.testing.assert_close(loss, manual, **TOL)


@torch.no_grad()
def test_to_tokens_options_and_mask_inference(model):
    texts = ["Hi", "Hello there"]
    right = model.to_tokens(texts)
    assert model.cfg.default_padding_side == "right" and right.shape == (2, 12)
    assert right[0, 0] == right[1, 0] == model.cfg.bos_token_id
    assert right[0, 3:].eq(model.pad_token_id).all() and right[0, 2] != model.pad_token_id
    left, mask = model.to_tokens_and_mask(texts, padding_side="left")
    assert left[0, :9].eq(model.pad_token_id).all() and left[0, 9] == model.cfg.bos_token_id
    assert mask.sum(-1).tolist() == [3, 12]
    assert model.to_tokens("Hi", prepend_bos=False).tolist() == [[model.to_single_token(c) for c in "Hi"]]
    assert model.to_str_tokens("Hi") == ["<bos>", "H", "i"]
    assert model.to_string(right[1]) == "<bos>Hello there"
    long = "x" * 300
    assert model.to_tokens(long).shape == (1, model.cfg.n_ctx)
    assert model.to_tokens(long, truncate=False).shape == (1, 301)
    # Left-padded ids without a mask are padding only when the caller says so (TransformerLens' padding_side).
    padded = model(left, padding_side="left")
    torch.testing.assert_close(padded[0, -1], model("Hi")[0, -1], **TOL)
    torch.testing.assert_close(padded[1, -1], model("Hello there")[0, -1], **TOL)
    torch.testing.assert_close(padded, model(left, attention_mask=mask), atol=0, rtol=0)
