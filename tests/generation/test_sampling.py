"""Oracle tests for the sampling warpers: HF's own warpers, HF's own builder order, and sampling statistics."""

import doctest
import math

import pytest
import torch
from transformers import (
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from transformer_bridge.generation import sampling
from transformer_bridge.generation.sampling import greedy, sample, validate_sampling_args, warp_logits

D_VOCAB = 53
WARPER_CASES = [
    {"temperature": 0.7},
    {"temperature": 1.6},
    {"top_k": 1},
    {"top_k": 7},
    {"top_k": D_VOCAB + 5},
    {"top_p": 0.05},
    {"top_p": 0.6},
    {"top_p": 0.95},
    {"min_p": 0.05},
    {"min_p": 0.5},
    {"min_p": 1.0},
    {"typical_p": 0.2},
    {"typical_p": 0.9},
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 30, "top_p": 0.8, "min_p": 0.05, "typical_p": 0.7},
    {"temperature": 0.5, "top_p": 0.9, "min_p": 0.1},
]


def hf_warpers(temperature=1.0, top_k=None, top_p=None, min_p=None, typical_p=None) -> LogitsProcessorList:
    """HF's warpers with HF's skip conditions, in the order of `GenerationMixin._get_logits_processor`."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p))
    if typical_p is not None and typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(typical_p))
    return warpers


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    smooth = torch.randn(6, D_VOCAB, generator=g) * 2.0
    # Coarse values create ties at the top-k / nucleus boundary, where HF's exact comparison rules matter.
    tied = torch.randint(-3, 4, (4, D_VOCAB), generator=g).float()
    # Upstream processors leave -inf (banned tokens); warpers must treat them as probability 0.
    banned = torch.randn(2, D_VOCAB, generator=g).masked_fill(torch.rand(2, D_VOCAB, generator=g) < 0.4, -math.inf)
    return torch.cat([smooth, tied, banned])


@pytest.mark.parametrize("kwargs", WARPER_CASES, ids=str)
def test_warp_logits_equals_hf_warpers(logits, kwargs):
    expected = hf_warpers(**kwargs)(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits)
    got = warp_logits(logits, **kwargs)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got, expected)


def test_warper_order_is_hfs_own(logits):
    # HF's (private) builder is the authority on order; a tiny GPT-2 is enough to call it.
    config = GPT2Config(
        vocab_size=D_VOCAB, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=1
    )
    model = GPT2LMHeadModel(config)
    if not hasattr(model, "_get_logits_processor"):
        pytest.skip("this transformers version has no `_get_logits_processor`")
    kwargs = {"temperature": 1.3, "top_k": 30, "top_p": 0.8, "min_p": 0.05, "typical_p": 0.7}
    generation_config = GenerationConfig(do_sample=True, **kwargs)
    processors = model._get_logits_processor(generation_config=generation_config, input_ids_seq_length=1)
    names = [type(p).__name__ for p in processors]
    assert names == [type(p).__name__ for p in hf_warpers(**kwargs)]
    expected = processors(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits)
    assert torch.equal(warp_logits(logits, **kwargs), expected)


def test_warp_logits_leaves_input_untouched(logits):
    before = logits.clone()
    warp_logits(logits, temperature=0.5, top_k=5, top_p=0.5, min_p=0.1, typical_p=0.5)
    assert torch.equal(logits, before)


def test_half_precision_logits_are_warped_in_float32(logits):
    half = logits.to(torch.bfloat16)
    got = warp_logits(half, top_p=0.7, min_p=0.1)
    assert got.dtype == torch.float32
    assert torch.equal(got, warp_logits(half.float(), top_p=0.7, min_p=0.1))


def test_temperature_zero_is_argmax_and_uses_no_randomness(logits):
    g = torch.Generator().manual_seed(3)
    generator_state, global_state = g.get_state(), torch.get_rng_state()
    tokens = sample(logits, temperature=0.0, top_p=0.5, generator=g)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert torch.equal(g.get_state(), generator_state)
    assert torch.equal(torch.get_rng_state(), global_state)
    one_hot = warp_logits(logits, temperature=0.0)
    assert torch.equal(torch.isfinite(one_hot).sum(-1), torch.ones(logits.shape[0], dtype=torch.long))
    assert torch.equal(one_hot.argmax(-1), logits.argmax(-1))


def test_same_seed_same_samples_and_global_rng_untouched(logits):
    global_state = torch.get_rng_state()
    draws = [
        sample(logits, temperature=0.9, top_p=0.9, generator=torch.Generator().manual_seed(seed))
        for seed in (11, 11, 12)
    ]
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


def test_sample_is_hfs_multinomial_step(logits):
    # HF's sampling step is softmax → torch.multinomial(probs, 1); same generator state → same tokens.
    kwargs = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
    scores = hf_warpers(**kwargs)(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits)
    expected = torch.multinomial(scores.softmax(-1), 1, generator=torch.Generator().manual_seed(5)).squeeze(1)
    assert torch.equal(sample(logits, **kwargs, generator=torch.Generator().manual_seed(5)), expected)


# A 6-token vocabulary with distinct probabilities (≈ .41 .25 .15 .09 .06 .03) and 50k draws in one batch:
# the standard error of a frequency is at most 0.0022, so 0.01 is a > 4 sigma bound.
SMALL_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.1, -0.6])
N_DRAWS = 50_000
STAT_CASES = [
    ({"temperature": 1.0}, None),
    ({"temperature": 0.6}, None),
    ({"top_k": 3}, {0, 1, 2}),
    ({"top_p": 0.7}, {0, 1, 2}),
    ({"top_p": 0.4}, {0}),
    ({"min_p": 0.3}, {0, 1, 2}),
    ({"typical_p": 0.5}, {0, 1, 2}),
    # Typical sampling can drop the most likely token: here token 0 is further from the entropy than 1 and 2.
    ({"typical_p": 0.3}, {1, 2}),
    ({"temperature": 1.5, "top_k": 4, "top_p": 0.8}, {0, 1, 2}),
]


@pytest.mark.parametrize(("kwargs", "support"), STAT_CASES, ids=[str(k) for k, _ in STAT_CASES])
def test_empirical_distribution_matches_processed_softmax(kwargs, support):
    logits = SMALL_LOGITS.expand(N_DRAWS, -1)
    tokens = sample(logits, **kwargs, generator=torch.Generator().manual_seed(1234))
    expected = warp_logits(SMALL_LOGITS[None], **kwargs).softmax(-1)[0]
    if support is not None:
        # The support is hand-computed from the probabilities above, independently of `warp_logits`.
        assert set(torch.nonzero(expected).flatten().tolist()) == support
        assert set(tokens.unique().tolist()) <= support
    empirical = torch.bincount(tokens, minlength=SMALL_LOGITS.numel()).float() / N_DRAWS
    assert (empirical - expected).abs().max() < 0.01


def test_min_p_never_samples_below_threshold():
    probs = SMALL_LOGITS.softmax(-1)
    tokens = sample(SMALL_LOGITS.expand(N_DRAWS, -1), min_p=0.3, generator=torch.Generator().manual_seed(9))
    assert (probs[tokens] >= 0.3 * probs.max()).all()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 2},
        {"top_k": 0},
        {"top_k": None},
        {"top_k": 5},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"typical_p": 1.0},
        {"typical_p": 0.01},
    ],
    ids=str,
)
def test_valid_arguments_pass(kwargs):
    assert validate_sampling_args(**kwargs) is None


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"typical_p": 0.0}, "typical_p"),
        ({"typical_p": 2.0}, "typical_p"),
    ],
    ids=str,
)
def test_invalid_arguments_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`") as info:
        validate_sampling_args(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_docstring_examples_run():
    assert doctest.testmod(sampling).failed == 0
