"""The verify chunk's width (`speculative.Widths`): the cost model's choices computed by hand, what it learns
from verify rounds, and greedy tokens equal to the plain loop's whatever width it picks (batches whose rows
accept different counts, several families)."""

import pytest
from conftest import FAMILIES, make_bridge
from test_speculative import REPEATING, SOME, Fed, _advances, batch, same

from transformer_bridge.generation import engine, speculative
from transformer_bridge.generation.speculative import Widths


def test_the_width_that_pays_by_hand():
    """Two rows, one drafting two 1-gram tokens (prior rate 0.4): expected tokens per cost of the forward.
    Forward cost 24: width 1 → 2 / (24 + 2) = 0.0769, width 2 → 2.4 / 28 = 0.0857, width 3 → 2.56 / 30 =
    0.0853, so one draft. Cost 0: 2 / 2 = 1 beats 2.4 / 4, no draft. A forward that costs the same at any
    width: both drafts."""
    assert Widths("cpu").rate(1) == pytest.approx(0.4)
    assert Widths("cpu", forward=24).trim(batch=2, running=2, base=1, rows=[(1, 2, 1)]) == [1]
    assert Widths("cpu", forward=0).trim(batch=2, running=2, base=1, rows=[(1, 2, 1)]) == [0]
    assert Widths("cpu", forward=1e9).trim(batch=2, running=2, base=1, rows=[(1, 2, 1)]) == [2]
    # Another row feeds 3 forced tokens: the chunk is 3 wide anyway, so 2 drafts ride along for free even when
    # a column costs everything (cost 0: width 3 → (2 + 0.4 + 0.16) / 6 = 0.427, width 4 → 2.624 / 8 = 0.328).
    assert Widths("cpu", forward=0).trim(batch=2, running=2, base=3, rows=[(1, 5, 1)]) == [2]
    # A row that re-feeds a token before its drafts (pending 2) fits one draft fewer in the same width.
    assert Widths("cpu", forward=1e9).trim(batch=2, running=2, base=3, rows=[(2, 5, 1), (1, 2, 1)]) == [5, 2]
    assert Widths("cpu").trim(batch=1, running=1, base=1, rows=[]) == []


def test_rates_follow_the_verify_rounds():
    w = Widths("cpu")
    assert w.rate(3) == pytest.approx(0.9) and w.rate(2) == pytest.approx(0.6) and w.rate(0) == pytest.approx(0.7)
    assert w.rate(7) == pytest.approx(0.9)  # a longer n-gram: the longest one's prior
    rows = [(1, 10, 3)] * 8
    assert w.trim(8, 8, 1, rows) == [6] * 8  # q = 0.9: the 7th column no longer pays at batch 8
    for _ in range(20):
        w.observe(3, 10, 10)  # every draft accepted: 200 accepted, no rejection
    assert w.rate(3) == pytest.approx(218 / 220)
    assert w.trim(8, 8, 1, rows) == [10] * 8
    for _ in range(40):
        w.observe(3, 10, 0)  # now every first draft fails
    assert w.rate(3) == pytest.approx(218 / 260)
    assert w.rate(1) == pytest.approx(0.4)  # other sources keep their own rate
    # One draft each pays while (8 + 8 q) / (24 + 16) > 8 / (24 + 8), i.e. q > 0.25.
    for _ in range(400):
        w.observe(3, 10, 0)
    assert w.rate(3) == pytest.approx(218 / 660) and w.trim(8, 8, 1, rows) == [1] * 8
    for _ in range(600):
        w.observe(3, 10, 0)
    assert w.rate(3) == pytest.approx(218 / 1260) and w.trim(8, 8, 1, rows) == [0] * 8


@pytest.mark.parametrize("family", SOME)
def test_greedy_tokens_do_not_depend_on_the_width_chosen(family, monkeypatch):
    """Forward costs that make the cost model feed no drafts, some, or all of them: the tokens are the plain
    loop's every time, rows accept different counts in the same forward, and the chunk widths do change."""
    model = make_bridge(family)
    tokens, mask = batch(model, [*REPEATING, "abcdabcdab", "xyzxyzxy"])
    kw = dict(attention_mask=mask, max_new_tokens=20, return_dict=True)
    plain = model.generate(tokens, **kw)
    widths = {}
    for cost in (0.0, 24.0, 1e9):
        monkeypatch.setitem(speculative.FORWARD_POSITIONS, "cpu", cost)
        fed = Fed(model)
        with model.hooks(fwd_hooks=[("hook_embed", fed)]):
            fast = model.generate(tokens, prompt_lookup_num_tokens=4, **kw)
        assert same(fast, plain)
        widths[cost] = [max(map(len, p)) for _, _, p, _ in fed.seen[1:]]  # chunk widths after the prompt
        advances = _advances(fed, fast)
        if cost == 1e9:
            assert any(len(set(a.values())) > 1 for a in advances)  # rows accept different counts
            assert max(widths[cost]) == 5  # every draft fed
    assert max(widths[0.0]) < max(widths[1e9])
    assert len(set(map(tuple, widths.values()))) > 1


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return make_bridge(request.param)


def test_rejected_drafts_left_as_masked_columns_keep_the_tokens(family_model, monkeypatch):
    """A verify round may leave its rejected drafts in a dynamic cache as masked columns (`engine.HOLES` of
    them before it realigns; never with windowed attention): the tokens are the plain loop's whether the
    cache is realigned every round, every few rounds or never, and holes only ever widen the cache."""
    model = family_model
    monkeypatch.setitem(speculative.FORWARD_POSITIONS, "cpu", 1e9)  # every draft fed: many are rejected
    tokens, mask = batch(model, [*REPEATING, "abcdabcdab", "xyzxyzxy"])
    kw = dict(attention_mask=mask, max_new_tokens=16, return_dict=True)
    plain = model.generate(tokens, **kw)
    keys = {}
    point = "blocks.0.attn.hook_pattern"  # [batch, head, query, key]: the key axis is the cache's width
    hooks = point in model.hook_dict
    for holes in (0, 3, 1000):
        monkeypatch.setattr(engine, "HOLES", holes)
        seen = keys[holes] = [0]
        with model.hooks(fwd_hooks=[(point, lambda x, hook, seen=seen: seen.append(x.shape[-1]))] if hooks else []):
            fast = model.generate(tokens, prompt_lookup_num_tokens=4, **kw)
        assert same(fast, plain)
    assert max(keys[0]) <= tokens.shape[1] + 16 + 4  # realigned every round (the last chunk at most 4 past)
    assert max(keys[1000]) >= max(keys[0])
    if engine.windowed(model.hf_model.config):
        assert keys[1000] == keys[0]
    elif model.cfg.model_type == "llama":
        assert max(keys[1000]) > tokens.shape[1] + 16 + 4  # rejected drafts stayed: holes
