"""Every kind of hook point: edits propagate like a manual computation, backward hooks see the gradient."""

import pytest
import torch
from conftest import FAMILIES, V, make_bridge

from transformer_bridge.adapters.base import one_plus
from transformer_bridge.sites.module_paths import get_module

TOKENS = torch.randint(4, V, (2, 6), generator=torch.Generator().manual_seed(3))
LAYER, HEAD = 1, 2


def _manual(model, path, fn, pre=False, call=None):
    """Logits with a plain torch hook on an HF module (the oracle); ``call``: edit only that call of the module
    in the forward (NanoChat's norm serves the embedding, call 0, and the final norm, call 1)."""
    module = get_module(model.hf_model, path)
    calls = [-1]

    def edit(x):
        calls[0] += 1
        return fn(x) if call is None or calls[0] == call else x

    if pre:
        handle = module.register_forward_pre_hook(lambda m, args: (edit(args[0]), *args[1:]))
    else:
        handle = module.register_forward_hook(
            lambda m, args, out: (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)
        )
    try:
        with torch.no_grad():
            return model.hf_model(TOKENS).logits
    finally:
        handle.remove()


def _hooked(model, name, fn):
    with torch.no_grad():
        return model.run_with_hooks(TOKENS, fwd_hooks=[(name, fn)])


def _block(model, rel):
    return f"{model.adapter.blocks}.{LAYER}.{rel}"


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def test_zero_head_in_hook_z_equals_zeroing_o_proj_input(model):
    d = model.cfg.d_head

    def zero_slice(x):
        x = x.clone()
        x[..., HEAD * d : (HEAD + 1) * d] = 0
        return x

    def zero_head(z, hook):
        z = z.clone()
        z[:, :, HEAD] = 0
        return z

    expected = _manual(model, _block(model, model.adapter.o_proj), zero_slice, pre=True)
    assert torch.equal(_hooked(model, f"blocks.{LAYER}.attn.hook_z", zero_head), expected)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_qkv_edit_equals_editing_projection_output(model, which):
    a = model.adapter
    if a.mla:
        pytest.skip("multi-head latent attention has no k / v projections: tests/sites/test_moe.py")
    n = model.cfg.n_heads if which == "q" else model.cfg.n_kv_heads
    d = model.cfg.d_head

    def scale_head(x, hook):
        x = x.clone()
        x[:, :, 0] *= 3.0
        return x

    if a.qkv is None:

        def manual(out):
            out = out.view(*out.shape[:-1], n, d).clone()
            out[:, :, 0] *= 3.0
            return out.flatten(-2)

        expected = _manual(model, _block(model, getattr(a, which)), manual)
    elif a.qkv_layout == "per_head":
        j = "qkv".index(which)

        def manual(out):
            out = out.view(*out.shape[:-1], n, 3 * d).clone()
            out[:, :, 0, j * d : (j + 1) * d] *= 3.0
            return out.flatten(-2)

        expected = _manual(model, _block(model, a.qkv), manual)
    else:
        nh, nk = model.cfg.n_heads, model.cfg.n_kv_heads
        start = {"q": 0, "k": nh * d, "v": (nh + nk) * d}[which]

        def manual(out):
            out = out.clone()
            out[..., start : start + d] *= 3.0
            return out

        expected = _manual(model, _block(model, a.qkv), manual)
    got = _hooked(model, f"blocks.{LAYER}.attn.hook_{which}", scale_head)
    assert not torch.equal(got, model.hf_model(TOKENS).logits)
    _close(got, expected)


@pytest.mark.parametrize(
    ("name", "path_attr", "pre"),
    [("hook_resid_pre", None, True), ("hook_resid_post", None, False), ("hook_attn_out", "attn_out", False),
     ("hook_mlp_out", "mlp_out", False), ("mlp.hook_post", "mlp_down", True), ("mlp.hook_pre", "mlp_in", False)],
)  # fmt: skip
def test_residual_and_mlp_edits_equal_manual_module_hooks(model, name, path_attr, pre):
    if name == "mlp.hook_pre" and model.adapter.fused_gate_up:
        pytest.skip("fused gate/up: covered by test_gate_up_parts")
    if f"blocks.{LAYER}.{name}" not in model.hook_dict:
        pytest.skip("a mixture-of-experts block has no dense MLP points: tests/sites/test_moe.py")
    delta = torch.linspace(-1, 1, model.cfg.d_mlp if "mlp.hook" in name else model.cfg.d_model)
    path = _block(model, getattr(model.adapter, path_attr)) if path_attr else f"{model.adapter.blocks}.{LAYER}"
    expected = _manual(model, path, lambda x: x + delta, pre=pre)
    _close(_hooked(model, f"blocks.{LAYER}.{name}", lambda x, hook: x + delta), expected)


def test_gate_up_parts(model):
    if not model.cfg.gated_mlp or f"blocks.{LAYER}.mlp.hook_post" not in model.hook_dict:
        pytest.skip("not a gated dense MLP (mixture-of-experts blocks: tests/sites/test_moe.py)")
    zero = lambda x, hook: x * 0  # noqa: E731
    post_zero = _hooked(model, f"blocks.{LAYER}.mlp.hook_post", zero)
    # act(0) = 0 for SiLU/GELU, and gate * 0 = 0: both zero the MLP's hidden activation.
    _close(_hooked(model, f"blocks.{LAYER}.mlp.hook_pre", zero), post_zero)
    _close(_hooked(model, f"blocks.{LAYER}.mlp.hook_pre_linear", zero), post_zero)


def test_resid_mid_edit_equals_attn_out_edit(model):
    if model.cfg.parallel_attn_mlp:
        pytest.skip("parallel attention and MLP have no resid_mid")
    delta = torch.linspace(-1, 1, model.cfg.d_model)
    add = lambda x, hook: x + delta  # noqa: E731
    r = model.adapter.residual_scale(model.hf_model.config)  # Granite: resid_mid = resid_pre + r * attn_out
    add_r = lambda x, hook: x + delta / r  # noqa: E731
    _close(
        _hooked(model, f"blocks.{LAYER}.hook_resid_mid", add), _hooked(model, f"blocks.{LAYER}.hook_attn_out", add_r)
    )


def test_resid_mid_value(model):
    if model.cfg.parallel_attn_mlp:
        pytest.skip("parallel attention and MLP have no resid_mid")
    _, cache = model.run_with_cache(TOKENS)
    mid = cache["resid_mid", LAYER]
    r = model.adapter.residual_scale(model.hf_model.config)  # Granite's residual_multiplier
    assert torch.equal(
        mid, cache["resid_pre", LAYER] + (cache["attn_out", LAYER] * r if r != 1 else cache["attn_out", LAYER])
    )
    ln2_in = {}
    # What reads resid_mid: the norm before the MLP, or the MLP itself where there is none (OLMo 2; FlexOLMo's router).
    reader = model.adapter.ln2 if f"blocks.{LAYER}.ln2.hook_scale" in model.hook_dict else model.adapter.mlp_in
    if reader == model.adapter.mlp_in and f"blocks.{LAYER}.mlp.hook_router_logits" in model.hook_dict:
        reader = model.adapter.moe.router
    norm = get_module(model.hf_model, _block(model, reader))
    h = norm.register_forward_hook(lambda m, args, out: ln2_in.update(x=args[0]))  # returns None: reads only
    try:
        with torch.no_grad():
            model.hf_model(TOKENS)
    finally:
        h.remove()
    _close(mid, ln2_in["x"].view_as(mid))


def _norms(model):
    """Every norm with hook points in ``LAYER`` (and the final one): point prefix → HF module path."""
    a = model.adapter
    found = {f"blocks.{LAYER}.{n}": _block(model, getattr(a, n)) for n in ("ln1", "ln2")
             if f"blocks.{LAYER}.{n}.hook_scale" in model.hook_dict}  # fmt: skip
    found["ln_final"] = a.ln_final
    if a.embed_norm:  # NanoChat: the final norm module also normalises the embedding (its first call)
        found["ln_embed"] = a.ln_final
    if a.sandwich:
        found[f"blocks.{LAYER}.ln1_post"] = _block(model, a.attn_out)
        found[f"blocks.{LAYER}.ln2_post"] = _block(model, a.mlp_out)
    for key in ("q_norm", "k_norm"):
        if getattr(a, key) is not None:
            found[f"blocks.{LAYER}.attn.{key}"] = _block(model, getattr(a, key))
    if a.mla:  # latent attention: the norms of the query and key/value latents
        for key in ("q_a_layernorm", "kv_a_layernorm"):
            found[f"blocks.{LAYER}.attn.{key}"] = _block(model, f"{a.attn}.{key}")
    assert all(f"{prefix}.hook_scale" in model.hook_dict for prefix in found)
    return found


def test_norm_scale_and_normalized(model):
    norms = _norms(model)
    every = {n.rsplit(".", 1)[0] for n in model.hook_dict if n.startswith(f"blocks.{LAYER}.") or n.startswith("ln_")}
    assert set(norms) == {prefix for prefix in every if f"{prefix}.hook_scale" in model.hook_dict}
    for prefix, path in norms.items():
        norm = get_module(model.hf_model, path)
        bias = getattr(norm, "bias", None)
        bias = torch.zeros(()) if bias is None else bias.detach()
        # Doubling the scale halves the weighted part of the output; the bias stays.
        call = {"ln_embed": 0, "ln_final": 1}.get(prefix) if model.adapter.embed_norm else None
        expected = _manual(model, path, lambda out, bias=bias: (out - bias) / 2 + bias, call=call)
        _close(_hooked(model, f"{prefix}.hook_scale", lambda s, hook: s * 2), expected)
        _close(_hooked(model, f"{prefix}.hook_normalized", lambda n, hook: n / 2), expected)
        # The cached values reproduce the module's output.
        _, cache = model.run_with_cache(TOKENS, names_filter=lambda n, prefix=prefix: n.startswith(prefix + "."))
        scale, normalized = cache[f"{prefix}.hook_scale"], cache[f"{prefix}.hook_normalized"]
        assert scale.shape == (*normalized.shape[:-1], 1)
        per_head = prefix.endswith("_norm") and model.adapter.qk_norm_layout != "flat"  # OLMo 2: one norm
        assert normalized.shape[:2] == TOKENS.shape and normalized.dim() == (4 if per_head else 3)
        stored = getattr(norm, "weight", None)  # OLMo's LayerNorm has none
        weight = model.ln_final_weight if prefix == "ln_final" else (
            1 if stored is None else 1 + stored if one_plus(model.adapter.norm) else stored)  # fmt: skip
        out: dict = {}
        h = norm.register_forward_hook(lambda m, a, o, out=out: out.setdefault("y", []).append(o))
        with torch.no_grad():
            model.hf_model(TOKENS)
        h.remove()
        y = out["y"][call or 0]
        y = y.transpose(1, 2) if per_head and model.adapter.qk_norm_layout == "head_pos" else y
        _close(normalized * weight + bias, y.reshape(normalized.shape))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_norm_scale_of_a_16_bit_model_is_float32(family):
    """HF's norms compute their statistics in float32 in a bf16 model; hook_scale shows that float32 value
    (TransformerLens caches it so too), hook_normalized the model's dtype, and the logits stay HF's."""
    model = make_bridge(family)
    model.hf_model.to(torch.bfloat16)
    model = type(model)(model.hf_model)
    logits, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.startswith("blocks.0."))
    assert torch.equal(logits, model.hf_model(TOKENS).logits)
    scale, x = cache["blocks.0.ln1.hook_scale"], cache["blocks.0.hook_resid_pre"]
    assert scale.dtype == torch.float32 and cache["blocks.0.ln1.hook_normalized"].dtype == torch.bfloat16
    h = x.float() - x.float().mean(-1, keepdim=True) if family == "gpt2" else x.float()
    eps = model.hf_model.config.layer_norm_epsilon if family == "gpt2" else model.hf_model.config.rms_norm_eps
    torch.testing.assert_close(scale, (h.pow(2).mean(-1, keepdim=True) + eps).sqrt(), rtol=0, atol=0)


def test_sandwich_norm_edits_reach_the_sublayer_output_points():
    """Gemma 2: ``ln1_post``/``ln2_post`` and ``hook_attn_out``/``hook_mlp_out`` share a module; order is fixed."""
    model = make_bridge("gemma2")
    for post, out_name in (("ln1_post", "hook_attn_out"), ("ln2_post", "hook_mlp_out")):
        seen = {}
        _, cache = model.run_with_cache(TOKENS, names_filter=f"blocks.{LAYER}.{out_name}")
        with torch.no_grad():
            model.run_with_hooks(TOKENS, fwd_hooks=[
                (f"blocks.{LAYER}.{post}.hook_scale", lambda s, hook: s * 2),
                (f"blocks.{LAYER}.{out_name}", lambda x, hook, seen=seen: seen.setdefault("x", x.clone())),
            ])  # fmt: skip
        _close(seen["x"], cache[f"blocks.{LAYER}.{out_name}"] / 2)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_soft_capped_pattern_is_the_one_the_output_used(attn):
    """Gemma 2 soft-caps its attention scores; HF's sdpa kernel dropped the cap silently before it refused it (5.19
    vs 5.24). Whatever the kernel computes, hook_pattern @ v is hook_z, and an edit that changes nothing (a copy of
    the pattern, so the bridge computes the output itself) gives the unhooked logits."""
    from transformers import AutoModelForCausalLM

    from transformer_bridge import TransformerBridge

    cfg = make_bridge("gemma2").hf_model.config
    cfg.attn_logit_softcapping = 0.002  # about the tiny model's scores (~0.003), so the cap changes every row
    try:
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    except ValueError:
        pytest.skip(f"this transformers release refuses attn_implementation={attn!r} for Gemma 2")
    model = TransformerBridge(hf)
    logits, cache = model.run_with_cache(TOKENS)
    v = cache["v", LAYER].repeat_interleave(model.cfg.n_heads // model.cfg.n_kv_heads, dim=2)
    _close(torch.einsum("bhqk,bkhd->bqhd", cache["pattern", LAYER], v), cache["z", LAYER])
    copied = model.run_with_hooks(TOKENS, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", lambda p, hook: p.clone())])
    _close(copied, logits)


def test_pattern_edit_equals_z_from_values(model):
    """Replacing the pattern of one head equals writing pattern @ v into hook_z by hand."""
    if f"blocks.{LAYER}.attn.hook_pattern" not in model.hook_dict:
        pytest.skip("the HF module calls SDPA itself (Falcon): no pattern point")
    if model.adapter.mla:
        pytest.skip("multi-head latent attention has no hook_v: tests/sites/test_moe.py")
    _, cache = model.run_with_cache(TOKENS, names_filter=lambda n: n.startswith(f"blocks.{LAYER}.attn"))
    pos = TOKENS.shape[1]
    uniform = torch.tril(torch.ones(pos, pos)) / torch.arange(1, pos + 1)[:, None]

    def set_pattern(p, hook):
        p = p.clone()
        p[:, HEAD] = uniform
        return p

    v = cache["v", LAYER]  # [b, pos, kv_head, d]
    kv_head = HEAD // (model.cfg.n_heads // model.cfg.n_kv_heads)
    z = cache["z", LAYER].clone()
    z[:, :, HEAD] = torch.einsum("qk,bkd->bqd", uniform, v[:, :, kv_head])
    expected = _hooked(model, f"blocks.{LAYER}.attn.hook_z", lambda x, hook: z)
    _close(_hooked(model, f"blocks.{LAYER}.attn.hook_pattern", set_pattern), expected)
    if f"blocks.{LAYER}.attn.hook_attn_scores" not in model.hook_dict:
        return  # GPT-J, GPT-Neo: the pattern is read after the HF module's own softmax

    # Scores set to 0 where attention is allowed (masked entries kept) give the same uniform pattern.
    def flat_scores(s, hook):
        s = s.clone()
        s[:, HEAD] = torch.where(uniform > 0, 0.0, s[:, HEAD])
        return s

    if getattr(get_module(model.hf_model, _block(model, model.adapter.attn)), "sinks", None) is not None:
        return  # attention sinks (GPT-OSS) take a share of each row: flat scores are not uniform (test_moe.py)
    _close(_hooked(model, f"blocks.{LAYER}.attn.hook_attn_scores", flat_scores), expected)


def test_rotated_q_edit_scales_scores(model):
    if "blocks.0.attn.hook_rot_q" not in model.hook_dict:
        pytest.skip("no rotary embedding")
    if getattr(model.hf_model.config, "attn_logit_softcapping", None):
        pytest.skip("soft-capping makes scores non-linear in q")
    minimum = torch.finfo(torch.float32).min
    scaled = _hooked(model, f"blocks.{LAYER}.attn.hook_rot_q", lambda q, hook: q * 2)
    expected = _hooked(
        model, f"blocks.{LAYER}.attn.hook_attn_scores", lambda s, hook: torch.where(s > minimum, s * 2, s)
    )
    _close(scaled, expected)
    # Scaling rotated keys of the kv-heads does the same.
    _close(_hooked(model, f"blocks.{LAYER}.attn.hook_rot_k", lambda k, hook: k * 2), expected)


def test_head_results_sum_and_edit(model):
    # Named one by one, so the head results (computed on demand) are in the cache.
    attn_points = [n for n in model.hook_dict if n.startswith(f"blocks.{LAYER}.attn.hook_")]
    _, cache = model.run_with_cache(TOKENS, names_filter=attn_points)
    o_proj = get_module(model.hf_model, _block(model, model.adapter.o_proj))
    bias = o_proj.bias if getattr(o_proj, "bias", None) is not None else 0
    result = cache["result", LAYER]
    assert result.shape == (*TOKENS.shape, model.cfg.n_heads, model.cfg.d_model)
    out = {}
    h = o_proj.register_forward_hook(lambda m, a, o: out.setdefault("y", o))
    with torch.no_grad():
        model.hf_model(TOKENS)
    h.remove()
    _close(result.sum(-2) + bias, out["y"])

    def zero_result(r, hook):
        r = r.clone()
        r[:, :, HEAD] = 0
        return r

    def zero_z(z, hook):
        z = z.clone()
        z[:, :, HEAD] = 0
        return z

    _close(_hooked(model, f"blocks.{LAYER}.attn.hook_result", zero_result),
           _hooked(model, f"blocks.{LAYER}.attn.hook_z", zero_z))  # fmt: skip


def test_embed_edits(model):
    delta = torch.linspace(-1, 1, model.cfg.d_model)
    expected = _manual(model, model.adapter.embed, lambda x: x + delta)
    _close(_hooked(model, "hook_embed", lambda x, hook: x + delta), expected)
    if model.adapter.pos_embed:
        expected = _manual(model, model.adapter.pos_embed, lambda x: x + delta)
        _close(_hooked(model, "hook_pos_embed", lambda x, hook: x + delta), expected)


def test_backward_hooks_on_every_point(model):
    """A backward hook on each point receives d(loss)/d(activation), checked against retain_grad."""
    names = [n for n in model.hook_dict if n != "hook_tokens"]  # token ids have no gradient
    captured, grads = {}, {}

    def keep(x, hook):
        x = x.clone().requires_grad_(True) if not x.requires_grad else x.clone()
        x.retain_grad()
        captured[hook.name] = x
        return x

    def grab(g, hook):
        grads[hook.name] = g

    with model.hooks(fwd_hooks=[(n, keep) for n in names], bwd_hooks=[(n, grab) for n in names]):
        model(TOKENS, return_type="loss").backward()
    model.hf_model.zero_grad()
    assert set(grads) == set(names)
    for name in names:
        assert grads[name].shape == captured[name].shape, name
        _close(grads[name], captured[name].grad)


def test_backward_hook_can_replace_gradient(model):
    seen = {}
    zero = lambda g, hook: torch.zeros_like(g)  # noqa: E731
    grab = lambda g, hook: seen.setdefault("embed", g)  # noqa: E731
    with model.hooks(bwd_hooks=[("blocks.0.hook_resid_pre", zero), ("hook_embed", grab)]):
        model(TOKENS, return_type="loss").backward()
    model.hf_model.zero_grad()
    assert seen["embed"].abs().max() == 0  # the replaced gradient is what flows further back


def test_masked_scores_are_minus_inf_as_in_tl(model):
    """TransformerLens' masked scores are -inf (an abs-sum or an isinf mask gives its numbers); the pattern and
    the logits stay HF's, with and without padding (a fully masked padding row stays uniform, not NaN)."""
    if f"blocks.{LAYER}.attn.hook_attn_scores" not in model.hook_dict:
        pytest.skip("no attention scores in this family")
    mask = torch.ones_like(TOKENS)
    mask[0, :2] = 0  # left padding in row 0
    for kwargs in ({}, {"attention_mask": mask}):
        plain = model(TOKENS, **kwargs)
        logits, cache = model.run_with_cache(TOKENS, names_filter=lambda n: "scores" in n or "pattern" in n, **kwargs)
        assert torch.equal(logits, plain)
        scores, pattern = cache["attn_scores", LAYER], cache["pattern", LAYER]
        blocked = torch.isneginf(scores)
        future = torch.ones(6, 6, dtype=torch.bool).triu(1)
        assert blocked[..., future].all() and not torch.isnan(pattern).any()
        if not kwargs:
            assert torch.isfinite(scores.diagonal(dim1=-2, dim2=-1)).all()  # (sliding windows block older keys)
        else:
            assert blocked[0, :, 2:, :2].all()  # real queries do not see the padding keys
        real_rows = ~blocked.all(-1, keepdim=True)
        assert (pattern[blocked & real_rows] == 0).all()
        # an editing hook: the explicit kernel reads the -inf scores with HF's fill, so no real position moves
        with torch.no_grad():
            edited = model.run_with_hooks(
                TOKENS, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_attn_scores", lambda s, hook: s * 1.0)], **kwargs
            )
        _close(edited[mask.bool()], plain[mask.bool()])
