"""TransformerLens' split-input points (`transformer_bridge.sites.split_inputs`), checked against oracles computed by
hand from a cache and the HF modules: per-head copies of the residual that Q / K / V read (``hook_q_input`` …,
``hook_attn_in``) and the MLP branch's own input (``hook_mlp_in``)."""

import pytest
import torch
from conftest import CONFIGS, HYBRID_CONFIGS, SSM_CONFIGS, adapted_config, char_tokenizer, make_bridge, perturb_
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge
from transformer_bridge.config import ConfigFieldError
from transformer_bridge.hooks.names import HookOffError
from transformer_bridge.sites.module_paths import get_module
from transformer_bridge.sites.split_inputs import SWITCHES

TOKENS = torch.tensor([[1, 40, 41, 42, 7, 19], [1, 5, 6, 70, 71, 72]])
FLAGS = ("use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")
# Fused Conv1D [q|k|v] (GPT-2), GQA (Llama), per-head interleaved (GPT-NeoX), q/k norms (Qwen 3), OPT's scaled
# queries, fused Linear (Phi-3), no ln1 (OLMo 2), multi-query fused (GPT-BigCode), Gemma 2's (1 + w) norms.
FAMILIES = ["gpt2", "llama", "gpt_neox", "qwen3", "opt", "phi3", "olmo2", "gpt_bigcode", "gemma2"]
SPLIT_POINTS = ("hook_q_input", "hook_k_input", "hook_v_input")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request) -> TransformerBridge:
    return perturb_(make_bridge(request.param))


@pytest.fixture(autouse=True)
def flags_off(request):
    yield
    if "model" in request.fixturenames:
        bridge = request.getfixturevalue("model")
        bridge.reset_hooks(including_permanent=True)
        for flag in FLAGS:
            setattr(bridge.cfg, flag, False)


def names(model, kinds=SPLIT_POINTS):
    return [f"blocks.{layer}.{kind}" for layer in range(model.cfg.n_layers) for kind in kinds]


def cached(model, hooks=()):
    with model.hooks(fwd_hooks=list(hooks)):
        return model.run_with_cache(TOKENS)[1]


def ln1(model, layer):
    a = model.adapter
    return None if a.ln1 is None else get_module(get_module(model.hf_model, a.blocks)[layer], a.ln1)


def by_hand(model, layer, copy, kind):
    """``kind`` (q, k or v) of every head from one residual copy ``[batch, pos, d_model]``: ln1, then TL's
    per-head weights (`model.blocks[L].attn.W_Q` …, read by compat/weights.py, not by split_inputs)."""
    norm = ln1(model, layer)
    x = copy if norm is None else norm(copy)
    attn = model.blocks[layer].attn
    w, b = getattr(attn, f"W_{kind.upper()}"), getattr(attn, f"b_{kind.upper()}")
    return torch.einsum("bpm,hme->bphe", x, w) + b


# -- (a) on, unhooked: nothing attached, bitwise ------------------------------------------------------------------


def test_flags_on_without_hooks_are_bitwise(model):
    off = model(TOKENS)
    for flags in (("use_split_qkv_input", "use_hook_mlp_in"), ("use_attn_in",)):
        for flag in flags:
            setattr(model.cfg, flag, True)
        assert torch.equal(model(TOKENS), off)
        assert not model._live  # no site attached
        for flag in flags:
            setattr(model.cfg, flag, False)
    assert torch.equal(off, model.hf_model(TOKENS).logits)


# -- (b) hooks that edit nothing ---------------------------------------------------------------------------------


def test_hooks_that_edit_nothing_keep_the_logits(model):
    off = model(TOKENS)
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    every = names(model, (*SPLIT_POINTS, "hook_mlp_in"))
    for fn in (lambda x, hook: None, lambda x, hook: x, lambda x, hook: x.clone()):
        assert torch.equal(model.run_with_hooks(TOKENS, fwd_hooks=[(n, fn) for n in every]), off)
    _, cache = model.run_with_cache(TOKENS)  # every point, split ones included
    assert cache["blocks.0.hook_q_input"].shape == (2, 6, model.cfg.n_heads, model.cfg.d_model)
    assert cache["blocks.0.hook_k_input"].shape == (2, 6, model.cfg.n_kv_heads, model.cfg.d_model)
    assert torch.equal(cache["blocks.1.hook_v_input"][:, :, -1], cache["blocks.1.hook_resid_pre"])
    model.set_use_split_qkv_input(False)
    model.set_use_attn_in(True)
    copies = [(n, lambda x, hook: x.clone()) for n in names(model, ("hook_attn_in",))]
    assert torch.equal(model.run_with_hooks(TOKENS, fwd_hooks=copies), off)


@pytest.mark.parametrize("flag", ["use_split_qkv_input", "use_attn_in"])
def test_every_head_recomputed_matches_the_unsplit_logits(model, flag):
    """A backward hook makes every head read its copy (so gradients reach it): the per-head recomputation."""
    off = model(TOKENS)
    setattr(model.cfg, flag, True)
    kinds = SPLIT_POINTS if flag == "use_split_qkv_input" else ("hook_attn_in",)
    grads = {}
    with model.hooks(bwd_hooks=[(n, lambda g, hook: grads.setdefault(hook.name, g)) for n in names(model, kinds)]):
        logits = model(TOKENS)
        logits.logsumexp(-1).sum().backward()
    model.hf_model.zero_grad()
    torch.testing.assert_close(logits, off, atol=1e-5, rtol=0)
    # Every copy is on the path (its gradient reached the hook): the sign of the recomputation. Bitwise inequality
    # with the fused product is not one: from torch 2.14 on the per-head products round like the fused one.
    assert set(grads) == set(names(model, kinds))
    assert all(g.abs().sum() > 0 for g in grads.values())


# -- (c) an edit of one head's copy ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["q", "k", "v"])
def test_an_edit_of_one_heads_copy_changes_that_head_only(model, kind):
    model.set_use_split_qkv_input(True)
    layer, head = 1, 1 if kind == "q" else model.cfg.n_kv_heads - 1  # multi-query (GPT-BigCode): one kv head
    _, base = model.run_with_cache(TOKENS)
    new_copy = base["resid_pre", layer] * 1.7 + 0.3

    def edit(x, hook):
        x[:, :, head] = new_copy

    cache = cached(model, [(f"blocks.{layer}.hook_{kind}_input", edit)])
    expected = by_hand(model, layer, new_copy, kind)[:, :, head]
    torch.testing.assert_close(cache[kind, layer][:, :, head], expected, atol=1e-5, rtol=0)
    for other in "qkv":
        got, was = cache[other, layer], base[other, layer]
        keep = torch.ones(got.shape[2], dtype=torch.bool)
        if other == kind:
            keep[head] = False
            assert not torch.equal(got[:, :, head], was[:, :, head])
        assert torch.equal(got[:, :, keep], was[:, :, keep]), other  # bitwise: not recomputed
    assert torch.equal(cache["resid_pre", layer], base["resid_pre", layer])


def test_attn_in_feeds_q_k_v_and_kv_head_g_reads_copy_g(model):
    model.set_use_attn_in(True)
    layer, head = 0, 1
    _, base = model.run_with_cache(TOKENS)
    new_copy = base["resid_pre", layer].flip(1)

    def edit(x, hook):
        out = x.clone()
        out[:, :, head] = new_copy
        return out

    cache = cached(model, [(f"blocks.{layer}.hook_attn_in", edit)])
    assert cache["attn_in", layer].shape[2] == model.cfg.n_heads
    for kind in "qkv":
        if kind != "q" and head >= model.cfg.n_kv_heads:  # multi-query: the one kv head reads copy 0
            assert torch.equal(cache[kind, layer], base[kind, layer])
            continue
        expected = by_hand(model, layer, new_copy, kind)[:, :, head]
        torch.testing.assert_close(cache[kind, layer][:, :, head], expected, atol=1e-5, rtol=0)
        others = [h for h in range(cache[kind, layer].shape[2]) if h != head]
        assert torch.equal(cache[kind, layer][:, :, others], base[kind, layer][:, :, others])


def test_hook_q_edits_apply_after_the_recomputation(model):
    """``attn.hook_q`` shows the recomputed projection, and its own edit is what attention reads."""
    model.set_use_split_qkv_input(True)
    seen = {}
    hooks = [("blocks.0.hook_q_input", lambda x, hook: x * 0.5),
             ("blocks.0.attn.hook_q", lambda q, hook: seen.setdefault("q", q.clone()))]  # fmt: skip
    split = model.run_with_hooks(TOKENS, fwd_hooks=hooks)
    zero = model.run_with_hooks(TOKENS, fwd_hooks=[*hooks, ("blocks.0.attn.hook_q", lambda q, hook: q * 0)])
    model.set_use_split_qkv_input(False)
    plain = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.attn.hook_q", lambda q, hook: q * 0)])
    assert not torch.equal(split, zero)
    torch.testing.assert_close(zero, plain, atol=1e-5, rtol=0)  # a zero query whatever its input
    assert seen["q"].shape[2] == model.cfg.n_heads


# -- (d) hook_mlp_in -----------------------------------------------------------------------------------------------


def mlp_by_hand(model, layer, x):
    """What ``layer``'s MLP branch adds to the residual when it reads ``x`` (HF modules, called directly)."""
    block = get_module(model.hf_model, model.adapter.blocks)[layer]
    a = model.adapter
    h = get_module(block, a.ln2)(x) if a.ln2 else x
    opt = "opt" in a.model_types  # OPT's MLP is fc1 / fc2 in the block itself
    out = block.fc2(block.activation_fn(block.fc1(h))) if opt else block.mlp(h)
    return get_module(block, a.mlp_out)(out) if a.sandwich else out


def test_hook_mlp_in_edit_is_what_the_mlp_reads_not_the_residual(model):
    model.set_use_hook_mlp_in(True)
    layer = 1
    _, base = model.run_with_cache(TOKENS)
    before_mlp = base["resid_pre" if model.cfg.parallel_attn_mlp else "resid_mid", layer]
    assert torch.equal(base["mlp_in", layer], before_mlp)
    edited = before_mlp * 1.3 + 0.1
    cache = cached(model, [(f"blocks.{layer}.hook_mlp_in", lambda x, hook: x.mul_(1.3).add_(0.1))])
    expected = mlp_by_hand(model, layer, edited)
    torch.testing.assert_close(cache["mlp_out", layer], expected, atol=1e-5, rtol=0)
    stream = base["resid_mid", layer] if not model.cfg.parallel_attn_mlp else base["resid_pre", layer] + base[
        "attn_out", layer]  # fmt: skip
    torch.testing.assert_close(cache["resid_post", layer], stream + expected, atol=1e-5, rtol=0)


# -- (f) generation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_with_split_hooks_equals_a_loop_of_full_forwards(family):
    model = perturb_(make_bridge(family), scale=0.5)
    model.set_use_split_qkv_input(True)
    widths = []

    def q_edit(x, hook):
        widths.append(x.shape[1])
        x[:, :, 1] = x[:, :, 1] * -2.0

    def k_edit(x, hook):
        x[:, :, 0] = x[:, :, 0].flip(-1)

    hooks = [("blocks.0.hook_q_input", q_edit), ("blocks.1.hook_k_input", k_edit)]
    prompt = TOKENS[:1]
    with model.hooks(fwd_hooks=hooks):
        generated = model.generate(prompt, max_new_tokens=5, do_sample=False)
        assert widths[0] == prompt.shape[1] and set(widths[1:]) == {1}  # new positions only
        seq = prompt
        for _ in range(5):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        hooked = model(seq)
    assert torch.equal(generated, seq)
    assert (hooked - model(seq)).abs().max() > 1e-2  # the hooks mattered


# -- (e) errors and switches ---------------------------------------------------------------------------------------


def test_switched_off_points_are_not_in_hook_dict_and_naming_them_raises(model):
    split = set(names(model, (*SPLIT_POINTS, "hook_attn_in", "hook_mlp_in")))
    assert not split & set(model.hook_dict)
    assert not split & set(model.run_with_cache(TOKENS)[1].keys())
    for name, flag in (("blocks.0.hook_q_input", "use_split_qkv_input"), ("blocks.1.hook_attn_in", "use_attn_in"),
                       ("blocks.0.hook_mlp_in", "use_hook_mlp_in")):  # fmt: skip
        with pytest.raises(HookOffError, match=f"set_{flag}"):
            model.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda x, hook: x)])
        with pytest.raises(HookOffError, match=flag):
            model.run_with_cache(TOKENS, names_filter=name)
    with pytest.raises(HookOffError):
        model.run_with_cache(TOKENS, names_filter="q_input")
    model.set_use_split_qkv_input(True)
    assert set(names(model)) <= set(model.hook_dict)
    order = list(model.hook_dict)
    before = "blocks.0.ln1.hook_normalized" if model.adapter.ln1 else "blocks.0.hook_resid_pre"
    assert order.index(before) < order.index("blocks.0.hook_q_input") < order.index("blocks.0.attn.hook_q")
    model.add_hook("blocks.0.hook_q_input", lambda x, hook: x, is_permanent=True)
    with pytest.raises(ConfigFieldError, match="remove them first"):
        model.set_use_split_qkv_input(False)


def test_use_attn_in_and_use_split_qkv_input_are_mutually_exclusive(model):
    model.set_use_split_qkv_input(True)
    with pytest.raises(ValueError, match="mutually exclusive"):
        model.set_use_attn_in(True)
    model.set_use_split_qkv_input(False)
    model.cfg.use_attn_in = True
    with pytest.raises(ConfigFieldError, match=r"cfg\.use_split_qkv_input.*mutually exclusive"):
        model.cfg.use_split_qkv_input = True
    with pytest.raises(ConfigFieldError, match="True or False"):
        model.cfg.use_attn_in = 1
    with pytest.raises(TypeError, match="use_hook_mlp_in"):
        model.set_use_hook_mlp_in("yes")


def _hf(make_config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config()).eval()


@pytest.mark.parametrize(
    ("family", "refused"),
    [("youtu", FLAGS[:2]), ("mamba", FLAGS), ("lfm2", FLAGS[:2]), ("nemotron_h", FLAGS), ("phi", FLAGS[2:]),
     ("gptj", FLAGS[2:]), ("cohere", FLAGS[2:])],
)  # fmt: skip
def test_families_that_cannot_split_exactly_refuse(family, refused):
    configs = {**CONFIGS, **SSM_CONFIGS, **HYBRID_CONFIGS}
    bridge = TransformerBridge(_hf(lambda: adapted_config(family, configs[family])), char_tokenizer())
    for flag in FLAGS:
        if flag in refused:
            with pytest.raises(ConfigFieldError, match=rf"`cfg.{flag}` = True .*{bridge.cfg.model_type!r}"):
                setattr(bridge.cfg, flag, True)
            assert not [n for n in bridge.names.valid if n.endswith(SWITCHES[flag])]  # no such point at all
        else:
            setattr(bridge.cfg, flag, True)
            setattr(bridge.cfg, flag, False)


def test_refused_reasons_name_what_is_missing():
    mla = TransformerBridge(_hf(lambda: adapted_config("youtu", CONFIGS["youtu"])))
    with pytest.raises(ConfigFieldError, match="latent attention"):
        mla.set_use_split_qkv_input(True)
    phi = make_bridge("phi")
    with pytest.raises(ConfigFieldError, match="shared norm"):
        phi.set_use_hook_mlp_in(True)


# -- (g) TransformerLens 4's spellings -----------------------------------------------------------------------------


def test_transformerlens_4_spellings_resolve_to_the_one_point(model):
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    seen = []
    note = lambda x, hook: seen.append(hook.name)  # noqa: E731
    model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.attn.hook_q_input", note), ("blocks.0.hook_mlp_in", note)])
    assert seen == ["blocks.0.hook_q_input", "blocks.0.hook_mlp_in"]
    _, cache = model.run_with_cache(TOKENS, names_filter=["blocks.1.attn.hook_k_input", ("v_input", 1)])
    assert list(cache.keys()) == ["blocks.1.hook_k_input", "blocks.1.hook_v_input"]  # each stored once
    assert cache["blocks.1.attn.hook_k_input"] is cache["k_input", 1]
    assert model.blocks[0].attn.hook_q_input is model.hook_dict["blocks.0.hook_q_input"] is model.blocks[0].hook_q_input
    model.set_use_split_qkv_input(False)
    model.set_use_attn_in(True)
    assert model.names_matching("blocks.0.attn.hook_attn_in") == ["blocks.0.hook_attn_in"]


def test_every_family_splits_exactly_or_refuses(family):
    """Over every dense and MoE family of conftest: each head's copy edited at once in Q, K and V matches the hand
    oracle, or the family refuses (latent attention)."""
    model = perturb_(make_bridge(family))
    if model.adapter.mla:
        with pytest.raises(ConfigFieldError, match="latent attention"):
            model.set_use_split_qkv_input(True)
        return
    model.set_use_split_qkv_input(True)
    layer, heads = 1, {"q": 1, "k": model.cfg.n_kv_heads - 1, "v": 0}
    base = cached(model)
    new_copy = base["resid_pre", layer].flip(1) * 0.9

    def put(head):
        def edit(x, hook):
            x[:, :, head] = new_copy

        return edit

    edits = [(f"blocks.{layer}.hook_{k}_input", put(h)) for k, h in heads.items()]
    cache = cached(model, edits)
    for kind, head in heads.items():
        expected = by_hand(model, layer, new_copy, kind)[:, :, head]
        torch.testing.assert_close(cache[kind, layer][:, :, head], expected, atol=1e-5, rtol=0)
