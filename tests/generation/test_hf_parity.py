"""HF's and TransformerLens' `generate` habits against HF's own `generate` on the same tiny models.

Input forms (``input_ids``, a tokenizer's output, right padding, no prompt), generation configs (the
caller's and the model's own), HF's lengths and HF-shaped outputs (``scores`` / ``logits``), TL's
keywords (``use_past_kv_cache``, ``freq_penalty``), keyword errors, and `generate_stream`.
"""

import inspect
import math
import warnings

import pytest
import torch
from conftest import V, char_tokenizer, make_bridge
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from transformer_bridge import versions
from transformer_bridge.generation import generate, generate_stream, options, resolve

PROMPTS = ["Hello world, this is", "Hi", "The cat sat"]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return make_bridge(request.param)


@pytest.fixture(scope="module")
def llama():
    """A bridge the tests below leave as they found it (tests that change its config make their own)."""
    return make_bridge("llama")


def left_tokenizer():
    tok = char_tokenizer()
    tok.padding_side = "left"
    return tok


def hf(model, tokens, mask=None, **kw):
    return model.hf_model.generate(tokens, attention_mask=mask, **{"do_sample": False, **kw})


def real_new(out):
    """Each row's real generated tokens (a `GenerationOutput`)."""
    rows, keep = out.new_tokens.tolist(), out.attention_mask[:, out.prompt_width :].bool().tolist()
    return [[t for t, k in zip(r, m, strict=True) if k] for r, m in zip(rows, keep, strict=True)]


# -- the prompt ------------------------------------------------------------------------------------
def test_input_ids_and_tokenizer_output_equal_hf(model):
    enc = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    expected = hf(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=8)
    assert torch.equal(model.generate(**enc, max_new_tokens=8), expected)
    assert torch.equal(model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                      max_new_tokens=8), expected)  # fmt: skip
    assert torch.equal(model.generate(inputs=enc["input_ids"], attention_mask=enc["attention_mask"],
                                      max_new_tokens=8), expected)  # fmt: skip
    assert torch.equal(model.generate(enc, max_new_tokens=8), expected)  # the tokenizer output, unpacked for you


def test_right_padded_rows_give_the_tokens_of_left_padded_ones(model):
    right = char_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    assert right["attention_mask"][:, -1].eq(0).any()  # the tokenizer pads on the right by default
    left = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(**right, max_new_tokens=8, return_dict=True)
    expected = model.generate(**left, max_new_tokens=8, return_dict=True)
    assert torch.equal(out.sequences, expected.sequences) and torch.equal(out.attention_mask, expected.attention_mask)
    assert torch.equal(out.sequences, hf(model, left["input_ids"], left["attention_mask"], max_new_tokens=8))
    for i, prompt in enumerate(PROMPTS):
        alone = model.generate(**char_tokenizer()(prompt, return_tensors="pt"), max_new_tokens=8, return_dict=True)
        assert real_new(alone)[0] == real_new(out)[i]


def test_left_aligned_moves_each_row_and_keeps_holes_as_hf(llama):
    model = llama
    tokens, mask = (
        torch.tensor([[5, 6, 0, 0], [7, 8, 9, 4], [0, 3, 4, 0]]),
        torch.tensor([[1, 1, 0, 0], [1] * 4, [0, 1, 1, 0]]),
    )
    moved, moved_mask = resolve.left_aligned(model, tokens, mask)
    assert moved.tolist() == [[0, 0, 5, 6], [7, 8, 9, 4], [0, 0, 3, 4]]
    assert moved_mask.tolist() == [[0, 0, 1, 1], [1] * 4, [0, 0, 1, 1]]
    # A masked token between real ones stays where it is (positions count real tokens), as in HF's generate,
    # and the tokens are those of the prompt without it; the row driver refuses such a mask.
    gapped, gap_mask = torch.tensor([[5, 6, 9, 7, 8]]), torch.tensor([[1, 1, 0, 1, 1]])
    ours = model.generate(gapped, attention_mask=gap_mask, max_new_tokens=4)
    hf = model.hf_model.generate(gapped, attention_mask=gap_mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours, hf)
    compact = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4)
    assert torch.equal(ours[:, 5:], compact[:, 4:])
    with pytest.raises(ValueError, match="padding between real tokens; a controller"):
        model.generate(gapped, attention_mask=gap_mask, max_new_tokens=2, controller=lambda view: None)


def test_token_type_ids_of_zeros_are_ignored_others_refused(llama):
    model = llama
    enc = char_tokenizer()("Hi there", return_tensors="pt", return_token_type_ids=True)
    assert "token_type_ids" in enc and not enc["token_type_ids"].any()
    assert torch.equal(model.generate(**enc, max_new_tokens=4), model.generate(enc["input_ids"], max_new_tokens=4))
    with pytest.raises(ValueError, match=r"`token_type_ids`.*non-zero"):
        model.generate(enc["input_ids"], token_type_ids=torch.ones_like(enc["input_ids"]), max_new_tokens=2)


def test_no_prompt_starts_from_bos_as_hf(llama):
    model = llama
    assert torch.equal(model.generate(max_new_tokens=5), model.hf_model.generate(max_new_tokens=5, do_sample=False))


def test_the_prompt_given_twice_raises(llama):
    model = llama
    with pytest.raises(ValueError, match="`input`, `input_ids`"):
        model.generate(torch.tensor([[1, 5]]), input_ids=torch.tensor([[1, 5]]), max_new_tokens=2)


# -- lengths ---------------------------------------------------------------------------------------
def test_max_length_counts_the_prompt_and_max_new_tokens_wins(llama):
    model = llama
    enc = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    width = enc["input_ids"].shape[1]
    out = model.generate(**enc, max_length=width + 6, stop_at_eos=False)
    assert out.shape[1] == width + 6
    assert torch.equal(out, hf(model, enc["input_ids"], enc["attention_mask"], max_length=width + 6, eos_token_id=[]))
    with pytest.warns(UserWarning, match="`max_new_tokens` takes precedence") as caught:
        both = model.generate(**enc, max_length=width + 6, max_new_tokens=3, stop_at_eos=False)
    assert both.shape[1] == width + 3 and caught[0].filename == __file__
    with pytest.raises(ValueError, match=r"`max_length`=3 counts the prompt"):
        model.generate(**enc, max_length=3)


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`")  # HF's, for HF's own call
def test_default_length_is_twenty_new_tokens_capped_by_the_context(llama):
    model = llama
    prompt = torch.full((1, 120), 7)
    assert model.generate(torch.tensor([[1, 5]]), stop_at_eos=False).shape == (1, 22)
    assert model.generate(prompt, stop_at_eos=False).shape == (1, 128)  # n_ctx 128, as HF's max_length cap
    assert torch.equal(model.generate(prompt, stop_at_eos=False), hf(model, prompt, eos_token_id=[]))


def test_min_length_equals_hf():
    model = make_bridge("qwen2")
    enc = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    width = enc["input_ids"].shape[1]
    bias = {2: 8.0}  # EOS made likely, so the ban shows
    ours = model.generate(**enc, min_length=width + 4, max_new_tokens=8, logit_bias=bias, return_dict=True)
    theirs = hf(model, enc["input_ids"], enc["attention_mask"], min_length=width + 4, max_new_tokens=8,
                logits_processor=LogitsProcessorList([SequenceBiasLogitsProcessor({(2,): 8.0})]))  # fmt: skip
    assert torch.equal(ours.sequences, theirs) and min(ours.new_lengths.tolist()) >= 5


# -- generation configs ----------------------------------------------------------------------------
def test_generation_config_argument_and_keywords_override_it(llama):
    model = llama
    enc = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    config = GenerationConfig(max_new_tokens=9, repetition_penalty=1.5, no_repeat_ngram_size=2)
    theirs = model.hf_model.generate(**enc, generation_config=config)
    assert torch.equal(model.generate(**enc, generation_config=config), theirs)
    theirs = model.hf_model.generate(**enc, generation_config=config, max_new_tokens=4, repetition_penalty=1.0)
    assert torch.equal(
        model.generate(**enc, generation_config=config, max_new_tokens=4, repetition_penalty=1.0), theirs
    )


def test_the_models_generation_config_supplies_defaults_as_in_hf():
    model = make_bridge("llama")
    enc = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    gc = model.hf_model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.max_new_tokens = True, 0.6, 0.9, 7
    for kw in [{}, {"temperature": 1.3}, {"top_k": 5}]:
        torch.manual_seed(11)
        theirs = model.hf_model.generate(**enc, **kw)
        torch.manual_seed(11)
        ours = model.generate(**enc, **kw)
        assert torch.equal(ours, theirs) and ours.shape[1] == enc["input_ids"].shape[1] + 7, kw
    greedy = model.generate(**enc, do_sample=False)  # an explicit keyword wins over the config
    assert torch.equal(greedy, model.hf_model.generate(**enc, do_sample=False))


def test_the_models_eos_pad_and_max_length_apply_as_in_hf():
    model = make_bridge("gpt2")
    enc = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    width = enc["input_ids"].shape[1]
    free = model.generate(**enc, max_new_tokens=10, stop_at_eos=False)
    gc = model.hf_model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.max_length = int(free[0, width + 2]), 5, width + 10
    out = model.generate(**enc, return_dict=True)
    assert torch.equal(out.sequences, model.hf_model.generate(**enc, do_sample=False))
    assert out.finish_reasons[0] == "eos" and out.sequences[0, -1].item() == 5


def test_processor_fields_of_either_config_are_honoured_as_in_hf():
    model = make_bridge("llama")
    tokens = torch.tensor([[1, 5, 6]])
    free = model.generate(tokens, max_new_tokens=4)
    banned = free[0, 3:5].tolist()
    config = GenerationConfig(suppress_tokens=banned)
    ours = model.generate(tokens, max_new_tokens=4, generation_config=config)
    assert torch.equal(ours, model.hf_model.generate(tokens, max_new_tokens=4, generation_config=config))
    assert not set(ours[0, 3:].tolist()) & set(banned)
    model.hf_model.generation_config.suppress_tokens = banned
    try:
        assert torch.equal(model.generate(tokens, max_new_tokens=4), ours)
    finally:
        model.hf_model.generation_config.suppress_tokens = None


def test_unsupported_config_fields_raise_for_the_callers_config_and_warn_for_the_models():
    model = make_bridge("llama")
    with pytest.raises(ValueError, match=r"`generation_config.penalty_alpha`=0.6.*contrastive search"):
        model.generate(torch.tensor([[1, 5]]), generation_config=GenerationConfig(penalty_alpha=0.6, top_k=4))
    model.hf_model.generation_config.penalty_alpha = 0.6
    with pytest.warns(UserWarning, match=r"generation_config.penalty_alpha`=0.6 is ignored") as caught:
        model.generate(torch.tensor([[1, 5]]), max_new_tokens=2)
    assert caught[0].filename == __file__
    model.hf_model.generation_config.cache_implementation = "hybrid"  # Gemma2's: a cache choice, tokens unchanged
    model.hf_model.generation_config.penalty_alpha = None
    model._warned_greedy = True  # TransformerLens' sampling default: tests/compat/test_tl_warnings.py
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(torch.tensor([[1, 5]]), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"`generation_config` must be a transformers GenerationConfig.*Build one"):
        model.generate(torch.tensor([[1, 5]]), generation_config={"top_k": 3})


# -- HF-shaped outputs -----------------------------------------------------------------------------
class RowRepetitionPenalty(LogitsProcessor):
    """HF's repetition penalty over each row's tokens after its left padding: what HF's generate runs from 5.23 on
    (`versions.HF_REPETITION_PENALTY_SKIPS_PADDING`), built from HF's own processor for the releases before."""

    def __init__(self, penalty: float, mask: torch.Tensor):
        self.penalty, self.first_real = RepetitionPenaltyLogitsProcessor(penalty), (mask != 0).int().argmax(dim=1)

    def __call__(self, input_ids, scores):
        rows = zip(input_ids, scores, self.first_real.tolist(), strict=True)
        return torch.cat([self.penalty(ids[None, first:], row[None]) for ids, row, first in rows])


def test_return_dict_in_generate_scores_and_logits_equal_hf_greedy(model):
    enc = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=6, return_dict_in_generate=True, output_scores=True, output_logits=True,
              repetition_penalty=1.3)  # fmt: skip
    ours = model.generate(**enc, **kw)
    if versions.HF_REPETITION_PENALTY_SKIPS_PADDING:
        theirs = hf(model, enc["input_ids"], enc["attention_mask"], **kw)
    else:  # HF's own penalty counted the pad token of padded rows: the bridge never counts padding
        processors = LogitsProcessorList([RowRepetitionPenalty(1.3, enc["attention_mask"])])
        theirs = hf(model, enc["input_ids"], enc["attention_mask"], **{**kw, "repetition_penalty": None},
                    logits_processor=processors)  # fmt: skip
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.scores) == len(theirs.scores) == len(ours.logits) == ours.new_tokens.shape[1]
    for step, (s, t, lo, lt) in enumerate(zip(ours.scores, theirs.scores, ours.logits, theirs.logits, strict=True)):
        running = ours.attention_mask[:, ours.prompt_width + step].bool()
        torch.testing.assert_close(s[running], t[running])
        torch.testing.assert_close(lo[running], lt[running])
    scores = model.hf_model.compute_transition_scores(ours.sequences, ours.scores)  # HF's tools take ours
    torch.testing.assert_close(scores, model.hf_model.compute_transition_scores(theirs.sequences, theirs.scores))


def test_sampled_scores_are_the_warped_ones_as_in_hf(llama):
    model = llama
    enc = left_tokenizer()(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=5, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, return_dict_in_generate=True,
              output_scores=True)  # fmt: skip
    torch.manual_seed(3)
    ours = model.generate(**enc, **kw)
    torch.manual_seed(3)
    theirs = model.hf_model.generate(**enc, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (s, t) in enumerate(zip(ours.scores, theirs.scores, strict=True)):
        running = ours.attention_mask[:, ours.prompt_width + step].bool()
        torch.testing.assert_close(s[running], t[running])
        assert s[running].isinf().any()  # truncated tokens are -inf, as HF's


def test_return_dict_keeps_the_stacked_logits_and_beams_take_return_dict_in_generate(llama):
    model = llama
    tokens = torch.tensor([[1, 40, 50, 60]])
    out = model.generate(tokens, max_new_tokens=3, return_dict=True, output_logits=True, output_scores=True)
    assert out.logits.shape == (1, 3, V) and len(out.scores) == 3
    torch.testing.assert_close(torch.stack(out.scores, 1), out.logits)  # greedy, no processors: scores = logits
    beams = model.generate(tokens, max_new_tokens=4, num_beams=3, return_dict_in_generate=True)
    theirs = hf(model, tokens, max_new_tokens=4, num_beams=3, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(beams.sequences, theirs.sequences)
    torch.testing.assert_close(beams.sequences_scores, theirs.sequences_scores)
    # TransformerLens 4's rule: `output_scores` / `output_logits` alone return what `return_dict_in_generate=True`
    # returns (HF's tuples); said False explicitly, the flag is refused (HF would ignore it).
    for flag in ("output_scores", "output_logits"):
        alone = model.generate(tokens, max_new_tokens=3, **{flag: True})
        theirs = hf(model, tokens, max_new_tokens=3, return_dict_in_generate=True, **{flag: True})
        assert torch.equal(alone.sequences, theirs.sequences)
        records = getattr(alone, flag.removeprefix("output_"))
        assert isinstance(records, tuple) and len(records) == 3
        for mine, hfs in zip(records, getattr(theirs, flag.removeprefix("output_")), strict=True):
            torch.testing.assert_close(mine, hfs)
    with pytest.raises(ValueError, match=r"`output_scores`.*`return_dict=True` \(or HF's `return_dict_in_generate"):
        model.generate(tokens, max_new_tokens=2, output_scores=True, return_dict_in_generate=False)
    with pytest.raises(ValueError, match=r"`top_logprobs`.*`return_dict=True`"):
        model.generate(tokens, max_new_tokens=2, top_logprobs=2)  # this library's record: no TransformerLens rule


# -- TransformerLens keywords ----------------------------------------------------------------------
def test_use_past_kv_cache_is_use_cache():
    model = make_bridge("gpt2")
    tokens = torch.tensor([[1, 40, 50, 60], [1, 9, 8, 7]])
    kw = dict(max_new_tokens=5, return_dict=True, output_logits=True)
    off = model.generate(tokens, use_past_kv_cache=False, **kw)
    ref = model.generate(tokens, use_cache=False, **kw)
    assert torch.equal(off.sequences, ref.sequences) and torch.equal(off.logits, ref.logits)
    with pytest.raises(ValueError, match="`use_cache`=True and `use_past_kv_cache`=False disagree"):
        model.generate(tokens, use_cache=True, use_past_kv_cache=False, max_new_tokens=2)


class TLFreqPenalty(LogitsProcessor):
    """TransformerLens' sampler step, written as TL writes it: ``logits / temperature - penalty * count``."""

    def __init__(self, penalty, temperature):
        self.penalty, self.temperature = penalty, temperature

    def __call__(self, input_ids, scores):
        counts = torch.stack([torch.bincount(row, minlength=scores.shape[-1]) for row in input_ids])
        return scores / self.temperature - self.penalty * counts


def test_freq_penalty_is_transformer_lens_penalty_after_temperature(llama):
    model = llama
    tokens = torch.tensor([[1, 40, 40, 40, 50], [1, 9, 9, 8, 8]])  # unpadded: TL counts every position
    ours_kw = dict(max_new_tokens=6, temperature=0.5, freq_penalty=2.0, top_k=0, return_dict=True, output_scores=True)
    torch.manual_seed(4)
    ours = model.generate(tokens, **ours_kw)
    torch.manual_seed(4)
    theirs = model.hf_model.generate(tokens, max_new_tokens=6, do_sample=True, top_k=0, output_scores=True,
                                     return_dict_in_generate=True,
                                     logits_processor=LogitsProcessorList([TLFreqPenalty(2.0, 0.5)]))  # fmt: skip
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(theirs.scores))
    with pytest.warns(UserWarning, match=r"`do_sample=False`.*\['freq_penalty'\]"):  # TL: ignored when greedy
        greedy = model.generate(tokens, max_new_tokens=3, do_sample=False, freq_penalty=2.0)
    assert torch.equal(greedy, model.generate(tokens, max_new_tokens=3))
    with pytest.raises(ValueError, match=r"`freq_penalty`.*>= 0"):
        model.generate(tokens, max_new_tokens=2, freq_penalty=-1.0)


def test_transformer_lens_call_runs():
    model = make_bridge("gpt2")
    text = model.generate("Hello", max_new_tokens=5, stop_at_eos=True, eos_token_id=2, do_sample=True, top_k=10,
                          top_p=0.9, temperature=0.8, freq_penalty=0.5, use_past_kv_cache=True, prepend_bos=True,
                          padding_side="left", return_type="str", verbose=False)  # fmt: skip
    assert isinstance(text, str) and text.startswith("Hello")
    with pytest.raises(ValueError, match="`padding_side`"):
        model.generate("Hello", max_new_tokens=2, padding_side="middle")


# -- keyword errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(max_lenght=5), TypeError, r"\['max_lenght'\].*Did you mean 'max_length'"),
        (dict(use_past_kv_cach=True), TypeError, r"Did you mean 'use_past_kv_cache'"),
        (dict(return_dict_in_generat=True), TypeError, r"Did you mean 'return_dict_in_generate'"),
        (dict(output_attentions=True), ValueError, r"`output_attentions`=True.*return_cache=True.*hook_pattern"),
        (dict(penalty_alpha=0.6), ValueError, r"`penalty_alpha`=0.6.*contrastive search"),
        (dict(prefix_allowed_tokens_fn=lambda b, ids: [1]), ValueError, r"PrefixConstrainedLogitsProcessor"),
    ],
)
def test_keywords_name_the_closest_or_what_to_use(kwargs, error, pattern, llama):
    model = llama
    with pytest.raises(error, match=pattern):
        model.generate(torch.tensor([[1, 5]]), max_new_tokens=2, **kwargs)


def test_neutral_hf_keywords_are_accepted(llama):
    model = llama
    tokens = torch.tensor([[1, 5, 6]])
    kw = dict(output_attentions=False, output_hidden_states=False, synced_gpus=False, past_key_values=None)
    assert torch.equal(model.generate(tokens, max_new_tokens=3, **kw), model.generate(tokens, max_new_tokens=3))
    with pytest.raises(TypeError, match=r"HF's `generate` takes it there.*generation_config=config"):
        model.generate(tokens, GenerationConfig(max_new_tokens=2))


def test_prepare_reads_every_option_of_generate_by_its_name(llama):
    """`generate`'s signature is the one place the option names are written: `resolve.prepare` and
    `options.plan` read them from its arguments. Every argument is read, and nothing else is."""

    class Recording(dict):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.read = set()

        def __getitem__(self, key):
            self.read.add(key)
            return super().__getitem__(key)

    params = inspect.signature(generate).parameters
    args = Recording({n: p.default for n, p in params.items() if n != "model"}, input=torch.tensor([[1, 5, 6]]))
    resolve.prepare(llama, args)
    assert args.read == set(args)
    assert all(p.default is inspect.Parameter.empty for p in inspect.signature(options.plan).parameters.values())


# -- generate_stream -------------------------------------------------------------------------------
def test_stream_chunks_join_to_generate(llama):
    model = llama
    tokens, mask = model.prepare_input(PROMPTS)
    steer = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))

    def hook(resid, hook):
        return resid + 2.0 * steer

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", hook)]):
        expected = model.generate(tokens, attention_mask=mask, max_new_tokens=7)
        chunks = list(model.generate_stream(tokens, attention_mask=mask, max_new_tokens=7, max_tokens_per_yield=3))
    assert [c.shape[1] for c in chunks] == [tokens.shape[1] + 3, 3, 1]
    assert torch.equal(torch.cat(chunks, 1), expected)
    assert not torch.equal(expected, model.generate(tokens, attention_mask=mask, max_new_tokens=7))  # the hook acted
    text = list(generate_stream(model, PROMPTS[0], max_new_tokens=6))  # the function behind the method
    assert "".join(text) == model.generate(PROMPTS[0], max_new_tokens=6) and len(text) == 6
    texts = list(model.generate_stream(PROMPTS, max_new_tokens=5, max_tokens_per_yield=2))
    assert ["".join(row) for row in zip(*texts, strict=True)] == model.generate(PROMPTS, max_new_tokens=5)


def test_stream_samples_as_generate_and_checks_before_the_first_step():
    model = make_bridge("llama")
    kw = dict(max_new_tokens=6, temperature=0.9, seed=5)
    assert "".join(model.generate_stream("Hi", **kw)) == model.generate("Hi", **kw)
    calls = []
    model.hf_model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(TypeError, match=r"generate_stream\(\) does not take `return_cache`: call `generate"):
        model.generate_stream("Hi", return_cache=True)
    with pytest.raises(ValueError, match="`top_p`"):
        model.generate_stream("Hi", top_p=2.0)  # raised at the call, not at the first next()
    with pytest.raises(TypeError, match="Did you mean 'max_tokens_per_yield'"):
        model.generate_stream("Hi", max_token_per_yield=2)
    assert calls == []
    with pytest.warns(UserWarning, match="`do_sample=False`") as caught:
        model.generate_stream("Hi", max_new_tokens=2, do_sample=False, temperature=0.5)
    assert caught[0].filename == __file__


def test_stream_text_of_token_input_and_an_early_stop():
    model = make_bridge("gpt2")
    tokens = torch.tensor([[1, 40, 50, 60], [0, 1, 9, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    free = model.generate(tokens, attention_mask=mask, max_new_tokens=8, stop_at_eos=False)
    eos = int(free[0, 6])  # row 0 stops at its 3rd token
    kw = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=eos, return_type="str")
    pieces = list(model.generate_stream(tokens, max_tokens_per_yield=2, **kw))
    assert ["".join(row) for row in zip(*pieces, strict=True)] == model.generate(tokens, **kw)
    chunks = list(model.generate_stream(tokens, attention_mask=mask, max_new_tokens=8, eos_token_id=eos))
    assert torch.equal(torch.cat(chunks, 1), model.generate(tokens, attention_mask=mask, max_new_tokens=8,
                                                               eos_token_id=eos))  # fmt: skip
    assert math.isclose(len(chunks), torch.cat(chunks, 1).shape[1] - tokens.shape[1])
