"""The assistant drafter keeps the draft model's KV cache across rounds (`speculative.Assistant`): its drafts
equal a full greedy `generate` of the draft model over each row's whole sequence (the drafter this replaced),
round after round, with rejections, forced tokens, backtracks, forks, rows that skip a round and rows that
finish; each round feeds the draft only the new tokens; the output is the non-speculative output."""

import random

import pytest
import torch
from conftest import make_bridge
from test_control import Script, mixed_script

from transformer_bridge.generation.speculative import Assistant

PROMPTS = ["Hello world, this is", "Hi", "The cat sat on the mat"]
SOME = ["llama", "gpt2", "gemma3_text"]  # GQA, learned positions, a sliding window (4 tokens)


def full_drafts(draft, rows: list[list[int]], k: int) -> list[list[int]]:
    """The oracle: the draft model's greedy continuation of each row, from scratch (left-padded batch)."""
    width = max(len(r) for r in rows)
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = draft.generate(tokens, attention_mask=mask, max_new_tokens=k, do_sample=False, stop_at_eos=False,
                         pad_token_id=0, return_type="tokens")  # fmt: skip
    return out[:, width:].tolist()


@pytest.mark.parametrize("family", SOME)
def test_cached_drafts_equal_full_recompute_over_rounds(family):
    draft = make_bridge(family, seed=3)
    rng = random.Random(0)
    k = 4
    rows = {i: draft.to_tokens(p)[0].tolist() for i, p in enumerate(PROMPTS)}
    assistant = Assistant(draft, k)
    next_id, skipped = len(rows), set()
    seen = {"reject": 0, "all": 0, "forced": 0, "back": 0, "fork": 0, "skip": 0, "finish": 0}
    moves = ["reject", "all", "forced", "back", "fork", "reject", "skip", "finish"]
    for step in range(12):
        ids = [i for i in rows if i not in skipped]
        drafts = assistant.propose([rows[i] for i in ids], k, ids)
        assert drafts == full_drafts(draft, [rows[i] for i in ids], k)
        assert all(len(d) == k for d in drafts)
        skipped = set()
        for n, (i, d) in enumerate(zip(ids, drafts, strict=True)):
            move = moves[(step + n) % len(moves)]
            if move == "finish" and len(rows) > 2:
                del rows[i]
                seen["finish"] += 1
                continue
            j = rng.randrange(k)
            if move == "all":  # every draft accepted, then the bonus token
                rows[i] += [*d, rng.randrange(4, 90)]
            elif move == "forced":  # a few drafts, then forced tokens of a controller
                rows[i] += d[:j] + [rng.randrange(4, 90) for _ in range(3)]
            elif move == "back":  # a controller backtracks past tokens the draft has cached
                rows[i] = [*rows[i][: max(len(rows[i]) - 3, 2)], rng.randrange(4, 90)]
            else:  # the first j drafts accepted, then the target's own token
                rows[i] += [*d[:j], (d[j] + 1 + rng.randrange(80)) % 90 + 4]
            if move == "fork":
                rows[next_id] = [*rows[i][:-1], (rows[i][-1] + 7) % 90 + 4]
                next_id += 1
            if move == "skip":
                skipped.add(i)
            seen[move if move != "finish" else "reject"] += 1
    assert all(seen.values()), seen


@pytest.mark.parametrize("family", SOME)
def test_a_round_feeds_the_draft_only_the_new_tokens(family):
    """A copy of the target as the assistant (every draft accepted): after the prompt each draft forward is at
    most 2 tokens wide (the last draft, never fed, and the bonus token), and a round is ``k`` draft forwards."""
    model, copy = make_bridge(family), make_bridge(family)
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    plain = model.generate(tokens, attention_mask=mask, max_new_tokens=21, stop_at_eos=False)
    widths, verify = [], []
    with (copy.hooks(fwd_hooks=[("hook_embed", lambda x, hook: widths.append(x.shape[1]))]),
          model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: verify.append(hook.ctx.kind))])):  # fmt: skip
        fast = model.generate(tokens, attention_mask=mask, max_new_tokens=21, stop_at_eos=False,
                              assistant_model=copy, num_assistant_tokens=4)  # fmt: skip
    assert torch.equal(fast, plain)
    rounds = verify.count("verify")
    assert rounds == 4 and len(widths) == 4 * rounds  # 1 + 5 * 4 = 21 tokens; k draft forwards a round
    assert widths[0] == tokens.shape[1] + 1 and max(widths[1:]) == 2  # the prompt and the first token


@pytest.mark.parametrize("family", SOME)
def test_assistant_with_a_controller_gives_the_plain_output(family):
    """Backtracks, forced tokens and forks (test_control's script): forked rows and rows that wait a round
    (a deferred sample) rebuild or rejoin the draft's rows; the tokens are the ones without speculation."""
    model = make_bridge(family)
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    outs = []
    for extra in ({}, {"assistant_model": make_bridge(family, seed=3), "num_assistant_tokens": 3},
                  {"assistant_model": make_bridge(family), "num_assistant_tokens": 3}):  # fmt: skip
        c = Script(mixed_script(model.cfg.d_vocab))
        outs.append(model.generate(tokens, attention_mask=mask, max_new_tokens=12, controller=c, return_dict=True,
                                   **extra))  # fmt: skip
    plain = outs[0]
    keep = [i for i, r in enumerate(plain.finish_reasons) if r != "max_steps"]  # budgets count forwards
    assert len(plain) > 3 and len(keep) >= 3
    for out in outs[1:]:
        assert out.parents == plain.parents
        assert torch.equal(out.sequences[keep], plain.sequences[keep])
