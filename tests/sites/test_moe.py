"""Mixture-of-experts hook points against independent oracles: HF's own routing (with edited router
weights), plain torch hooks on the HF router, and the sum of the experts' outputs."""

import pytest
import torch
from conftest import MOE_CONFIGS, V, char_tokenizer, make_bridge
from transformers import AutoConfig, AutoModelForCausalLM

from transformer_bridge import TransformerBridge, get_act_name
from transformer_bridge.compat.weights import MLP_WEIGHTS
from transformer_bridge.sites.module_paths import get_module
from transformer_bridge.sites.moe import route

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(7))
LAYER = 1  # a mixture-of-experts block in every family here
BAN = {0: [1, 4], 1: [0, 2, 5]}  # row -> positions where the banned expert is taken away


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def model(request):
    return make_bridge(request.param)


def _moe(model, path: str):
    return get_module(model.hf_model, f"{model.adapter.blocks}.{LAYER}.{path}")


def _with_router_hook(model, fn):
    """HF logits with a plain torch forward hook rewriting the router's output (the oracle)."""
    handle = _moe(model, model.adapter.moe.router).register_forward_hook(lambda m, a, out: fn(out))
    try:
        with torch.no_grad():
            return model.hf_model(TOKENS).logits
    finally:
        handle.remove()


def _cache(model):
    _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.startswith(f"blocks.{LAYER}."))
    return cache


def test_points_shapes_and_config(model):
    c = model.cfg
    assert (c.num_experts, c.experts_per_token) == (4, 2)
    cache = _cache(model)
    logits, weights = cache[f"blocks.{LAYER}.mlp.hook_router_logits"], cache[f"blocks.{LAYER}.mlp.hook_expert_weights"]
    assert logits.shape == weights.shape == (*TOKENS.shape, 4)
    assert cache[f"blocks.{LAYER}.mlp.hook_expert_result"].shape == (*TOKENS.shape, 4, c.d_model)
    assert ((weights != 0).sum(-1) == 2).all()  # top-2: two experts per token, the others weigh 0
    if model.adapter.moe.routing != "sigmoid_group_topk":  # DeepSeek: groups and a bias decide, not only logits
        chosen = weights.topk(2, dim=-1).indices.sort(-1).values
        assert torch.equal(chosen, logits.topk(2, dim=-1).indices.sort(-1).values)  # the top logits win
    # Dense-MLP points do not exist on a mixture-of-experts block (they do on Llama 4's dense block 0).
    for name in ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post"):
        assert f"blocks.{LAYER}.{name}" not in model.hook_dict
    assert ("blocks.0.mlp.hook_post" in model.hook_dict) == (c.model_type in ("llama4_text", "deepseek_v3", "glm4_moe"))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        MLP_WEIGHTS["W_in"](model, LAYER)


def test_expert_results_sum_to_the_routed_output(model):
    """Σ_expert hook_expert_result = hook_mlp_out, less the shared expert where the family has one (FlexOLMo: the
    input of the post-norm whose output is hook_mlp_out)."""
    cache = _cache(model)
    routed = cache[f"blocks.{LAYER}.mlp.hook_expert_result"].sum(-2)
    mlp_in = {}
    h = _moe(model, model.adapter.mlp_out).register_forward_hook(lambda m, a, o: mlp_in.update(x=a[0]))
    with torch.no_grad():
        model.hf_model(TOKENS)
        h.remove()
        if model.adapter.sandwich:
            _close(routed, mlp_in["x"].reshape(routed.shape))
            return
        x = mlp_in["x"].reshape(-1, model.cfg.d_model)
        block = _moe(model, model.adapter.mlp_out)
        shared = 0.0
        if hasattr(block, "shared_expert_gate"):  # Qwen2-MoE: a sigmoid-gated shared expert
            shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        elif hasattr(block, "shared_expert"):  # Llama 4
            shared = block.shared_expert(x)
        elif hasattr(block, "shared_experts"):  # DeepSeek-V3
            shared = block.shared_experts(x)
    _close(routed + torch.as_tensor(shared).reshape(routed.shape if torch.is_tensor(shared) else ()),
           cache["mlp_out", LAYER])  # fmt: skip


def test_router_logit_edit_reroutes_like_doubled_router_weights(model):
    """Doubling the logits through the hook equals HF's own routing with the router's weights doubled."""
    router = _moe(model, model.adapter.moe.router)
    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_router_logits", lambda x, h: x * 2)])
        params = [p for p in (router.weight, getattr(router, "bias", None)) if p is not None]
        for p in params:
            p.mul_(2)
        try:
            expected = model.hf_model(TOKENS).logits
        finally:
            for p in params:
                p.div_(2)
    assert not torch.equal(expected, model.hf_model(TOKENS).logits)
    _close(got, expected)


def test_router_logit_ban_keeps_an_expert_out(model):
    seen = {}

    def ban(x, hook):
        x = x.clone()
        x[..., 3] = float("-inf")
        return x

    with torch.no_grad():
        model.run_with_hooks(TOKENS, fwd_hooks=[
            (f"blocks.{LAYER}.mlp.hook_router_logits", ban),
            (f"blocks.{LAYER}.mlp.hook_expert_weights", lambda w, h: seen.setdefault("w", w.clone())),
        ])  # fmt: skip
    assert (seen["w"][..., 3] == 0).all() and ((seen["w"] != 0).sum(-1) == 2).all()


def _ban_in_router_output(model, expert: int):
    """The oracle's edit of the router's own output: the banned expert's weight is 0 at the chosen tokens."""
    positions = torch.zeros(TOKENS.shape, dtype=torch.bool)
    for row, cols in BAN.items():
        positions[row, cols] = True
    flat = positions.reshape(-1)

    def fn(out):
        if model.adapter.moe.dense:  # Llama 4: (scores [token, expert], logits)
            scores = out[0].clone()
            scores[flat, expert] = 0
            return (scores, *out[1:])
        named = _router_output(model, out)
        named["weights"] = named["weights"].clone()
        named["weights"][(named["indices"] == expert) & flat[:, None]] = 0
        return _as_router_output(model, named, out)

    return positions, fn


def _router_output(model, out) -> dict:
    """The router's output by name (its order is the adapter's, which follows the release: GraniteMoE)."""
    return dict(zip(model.adapter.moe.router_output, out, strict=False))


def _as_router_output(model, named: dict, out) -> tuple:
    order = model.adapter.moe.router_output
    return (*(named[name] for name in order), *out[len(order) :])


@pytest.mark.parametrize("way", ["expert_weights", "expert_result"])
def test_banning_an_expert_equals_zeroing_its_router_weight(model, way):
    cache = _cache(model)
    expert = int(cache[f"blocks.{LAYER}.mlp.hook_expert_weights"][0, 1].argmax())  # routed at (0, 1)
    positions, oracle = _ban_in_router_output(model, expert)

    def ban(x, hook):
        x = x.clone()
        x[positions, expert] = 0
        return x

    expected = _with_router_hook(model, oracle)
    assert not torch.allclose(expected, model.hf_model(TOKENS).logits)
    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_{way}", ban)])
    _close(got, expected)


def test_forcing_an_expert_equals_routing_it_in_the_router_output(model):
    """Give token (1, 3) an expert it was not routed to, with the weight of the one it replaces."""
    weights = _cache(model)[f"blocks.{LAYER}.mlp.hook_expert_weights"]
    w = weights[1, 3]
    old = int(w.masked_fill(w == 0, float("inf")).argmin())  # the weaker of its two experts
    new = int((w == 0).nonzero()[0])
    flat = 1 * TOKENS.shape[1] + 3

    def force(x, hook):
        x = x.clone()
        x[1, 3, new], x[1, 3, old] = x[1, 3, old], 0
        return x

    def oracle(out):
        if model.adapter.moe.dense:
            scores = out[0].clone()
            scores[flat, new], scores[flat, old] = scores[flat, old], 0
            return (scores, *out[1:])
        named = _router_output(model, out)
        indices = named["indices"].clone()
        indices[flat] = torch.where(indices[flat] == old, new, indices[flat])
        return _as_router_output(model, {**named, "indices": indices}, out)

    expected = _with_router_hook(model, oracle)
    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_expert_weights", force)])
    _close(got, expected)


def test_default_grouped_mm_kernel():
    """Mixtral with the experts kernel real checkpoints use (grouped_mm; 16-byte rows, so width 36)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("mixtral", vocab_size=V, hidden_size=32, intermediate_size=36, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2)  # fmt: skip
    hf = AutoModelForCausalLM.from_config(config).eval()
    assert hf.config._experts_implementation == "grouped_mm"
    model = TransformerBridge(hf, char_tokenizer())
    with torch.no_grad():
        theirs = hf(TOKENS).logits
        assert torch.equal(model(TOKENS), theirs)
        logits, cache = model.run_with_cache(TOKENS)
        assert torch.equal(logits, theirs)
        _close(cache["blocks.1.mlp.hook_expert_result"].sum(-2), cache["mlp_out", 1])
        zero = lambda x, h: x * 0  # noqa: E731
        by_weights = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.mlp.hook_expert_weights", zero)])
        by_results = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.mlp.hook_expert_result", zero)])
        by_output = model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_mlp_out", zero)])
    _close(by_weights, by_output)
    _close(by_results, by_output)


def test_jamba_routing_points_on_either_router():
    """Jamba's router returns (logits, weights, indices) from transformers 5.21 on; before, it is a plain linear map
    and the MoE block routes its logits itself (`LINEAR_ROUTER`): on either, a logit edit re-routes as doubled router
    weights do, an expert-weight ban equals the same ban of the experts' input, and the results sum to the output."""
    from conftest import HYBRID_CONFIGS, adapted_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(adapted_config("jamba", HYBRID_CONFIGS["jamba"])).eval()
    model = TransformerBridge(hf, char_tokenizer())
    cache = _cache(model)
    weights = cache[f"blocks.{LAYER}.mlp.hook_expert_weights"]
    assert weights.shape == (*TOKENS.shape, 4) and ((weights != 0).sum(-1) == 2).all()
    chosen = weights.topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(chosen, cache[f"blocks.{LAYER}.mlp.hook_router_logits"].topk(2, dim=-1).indices.sort(-1).values)
    _close(cache[f"blocks.{LAYER}.mlp.hook_expert_result"].sum(-2), cache["mlp_out", LAYER])

    router = _moe(model, model.adapter.moe.router)
    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_router_logits", lambda x, h: x * 2)])
        router.weight.mul_(2)
        try:
            expected = model.hf_model(TOKENS).logits
        finally:
            router.weight.div_(2)
    assert not torch.equal(expected, model.hf_model(TOKENS).logits)
    _close(got, expected)

    expert = int(weights[0, 1].argmax())
    positions = torch.zeros(TOKENS.shape, dtype=torch.bool)
    for row, cols in BAN.items():
        positions[row, cols] = True
    flat = positions.reshape(-1)

    def ban_input(module, args):  # the oracle: the experts module's own input, (hidden, top_k_index, top_k_weights)
        hidden, index, w = args
        return hidden, index, w.masked_fill((index == expert) & flat[:, None], 0)

    def ban(x, hook):
        x = x.clone()
        x[positions, expert] = 0
        return x

    handle = _moe(model, model.adapter.moe.experts).register_forward_pre_hook(ban_input)
    try:
        with torch.no_grad():
            expected = model.hf_model(TOKENS).logits
    finally:
        handle.remove()
    assert not torch.allclose(expected, model.hf_model(TOKENS).logits)
    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_expert_weights", ban)])
    _close(got, expected)


def test_attention_sinks_pattern_is_hf_eager_attention():
    """GPT-OSS: the pattern is HF's eager attention weights (the sink's share dropped: rows sum below 1)."""
    model = make_bridge("gpt_oss")
    with torch.no_grad():
        hf = model.hf_model(TOKENS, output_attentions=True).attentions
        _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_pattern"))
    for layer in range(model.cfg.n_layers):
        pattern = cache["pattern", layer]
        _close(pattern, hf[layer])
        assert (pattern.sum(-1) < 1).all()


def test_expert_internals_match_the_experts_module():
    """``hook_expert_post`` through each expert's down projection is what the HF experts module computes."""
    model = make_bridge("mixtral")
    experts = _moe(model, model.adapter.moe.experts)
    cache = _cache(model)
    hidden = {}
    h = experts.register_forward_hook(lambda m, a, o: hidden.update(x=a[0]))
    with torch.no_grad():
        model.hf_model(TOKENS)
        h.remove()
        x, n = hidden["x"], model.cfg.num_experts
        for e in range(n):
            theirs = experts(x, torch.full((x.shape[0], 1), e), torch.ones(x.shape[0], 1))
            ours = cache[f"blocks.{LAYER}.mlp.hook_expert_post"][:, :, e] @ experts.down_proj[e].T
            _close(ours.reshape(theirs.shape), theirs)
    assert cache[f"blocks.{LAYER}.mlp.hook_expert_pre"].shape == (*TOKENS.shape, n, model.cfg.d_mlp)
    # Zeroing an expert's hidden activation at some tokens bans it there.
    expert = int(cache[f"blocks.{LAYER}.mlp.hook_expert_weights"][0, 1].argmax())
    positions, oracle = _ban_in_router_output(model, expert)

    def zero(x, hook):
        x = x.clone()
        x[positions, expert] = 0
        return x

    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_expert_post", zero)])
    _close(got, _with_router_hook(model, oracle))


def test_llama4_expert_internals_match_the_experts_module():
    """Llama 4 (experts run on router-scaled copies of the tokens): ``hook_expert_post`` through each down
    projection is the HF experts module's output, ``hook_expert_pre`` the gate of the scaled input, and
    zeroing an expert's hidden activation at some tokens equals zeroing its router score there."""
    model = make_bridge("llama4_text")
    experts = _moe(model, model.adapter.moe.experts)
    cache, n = _cache(model), model.cfg.num_experts
    seen = {}
    h = experts.register_forward_hook(lambda m, a, o: seen.update(x=a[0], y=o))
    with torch.no_grad():
        model.hf_model(TOKENS)
    h.remove()
    x = seen["x"].view(n, -1, model.cfg.d_model)
    d_mlp = experts.down_proj.shape[1]
    gate = torch.bmm(x, experts.gate_up_proj[..., :d_mlp])
    _close(cache[f"blocks.{LAYER}.mlp.hook_expert_pre"].reshape(-1, n, d_mlp).transpose(0, 1), gate)
    post = cache[f"blocks.{LAYER}.mlp.hook_expert_post"].reshape(-1, n, d_mlp).transpose(0, 1)
    _close(torch.bmm(post, experts.down_proj).reshape(seen["y"].shape), seen["y"])
    expert = int(cache[f"blocks.{LAYER}.mlp.hook_expert_weights"][0, 1].argmax())
    positions, oracle = _ban_in_router_output(model, expert)

    def zero(x, hook):
        x = x.clone()
        x[positions, expert] = 0
        return x

    with torch.no_grad():
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_expert_post", zero)])
    _close(got, _with_router_hook(model, oracle))


def test_deepseek_group_routing_rule_equals_hf_router():
    """DeepSeek-V3's rule (sigmoid, bias-corrected group top-k) as `route` computes it, against HF's router."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = AutoConfig.for_model("deepseek_v3", hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                  topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)  # fmt: skip
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.1)
        x = torch.randn(20, 32)
        logits, weights, indices = router(x)
        ours_w, ours_i = route("sigmoid_group_topk", logits, router)
    order, ours_order = indices.argsort(-1), ours_i.argsort(-1)
    assert torch.equal(indices.gather(1, order), ours_i.gather(1, ours_order))
    _close(weights.gather(1, order), ours_w.gather(1, ours_order))


def test_shorthand_names(model):
    """The MoE points go through the one name grammar: keys, bare shorthand, cache lookups, unknown names."""
    assert get_act_name("router_logits", 1) == "blocks.1.mlp.hook_router_logits"
    _, cache = model.run_with_cache(TOKENS, names_filter="expert_weights")  # that point in every MoE block
    assert [n for n in cache] == [f"blocks.{i}.mlp.hook_expert_weights" for i in range(model.cfg.n_layers)
                                  if f"blocks.{i}.mlp.hook_expert_weights" in model.hook_dict]  # fmt: skip
    assert torch.equal(cache["expert_weights", LAYER], cache[f"blocks.{LAYER}.mlp.hook_expert_weights"])
    with pytest.raises(KeyError, match="hook_router_logits"):
        model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_router_logit", lambda x, h: x)])


def test_latent_attention_points():
    """DeepSeek-V3's MLA: edits of the query, the latent and the shared rotary key equal plain torch hooks on
    their projections; a pattern edit equals writing pattern @ v (v expanded from the latent by hand) into z."""
    model = make_bridge("deepseek_v3")
    attn = _moe(model, "self_attn")
    scale_q = (attn.q_b_proj, lambda out: out * 1.5, "attn.hook_q")
    scale_latent = (attn.kv_a_proj_with_mqa, lambda out: torch.cat([out[..., :12] * 1.5, out[..., 12:]], -1),
                    "attn.hook_kv_latent")  # fmt: skip
    scale_rope = (attn.kv_a_proj_with_mqa, lambda out: torch.cat([out[..., :12], out[..., 12:] * 1.5], -1),
                  "attn.hook_k_rope")  # fmt: skip
    for module, manual, name in (scale_q, scale_latent, scale_rope):
        handle = module.register_forward_hook(lambda m, a, out, manual=manual: manual(out))
        with torch.no_grad():
            expected = model.hf_model(TOKENS).logits
        handle.remove()
        assert not torch.allclose(expected, model.hf_model(TOKENS).logits)
        with torch.no_grad():
            got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.{name}", lambda x, h: x * 1.5)])
        _close(got, expected)
    _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.startswith(f"blocks.{LAYER}.attn"))
    assert cache["q", LAYER].shape == (*TOKENS.shape, 4, 10) and cache["z", LAYER].shape == (*TOKENS.shape, 4, 8)
    assert cache["blocks.1.attn.hook_kv_latent"].shape == (*TOKENS.shape, 12)
    latent = attn.kv_a_layernorm(cache["blocks.1.attn.hook_kv_latent"])
    v = attn.kv_b_proj(latent).view(*TOKENS.shape, 4, 6 + 8)[..., 6:]  # per head [k without rope | v]
    pos = TOKENS.shape[1]
    uniform = torch.tril(torch.ones(pos, pos)) / torch.arange(1, pos + 1)[:, None]
    z = cache["z", LAYER].clone()
    z[:, :, 2] = torch.einsum("qk,bkd->bqd", uniform, v[:, :, 2])

    def set_pattern(p, hook):
        p = p.clone()
        p[:, 2] = uniform
        return p

    with torch.no_grad():
        expected = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", lambda x, h: z)])
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", set_pattern)])
    _close(got, expected)


def _has_shared_experts(family: str) -> bool:
    try:
        return make_bridge(family).adapter.moe.shared is not None
    except pytest.skip.Exception:  # no adapter for the installed transformers: its tests skip when they run
        return True


SHARED = [f for f in MOE_CONFIGS if _has_shared_experts(f)]


def _torch_hook(module, kind, fn):
    if kind == "pre":
        return module.register_forward_pre_hook(lambda m, args: (fn(args[0]), *args[1:]))
    return module.register_forward_hook(lambda m, args, out: fn(out))


@pytest.mark.parametrize("family", SHARED)
def test_shared_expert_points_equal_torch_hooks_on_hf_modules(family):
    """hook_shared_pre / post / gate: what plain torch hooks see on the shared expert's modules, and an edit
    of each equals the same edit made by a torch hook on HF's module (never attached while unhooked)."""
    from transformer_bridge.sites.moe import shared_points

    model = make_bridge(family)
    keys = shared_points(model.adapter.moe)
    assert {k for k, _, _ in keys} >= {"shared_pre", "shared_post"}
    assert ("shared_gate" in {k for k, _, _ in keys}) == (family == "qwen2_moe")
    _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: "hook_shared" in n)
    for key, path, kind in keys:
        module, seen = _moe(model, path), {}
        handle = _torch_hook(module, kind, lambda x, seen=seen: seen.setdefault("x", x.detach().clone()))
        with torch.no_grad():
            model.hf_model(TOKENS)
        handle.remove()
        _close(cache[f"blocks.{LAYER}.mlp.hook_{key}"], seen["x"].reshape(*TOKENS.shape, -1))

        def edit(x):
            return x * 3.0 - 0.5

        want = _logits_with(model, module, kind, edit)
        assert not torch.allclose(want, model.hf_model(TOKENS).logits, atol=1e-4)  # the edit matters
        got = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_{key}", lambda x, hook: edit(x))])
        _close(got, want)
        assert not module._forward_hooks and not module._forward_pre_hooks


def _logits_with(model, module, kind, fn):
    handle = _torch_hook(module, kind, fn)
    try:
        with torch.no_grad():
            return model.hf_model(TOKENS).logits
    finally:
        handle.remove()


def test_latent_norm_scales_are_the_rms_of_the_latents():
    """DeepSeek-V3: attn.q_a_layernorm / kv_a_layernorm.hook_scale = √(mean(x²)+ε) of the query latent and of
    hook_kv_latent; scaling the kv scale by 2 halves the values, as halving kv_a_layernorm's output does."""
    model = make_bridge("deepseek_v3")
    attn = _moe(model, "self_attn")
    _, cache = model.run_with_cache(TOKENS)
    latent = cache[f"blocks.{LAYER}.attn.hook_kv_latent"]
    eps = attn.kv_a_layernorm.variance_epsilon
    _close(cache[f"blocks.{LAYER}.attn.kv_a_layernorm.hook_scale"], (latent.pow(2).mean(-1, keepdim=True) + eps).sqrt())
    seen = {}
    handle = attn.q_a_proj.register_forward_hook(lambda m, a, out: seen.setdefault("q", out.detach()))
    with torch.no_grad():
        model.hf_model(TOKENS)
    handle.remove()
    q = seen["q"]
    _close(cache[f"blocks.{LAYER}.attn.q_a_layernorm.hook_scale"], (q.pow(2).mean(-1, keepdim=True) + eps).sqrt())
    want = _logits_with(model, attn.kv_a_layernorm, "post", lambda x: x / 2)
    got = model.run_with_hooks(
        TOKENS, fwd_hooks=[(f"blocks.{LAYER}.attn.kv_a_layernorm.hook_scale", lambda s, hook: s * 2)]
    )
    _close(got, want)
