"""The static cache, the compiled step (CUDA graphs: mode ``"reduce-overhead"``), controllers and speculation on a
CUDA device, against the eager dynamic-cache loop on the same device and fresh forwards.

Skipped where there is no CUDA device (CI has none); on a GPU machine: ``pytest tests/generation/test_cuda.py``.
The models are fp32, so compiled logits stay within 1e-4 of eager ones (tf32 is off by default for matmuls).
"""

import pytest
import torch
from conftest import char_tokenizer, make_bridge, make_hf, perturb_
from test_control import Script, mixed_script
from torch._dynamo.utils import counters

from transformer_bridge import TransformerBridge
from transformer_bridge.generation import fast

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:GPTNeoForCausalLM does not support a static KV cache"),
]
PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]
CUDA_FAMILIES = ["llama", "gpt2", "gemma2", "gemma3_text", "qwen3", "mixtral"]


def cuda_bridge(family: str, seed: int = 0) -> TransformerBridge:
    return TransformerBridge(perturb_(make_bridge(family, seed)).hf_model.cuda(), char_tokenizer())


def batch(model, prompts=PROMPTS):
    tokens, mask = model.to_tokens_and_mask(prompts, padding_side="left")
    assert tokens.is_cuda and mask.is_cuda
    return tokens, mask


def assert_same(a, b, atol=1e-4) -> None:
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert a.finish_reasons == b.finish_reasons
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("family", CUDA_FAMILIES)
def test_static_and_compiled_equal_the_eager_loop_on_cuda(family):
    """Every step's logits are kept (``output_logits``/``output_scores``): a CUDA graph reuses its output buffer
    at the next replay, so a kept step must be a copy."""
    model = cuda_bridge(family)
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=12, return_dict=True, output_logits=True, output_scores=True)
    plain = model.generate(tokens, **kw)
    for options in ({"cache_implementation": "static"}, {"compile": True}, {"compile": True}):  # 2nd: replays
        out = model.generate(tokens, **kw, **options)
        assert_same(out, plain)
        torch.testing.assert_close(out.logits, plain.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.stack(out.scores), torch.stack(plain.scores), atol=1e-4, rtol=0)
    assert out.sequences.is_cuda and len({step.data_ptr() for step in out.scores}) == len(out.scores)


def test_rows_stopping_between_two_looks_of_the_host_on_cuda():
    """On CUDA the host looks at the finished rows every `fast.SYNC_EVERY` steps: the steps run after the last
    row stopped leave no trace."""
    model = cuda_bridge("llama")
    tokens, mask = batch(model)
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=20, stop_at_eos=False, return_dict=True)
    forwards = []
    for stop_at in (2, 5):
        eos = [free.new_tokens[i, stop_at].item() for i in range(3)]
        kw = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=eos, return_dict=True, top_logprobs=2)
        plain = model.generate(tokens, **kw)
        forwards.clear()
        with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append(x.shape[1]))]):
            compiled = model.generate(tokens, **kw, compile=True)
        assert_same(compiled, plain)
        assert compiled.sequences.shape[1] == tokens.shape[1] + stop_at + 1
        # The prefill and the steps up to the host's first look (SYNC_EVERY tokens): the run went on past the end.
        assert len(forwards) == fast.SYNC_EVERY


def test_steering_and_python_hooks_in_the_cuda_graph():
    model = cuda_bridge("llama", seed=4)
    tokens, mask = batch(model)
    point = "blocks.1.hook_resid_post"
    v = 2 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(attention_mask=mask, max_new_tokens=10)

    def late(x, hook):  # reads hook.ctx inside the compiled step
        return x + v * (hook.ctx.positions >= 6)[..., None]

    eager = {}
    for name, fn in (("plus", lambda x, hook: x + v), ("minus", lambda x, hook: x - v), ("late", late)):
        with model.hooks(fwd_hooks=[(point, fn)]):
            eager[name] = model.generate(tokens, **kw)
    assert not torch.equal(eager["plus"], eager["minus"])
    with model.steer(point, add=v) as s:
        assert torch.equal(model.generate(tokens, **kw, compile=True), eager["plus"])
        graphs = counters["stats"]["unique_graphs"]
        s.update(add=-v)  # new values, same graph: no recompile
        assert torch.equal(model.generate(tokens, **kw, compile=True), eager["minus"])
        assert counters["stats"]["unique_graphs"] == graphs
    with model.hooks(fwd_hooks=[(point, late)]):
        out, cache = model.generate(tokens, **kw, compile=True, return_dict=True, return_cache=True,
                                    names_filter=[point])  # fmt: skip
        _, expected = model.run_with_cache(out.sequences, attention_mask=out.attention_mask, names_filter=[point])
    assert torch.equal(out.sequences, eager["late"])
    assert torch.equal(cache[point], expected[point])  # the recompute stays eager: bitwise


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_controller_over_the_compiled_cuda_step(family):
    """Backtrack, fast-forward and fork per row over the static cache with the compiled step: every view's logits
    equal a fresh forward, the tokens the dynamic engine's; `return_cache` equals `run_with_cache` bitwise."""
    model = cuda_bridge(family)
    tokens, mask = batch(model)
    outs, point = [], "blocks.1.hook_resid_post"
    for options, atol in (({}, 1e-5), ({"compile": True}, 1e-4)):
        c = Script(mixed_script(model.cfg.d_vocab))
        out, cache = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, return_dict=True,
                                    return_cache=True, names_filter=[point], **options)  # fmt: skip
        assert any(v.backtracked for v in c.views) and any(len(v.appended) > 1 for v in c.views)
        for v in c.views:
            torch.testing.assert_close(v.logits, model(torch.tensor([v.tokens]))[0, -1], atol=atol, rtol=0)
        _, ref = model.run_with_cache(out.sequences, attention_mask=out.attention_mask, names_filter=[point])
        assert torch.equal(cache[point], ref[point])
        outs.append(out)
    assert torch.equal(outs[0].sequences, outs[1].sequences) and outs[0].parents == outs[1].parents


@pytest.mark.parametrize("options", [{}, {"compile": True}])
def test_prompt_lookup_on_cuda_equals_plain_greedy(options):
    model = cuda_bridge("llama", seed=1)
    tokens, mask = batch(model, ["abcabcabcabc", "xyzxyz xyz", "Hello Hello Hello"])
    kw = dict(attention_mask=mask, max_new_tokens=16, return_dict=True)
    plain = model.generate(tokens, **kw)
    out = model.generate(tokens, **kw, prompt_lookup_num_tokens=4, **options)
    assert torch.equal(out.sequences, plain.sequences) and out.finish_reasons == plain.finish_reasons


def test_bf16_compiled_runs_and_stays_close():
    """bf16 (the GPU benchmark's dtype): compiled logits near eager ones (bf16 rounding, not exactness)."""
    model = TransformerBridge(make_hf("llama").to(device="cuda", dtype=torch.bfloat16), char_tokenizer())
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=8, return_dict=True, output_logits=True)
    plain = model.generate(tokens, **kw)
    out = model.generate(tokens, **kw, compile=True)
    assert out.logits.dtype == plain.logits.dtype and torch.isfinite(out.logits).all()
    # bf16 rounding, not kernel order, sets the bound; the first step comes from an eager prefill in both.
    torch.testing.assert_close(out.logits[:, 0].float(), plain.logits[:, 0].float(), atol=5e-2, rtol=2e-2)
