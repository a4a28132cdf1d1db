"""Controllers in beam search (`beam_control`): masks, forced tokens and stops per beam, checked against HF's own
beam search with the equivalent logits processor, on every family; grammars; what cannot go with beams."""

import json
import re

import pytest
import torch
from conftest import FAMILIES, V, make_bridge

from transformer_bridge import Branch, grammar

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def banned(last: int) -> torch.Tensor:
    """The tokens a row may not take after ``last``: a rule that depends on the row (so on the beam)."""
    ids = torch.arange(V)
    return (ids + last) % 3 == 0


class Rule:
    """A controller masking by `banned`, and the same rule as an HF logits processor (the oracle)."""

    def mid_process(self, view):
        return Branch.sample(~banned(view.tokens[-1]))

    def __call__(self, input_ids, scores):  # HF: input_ids [rows, pos], scores [rows, d_vocab]
        bans = torch.stack([banned(int(row[-1])) for row in input_ids])
        return scores.masked_fill(bans, float("-inf"))


def hf_beams(model, tokens, mask, processor, **kw):
    return model.hf_model.generate(tokens, attention_mask=mask, do_sample=False, return_dict_in_generate=True,
                                   output_scores=True, logits_processor=[processor] if processor else None,
                                   **kw)  # fmt: skip


def assert_same(ours, hf):
    real = ours.attention_mask.bool()
    assert ours.sequences.shape == hf.sequences.shape
    assert torch.equal(ours.sequences[real], hf.sequences[real])
    torch.testing.assert_close(ours.sequences_scores, hf.sequences_scores)


def test_mask_equals_hf_beam_search_with_the_same_processor(model):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2)
    ours = model.generate(tokens, attention_mask=mask, controller=Rule(), return_dict=True, **kw)
    assert_same(ours, hf_beams(model, tokens, mask, Rule(), **kw))
    new = ours.sequences[:, ours.prompt_width :]
    prev = ours.sequences[:, ours.prompt_width - 1 : -1]
    real = ours.attention_mask[:, ours.prompt_width :].bool()
    assert not ((new + prev) % 3 == 0)[real].any()  # the rule held in every returned beam


def test_forced_tokens_equal_hf_with_a_forcing_processor(model):
    tokens, mask = model.to_tokens_and_mask(PROMPTS[:2], padding_side="left")
    forced = lambda view: None if view.generated else Branch.forced([7, 8, 9])  # noqa: E731

    def oracle(input_ids, scores):  # HF: force 7, 8, 9 one per step
        n = input_ids.shape[1] - tokens.shape[1]
        if n >= 3:
            return scores
        out = torch.full_like(scores, float("-inf"))
        out[:, [7, 8, 9][n]] = scores[:, [7, 8, 9][n]]
        return out

    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=3)
    ours = model.generate(tokens, attention_mask=mask, controller=forced, return_dict=True, **kw)
    assert_same(ours, hf_beams(model, tokens, mask, oracle, **kw))
    assert (ours.sequences[:, ours.prompt_width : ours.prompt_width + 3] == torch.tensor([7, 8, 9])).all()


def test_ff_sequences_follow_each_beam():
    model = make_bridge("qwen2")
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    tails = [[t, 40, 41] for t in range(3, V, 5)]  # a sampled 3, 8, 13, ... brings 40 41 after it
    follow = lambda view: Branch.sample(ff_tokens=tails)  # noqa: E731
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=10, num_beams=3, num_return_sequences=3,
                         controller=follow, stop_at_eos=False, return_dict=True)  # fmt: skip
    hits = 0
    for row in out.sequences[:, out.prompt_width :].tolist():
        j = 0
        while j < len(row):
            if row[j] % 5 == 3:
                assert row[j + 1 : j + 3] == [40, 41][: len(row) - j - 1], row
                hits += 1
                j += 3
            else:
                j += 1
    assert hits  # the rule was exercised


def test_stop_finishes_the_beam_as_hf_finishes_at_the_length_limit(model):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    stop = lambda view: [] if len(view.generated) == 4 else None  # noqa: E731
    for lp in (1.0, 0.5):
        kw = dict(num_beams=3, num_return_sequences=2, length_penalty=lp)
        ours = model.generate(tokens, attention_mask=mask, max_new_tokens=9, controller=stop, return_dict=True,
                              stop_at_eos=False, **kw)  # fmt: skip
        hf = hf_beams(model, tokens, mask, None, max_new_tokens=4, eos_token_id=None, **kw)
        assert_same(ours, hf)
        assert set(ours.finish_reasons) == {"controller"}


def test_reads_see_the_beams_newest_position():
    model = make_bridge("llama")
    tokens, mask = model.to_tokens_and_mask(PROMPTS[:2], padding_side="left")
    seen = []

    class Reader:
        reads = ("blocks.1.hook_resid_post",)

        def mid_process(self, view):
            seen.append((list(view.tokens), view.reads["blocks.1.hook_resid_post"]))
            return None

    model.generate(tokens, attention_mask=mask, max_new_tokens=3, num_beams=2, controller=Reader())
    assert len(seen) == 3 * 4  # 3 steps x 2 prompts x 2 beams
    for toks, act in seen[-4:]:
        _, cache = model.run_with_cache(torch.tensor([toks]), names_filter=["blocks.1.hook_resid_post"])
        torch.testing.assert_close(act[0], cache["blocks.1.hook_resid_post"][0, -1], atol=1e-5, rtol=1e-5)
    assert not any(p.fwd_hooks for p in model.hook_dict.values())


def test_grammar_constrained_beam_search(model):
    pytest.importorskip("llguidance")
    pattern = r"(ab|cd)[0-9]{2,3}!"
    out = model.generate(PROMPTS[:2], max_new_tokens=12, num_beams=3, num_return_sequences=2,
                         controller=grammar.regex(pattern), return_dict=True)  # fmt: skip
    w = out.prompt_width
    texts = [model.tokenizer.decode(r[w:][m[w:].bool()].tolist()) for r, m in zip(out.sequences, out.attention_mask,
                                                                                 strict=True)]  # fmt: skip
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert set(out.finish_reasons) == {"controller"}


def test_smollm2_json_beam_search(smollm2):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    out = smollm2.generate(
        ["The capital of France is Paris. JSON: ", "Berlin is in Germany. JSON: "],
        max_new_tokens=24,
        num_beams=2,
        controller=grammar.json_schema(schema),
        return_dict=True,
    )
    w = out.prompt_width
    for row, m, reason in zip(out.sequences, out.attention_mask, out.finish_reasons, strict=True):
        assert reason == "controller"
        assert set(json.loads(smollm2.tokenizer.decode(row[w:][m[w:].bool()].tolist()))) == {"city"}


def test_backtrack_and_fork_are_refused_with_beams_and_hooks_are_clean():
    model = make_bridge("gpt2")
    tokens = torch.tensor([[1, 5, 6, 7]])
    fork = lambda view: [Branch.sample(), Branch.sample()]  # noqa: E731
    back = lambda view: Branch.sample(backtrack=1) if view.generated else None  # noqa: E731
    with pytest.raises(ValueError, match=r"num_beams.*fork"):
        model.generate(tokens, max_new_tokens=3, num_beams=2, controller=fork)
    with pytest.raises(ValueError, match=r"num_beams.*backtrack"):
        model.generate(tokens, max_new_tokens=3, num_beams=2, controller=back)
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate(tokens, max_new_tokens=3, num_beams=2, controller=lambda v: Branch.forced([V]))
    assert not any(p.fwd_hooks for p in model.hook_dict.values())
