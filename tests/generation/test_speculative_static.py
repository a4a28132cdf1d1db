"""Speculative decoding over a static KV cache (``cache_implementation="static"``) and with the compiled
one-token step (``compile=True``): the greedy tokens are the non-speculative static and dynamic runs' tokens,
on several families (a sliding-window one included), with a controller too, and ``return_cache`` is
`run_with_cache`'s cache bitwise."""

import pytest
import torch
from conftest import make_bridge, perturb_
from test_control import Script, mixed_script

from transformer_bridge.generation import fast

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]
REPEATING = ["abcabcabcab", "Hi", "The cat sat on the mat, the cat sat"]  # prompt lookup finds drafts here
# GQA, learned positions, two sliding-window families (windows of 4 tokens).
SOME = ["llama", "gpt2", "gemma3_text", "starcoder2"]


def same(a, b) -> bool:
    return (torch.equal(a.sequences, b.sequences) and torch.equal(a.attention_mask, b.attention_mask)
            and a.finish_reasons == b.finish_reasons)  # fmt: skip


class Seen:
    """Each forward's kind, chunk width and key length (the attention's last axis: the bucket when static)."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.widths: list[int] = []
        self.keys: list[int] = []

    def hooks(self) -> list:
        def embed(x, hook):
            self.kinds.append(hook.ctx.kind)
            self.widths.append(x.shape[1])

        def pattern(x, hook):
            self.keys.append(x.shape[-1])

        return [("hook_embed", embed), ("blocks.0.attn.hook_pattern", pattern)]


@pytest.mark.parametrize("family", SOME)
def test_static_speculation_greedy_equals_static_and_dynamic_runs(family):
    model = make_bridge(family)
    tokens, mask = model.to_tokens_and_mask(REPEATING, padding_side="left")
    kw = dict(attention_mask=mask, max_new_tokens=20, return_dict=True, top_logprobs=2)
    dynamic = model.generate(tokens, **kw)
    static = model.generate(tokens, cache_implementation="static", **kw)
    assert same(static, dynamic)
    other, copy = make_bridge(family, seed=3), make_bridge(family)  # the copy's drafts are all accepted
    drafters = ({"prompt_lookup_num_tokens": 4}, {"assistant_model": other, "num_assistant_tokens": 3},
                {"assistant_model": copy, "num_assistant_tokens": 3})  # fmt: skip
    for extra in drafters:
        seen = Seen()
        with model.hooks(fwd_hooks=seen.hooks()):
            spec = model.generate(tokens, cache_implementation="static", **extra, **kw)
        assert same(spec, dynamic), extra
        assert torch.equal(spec.top_tokens, dynamic.top_tokens)
        torch.testing.assert_close(spec.logprobs, dynamic.logprobs, atol=1e-4, rtol=0)
        assert "verify" in seen.kinds and max(seen.widths[1:]) > 1  # verify chunks were fed
        if seen.keys:  # every forward attends over the static bucket
            assert {k % fast.BUCKET for k in seen.keys} == {0}, seen.keys
    assert len(seen.kinds) <= 1 + 19 // 4 + 1  # the copy's drafts are all accepted: 4 tokens per forward


@pytest.mark.parametrize("family", SOME)
def test_static_speculation_with_a_controller_and_return_cache(family):
    """The mixed script (backtrack, forced tokens, forks) with prompt lookup over a static cache gives the
    dynamic speculative run's output, and its cache is `run_with_cache`'s over the output, bitwise."""
    model = perturb_(make_bridge(family))
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    names = [n for n in ("blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern") if n in model.hook_dict]
    outs = []
    for options in ({}, {"cache_implementation": "static"}):
        c = Script(mixed_script(model.cfg.d_vocab))
        out, cache = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, return_dict=True,
                                    prompt_lookup_num_tokens=3, return_cache=True, names_filter=names,
                                    **options)  # fmt: skip
        assert len(out) > 3 and any(v.backtracked for v in c.views)
        _, ref = model.run_with_cache(out.sequences, attention_mask=out.attention_mask, names_filter=names)
        for name in names:
            assert torch.equal(cache[name], ref[name]), name
        outs.append(out)
    dynamic, static = outs
    assert same(static, dynamic) and static.parents == dynamic.parents
    torch.testing.assert_close(static.logprobs, dynamic.logprobs, atol=1e-4, rtol=0, equal_nan=True)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_compiled_speculation_equals_the_eager_runs(family):
    """``compile=True`` with prompt lookup: one-token steps run the compiled step, verify chunks run eagerly,
    and the tokens are the non-speculative compiled and dynamic runs' tokens (with a controller too)."""
    model = make_bridge(family)
    tokens, mask = model.to_tokens_and_mask(REPEATING, padding_side="left")
    kw = dict(attention_mask=mask, max_new_tokens=20, return_dict=True)
    dynamic = model.generate(tokens, **kw)
    compiled = model.generate(tokens, compile=True, **kw)
    assert same(compiled, dynamic)
    seen = Seen()
    with model.hooks(fwd_hooks=seen.hooks()[:1]):
        spec = model.generate(tokens, compile=True, prompt_lookup_num_tokens=4, **kw)
    assert same(spec, dynamic)
    torch.testing.assert_close(spec.logprobs, dynamic.logprobs, atol=1e-4, rtol=0)
    assert "verify" in seen.kinds and 1 in seen.widths[1:]  # verify chunks and one-token steps
    assert any(batch == 3 for batch, _ in fast.COMPILE_SECONDS)
    # A controller that only masks (here: nothing) and speculation, compiled: the same tokens again.
    controlled = model.generate(tokens, compile=True, prompt_lookup_num_tokens=4, controller=lambda v: None, **kw)
    assert torch.equal(controlled.sequences, dynamic.sequences)


def test_speculation_without_a_cache_is_refused_with_the_reason():
    model = make_bridge("llama")
    for extra in ({}, {"cache_implementation": "static"}):
        with pytest.raises(ValueError, match=r"`prompt_lookup_num_tokens`.*use_cache=False.*rolls back"):
            model.generate("Hi", max_new_tokens=3, prompt_lookup_num_tokens=2, use_cache=False, **extra)
