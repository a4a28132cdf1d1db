"""Speculative decoding (prompt lookup, an assistant model) against the plain loop and exact probabilities,
with per-row acceptance, hooks, controllers and grammars."""

import re

import pytest
import torch
from conftest import FAMILIES, V, make_bridge
from test_control import Script, mixed_script

from transformer_bridge import Branch

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]
# GQA, learned positions, two sliding-window families (windows of 4 tokens).
SOME = ["llama", "gpt2", "gemma3_text", "starcoder2"]
REPEATING = ["abcabcabcab", "Hi", "The cat sat on the mat, the cat sat"]  # prompt lookup finds drafts here


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def batch(model, prompts=PROMPTS):
    return model.to_tokens_and_mask(prompts, padding_side="left")


def same(a, b) -> bool:
    return (torch.equal(a.sequences, b.sequences) and torch.equal(a.attention_mask, b.attention_mask)
            and a.finish_reasons == b.finish_reasons)  # fmt: skip


class Forwards:
    """Counts forwards and records each one's ``hook.ctx`` (kind, chunk width)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def __call__(self, x, hook):
        self.seen.append((hook.ctx.kind, x.shape[1]))


# -- greedy: the plain loop's tokens ------------------------------------------------------------------------
def test_prompt_lookup_greedy_equals_plain_loop(model):
    tokens, mask = batch(model)
    for t, m in [(tokens[:1], mask[:1]), (tokens, mask)]:
        plain = model.generate(t, attention_mask=m, max_new_tokens=16, return_dict=True, top_logprobs=2)
        for k in (1, 4):
            fast = model.generate(t, attention_mask=m, max_new_tokens=16, prompt_lookup_num_tokens=k,
                                  return_dict=True, top_logprobs=2)  # fmt: skip
            assert same(fast, plain)
            assert torch.equal(fast.top_tokens, plain.top_tokens)
            torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-4, rtol=0)


def test_rows_stopping_at_different_steps(model):
    tokens, mask = batch(model)
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=12, stop_at_eos=False, return_dict=True)
    eos = free.new_tokens[0, 4].item()
    plain = model.generate(tokens, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, return_dict=True)
    fast = model.generate(tokens, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, return_dict=True,
                          prompt_lookup_num_tokens=3)  # fmt: skip
    assert same(fast, plain) and fast.finish_reasons[0] == "eos"


def test_assistant_greedy_equals_plain_loop(model):
    tokens, mask = batch(model)
    draft = make_bridge(FAMILIES[0], seed=3)  # another model: many drafts are rejected
    plain = model.generate(tokens, attention_mask=mask, max_new_tokens=10, return_dict=True)
    for assistant in (draft, model):
        fast = model.generate(tokens, attention_mask=mask, max_new_tokens=10, return_dict=True,
                              assistant_model=assistant, num_assistant_tokens=3)  # fmt: skip
        assert same(fast, plain)


# -- the verify chunk and hooks -----------------------------------------------------------------------------
def test_drafts_are_verified_in_few_forwards_and_hooks_see_the_chunk():
    model = make_bridge("llama")
    tokens = model.to_tokens("abcdefgh abcdefgh abcdefgh abc")
    plain_hook, fast_hook = Forwards(), Forwards()
    with model.hooks(fwd_hooks=[("hook_embed", plain_hook)]):
        plain = model.generate(tokens, max_new_tokens=20, stop_at_eos=False)
    # A copy of the model as the assistant (its own hooks: none): every draft is accepted, so k + 1
    # tokens per verify forward.
    with model.hooks(fwd_hooks=[("hook_embed", fast_hook)]):
        fast = model.generate(tokens, max_new_tokens=20, stop_at_eos=False, assistant_model=make_bridge("llama"),
                              num_assistant_tokens=4)  # fmt: skip
    assert torch.equal(fast, plain)
    assert len(plain_hook.seen) == 20  # prefill + 19 one-token steps
    kinds = [k for k, _ in fast_hook.seen]
    verify = [w for k, w in fast_hook.seen if k == "verify"]
    assert kinds[0] == "prompt" and set(kinds[1:]) == {"verify"}
    assert verify[0] == 5 and len(verify) == 4  # 1 + 5 + 5 + 5 + 4 = 20 tokens


@pytest.mark.parametrize("controlled", [False, True], ids=["plain", "controller"])
def test_position_steering_gives_the_same_tokens_with_speculation(model, controlled):
    tokens, mask = batch(model)
    extra = {"controller": NoRepeat()} if controlled else {}
    vec = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))

    def steer(resid, hook):  # steer positions 6.. only: depends on each token's absolute position
        return resid + 3 * vec * (hook.ctx.positions >= 6)[..., None]

    point = "blocks.0.hook_resid_post"
    with model.hooks(fwd_hooks=[(point, steer)]):
        plain = model.generate(tokens, attention_mask=mask, max_new_tokens=12, return_dict=True, **extra)
        fast = model.generate(tokens, attention_mask=mask, max_new_tokens=12, return_dict=True,
                              prompt_lookup_num_tokens=3, **extra)  # fmt: skip
    unsteered = model.generate(tokens, attention_mask=mask, max_new_tokens=12, return_dict=True, **extra)
    assert same(fast, plain)
    assert not torch.equal(plain.sequences, unsteered.sequences)  # the steering does change the tokens


def test_prompt_lookup_drafts():
    from transformer_bridge.generation.speculative import PromptLookup

    lookup = PromptLookup(3)
    assert lookup.propose([[5, 6, 7, 8, 5, 6]], 3) == [[7, 8, 5]]  # trigram absent, bigram (5, 6) found
    assert lookup.propose([[1, 2, 3, 9, 2, 3, 4, 2, 3]], 2) == [[4, 2]]  # the latest occurrence
    assert lookup.propose([[1, 2, 3]], 3) == [[]]  # nothing repeats


# -- sampling: exact in distribution ------------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True], ids=["free", "controller_mask"])
def test_speculative_sampling_matches_the_model_distribution(masked):
    """Tokens 2 and 3 after a prompt, drawn with the model as its own assistant (drafts accepted with
    probability p(draft), else redrawn from the rest), against their exact marginals from plain forwards.
    With a controller that bans, everywhere, the likeliest first token and the assistant's first draft after
    each of the four likeliest (so ~97% of first drafts are banned), p is the masked distribution and a banned
    draft is never kept."""
    model = make_bridge("llama", seed=1)
    prompt = model.to_tokens("abcab")
    allowed = torch.ones(V, dtype=torch.bool)
    if masked:
        with torch.no_grad():
            first = model(prompt)[0, -1]
            drafts = model(torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1))[:, -1].argmax(-1)
        allowed[first.argmax()] = False
        allowed[drafts[first.topk(4).indices]] = False
    temp, rows, calls = 0.02, 16, 150  # a peaked distribution: drafts (argmaxes) are often accepted
    draws = []
    for seed in range(calls):
        out = model.generate(prompt.repeat(rows, 1), max_new_tokens=3, do_sample=True, temperature=temp, top_k=0,
                             stop_at_eos=False, assistant_model=model, num_assistant_tokens=2, seed=seed,
                             controller=(lambda v: Branch.sample(allowed)) if masked else None)  # fmt: skip
        draws.append(out[:, prompt.shape[1] :])
    draws = torch.cat(draws)
    n = draws.shape[0]

    # Exact: P(t1) from the prompt, P(t2 | t1) from V forwards, P(t3 | t1, t2) from V² forwards.
    def dist(logits):
        return (logits.masked_fill(~allowed, -torch.inf) / temp).softmax(-1)

    with torch.no_grad():
        p1 = dist(model(prompt)[0, -1])
        ext = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
        p2 = dist(model(ext)[:, -1])  # [t1, t2]
        ext2 = torch.cat([ext.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
        p3 = dist(model(ext2)[:, -1]).reshape(V, V, V)
    joint12 = p1[:, None] * p2
    exact = {1: joint12.sum(0), 2: (joint12[..., None] * p3).sum((0, 1))}
    gen = torch.Generator().manual_seed(0)
    for col, probs in exact.items():
        seen = torch.bincount(draws[:, col], minlength=V).double() / n
        tv = 0.5 * (seen - probs.double()).abs().sum()
        null = [0.5 * (torch.multinomial(probs, n, True, generator=gen).bincount(minlength=V).double() / n
                       - probs.double()).abs().sum() for _ in range(300)]  # fmt: skip
        assert tv <= torch.stack(null).quantile(0.999) * 1.1, (col, tv)
    # And the drafts were accepted often enough to matter (the tokens are often the masked argmax).
    assert (draws[:, 1] == p2.argmax(-1)[draws[:, 0]]).float().mean() > 0.2
    assert allowed[draws].all()


# -- per-row acceptance, positions -------------------------------------------------------------------------
class Fed:
    """Per forward: the kind, and per batch row its output row, real positions and the tokens fed (read back
    from ``hook_embed``, which is ``W_E[token]`` on every family)."""

    def __init__(self, model) -> None:
        self.model, self.seen = model, []

    def __call__(self, x, hook):
        ctx = hook.ctx
        real = ~ctx.pad_mask
        fed = [torch.cdist(x[b][real[b]], self.model.W_E).argmin(-1).tolist() for b in range(x.shape[0])]
        self.seen.append((ctx.kind, ctx.rows, [p[r].tolist() for p, r in zip(ctx.positions, real, strict=True)], fed))


class NoRepeat:
    """Bans the previous token while the row has 4 to 9 generated tokens: drafts copying a cycle fail there."""

    def __call__(self, view):
        if 4 <= len(view.generated) < 10:
            allowed = torch.ones(view.logits.shape[-1], dtype=torch.bool)
            allowed[view.generated[-1]] = False
            return Branch.sample(allowed)
        return None


def _advances(fed: Fed, out) -> list[dict[int, int]]:
    """Checks each fed chunk's positions against the output; returns per round how far each row advanced."""
    rows = [seq[m.bool()].tolist() for seq, m in zip(out.sequences, out.attention_mask, strict=True)]
    advances, last = [], {}
    for kind, ids, positions, tokens_fed in fed.seen[1:]:
        assert kind in ("verify", "sampled", "mixed")
        step = {}
        for row, pos, toks in zip(ids, positions, tokens_fed, strict=True):
            assert pos == list(range(pos[0], pos[0] + len(pos)))  # contiguous, absolute
            assert toks[0] == rows[row][pos[0]]  # the chosen token: always kept, at its position
            if row in last:
                step[row] = pos[0] - last[row]
            last[row] = pos[0]
        advances.append(step)
    return advances


@pytest.mark.parametrize("family", SOME)
def test_rows_accept_different_counts_at_their_absolute_positions(family):
    """Greedy tokens equal the plain loop's (with and without a controller); in one verify forward rows accept
    different numbers of drafts; every fed chunk sits at the row's absolute positions, and its first token is
    the output's token there."""
    model = make_bridge(family)
    tokens, mask = batch(model, REPEATING)
    kw = dict(attention_mask=mask, max_new_tokens=24, return_dict=True)
    plain = model.generate(tokens, **kw)
    controllers = [lambda v: None, NoRepeat(), lambda v: None]
    controlled = model.generate(tokens, controller=controllers, **kw)
    assert torch.equal(controlled.sequences[[0, 2]], plain.sequences[[0, 2]])
    for reference, extra in ((plain, {}), (controlled, {"controller": controllers})):
        fed = Fed(model)
        with model.hooks(fwd_hooks=[("hook_embed", fed)]):
            fast = model.generate(tokens, prompt_lookup_num_tokens=4, **kw, **extra)
        assert same(fast, reference)
        assert len(fed.seen) < 24  # fewer forwards than tokens per row
        advances = _advances(fed, fast)
        assert any(v > 1 for a in advances for v in a.values())  # drafts were accepted
    assert any(len(set(a.values())) > 1 for a in advances)  # per-row acceptance: row 1's drafts fail


# -- controllers and grammars apply to drafts ---------------------------------------------------------------
@pytest.mark.parametrize("family", SOME)
def test_a_controller_sees_the_same_views_and_gives_the_same_tokens(family):
    """Backtrack, fast-forward and fork (test_control's script) with speculation: the controller is asked
    at the same tokens with the same logits, and the output is the one without speculation."""
    model = make_bridge(family)
    tokens, mask = batch(model)
    runs = []
    for k in (None, 3):
        c = Script(mixed_script())
        out = model.generate(tokens, attention_mask=mask, max_new_tokens=12, controller=c, return_dict=True,
                             prompt_lookup_num_tokens=k)  # fmt: skip
        runs.append((out, c.views))
    (a, va), (b, vb) = runs
    # Rows 1 and 2 backtrack in a loop until the step budget, which counts forwards: speculation needs fewer
    # of them, so those rows get further. Every other row finishes on its own and must be the same.
    assert a.parents == b.parents and len(a) > 3 and a.finish_reasons == b.finish_reasons
    keep = [i for i, r in enumerate(a.finish_reasons) if r != "max_steps"]
    assert len(keep) >= 3 and torch.equal(a.sequences[keep], b.sequences[keep])
    torch.testing.assert_close(a.logprobs[keep], b.logprobs[keep], atol=1e-4, rtol=0, equal_nan=True)
    va, vb = (sorted((v for v in views if v.row in keep), key=lambda v: v.row) for views in (va, vb))
    assert [(v.row, v.tokens, v.backtracked, v.appended) for v in va] == [
        (v.row, v.tokens, v.backtracked, v.appended) for v in vb
    ]
    for x, y in zip(va, vb, strict=True):
        torch.testing.assert_close(x.logits, y.logits, atol=1e-4, rtol=0)


def test_a_mask_applies_to_drafts_and_forced_drafts_are_free():
    """A controller that bans a token and forces a phrase: drafts that hold the banned token are rejected,
    the phrase costs no forward of its own when the drafts already hold it, and the tokens are the plain ones."""
    model = make_bridge("llama")
    tokens = model.to_tokens("abcabcabcabcab")
    free = model.generate(tokens, max_new_tokens=20, stop_at_eos=False)
    banned = free[0, tokens.shape[1] + 3].item()  # a token greedy decoding produces
    phrase = free[0, tokens.shape[1] + 6 : tokens.shape[1] + 9].tolist()

    class Ban:
        def __call__(self, view):
            if len(view.generated) == 6:
                return Branch.forced(phrase)
            allowed = torch.ones(V, dtype=torch.bool)
            allowed[banned] = False
            return Branch.sample(allowed)

    outs, forwards = [], []
    for k in (None, 4):
        seen = []
        with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook, seen=seen: seen.append(hook.ctx.kind))]):
            outs.append(model.generate(tokens, max_new_tokens=20, stop_at_eos=False, controller=Ban(),
                                       prompt_lookup_num_tokens=k, return_dict=True))  # fmt: skip
        forwards.append(seen)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert banned not in outs[1].new_tokens[0].tolist()
    assert "forced" in forwards[0] and len(forwards[1]) < len(forwards[0])


@pytest.mark.parametrize("family", SOME)
def test_grammars_with_speculation_give_the_same_tokens(family):
    pytest.importorskip("llguidance")
    from test_grammar import PATTERN, SCHEMA

    from transformer_bridge import grammar

    model = make_bridge(family)
    for make, n in ((lambda: grammar.regex(PATTERN), 40), (lambda: grammar.json_schema(SCHEMA), 60)):
        forwards = []
        for k in (None, 4):
            seen = []
            with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook, seen=seen: seen.append(1))]):
                out = model.generate(PROMPTS[:2], max_new_tokens=n, controller=make(), return_dict=True,
                                     prompt_lookup_num_tokens=k)  # fmt: skip
            forwards.append((out, len(seen)))
        (plain, n_plain), (fast, n_fast) = forwards
        assert same(fast, plain) and n_fast <= n_plain
        texts = [t[len(p) :] for t, p in zip(fast.text, PROMPTS, strict=False)]
        if n == 40:
            assert fast.finish_reasons == ["controller"] * 2
            assert all(re.fullmatch(PATTERN, t) for t in texts), texts
        else:
            assert all(t.startswith('{"n":') for t in texts), texts  # a long integer may hit the length first


def test_max_steps_and_stream_with_speculation():
    """A budget that ends mid-generation leaves no unverified draft in the output; a streamer gets the plain
    loop's columns."""
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.clone())

        def end(self):
            self.ended = True

    model = make_bridge("llama")
    tokens, mask = batch(model, REPEATING)
    plain = model.generate(tokens, attention_mask=mask, max_new_tokens=20, return_dict=True)
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=20, return_dict=True, max_steps=3,
                         controller=lambda v: None, prompt_lookup_num_tokens=4)  # fmt: skip
    assert out.finish_reasons == ["max_steps"] * 3
    for i in range(3):
        n = int(out.new_lengths[i])
        assert 0 < n < 20 and torch.equal(out.new_tokens[i, :n], plain.new_tokens[i, :n])
    streams = [Collect(), Collect()]
    model.generate(tokens, attention_mask=mask, max_new_tokens=20, streamer=streams[0])
    model.generate(tokens, attention_mask=mask, max_new_tokens=20, streamer=streams[1], prompt_lookup_num_tokens=4)
    a, b = (s.puts for s in streams)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and streams[1].ended


# -- errors ------------------------------------------------------------------------------------------------
def test_bad_speculative_arguments():
    model = make_bridge("llama")
    tokens = model.to_tokens("abc")
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        model.generate(tokens, max_new_tokens=3, prompt_lookup_num_tokens=0)
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        model.generate(tokens, max_new_tokens=3, num_assistant_tokens=3)
    with pytest.raises(ValueError, match="pass one"):
        model.generate(tokens, max_new_tokens=3, prompt_lookup_num_tokens=2, assistant_model=model)
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(tokens, max_new_tokens=3, prompt_lookup_num_tokens=2, num_beams=2)
    with pytest.raises(TypeError, match="assistant_model"):
        model.generate(tokens, max_new_tokens=3, assistant_model="gpt2")
    with pytest.raises(TypeError, match="generate"):
        model.generate_stream(tokens, max_new_tokens=3, prompt_lookup_num_tokens=2)


@pytest.mark.real
def test_smollm2_prompt_lookup_per_row(smollm2):
    """SmolLM2 on a copying task, batch 4 left-padded: prompt lookup gives the plain loop's tokens and records,
    in fewer forwards, with rows accepting different numbers of drafts."""
    passages = ["The committee met on Tuesday to review the budget for the coming year.",
                "Our new phone has a six-inch screen and a battery that lasts two days.",
                "To make the bread, mix the flour, the water, the salt and the yeast.", "Hi there."]  # fmt: skip
    texts = [f"Copy the text exactly.\nText: {p}\nCopy: {p.split()[0]}" for p in passages]
    tokens, mask = smollm2.to_tokens_and_mask(texts, padding_side="left")
    kw = dict(attention_mask=mask, max_new_tokens=20, return_dict=True, top_logprobs=2)
    forwards = []
    with smollm2.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append(1))]):
        plain = smollm2.generate(tokens, **kw)
    fed = Fed(smollm2)
    with smollm2.hooks(fwd_hooks=[("hook_embed", fed)]):
        fast = smollm2.generate(tokens, prompt_lookup_num_tokens=8, **kw)
    assert same(fast, plain) and torch.equal(fast.top_tokens, plain.top_tokens)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-4, rtol=0)
    assert len(fed.seen) < len(forwards)
    advances = _advances(fed, fast)
    assert any(len(set(a.values())) > 1 for a in advances)
