"""Controlled generation against independent answers: a fresh no-KV-cache forward over each row's tokens,
`use_cache=False`, separate runs for forks, `run_with_cache` for the cache, forward counts from a hook."""

import pytest
import torch
from conftest import FAMILIES, V, make_bridge, perturb_

from transformer_bridge import Branch

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return perturb_(make_bridge(request.param))


def batch(model, prompts=PROMPTS):
    return model.to_tokens_and_mask(prompts, padding_side="left")


class Script:
    """A controller that follows a script keyed by (row, generated length) and records every view."""

    def __init__(self, script, reads=()):
        self.script, self.reads, self.views = script, list(reads), []

    def __call__(self, view):
        self.views.append(view)
        return self.script.get((view.row, len(view.generated), view.backtracked > 0))


def mixed_script(d_vocab=V):
    """Backtrack, fast-forward and fork, differently per row, several in the same step."""
    any_ = Branch.sample()
    return {
        (0, 2, False): [any_, Branch.forced([10, 11, 12]), Branch(backtrack=1, ff_tokens=[[20]])],
        (1, 1, False): Branch.forced([30, 31]),
        (1, 3, False): Branch(backtrack=2, sample_mask=torch.arange(d_vocab) > 40),
        (2, 2, False): Branch(backtrack=2, ff_tokens=[[40, 41, 42, 43]]),
        (2, 5, False): Branch(backtrack=1, ff_tokens=[[]]),  # a pure rewind: the last kept token is fed again
        (3, 6, False): [any_, Branch.sample(torch.arange(d_vocab) < 30)],  # a fork of a fork
    }


def fresh_last_logits(model, tokens):
    return model(torch.tensor([tokens]))[0, -1]


def test_logits_after_backtrack_ff_fork_equal_a_fresh_forward(model):
    tokens, mask = batch(model)
    c = Script(mixed_script())
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, return_dict=True)
    assert len(out) > 3 and out.parents[:3] == [-1, -1, -1] and out.parents[3] == 0
    assert any(v.backtracked for v in c.views) and any(len(v.appended) > 1 for v in c.views)
    for v in c.views:
        torch.testing.assert_close(v.logits, fresh_last_logits(model, v.tokens), atol=1e-5, rtol=0)
    # Each output row is its last view's tokens (plus what the last branch appended).
    for i in range(len(out)):
        real = out.sequences[i][out.attention_mask[i].bool()].tolist()
        seen = [v for v in c.views if v.row == i]
        if not seen:  # a fork that finished (EOS, length) with the tokens its branch appended
            assert out.finish_reasons[i] in ("eos", "length")
            continue
        last = seen[-1]
        assert real[: len(last.tokens)] == last.tokens or real == last.tokens[: len(real)]


def test_use_cache_false_gives_the_same_tokens_and_logits(model):
    tokens, mask = batch(model)
    runs = []
    for use_cache in (True, False):
        c = Script(mixed_script())
        out = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, use_cache=use_cache,
                             return_dict=True)  # fmt: skip
        runs.append((out, c.views))
    (a, va), (b, vb) = runs
    assert torch.equal(a.sequences, b.sequences) and a.parents == b.parents
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0, equal_nan=True)
    for x, y in zip(va, vb, strict=True):
        torch.testing.assert_close(x.logits, y.logits, atol=1e-5, rtol=0)


def test_position_steering_equals_use_cache_false_and_positions_are_absolute(model):
    tokens, mask = batch(model)
    direction = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    seen = []

    def steer(resid, hook):
        ctx = hook.ctx
        seen.append((ctx.rows, ctx.positions.clone(), ctx.pad_mask.clone(), ctx.kind, ctx.row_kinds))
        return resid + 3.0 * direction * ((ctx.positions == 4) & ~ctx.pad_mask)[..., None]

    outs = []
    for use_cache in (True, False):
        seen.clear()
        c = Script(mixed_script())
        with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", steer)]):
            outs.append(model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c,
                                       use_cache=use_cache))  # fmt: skip
        if use_cache:
            # The newest real entry of each row sits at the position its view then counts from.
            views = {}
            for v in c.views:
                views.setdefault(v.step, {})[v.row] = v
            for step, (rows, pos, pad, kind, kinds) in enumerate(seen):
                assert len(kinds) == len(rows) and kind in (*kinds, "mixed")
                for b, row in enumerate(rows):
                    v = views.get(step, {}).get(row)
                    real = pos[b][~pad[b]]
                    if v is not None:
                        assert real[-1].item() == len(v.tokens) - 1
                    assert torch.equal(real, torch.arange(real[0], real[0] + len(real)))
            assert {"prompt", "sampled"} <= {k for s in seen for k in s[4]}
            assert "forced" in {k for s in seen for k in s[4]} and "refeed" in {k for s in seen for k in s[4]}
        else:
            assert {s[3] for s in seen} == {"recompute"}
    assert torch.equal(outs[0], outs[1])


def test_forks_equal_separate_runs(model):
    tokens, _mask = batch(model, PROMPTS[:1])
    forced = [[10], [20, 21], [30, 31, 32]]
    c = Script({(0, 3, False): [Branch.forced(f) for f in forced]})
    out = model.generate(tokens, max_new_tokens=10, controller=c, return_dict=True)
    assert out.parents == [-1, 0, 0]
    head = out.sequences[0, : out.prompt_width + 3]
    for i, f in enumerate(forced):
        alone = model.generate(torch.cat([head, torch.tensor(f)])[None], max_new_tokens=10 - 3 - len(f))
        real = out.sequences[i][out.attention_mask[i].bool()]
        assert torch.equal(real, alone[0])


def test_return_cache_equals_run_with_cache_bitwise(model):
    tokens, mask = batch(model)
    c = Script(mixed_script())
    names = [n for n in ("blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern") if n in model.hook_dict]
    out, cache = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, return_dict=True,
                                return_cache=True, names_filter=names)  # fmt: skip
    _, ref = model.run_with_cache(out.sequences, attention_mask=out.attention_mask, names_filter=names)
    for name in names:
        assert torch.equal(cache[name], ref[name])


def test_k_forced_tokens_cost_one_forward(model):
    tokens, _ = batch(model, PROMPTS[:1])
    forwards = []
    script = {(0, 0, False): Branch.forced([5, 6, 7, 8, 9]), (0, 5, False): []}
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append((hook.ctx.kind, x.shape[1])))]):
        out = model.generate(tokens, max_new_tokens=10, controller=Script(script), return_dict=True)
    assert out.new_tokens[0].tolist() == [5, 6, 7, 8, 9] and out.finish_reasons == ["controller"]
    assert forwards == [("prompt", tokens.shape[1]), ("forced", 5)]


def test_forced_logprobs_are_the_model_s(model):
    tokens, _ = batch(model, PROMPTS[:1])
    script = {(0, 1, False): Branch.forced([5, 6, 7])}
    out = model.generate(tokens, max_new_tokens=6, controller=Script(script), return_dict=True)
    logits = model(out.sequences)[0].log_softmax(-1)
    w = out.prompt_width
    expected = logits[w - 1 : -1].gather(-1, out.sequences[0, w:, None])[:, 0]
    torch.testing.assert_close(out.logprobs[0], expected, atol=1e-5, rtol=0)


def test_reads_come_from_the_same_forward(model):
    tokens, mask = batch(model)
    name = "blocks.1.hook_resid_post"
    c = Script(mixed_script(), reads=[name])
    forwards = []
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append(1))]):
        out = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, return_dict=True)
    plain = Script(mixed_script())
    forwards_plain = []
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards_plain.append(1))]):
        model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=plain, return_dict=True)
    assert len(forwards) == len(forwards_plain)  # reading costs no forward
    assert len(out) > 3
    for v in c.views:
        _, ref = model.run_with_cache(torch.tensor([v.tokens]), names_filter=[name])
        got = v.reads[name]
        torch.testing.assert_close(got, ref[name][0, -got.shape[0] :], atol=1e-5, rtol=0)


def test_reads_with_a_static_cache_after_a_row_finishes(model):
    """A static cache keeps a finished row's slot in the batch: the reads of the rows after it are still
    theirs (against `run_with_cache` over each view's tokens)."""
    tokens, mask = batch(model)
    name = "blocks.1.hook_resid_post"
    c = Script({(0, 2, False): []}, reads=[name])  # row 0 stops after 2 tokens, rows 1 and 2 go on
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=6, controller=c, return_dict=True,
                         cache_implementation="static", stop_at_eos=False)  # fmt: skip
    assert out.finish_reasons[0] == "controller" and any(v.row == 2 and v.step > 3 for v in c.views)
    for v in c.views:
        _, ref = model.run_with_cache(torch.tensor([v.tokens]), names_filter=[name])
        got = v.reads[name]
        torch.testing.assert_close(got, ref[name][0, -got.shape[0] :], atol=1e-5, rtol=0)


def test_no_op_controller_equals_plain_generate(model):
    tokens, mask = batch(model)
    plain = model.generate(tokens, attention_mask=mask, max_new_tokens=8, return_dict=True)
    ctl = model.generate(tokens, attention_mask=mask, max_new_tokens=8, return_dict=True, controller=lambda v: None)
    assert torch.equal(plain.sequences, ctl.sequences) and ctl.finish_reasons == plain.finish_reasons
    torch.testing.assert_close(plain.logprobs, ctl.logprobs, atol=1e-5, rtol=0)


@pytest.mark.real
def test_smollm2_mixed_control_equals_fresh_forward(smollm2):
    tokens, mask = smollm2.to_tokens_and_mask(["The capital of France is", "Hi"], padding_side="left")
    c = Script(mixed_script(smollm2.cfg.d_vocab))
    out = smollm2.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=c, return_dict=True)
    assert len(out) > 2
    for v in c.views:
        torch.testing.assert_close(v.logits, fresh_last_logits(smollm2, v.tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=True, temperature=0.9, top_k=20, seed=7, stop_at_eos=False),
        dict(repetition_penalty=1.5, no_repeat_ngram_size=2, min_new_tokens=6, logit_bias={5: 2.0}),
        dict(stop_strings=["e"], frequency_penalty=0.5),
    ],
    ids=["sampling", "processors", "stop_strings"],
)
def test_a_pass_through_controller_keeps_generate_s_options(model, options):
    """Processors see each row as the plain loop lays it out; sampling draws alike; stop strings stop alike."""
    tokens, mask = batch(model)
    kw = dict(attention_mask=mask, max_new_tokens=8, return_dict=True, **options)
    plain = model.generate(tokens, **kw)
    ctl = model.generate(tokens, controller=lambda v: None, **kw)
    assert torch.equal(plain.sequences, ctl.sequences) and plain.finish_reasons == ctl.finish_reasons
