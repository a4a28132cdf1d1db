"""Oracle tests for the logits processors: HF's processors on unpadded rows, and left padding never counted."""

import doctest
import math
import re
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from transformer_bridge import versions
from transformer_bridge.generation import processors as processors_module
from transformer_bridge.generation.processors import (
    BadWords,
    FrequencyPresencePenalty,
    LogitBias,
    MinNewTokens,
    NoRepeatNGram,
    RepetitionPenalty,
)
from transformer_bridge.generation.sampler import build_processors
from transformer_bridge.generation.sampling import warp_logits

D_VOCAB = 11
PAD = 0  # deliberately also a real token id, as when the pad token is EOS


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def per_row(make_hf, rows: list[list[int]], scores: torch.Tensor) -> torch.Tensor:
    """The oracle for padded batches: a fresh HF processor on each row without its padding."""
    return torch.cat([make_hf()(torch.tensor([row]), scores[i : i + 1]) for i, row in enumerate(rows)])


def random_rows(seed: int, n_rows: int = 8, max_len: int = 12, n_tokens: int = 5) -> list[list[int]]:
    # Few distinct tokens make repeats, n-gram hits and bad-word prefixes common.
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n_rows,), generator=g).tolist()
    return [torch.randint(0, n_tokens, (n,), generator=g).tolist() for n in lengths]


def random_scores(seed: int, n_rows: int) -> torch.Tensor:
    return torch.randn(n_rows, D_VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_hf(penalty):
    ids = torch.randint(0, D_VOCAB, (5, 9), generator=torch.Generator().manual_seed(1))
    scores = random_scores(2, 5)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores)
    assert torch.equal(RepetitionPenalty(penalty)(ids, scores), expected)
    assert torch.equal(RepetitionPenalty(penalty)(ids, scores, torch.ones_like(ids)), expected)


def test_repetition_penalty_ignores_left_padding():
    rows = [*random_rows(3), [4, 2], [1]]
    ids, mask = left_pad(rows)
    scores = random_scores(4, len(rows))
    got = RepetitionPenalty(1.7)(ids, scores, mask)
    assert torch.equal(got, per_row(lambda: RepetitionPenaltyLogitsProcessor(1.7), rows, scores))
    if versions.HF_REPETITION_PENALTY_SKIPS_PADDING:
        # HF's own generate passes the first real position as `prompt_ignore_length`: same answer.
        first_real = (mask != 0).int().argmax(dim=1)
        hf_generate_style = RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=first_real)(ids, scores)
        assert torch.equal(got, hf_generate_style)
    else:
        # HF's generate before 5.23 ran it over the padded rows: the pad token of a padded row whose real tokens lack
        # it was penalised too. That column of those rows is the only difference.
        differs = got != RepetitionPenaltyLogitsProcessor(1.7)(ids, scores)
        only_in_padding = [len(row) < ids.shape[1] and PAD not in row for row in rows]
        assert differs[:, PAD].tolist() == only_in_padding and any(only_in_padding)
        assert differs.sum() == differs[:, PAD].sum()
    assert torch.equal(got[-1, PAD], scores[-1, PAD])


@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
def test_no_repeat_ngram_equals_hf(ngram_size):
    ids = torch.randint(0, 3, (6, 40), generator=torch.Generator().manual_seed(ngram_size))
    scores = random_scores(5, 6)
    expected = NoRepeatNGramLogitsProcessor(ngram_size)(ids, scores)
    assert torch.isinf(expected).any()
    assert torch.equal(NoRepeatNGram(ngram_size)(ids, scores), expected)


@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
def test_no_repeat_ngram_ignores_left_padding(ngram_size):
    rows = [*random_rows(10 + ngram_size), [3, PAD], [PAD, PAD], [4, PAD, PAD], [2]]
    ids, mask = left_pad(rows)
    scores = random_scores(6, len(rows))
    got = NoRepeatNGram(ngram_size)(ids, scores, mask)
    assert torch.equal(got, per_row(lambda: NoRepeatNGramLogitsProcessor(ngram_size), rows, scores))


def test_no_repeat_ngram_padding_case_is_meaningful():
    # [3, PAD] left-padded: HF on the padded row sees the n-grams (PAD, PAD) and (PAD, 3) and bans PAD and 3.
    ids, mask = left_pad([[3, PAD], [1, 2, 3, 4, 5]])
    scores = torch.zeros(2, D_VOCAB)
    assert torch.isinf(NoRepeatNGramLogitsProcessor(2)(ids, scores)[0]).sum() == 2
    assert torch.isfinite(NoRepeatNGram(2)(ids, scores, mask)[0]).all()


BAD_WORDS = [[2], [4, 1], [1, 1, 3], [PAD, PAD, 4], [PAD, 6], [3, 2, 1, 9]]


def test_bad_words_equals_hf():
    ids = torch.randint(0, 5, (8, 10), generator=torch.Generator().manual_seed(7))
    ids[0, -2:] = torch.tensor([1, 1])  # make sure the multi-token rules fire
    ids[1, -1] = 4
    scores = random_scores(8, 8)
    expected = NoBadWordsLogitsProcessor(BAD_WORDS)(ids, scores)
    assert torch.equal(BadWords(BAD_WORDS)(ids, scores), expected)
    assert torch.isinf(expected[0, 3]) and torch.isinf(expected[1, 1])


def test_bad_words_ignore_left_padding():
    rows = [*random_rows(9), [PAD], [3, PAD], [2, 1, 1], [3, 2, 1]]
    ids, mask = left_pad(rows)
    scores = random_scores(10, len(rows))
    got = BadWords(BAD_WORDS)(ids, scores, mask)
    assert torch.equal(got, per_row(lambda: NoBadWordsLogitsProcessor(BAD_WORDS), rows, scores))
    pad_only_prefix = len(rows) - 4  # real [PAD]: the (PAD, PAD) prefix of [PAD, PAD, 4] is half padding
    assert torch.isinf(NoBadWordsLogitsProcessor(BAD_WORDS)(ids, scores)[pad_only_prefix, 4])
    assert torch.isfinite(got[pad_only_prefix, 4])
    assert torch.isinf(got[pad_only_prefix, 6])  # while the real PAD still triggers [PAD, 6]


def test_bad_words_ban_eos_when_asked():
    # HF's generate silently drops a bad word that is exactly an EOS id; we ban what the user listed.
    scores = torch.zeros(1, D_VOCAB)
    procs = build_processors(prompt_length=1, eos_token_id=5, bad_words_ids=[[5]])
    assert torch.isinf(procs(torch.tensor([[1]]), scores)[0, 5])


def test_logit_bias_equals_hf_sequence_bias():
    bias = {3: 1.5, 7: -2.0, 10: -math.inf, 0: 0.25}
    ids = torch.randint(0, D_VOCAB, (4, 6), generator=torch.Generator().manual_seed(11))
    scores = random_scores(12, 4)
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(ids, scores)
    assert torch.equal(LogitBias(bias)(ids, scores), expected)


@pytest.mark.parametrize("eos", [3, [3, 9]])
def test_min_new_tokens_equals_hf(eos):
    prompt_length, scores = 4, random_scores(13, 3)
    for length in range(prompt_length, prompt_length + 5):
        ids = torch.randint(0, D_VOCAB, (3, length), generator=torch.Generator().manual_seed(length))
        expected = MinNewTokensLengthLogitsProcessor(prompt_length, 2, eos)(ids, scores)
        got = MinNewTokens(2, eos, prompt_length)(ids, scores, torch.ones_like(ids))
        assert torch.equal(got, expected)


def test_frequency_presence_penalty_counts_generated_real_tokens_only():
    prompts = [[1, 2, 2], [5], [PAD, 7]]
    ids, mask = left_pad(prompts)
    prompt_length = ids.shape[1]
    generated = torch.tensor([[2, 2, 4, 2], [5, PAD, PAD, PAD], [7, 7, 1, 3]])
    generated_mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]])  # row 1 finished, frozen to PAD
    ids, mask = torch.cat([ids, generated], 1), torch.cat([mask, generated_mask], 1)
    scores = random_scores(14, 3)
    got = FrequencyPresencePenalty(0.6, 1.1, prompt_length)(ids, scores, mask)
    expected = scores.clone()
    for row in range(3):
        counts = Counter(t for t, m in zip(generated[row].tolist(), generated_mask[row].tolist(), strict=True) if m)
        for token, count in counts.items():
            expected[row, token] -= 0.6 * count + 1.1
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert got[1, PAD] == scores[1, PAD]  # neither the padded prompt nor the frozen tail counts


def test_frequency_presence_penalty_before_any_generation_is_identity():
    ids, scores = torch.tensor([[1, 2, 2]]), random_scores(15, 1)
    assert torch.equal(FrequencyPresencePenalty(1.0, 1.0, prompt_length=3)(ids, scores), scores)


def test_user_hf_processors_pass_through_and_see_padding():
    rows = random_rows(16)
    ids, mask = left_pad(rows)
    scores = random_scores(17, len(rows))
    user = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.4), SuppressTokensLogitsProcessor([2])])
    procs = build_processors(prompt_length=ids.shape[1], logits_processor=user)
    assert torch.equal(procs(ids, scores, mask), user(ids, scores))


def test_build_processors_order():
    procs = build_processors(
        prompt_length=3,
        eos_token_id=1,
        logit_bias={2: 1.0},
        repetition_penalty=1.2,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        no_repeat_ngram_size=2,
        bad_words_ids=[[4]],
        min_new_tokens=2,
        logits_processor=[SuppressTokensLogitsProcessor([3])],
    )
    assert [type(p).__name__ for p in procs] == [
        "LogitBias",
        "RepetitionPenalty",
        "FrequencyPresencePenalty",  # frequency
        "FrequencyPresencePenalty",  # presence
        "NoRepeatNGram",
        "BadWords",
        "MinNewTokens",
        "HFProcessors",  # the user's list, one entry per processor
    ]


def test_neutral_arguments_build_nothing():
    procs = build_processors(
        prompt_length=3,
        eos_token_id=1,
        logit_bias={},
        repetition_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0,
        no_repeat_ngram_size=0,
        bad_words_ids=[],
        min_new_tokens=0,
        logits_processor=[],
    )
    assert list(procs) == []
    assert list(build_processors(prompt_length=3, min_new_tokens=5)) == []  # no EOS: nothing to forbid


def test_full_pipeline_equals_hfs_own_builder():
    # HF's (private) builder is the authority on which processors run and in which order.
    config = GPT2Config(
        vocab_size=D_VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=1
    )
    model = GPT2LMHeadModel(config)
    if not hasattr(model, "_get_logits_processor"):
        pytest.skip("this transformers version has no `_get_logits_processor`")
    sampling = {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "min_p": 0.02}
    generation_config = GenerationConfig(
        do_sample=True,
        eos_token_id=1,
        sequence_bias=[[[3], 1.0], [[9], -0.5]],
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        bad_words_ids=[[5], [4, 6]],
        min_new_tokens=2,
        **sampling,
    )
    generation_config._eos_token_tensor = torch.tensor([1])  # what `generate` sets up before building
    prompt_length = 4
    ids = torch.randint(0, 7, (5, prompt_length + 3), generator=torch.Generator().manual_seed(18))
    ours = build_processors(
        prompt_length=prompt_length,
        d_vocab=D_VOCAB,
        eos_token_id=1,
        logit_bias={3: 1.0, 9: -0.5},
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        bad_words_ids=[[5], [4, 6]],
        min_new_tokens=2,
    )
    hf = model._get_logits_processor(
        generation_config=generation_config,
        input_ids_seq_length=prompt_length,
        model_kwargs={"attention_mask": torch.ones_like(ids)},
    )
    for length in range(prompt_length, ids.shape[1] + 1):
        step_ids, scores = ids[:, :length], random_scores(length, 5)
        expected = hf(step_ids, scores)
        got = warp_logits(ours(step_ids, scores, torch.ones_like(step_ids)), **sampling)
        assert torch.equal(got, expected)


def test_processors_leave_inputs_untouched():
    ids, mask = left_pad(random_rows(19))
    scores = random_scores(20, ids.shape[0])
    before = (ids.clone(), mask.clone(), scores.clone())
    procs = build_processors(
        prompt_length=4,
        eos_token_id=1,
        logit_bias={2: 1.0},
        repetition_penalty=1.2,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        no_repeat_ngram_size=2,
        bad_words_ids=[[4], [1, 2]],
        min_new_tokens=20,
    )
    procs(ids, scores, mask)
    assert all(torch.equal(a, b) for a, b in zip((ids, mask, scores), before, strict=True))


def test_numpy_integer_token_ids_are_accepted():
    procs = build_processors(prompt_length=1, bad_words_ids=[[np.int64(4)]], eos_token_id=np.int64(1))
    assert torch.isinf(procs(torch.tensor([[2]]), torch.zeros(1, D_VOCAB))[0, 4])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.2}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"presence_penalty": "0.5"}, "presence_penalty"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"no_repeat_ngram_size": 2.5}, "no_repeat_ngram_size"),
        ({"bad_words_ids": [[]]}, "bad_words_ids"),
        ({"bad_words_ids": [1, 2]}, "bad_words_ids"),
        ({"bad_words_ids": "abc"}, "bad_words_ids"),
        ({"bad_words_ids": [[1, -2]]}, "bad_words_ids"),
        ({"bad_words_ids": [[1, D_VOCAB]], "d_vocab": D_VOCAB}, "bad_words_ids"),
        ({"logit_bias": {D_VOCAB: 1.0}, "d_vocab": D_VOCAB}, "logit_bias"),
        ({"logit_bias": {1: math.nan}}, "logit_bias"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": [(1, 2.0)]}, "logit_bias"),
        ({"min_new_tokens": -1, "eos_token_id": 1}, "min_new_tokens"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"eos_token_id": D_VOCAB, "d_vocab": D_VOCAB}, "eos_token_id"),
        ({"eos_token_id": "</s>"}, "eos_token_id"),
        ({"prompt_length": -1}, "prompt_length"),
        ({"d_vocab": 0}, "d_vocab"),
        ({"logits_processor": [1]}, "logits_processor"),
        ({"logits_processor": SuppressTokensLogitsProcessor([1])}, "logits_processor"),
    ],
    ids=lambda v: re.sub(r" at 0x[0-9a-f]+", "", str(v)),  # no addresses: xdist workers compare ids
)
def test_invalid_arguments_raise_naming_the_parameter(kwargs, name):
    kwargs = {"prompt_length": 3, **kwargs}
    with pytest.raises(ValueError, match=f"`{name}`"):
        build_processors(**kwargs)


@pytest.mark.parametrize(
    ("processor", "name"), [(BadWords([[1, 20]]), "bad_words_ids"), (LogitBias({20: 1.0}), "logit_bias")]
)
def test_token_ids_past_the_logits_raise_at_first_call(processor, name):
    with pytest.raises(ValueError, match=f"`{name}`.*20"):
        processor(torch.tensor([[1]]), torch.zeros(1, D_VOCAB))


def test_docstring_examples_run():
    assert doctest.testmod(processors_module).failed == 0
