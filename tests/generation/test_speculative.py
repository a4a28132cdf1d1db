"""Speculative decoding (prompt lookup, an assistant model) against the plain loop and exact probabilities."""

import pytest
import torch
from conftest import FAMILIES, V, make_bridge

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]


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


def test_position_steering_gives_the_same_tokens_with_speculation(model):
    tokens, mask = batch(model)
    vec = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))

    def steer(resid, hook):  # steer positions 6.. only: depends on each token's absolute position
        return resid + 3 * vec * (hook.ctx.positions >= 6)[..., None]

    point = "blocks.0.hook_resid_post"
    with model.hooks(fwd_hooks=[(point, steer)]):
        plain = model.generate(tokens, attention_mask=mask, max_new_tokens=12, return_dict=True)
        fast = model.generate(tokens, attention_mask=mask, max_new_tokens=12, return_dict=True,
                              prompt_lookup_num_tokens=3)  # fmt: skip
    unsteered = model.generate(tokens, attention_mask=mask, max_new_tokens=12, return_dict=True)
    assert same(fast, plain)
    assert not torch.equal(plain.sequences, unsteered.sequences)  # the steering does change the tokens


def test_prompt_lookup_drafts():
    from transformer_bridge.generation.speculative import PromptLookup

    lookup = PromptLookup(3)
    assert lookup.propose([[5, 6, 7, 8, 5, 6]], 3) == [[7, 8, 5]]  # trigram absent, bigram (5, 6) found
    assert lookup.propose([[1, 2, 3, 9, 2, 3, 4, 2, 3]], 2) == [[4, 2]]  # the latest occurrence
    assert lookup.propose([[1, 2, 3]], 3) == [[]]  # nothing repeats


# -- sampling: exact in distribution ------------------------------------------------------------------------
def test_speculative_sampling_matches_the_model_distribution():
    """Tokens 2 and 3 after a prompt, drawn with the model as its own assistant (drafts accepted with
    probability p(draft), else redrawn from the rest), against their exact marginals from plain forwards."""
    model = make_bridge("llama", seed=1)
    prompt = model.to_tokens("abcab")
    temp, rows, calls = 0.02, 16, 150  # a peaked distribution: drafts (argmaxes) are often accepted
    draws = []
    for seed in range(calls):
        out = model.generate(prompt.repeat(rows, 1), max_new_tokens=3, do_sample=True, temperature=temp, top_k=0,
                             stop_at_eos=False, assistant_model=model, num_assistant_tokens=2, seed=seed)  # fmt: skip
        draws.append(out[:, prompt.shape[1] :])
    draws = torch.cat(draws)
    n = draws.shape[0]
    # Exact: P(t1) from the prompt, P(t2 | t1) from V forwards, P(t3 | t1, t2) from V² forwards.
    with torch.no_grad():
        p1 = (model(prompt)[0, -1] / temp).softmax(-1)
        ext = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
        p2 = (model(ext)[:, -1] / temp).softmax(-1)  # [t1, t2]
        ext2 = torch.cat([ext.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
        p3 = (model(ext2)[:, -1] / temp).softmax(-1).reshape(V, V, V)
    joint12 = p1[:, None] * p2
    exact = {1: joint12.sum(0), 2: (joint12[..., None] * p3).sum((0, 1))}
    gen = torch.Generator().manual_seed(0)
    for col, probs in exact.items():
        seen = torch.bincount(draws[:, col], minlength=V).double() / n
        tv = 0.5 * (seen - probs.double()).abs().sum()
        null = [0.5 * (torch.multinomial(probs, n, True, generator=gen).bincount(minlength=V).double() / n
                       - probs.double()).abs().sum() for _ in range(300)]  # fmt: skip
        assert tv <= torch.stack(null).quantile(0.999) * 1.1, (col, tv)
    # And the drafts were accepted often enough to matter: the sampled tokens differ from the argmax.
    assert (draws[:, 1] == p2.argmax(-1)[draws[:, 0]]).float().mean() > 0.2


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
