"""Independent answers for the relevance tests: hand-written forwards with each LRP rule written out.

Nothing here goes through the bridge's hooks: the Llama forward is rebuilt from the HF modules'
weights, and each rule is a small autograd Function applied where the rule says.
"""

import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class DivideGradient(torch.autograd.Function):
    """Identity forward; gradient divided by ``factor`` (the uniform rule)."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g / ctx.factor, None


class IdentityRule(torch.autograd.Function):
    """``act(x)`` forward; gradient times ``act(x) / x`` (the identity rule)."""

    @staticmethod
    def forward(ctx, x: Tensor, act) -> Tensor:
        out = act(x)
        ctx.save_for_backward(torch.where(x == 0, torch.zeros_like(x), out / x))
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        (ratio,) = ctx.saved_tensors
        return g * ratio, None


def _rms_const(x: Tensor, norm) -> Tensor:
    inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).detach()
    return norm.weight * (x * inv)


def llama_lrp(hf, tokens: Tensor, position: int, variant: str = "attnlrp") -> Tensor:
    """Relevance of each input position (batch 1, no padding) for the logit of ``tokens[0, position]``.

    Llama layout; Qwen 3's per-head q/k RMSNorm is applied (with its 1/rms constant) when present.
    """
    cfg = hf.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    emb = hf.model.embed_tokens.weight[tokens].detach().requires_grad_(True)
    b, p, _ = emb.shape
    positions = torch.arange(p)[None]
    cos, sin = hf.model.rotary_emb(emb, positions)
    causal = torch.full((p, p), float("-inf")).triu(1)
    x = emb
    for layer in hf.model.layers:
        attn = layer.self_attn
        h = _rms_const(x, layer.input_layernorm)
        q = attn.q_proj(h).view(b, p, n_heads, d_head)
        k = attn.k_proj(h).view(b, p, n_kv, d_head)
        if hasattr(attn, "q_norm"):  # Qwen 3: per-head RMSNorm on q and k, 1/rms constant too
            q, k = _rms_const(q, attn.q_norm), _rms_const(k, attn.k_norm)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(h).view(b, p, n_kv, d_head).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if variant == "attnlrp":
            q, k, v = DivideGradient.apply(q, 4.0), DivideGradient.apply(k, 4.0), DivideGradient.apply(v, 2.0)
        else:
            q, k = q.detach(), k.detach()
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        scores = q @ k.transpose(-1, -2) * d_head**-0.5 + causal
        z = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, p, -1)
        x = x + attn.o_proj(z)
        h = _rms_const(x, layer.post_attention_layernorm)
        mlp = layer.mlp
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        if variant == "attnlrp":
            prod = DivideGradient.apply(IdentityRule.apply(gate, mlp.act_fn) * up, 2.0)
        else:
            prod = mlp.act_fn(gate.detach()) * up
        x = x + mlp.down_proj(prod)
    logits = hf.lm_head(_rms_const(x, hf.model.norm))
    logits[0, position - 1, tokens[0, position]].backward()
    return (emb * emb.grad).sum(-1)[0].detach()


def gpt2_attnlrp(hf, tokens: Tensor, position: int) -> Tensor:
    """AttnLRP for GPT-2 (LayerNorm with constant std, identity rule on GELU), input = token + position."""
    cfg = hf.config
    n_heads, d = cfg.n_head, cfg.n_embd
    d_head = d // n_heads
    tr = hf.transformer
    p = tokens.shape[1]
    x0 = (tr.wte.weight[tokens] + tr.wpe.weight[:p][None]).detach().requires_grad_(True)

    def ln(x, mod):
        centred = x - x.mean(-1, keepdim=True)
        std = (centred.pow(2).mean(-1, keepdim=True) + mod.eps).sqrt().detach()
        return centred / std * mod.weight + mod.bias

    causal = torch.full((p, p), float("-inf")).triu(1)
    x = x0
    for block in tr.h:
        h = ln(x, block.ln_1)
        q, k, v = block.attn.c_attn(h).split(d, dim=-1)
        q, k, v = (t.view(1, p, n_heads, d_head).transpose(1, 2) for t in (q, k, v))
        q, k, v = DivideGradient.apply(q, 4.0), DivideGradient.apply(k, 4.0), DivideGradient.apply(v, 2.0)
        scores = q @ k.transpose(-1, -2) * d_head**-0.5 + causal
        z = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, p, d)
        x = x + block.attn.c_proj(z)
        h = ln(x, block.ln_2)
        x = x + block.mlp.c_proj(IdentityRule.apply(block.mlp.c_fc(h), block.mlp.act))
    logits = hf.lm_head(ln(x, tr.ln_f))
    logits[0, position - 1, tokens[0, position]].backward()
    return (x0 * x0.grad).sum(-1)[0].detach()
