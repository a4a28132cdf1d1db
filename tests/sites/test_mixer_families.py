"""State-space and hybrid families: the per-family exactness set for models with mixer layers.

Falcon-Mamba and Mamba 2 (every block a mixer), Bamba, Jamba, LFM2 and Nemotron-H (mixer layers and attention
layers; MLPs, mixtures of experts). Each family: forward and ``run_with_cache`` bitwise HF's (padded too), every
point where the layer kind says and nowhere else, edits equal plain torch hooks on HF's modules, in-place edits
equal returned ones on every point, greedy ``generate`` equal HF's (alone and left-padded), steering during
generation equal HF's generate under the same torch hook, beam search equal HF's, ``return_cache`` equal
``run_with_cache``, clear refusals (controllers, static cache / compile, speculative decoding), and the relevance
methods that apply.
Mamba itself: tests/sites/test_ssm.py.
"""

import pytest
import torch
from conftest import HYBRID_CONFIGS, SSM_CONFIGS, V, adapted_config, char_tokenizer, perturb_
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge
from transformer_bridge.hooks.names import UnknownHookError
from transformer_bridge.sites.mixers import mixer_of
from transformer_bridge.sites.module_paths import get_module

CONFIGS = {**{k: v for k, v in SSM_CONFIGS.items() if k != "mamba"}, **HYBRID_CONFIGS}
FAMILIES = list(CONFIGS)
TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(3))
PROMPTS = torch.tensor([[1, 40, 50, 60], [1, 7, 9, 11]])
PADDED = torch.tensor([[0, 0, 50, 60], [1, 7, 9, 11]])


def make(family: str, seed: int = 0) -> TransformerBridge:
    config = adapted_config(family, CONFIGS[family])
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config).eval()
    # Weights larger than the init, so greedy continuations vary and the recurrent state matters.
    return perturb_(TransformerBridge(hf, char_tokenizer()), scale=0.5)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request) -> TransformerBridge:
    return make(request.param)


def _blocks(model):
    return get_module(model.hf_model, model.adapter.blocks)


def _spec(model):
    return model.adapter.ssm or model.adapter.hybrid


def _kinds(model, layer: int) -> set[str]:
    """What block ``layer`` holds, read off HF's modules (not off the bridge's points)."""
    block = _blocks(model)[layer]
    if mixer_of(block, _spec(model)) is not None:
        kinds = {"mixer"}
    else:
        kinds = {"attn"} if hasattr(get_module(block, model.adapter.attn), "q_proj") else set()
    if model.adapter.ssm is None:
        mlp = get_module(block, model.adapter.mlp_out)
        if any(hasattr(mlp, a) for a in ("down_proj", "w2", "experts")):
            kinds.add("mlp")
    return kinds


def _hf_logits(model, tokens=TOKENS, **kwargs):
    with torch.no_grad():
        return model.hf_model(tokens, **kwargs).logits


def test_forward_and_cache_are_hf_bitwise_and_points_follow_the_layer_kinds(model):
    theirs = _hf_logits(model)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), theirs)
        logits, cache = model.run_with_cache(TOKENS)
    assert torch.equal(logits, theirs)
    seen_kinds = set()
    for layer in range(model.cfg.n_layers):
        kinds = _kinds(model, layer)
        seen_kinds |= kinds
        p = f"blocks.{layer}."
        assert (p + "hook_mixer_out" in cache) == ("mixer" in kinds)
        assert (p + "mixer.hook_y" in cache) == ("mixer" in kinds)
        assert (p + "attn.hook_z" in cache) == ("attn" in kinds) == (p + "hook_attn_out" in cache)
        assert (p + "hook_mlp_out" in cache) == ("mlp" in kinds)
        assert (p + "hook_resid_mid" in cache) == (len(kinds) == 2)
        parts = [cache[p + n] for n in ("hook_mixer_out", "hook_attn_out", "hook_mlp_out") if p + n in cache]
        torch.testing.assert_close(cache[p + "hook_resid_pre"] + sum(parts), cache[p + "hook_resid_post"])
        if layer + 1 < model.cfg.n_layers:
            assert torch.equal(cache[p + "hook_resid_post"], cache["resid_pre", layer + 1])
    assert len(seen_kinds) >= (1 if model.adapter.ssm else 2)
    for name, value in cache.items():
        if name.endswith(("hook_pattern", "hook_attn_scores")):
            assert value.shape[:2] == (2, model.cfg.n_heads) and value.shape[2:] == (6, 6), name
        else:
            assert value.shape[:2] == TOKENS.shape, name
    mixer_layer = next(i for i in range(model.cfg.n_layers) if "mixer" in _kinds(model, i))
    for name in (f"blocks.{mixer_layer}.attn.hook_pattern", f"blocks.{mixer_layer}.attn.hook_q"):
        with pytest.raises(UnknownHookError):
            model.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda x, h: None)])


def test_padded_forward_is_hf_bitwise_with_its_positions(model):
    mask = (PADDED != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        assert torch.equal(model(PADDED, attention_mask=mask), _hf_logits(model, PADDED, attention_mask=mask,
                                                                             position_ids=positions))  # fmt: skip


def _mixer_cases(model) -> list[tuple[str, str, bool, slice | None]]:
    """``(point, module path in the block, pre-hook?, slice of the module's tensor)`` for the mixer's points,
    from HF's layout of each kind (the oracle: the slice HF's forward splits off)."""
    spec = _spec(model)
    layer = next(i for i in range(model.cfg.n_layers) if "mixer" in _kinds(model, i))
    mixer = get_module(_blocks(model)[layer], spec.mixer)
    cases = [("hook_mixer_out", spec.mixer, False, None), ("mixer.hook_y", spec.out_proj, True, None)]
    if spec.kind == "short_conv":
        width = mixer.out_proj.in_features
        thirds = {key: slice(i * width, (i + 1) * width) for i, key in enumerate(("B", "C", "in"))}  # [B | C | x]
        cases += [(f"mixer.hook_{key}", spec.in_proj, False, part) for key, part in thirds.items()]
    elif spec.kind == "mamba2":
        inner, conv = mixer.intermediate_size, mixer.conv_dim
        cases += [("mixer.hook_gate", spec.in_proj, False, slice(0, inner)),
                  ("mixer.hook_in", spec.in_proj, False, slice(inner, inner + conv)),
                  ("mixer.hook_dt", spec.in_proj, False, slice(inner + conv, None)),
                  ("mixer.hook_scan", spec.gated_norm, True, None)]  # fmt: skip
    else:
        inner = mixer.intermediate_size
        cases += [("mixer.hook_in", spec.in_proj, False, slice(0, inner)),
                  ("mixer.hook_gate", spec.in_proj, False, slice(inner, None))]  # fmt: skip
        prefix = spec.x_proj.rpartition(".")[0]
        cases += [(f"mixer.hook_{key}", f"{prefix}.{key.lower()}_layernorm", False, None) for key in ("dt", "B", "C")]
    return [(f"blocks.{layer}.{name}", f"{layer}.{path}", pre, part) for name, path, pre, part in cases]


def _attn_cases(model) -> list[tuple[str, str, bool, slice | None]]:
    layers = [i for i in range(model.cfg.n_layers) if "attn" in _kinds(model, i)]
    if not layers:
        return []
    a, i = model.adapter, layers[0]
    return [(f"blocks.{i}.attn.hook_q", f"{i}.{a.q}", False, None),
            (f"blocks.{i}.attn.hook_v", f"{i}.{a.v}", False, None),
            (f"blocks.{i}.attn.hook_z", f"{i}.{a.o_proj}", True, None),
            (f"blocks.{i}.hook_attn_out", f"{i}.{a.attn_out}", False, None)]  # fmt: skip


def _mlp_cases(model) -> list[tuple[str, str, bool, slice | None]]:
    layers = [i for i in range(model.cfg.n_layers) if "mlp" in _kinds(model, i)]
    return [(f"blocks.{i}.hook_mlp_out", f"{i}.{model.adapter.mlp_out}", False, None) for i in layers]


def _with_torch_hook(model, path: str, pre: bool, part: slice | None, tokens=TOKENS):
    """HF's logits with a plain torch hook multiplying ``part`` of the module's input (``pre``) or output by 1.5."""

    def scaled(x):
        x = x.clone()
        x[..., part or slice(None)] *= 1.5
        return x

    module = get_module(_blocks(model), path)
    if pre:
        handle = module.register_forward_pre_hook(lambda m, args: (scaled(args[0]), *args[1:]))
    else:
        handle = module.register_forward_hook(
            lambda m, args, out: (scaled(out[0]), *out[1:]) if isinstance(out, tuple) else scaled(out)
        )
    try:
        return _hf_logits(model, tokens)
    finally:
        handle.remove()


def test_edits_equal_plain_torch_hooks_on_hf_modules(model):
    cases = _mixer_cases(model) + _attn_cases(model) + _mlp_cases(model)
    for name, path, pre, part in cases:
        expected = _with_torch_hook(model, path, pre, part)
        assert not torch.allclose(expected, _hf_logits(model)), name
        with torch.no_grad():
            got = model.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda x, h: x * 1.5)])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)


def test_in_place_edits_equal_returned_edits_on_every_point(model):
    def returned(x, hook):
        return x * 0.5 + 0.1  # the shift: a norm undoes a pure scale

    def in_place(x, hook):
        x.mul_(0.5).add_(0.1)

    plain = _hf_logits(model)
    _, cache = model.run_with_cache(TOKENS, names_filter=list(model.hook_dict))  # head results too: named
    seen = []
    with torch.no_grad():
        for name in model.hook_dict:
            if not cache[name].is_floating_point():  # token ids
                continue
            expected = model.run_with_hooks(TOKENS, fwd_hooks=[(name, returned)])
            assert not torch.allclose(expected, plain), name
            torch.testing.assert_close(model.run_with_hooks(TOKENS, fwd_hooks=[(name, in_place)]), expected, msg=name)
        read = model.run_with_hooks(TOKENS, fwd_hooks=[(list(model.hook_dict), lambda x, h: seen.append(h.name))])
    assert torch.equal(read, plain) and set(seen) == set(model.hook_dict)


def test_greedy_generate_equals_hf_alone_and_left_padded(model):
    theirs = model.hf_model.generate(PROMPTS, max_new_tokens=8, do_sample=False)
    ours = model.generate(PROMPTS, max_new_tokens=8, temperature=0)
    assert len(set(theirs[0, 4:].tolist())) > 3  # a continuation that varies, so the recurrent state matters
    assert torch.equal(ours, theirs)
    mask = (PADDED != 0).long()
    theirs = model.hf_model.generate(PADDED, attention_mask=mask, max_new_tokens=8, do_sample=False)
    both = model.generate(PADDED, attention_mask=mask, max_new_tokens=8, temperature=0, stop_at_eos=False)
    assert torch.equal(model.generate(PADDED, attention_mask=mask, max_new_tokens=8, temperature=0), theirs)
    for row, prompt in ((0, PADDED[:1, 2:]), (1, PADDED[1:])):
        alone = model.generate(prompt, max_new_tokens=8, temperature=0, stop_at_eos=False)
        assert torch.equal(both[row, -8:], alone[0, -8:]), row


def test_beam_search_equals_hf(model):
    """Beams reorder the conv and recurrent states with the keys and values (`KVRows.select`): equal HF's beams.
    Where HF disagrees with itself (transformers 5.5's cached Mamba 2 beams are not its uncached ones, and score
    lower), ours must be its uncached beams, which reorder nothing."""
    kwargs = dict(max_new_tokens=5, num_beams=2, do_sample=False)
    theirs = model.hf_model.generate(PROMPTS, **kwargs)
    ours = model.generate(PROMPTS, **kwargs)
    if not torch.equal(ours, theirs):
        uncached = model.hf_model.generate(PROMPTS, use_cache=False, **kwargs)
        assert not torch.equal(theirs, uncached) and torch.equal(ours, uncached)


@pytest.mark.parametrize("where", ["mixer", "attn"])
def test_steering_during_generate_equals_hf_generate_with_the_same_torch_hook(model, where):
    """An edit of a mixer's output enters the recurrent state, one of ``hook_v`` the KV cache, as HF's hooks do."""
    cases = _mixer_cases(model)[:1] if where == "mixer" else _attn_cases(model)[1:2]  # hook_mixer_out / hook_v
    if not cases:
        pytest.skip("no attention layer")
    name, path, _, _ = cases[0]
    width = model.cfg.d_model if where == "mixer" else model.cfg.n_kv_heads * model.cfg.d_head
    delta = torch.linspace(-2, 2, width)
    module = get_module(_blocks(model), path)
    handle = module.register_forward_hook(lambda m, a, o: o + delta)
    try:
        theirs = model.hf_model.generate(PROMPTS, max_new_tokens=6, do_sample=False)
    finally:
        handle.remove()
    phases = []

    def steer(x, hook):
        phases.append((hook.ctx.phase, x.shape[1]))
        return x + delta.view(x.shape[2:])

    with model.hooks(fwd_hooks=[(name, steer)]):
        ours = model.generate(PROMPTS, max_new_tokens=6, temperature=0)
    assert torch.equal(ours, theirs)
    assert phases[0] == ("prefill", 4) and all(p == ("decode", 1) for p in phases[1:])


def test_return_cache_equals_run_with_cache(model):
    out, cache = model.generate(PROMPTS, max_new_tokens=4, temperature=0, stop_at_eos=False, return_cache=True)
    _, expected = model.run_with_cache(out)
    assert set(cache) == set(expected)
    for name in expected:
        assert torch.equal(cache[name], expected[name]), name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"controller": lambda view: None}, "`controller` cannot drive a state-space model"),
     ({"compile": True}, "cannot be combined with a state-space model"),
     ({"cache_implementation": "static"}, "cannot be combined with a state-space model"),
     ({"prompt_lookup_num_tokens": 2}, "cannot be combined with a state-space model")],
    ids=["controller", "compile", "static", "speculative"],
)  # fmt: skip
def test_what_a_recurrent_state_cannot_do_is_refused_clearly(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(PROMPTS, max_new_tokens=2, temperature=0, **kwargs)


@pytest.mark.parametrize("method", ["dla", "grad_x_input", "integrated_gradients", "logit_lens"])
def test_relevance_methods_run_and_dla_sums_to_the_logit(model, method):
    pair = model.generate(PROMPTS[:1], max_new_tokens=3, temperature=0, return_cache=True)
    rel = model.relevance(pair, method=method)
    assert torch.isfinite(rel.scores).all() and rel.scores.abs().sum() > 0
    if method == "dla":
        labels = set(rel.labels)
        assert any(label.endswith(".mixer") for label in labels)
        assert rel.extras.get("checked", True) and max(rel.conservation_error) < 1e-4


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_lrp_says_it_has_no_rules_for_the_mixer(model, method):
    pair = model.generate(PROMPTS[:1], max_new_tokens=2, temperature=0, return_cache=True)
    with pytest.raises(ValueError, match=rf"'{method}' has no LRP rules for the state-space mixer.*grad_x_input"):
        model.relevance(pair, method=method)
