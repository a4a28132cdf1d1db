"""The static-cache loop and the compiled decode step against the plain (dynamic-cache, eager) loop."""

import logging
import warnings

import pytest
import torch
from conftest import FAMILIES, make_bridge
from torch._dynamo.utils import counters

from transformer_bridge.generation import fast

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]
COMPILED_FAMILIES = ["llama", "gpt2", "gemma2"]  # each compile takes seconds on a CPU: a few, unlike families


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def batch(model, prompts=PROMPTS):
    return model.to_tokens_and_mask(prompts, padding_side="left")


def assert_same(a, b) -> None:
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert a.finish_reasons == b.finish_reasons
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


# -- static cache, eager --------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:GPTNeoForCausalLM does not support a static KV cache")
def test_static_cache_equals_the_plain_loop(model):
    tokens, mask = batch(model)
    for t, m in [(tokens[:1], mask[:1]), (tokens, mask)]:
        plain = model.generate(t, attention_mask=m, max_new_tokens=14, return_dict=True)
        static = model.generate(t, attention_mask=m, max_new_tokens=14, return_dict=True, cache_implementation="static")
        assert_same(static, plain)


@pytest.mark.filterwarnings("ignore:GPTNeoForCausalLM does not support a static KV cache")
def test_rows_stopping_between_two_looks_of_the_host(model, monkeypatch):
    """The host looks every 8 steps (on an accelerator; made so here): steps run after the last row stopped must
    leave no trace."""
    monkeypatch.setattr(fast, "SYNC_EVERY_CPU", 8)
    tokens, mask = batch(model)
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=20, stop_at_eos=False, return_dict=True)
    for stop_at in (2, 5):
        eos = [free.new_tokens[i, stop_at].item() for i in range(3)]  # every row stops by then
        kw = dict(attention_mask=mask, max_new_tokens=20, eos_token_id=eos, return_dict=True, top_logprobs=2)
        plain = model.generate(tokens, **kw)
        static = model.generate(tokens, **kw, cache_implementation="static")
        assert_same(static, plain)
        assert static.top_logprobs.shape == plain.top_logprobs.shape
        assert static.sequences.shape[1] < tokens.shape[1] + 20


def test_on_the_cpu_no_step_runs_past_the_end():
    """On the CPU the host looks every step (free there): a static-cache run costs the plain loop's forwards."""
    model = make_bridge("llama")
    tokens, mask = batch(model)
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=20, stop_at_eos=False, return_dict=True)
    eos = [free.new_tokens[i, 2].item() for i in range(3)]
    forwards = []
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append(hook.ctx.step))]):
        model.generate(tokens, attention_mask=mask, max_new_tokens=20, eos_token_id=eos)
        plain = len(forwards)
        model.generate(tokens, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, cache_implementation="static")
    assert len(forwards) == 2 * plain and plain <= 3


def test_gpt_neo_warns_and_runs_the_dynamic_loop():
    model = make_bridge("gpt_neo")
    tokens, mask = batch(model)
    fast._WARNED.discard("GPTNeoForCausalLM")
    with pytest.warns(UserWarning, match="static KV cache"):
        out = model.generate(tokens, attention_mask=mask, max_new_tokens=6, compile=True)
    assert torch.equal(out, model.generate(tokens, attention_mask=mask, max_new_tokens=6))


def test_bucket_and_bad_arguments():
    assert [fast.bucket_length(n) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    model = make_bridge("llama")
    tokens = model.to_tokens("abc")
    with pytest.raises(TypeError, match="compile"):
        model.generate(tokens, max_new_tokens=3, compile="yes")
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(tokens, max_new_tokens=3, cache_implementation="offloaded")
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(tokens, max_new_tokens=3, compile=True, num_beams=2)
    with pytest.raises(TypeError, match="generate"):
        model.generate_stream(tokens, max_new_tokens=3, compile=True)


# -- compiled step ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", COMPILED_FAMILIES)
def test_compiled_equals_the_eager_loop(family):
    model = make_bridge(family)
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=12, return_dict=True, output_logits=True)
    plain = model.generate(tokens, **kw)
    compiled = model.generate(tokens, **kw, compile=True)
    assert torch.equal(compiled.sequences, plain.sequences)
    torch.testing.assert_close(compiled.logits, plain.logits, atol=1e-4, rtol=0)
    assert (3, 64) in fast.COMPILE_SECONDS


def test_compile_time_is_reported_for_each_compile(caplog):
    """Each call that compiles the step (a new bucket, then a new set of hooks) logs its seconds; a call that
    reuses a graph logs nothing."""
    model = make_bridge("llama", seed=7)
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=5)
    point = "blocks.1.hook_resid_post"
    with caplog.at_level(logging.INFO, logger="transformer_bridge.generation.kv"):
        model.generate(tokens, **kw, compile=True)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        model.generate(tokens, **kw, compile=True)
        again = [r.getMessage() for r in caplog.records]
        with model.hooks(fwd_hooks=[(point, lambda x, hook: 2 * x)]):
            model.generate(tokens, **kw, compile=True)
        hooked = [r.getMessage() for r in caplog.records]
    assert len(first) == 1 and first[0].startswith("compiled the decode step for batch 3, cache bucket 64 in ")
    assert again == [] and len(hooked) == 1
    assert fast.COMPILE_SECONDS[(3, 64)] > 0


def test_a_hook_dynamo_cannot_trace_warns_once_and_runs_eagerly():
    """A hook that breaks the graph (``.item()``): one warning naming its point, the eager engine, the hooked eager
    tokens; the same hook again (a new closure of it) does not warn again; another hook set still compiles."""
    model = make_bridge("llama", seed=5)
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=6)
    point = "blocks.1.hook_resid_post"

    def make_hook():
        def data_dependent(x, hook):
            return x * 2 if x.sum().item() > 0 else x * 3

        return data_dependent

    with model.hooks(fwd_hooks=[(point, make_hook())]):
        expected = model.generate(tokens, **kw)
        with pytest.warns(UserWarning, match="blocks.1.hook_resid_post cannot be traced") as warned:
            assert torch.equal(model.generate(tokens, **kw, compile=True), expected)
    assert len(warned) == 1 and "item" in str(warned[0].message)
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        with model.hooks(fwd_hooks=[(point, make_hook())]):
            assert torch.equal(model.generate(tokens, **kw, compile=True), expected)
        assert counters["stats"]["unique_graphs"] == graphs  # not traced again
        with model.hooks(fwd_hooks=[(point, lambda x, hook: 2 * x)]):
            model.generate(tokens, **kw, compile=True)
    assert counters["stats"]["unique_graphs"] > graphs  # this one was compiled
    assert not [w for w in later if "cannot be traced" in str(w.message)]


def test_model_code_dynamo_cannot_trace_is_compiled_in_pieces(caplog):
    """An MoE router's data-dependent loop stops a whole-graph trace: the step is compiled in pieces (no warning),
    hooks included, and gives the eager tokens."""
    model = make_bridge("mixtral")
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=6)
    point = "blocks.1.hook_resid_post"
    with model.hooks(fwd_hooks=[(point, lambda x, hook: 2 * x)]):
        expected = model.generate(tokens, **kw)
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, "transformer_bridge"):
            warnings.simplefilter("always")
            assert torch.equal(model.generate(tokens, **kw, compile=True), expected)
    assert not [w for w in caught if "cannot be traced" in str(w.message)]
    assert any("compiled in pieces" in r.getMessage() for r in caplog.records)
    assert fast._state(model)["compiled"] is not None and "untraceable" not in fast._state(model)


def test_compiled_with_steering_python_hooks_and_return_cache():
    model = make_bridge("llama", seed=4)
    tokens, mask = batch(model)
    point = "blocks.1.hook_resid_post"
    v = 2 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=mask, max_new_tokens=10)

    def late(x, hook):  # reads hook.ctx inside the compiled step
        return x + v * (hook.ctx.positions >= 6)[..., None]

    with model.hooks(fwd_hooks=[(point, lambda x, hook: x + v)]):
        plus = model.generate(tokens, **kw)
    with model.hooks(fwd_hooks=[(point, lambda x, hook: x - v)]):
        minus = model.generate(tokens, **kw)
    with model.hooks(fwd_hooks=[(point, late)]):
        later = model.generate(tokens, **kw)
    assert not torch.equal(plus, minus)
    with model.steer(point, add=v) as s:
        assert torch.equal(model.generate(tokens, **kw, compile=True), plus)
        s.update(add=-v)  # new values, same traced step
        assert torch.equal(model.generate(tokens, **kw, compile=True), minus)
    with model.hooks(fwd_hooks=[(point, late)]):
        out, cache = model.generate(tokens, **kw, compile=True, return_dict=True, return_cache=True,
                                    names_filter=[point])  # fmt: skip
        _, expected = model.run_with_cache(out.sequences, attention_mask=out.attention_mask, names_filter=[point])
    assert torch.equal(out.sequences, later)
    assert torch.equal(cache[point], expected[point])  # the recompute stays eager: bitwise


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_compiled_equals_eager(smollm2):
    tokens, mask = smollm2.to_tokens_and_mask(["The capital of France is", "def fibonacci(n):"], padding_side="left")
    kw = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, return_dict=True, output_logits=True)
    plain = smollm2.generate(tokens, **kw)
    for options in ({"cache_implementation": "static"}, {"compile": True}):
        out = smollm2.generate(tokens, **kw, **options)
        assert torch.equal(out.sequences, plain.sequences)
        # Compiled kernels reorder sums: with two threads 2 of 2.4M logits (|logit| > 1) moved by 1.03e-4, so
        # the bound is 1e-4 plus 1e-5 of the logit's size.
        torch.testing.assert_close(out.logits, plain.logits, atol=1e-4, rtol=1e-5)
