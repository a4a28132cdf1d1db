"""The controlled engine over a static KV cache (eager and compiled) against independent answers: a fresh
no-KV-cache forward over each row's tokens, the dynamic-cache engine's tokens, `run_with_cache` for the cache."""

import itertools

import pytest
import torch
from conftest import FAMILIES, V, make_bridge, perturb_
from test_control import Script
from test_control import mixed_script as control_script
from torch._dynamo.utils import counters

from transformer_bridge import grammar
from transformer_bridge.generation import fast
from transformer_bridge.generation.kv import StaticKVRows, run_chunk
from transformer_bridge.hooks.points import HookContext

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]
# Compiling takes seconds per graph on a CPU (and forks make graphs of new batch sizes): a GQA family and a
# sliding-window one.
COMPILED_FAMILIES = ["llama", "gemma3_text"]
pytestmark = pytest.mark.filterwarnings("ignore:GPTNeoForCausalLM does not support a static KV cache")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return perturb_(make_bridge(request.param))


def batch(model, prompts=PROMPTS):
    return model.to_tokens_and_mask(prompts, padding_side="left")


def mixed_script(d_vocab=V):
    """test_control's script (backtrack, fast-forward and fork per row), and a fork that stops (it retires while
    others run: with a static cache its slot stays as padding)."""
    return {**control_script(d_vocab), (4, 4, False): []}


def run(model, tokens, mask, atol, **options):
    """Controlled generation with the mixed script; every view's logits checked against a fresh forward."""
    c = Script(mixed_script(model.cfg.d_vocab))
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, return_dict=True, **options)
    assert len(out) > 3 and any(v.backtracked for v in c.views) and any(len(v.appended) > 1 for v in c.views)
    for v in c.views:
        fresh = model(torch.tensor([v.tokens]))[0, -1]
        torch.testing.assert_close(v.logits, fresh, atol=atol, rtol=0)
    return out


def test_static_engine_equals_fresh_forwards_and_the_dynamic_engine(model):
    tokens, mask = batch(model)
    dynamic = run(model, tokens, mask, 1e-5)
    static = run(model, tokens, mask, 1e-5, cache_implementation="static")
    assert torch.equal(static.sequences, dynamic.sequences) and static.parents == dynamic.parents
    assert static.finish_reasons == dynamic.finish_reasons
    torch.testing.assert_close(static.logprobs, dynamic.logprobs, atol=1e-5, rtol=0, equal_nan=True)


def test_static_engine_return_cache_equals_run_with_cache_bitwise(model):
    tokens, mask = batch(model)
    names = [n for n in ("blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern") if n in model.hook_dict]
    c = Script(mixed_script(model.cfg.d_vocab))
    out, cache = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, return_dict=True,
                                return_cache=True, names_filter=names, cache_implementation="static")  # fmt: skip
    _, ref = model.run_with_cache(out.sequences, attention_mask=out.attention_mask, names_filter=names)
    for name in names:
        assert torch.equal(cache[name], ref[name])


def test_the_engine_runs_over_the_static_cache():
    """The attention sees the bucket's keys (the static cache is really used); finished rows keep their slot
    and forks fill free slots first (the batch grows to 8, never shrinks); position-based steering gives the
    dynamic engine's tokens."""
    model = perturb_(make_bridge("llama"))
    tokens, mask = batch(model)
    direction = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    keys, rows = [], []

    def steer(resid, hook):
        rows.append(hook.ctx.rows)
        return resid + 3.0 * direction * ((hook.ctx.positions == 4) & ~hook.ctx.pad_mask)[..., None]

    def pattern(x, hook):
        keys.append(x.shape[-1])

    hooks = [("blocks.0.hook_resid_post", steer), ("blocks.0.attn.hook_pattern", pattern)]
    outs = []
    for options in ({}, {"cache_implementation": "static"}):
        keys.clear()
        rows.clear()
        with model.hooks(fwd_hooks=hooks):
            c = Script(mixed_script())
            outs.append(model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, **options))
    assert torch.equal(outs[0], outs[1])
    assert set(keys) == {fast.bucket_length(tokens.shape[1] + 9 + 16)}
    assert [len(r) for r in rows] == sorted(len(r) for r in rows) and {len(r) for r in rows} == {3, 8}
    reused = [j for j in range(8) for a, b in itertools.pairwise(rows) if len(a) == 8 and a[j] == -1 and b[j] >= 0]
    assert reused  # a fork took the slot of a finished row


def test_static_kv_rows_grow_past_the_bucket():
    """A chunk that would pass the end of the bucket moves the rows to a longer bucket, entries kept."""
    model = perturb_(make_bridge("llama"))
    tokens = torch.randint(4, V, (2, 70), generator=torch.Generator().manual_seed(0))
    kv = StaticKVRows(model, 2, 20)
    assert kv.capacity == 64
    pos = torch.arange(70).expand(2, -1)
    for cols in (slice(0, 30), slice(30, 70)):  # the second chunk passes column 64
        ctx = HookContext("decode", 0, pos[:, cols], torch.zeros_like(pos[:, cols], dtype=torch.bool),
                          torch.ones_like(pos[:, cols], dtype=torch.bool), "forced")  # fmt: skip
        logits = run_chunk(model, kv, tokens[:, cols], None, pos[:, cols], ctx, 0)
    assert kv.capacity == 128 and kv.length == 70
    torch.testing.assert_close(logits, model(tokens)[:, 30:], atol=1e-5, rtol=0)


# -- compiled step ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", COMPILED_FAMILIES)
def test_compiled_engine_equals_fresh_forwards_and_the_dynamic_engine(family):
    model = perturb_(make_bridge(family))
    tokens, mask = batch(model)
    dynamic = run(model, tokens, mask, 1e-5)
    steps = []
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: steps.append(x.shape[1]))]):
        compiled = run(model, tokens, mask, 1e-4, compile=True)
    assert torch.equal(compiled.sequences, dynamic.sequences) and compiled.parents == dynamic.parents
    torch.testing.assert_close(compiled.logprobs, dynamic.logprobs, atol=1e-4, rtol=0, equal_nan=True)
    assert 1 in steps and max(steps) > 1  # one-token steps (compiled) and wider chunks (eager)
    assert any(key[0] in (3, 4, 5) for key in fast.COMPILE_SECONDS)


@pytest.mark.parametrize("family", COMPILED_FAMILIES[:1])
def test_compiled_grammar_equals_the_eager_grammar(family):
    pytest.importorskip("llguidance")
    model = make_bridge(family)
    pattern = r"(ab|cd)[0-9]{2,3}! [a-z]{1,6}\."  # forced chunks, masked samples, rows finishing apart
    kw = dict(max_new_tokens=30, return_dict=True)
    model.generate(PROMPTS, max_new_tokens=30, compile=True)  # the plain loop compiles the (3, 64) step
    graphs = counters["stats"]["unique_graphs"]
    eager = model.generate(PROMPTS, controller=grammar.regex(pattern), **kw)
    compiled = model.generate(PROMPTS, controller=grammar.regex(pattern), compile=True, **kw)
    assert torch.equal(compiled.sequences, eager.sequences) and compiled.finish_reasons == eager.finish_reasons
    assert compiled.finish_reasons == ["controller"] * 3
    assert counters["stats"]["unique_graphs"] == graphs  # the engine reuses it, as rows finish too


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_compiled_json_grammar_equals_eager(smollm2):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    prompts = ["Alice is 31. As JSON: ", "Bob, aged 45, lives in Berlin. JSON: "]
    kw = dict(max_new_tokens=32, return_dict=True)
    eager = smollm2.generate(prompts, controller=grammar.json_schema(schema), **kw)
    compiled = smollm2.generate(prompts, controller=grammar.json_schema(schema), compile=True, **kw)
    assert torch.equal(compiled.sequences, eager.sequences) and compiled.finish_reasons == eager.finish_reasons
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, atol=1e-4, rtol=1e-5, equal_nan=True)
