"""`transformer_bridge.utils`: TransformerLens 4.3's utilities, each checked against a hand-computed answer or an
independent implementation (HF's activation functions, explicit products, counted ranks). The comparison with
TransformerLens itself (signatures and outputs, in a scratch venv) is benchmarks/tl_utils_parity.py."""

import ast
import doctest
import hashlib
import math

import numpy as np
import pytest
import torch
from conftest import char_tokenizer, make_bridge
from transformers.activations import ACT2FN

from transformer_bridge import utils
from transformer_bridge.compat.factored import FactoredMatrix
from transformer_bridge.utils import (
    act_name,
    activations,
    attributes,
    lm,
    slicing,
    statistics,
    tensors,
    tokenization,
)


@pytest.fixture(scope="module")
def llama():
    return make_bridge("llama")


def tok(pad: int | None = 0, bos: int | None = 1, side: str = "left", cls: int | None = None):
    """A stand-in tokenizer with just the ids the token helpers read."""
    return type("Tok", (), {"pad_token_id": pad, "bos_token_id": bos, "padding_side": side, "cls_token_id": cls})()


@pytest.mark.parametrize("module", [act_name, activations, attributes, lm, slicing, statistics, tensors, tokenization])
def test_docstring_examples(module):
    assert doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0


def test_every_public_name_is_exported_once():
    assert len(set(utils.__all__)) == len(utils.__all__) == 49
    assert all(hasattr(utils, name) for name in utils.__all__)


# -- test_prompt -------------------------------------------------------------------------------------------------


def _rank(logits: torch.Tensor, token: int) -> int:
    """How many tokens are strictly more probable (the oracle: no sorting)."""
    return int((logits > logits[token]).sum())


def test_test_prompt_one_answer_ranks_each_token(llama, capsys):
    assert utils.test_prompt("Hi the", "cat", llama, top_k=2) is None
    tokens = torch.cat([llama.to_tokens("Hi the"), llama.to_tokens(" cat", prepend_bos=False)], 1)
    logits = llama.hf_model(tokens).logits[0]
    n = llama.to_tokens("Hi the").shape[1]
    expected = [(s, _rank(logits[n - 1 + i], int(tokens[0, n + i]))) for i, s in enumerate([" ", "c", "a", "t"])]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Tokenized prompt: ['<bos>', 'H', 'i', ' ', 't', 'h', 'e']"
    assert lines[1] == "Tokenized answer: [' ', 'c', 'a', 't']"
    assert lines.count("Performance on answer token:") == 4  # one block per answer token, 2 top lines each
    assert sum(line.startswith("Top ") for line in lines) == 8
    rank_lines = [line for line in lines if line.startswith("Rank: ")]
    assert [int(line.split()[1]) for line in rank_lines] == [r for _, r in expected]
    assert rank_lines[0].endswith("Token: | |") and lines[-1] == f"Ranks of the answer tokens: {expected}"


def test_test_prompt_list_of_answers_ranks_their_first_tokens(llama, capsys):
    utils.test_prompt("Hi the", ["cat", " dog", "x"], llama, top_k=3)  # a space is added where missing
    prompt = llama.to_tokens("Hi the")
    logits = llama.hf_model(prompt).logits[0, -1]
    expected = [[(" ", _rank(logits, int(llama.to_tokens(" ", prepend_bos=False)[0, 0])))] * 3]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "Tokenized answers: [[' ', 'c', 'a', 't'], [' ', 'd', 'o', 'g'], [' ', 'x']]"
    assert lines[2] == "Performance on answer tokens:"
    assert len([line for line in lines if line.startswith("Rank: ")]) == 3  # one rank line per answer
    top = [line for line in lines if line.startswith("Top ")]
    assert len(top) == 3 and top[0].startswith("Top 0th token. Logit: ")
    best = int(logits.argmax())
    assert top[0].endswith(f"Token: |{llama.to_string([best])}|")
    assert f"{logits[best].item():5.2f}" in top[0] and f"{logits.softmax(-1)[best].item():6.2%}" in top[0]
    assert ast.literal_eval(lines[-1].removeprefix("Ranks of the answer tokens: ")) == expected


def test_test_prompt_quiet_and_bad_answers(llama, capsys):
    utils.test_prompt("Hi", ["a", "b"], llama, print_details=False)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Ranks of the answer tokens: [[(' ', ")
    utils.test_prompt("Hi", " a", llama, prepend_space_to_answer=False, print_details=False)
    assert capsys.readouterr().out.startswith("Ranks of the answer tokens: [(' ', ")
    for bad in ([], [1], 3):
        with pytest.raises(ValueError, match="`answer`"):
            utils.test_prompt("Hi", bad, llama)


# -- tokens -------------------------------------------------------------------------------------------------------


def test_get_attention_mask_both_sides():
    ids = torch.tensor([[0, 0, 5, 0], [0, 7, 8, 9], [5, 6, 0, 0]])
    mask = utils.get_attention_mask(tok(0, 0), ids, prepend_bos=True)  # BOS = pad: the last leading pad is kept
    assert mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    mask = utils.get_attention_mask(tok(0, 0), ids, prepend_bos=False)
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]
    mask = utils.get_attention_mask(tok(0, 1), ids, prepend_bos=True)  # a distinct BOS: only pads are padding
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]
    mask = utils.get_attention_mask(tok(0, 1), ids, True, padding_side="right")  # only the trailing pads
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert utils.get_attention_mask(tok(None), ids, True).tolist() == torch.ones_like(ids).tolist()
    assert utils.get_attention_mask(None, ids, True).tolist() == torch.ones_like(ids).tolist()
    with pytest.raises(ValueError, match="`padding_side`"):
        utils.get_attention_mask(tok(), ids, True, padding_side="middle")


def test_get_tokens_with_bos_removed():
    right = torch.tensor([[1, 5, 6, 0], [1, 7, 8, 9]])
    assert utils.get_tokens_with_bos_removed(tok(side="right"), right).tolist() == [[5, 6, 0], [7, 8, 9]]
    left = torch.tensor([[0, 0, 1, 5], [1, 7, 8, 9]])
    assert utils.get_tokens_with_bos_removed(tok(0, 1), left).tolist() == [[0, 0, 5], [7, 8, 9]]
    shared = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]])  # BOS = pad: the last leading pad is the BOS
    assert utils.get_tokens_with_bos_removed(tok(0, 0), shared).tolist() == [[0, 5, 6], [7, 8, 9]]
    cls = torch.tensor([[0, 101, 5], [101, 7, 8]])
    assert utils.get_tokens_with_bos_removed(tok(0, 1, cls=101), cls).tolist() == [[0, 5], [7, 8]]
    assert utils.get_tokens_with_bos_removed(tok(None, 1), torch.tensor([[1, 2, 3]])).tolist() == [[2, 3]]
    assert utils.get_tokens_with_bos_removed(tok(0, None), left) is left
    batched = torch.stack([left, left])  # any leading dimensions
    assert utils.get_tokens_with_bos_removed(tok(0, 1), batched).tolist() == [[[0, 0, 5], [7, 8, 9]]] * 2
    with pytest.raises(ValueError, match="do not start with the BOS"):
        utils.get_tokens_with_bos_removed(tok(0, 1), torch.tensor([[0, 5, 6], [1, 2, 3]]))


def test_manually_prepended_bos_and_tokenizer_with_bos():
    assert utils.get_input_with_manually_prepended_bos("<bos>", "Hi") == "<bos>Hi"
    assert utils.get_input_with_manually_prepended_bos(None, ["a"]) == ["a"]
    chars = char_tokenizer()
    chars.padding_side = "left"
    with_bos = utils.get_tokenizer_with_bos(chars)
    assert with_bos is not chars and with_bos.add_bos_token and with_bos.padding_side == "left"
    assert with_bos("ab").input_ids == [1, chars.convert_tokens_to_ids("a"), chars.convert_tokens_to_ids("b")]
    assert not chars.add_bos_token  # the original is untouched
    assert utils.get_tokenizer_with_bos(with_bos) is with_bos  # already adds BOS
    chars.bos_token = None
    assert utils.get_tokenizer_with_bos(chars) is chars  # nothing to add


@pytest.mark.real
def test_tokenizer_with_bos_reloads_smollm2_offline():
    from transformers import AutoTokenizer

    from transformer_bridge.real_model import smollm2_path

    plain = AutoTokenizer.from_pretrained(smollm2_path())
    plain.padding_side = "left"
    with_bos = utils.get_tokenizer_with_bos(plain)
    ids = plain("Hi there").input_ids
    assert with_bos("Hi there").input_ids == [plain.bos_token_id, *ids] and with_bos.padding_side == "left"


def test_tokenize_and_concatenate_packs_rows():
    datasets = pytest.importorskip("datasets")
    chars = char_tokenizer()
    ids = {c: chars.convert_tokens_to_ids(c) for c in "abcdefgh"}
    data = datasets.Dataset.from_dict({"text": ["abc", "de", "fgh"], "meta": [0, 1, 2]})
    rows = utils.tokenize_and_concatenate(data, chars, max_length=4, num_proc=None)
    assert rows.column_names == ["tokens"] and isinstance(rows[:]["tokens"], torch.Tensor)
    bos, eos = chars.bos_token_id, chars.eos_token_id
    stream = [ids["a"], ids["b"], ids["c"], eos, ids["d"], ids["e"], eos, ids["f"], ids["g"], ids["h"]]
    # rows of 3 with BOS in front; the last token of the 10 does not fill a row and is dropped
    assert rows[:]["tokens"].tolist() == [[bos, *stream[0:3]], [bos, *stream[3:6]], [bos, *stream[6:9]]]
    no_bos = utils.tokenize_and_concatenate(data, chars, max_length=5, add_bos_token=False, num_proc=None,
                                            set_format=False)  # fmt: skip
    assert no_bos[:]["tokens"] == [stream[0:5], stream[5:10]]
    short = datasets.Dataset.from_dict({"text": ["ab"]})
    padded = utils.tokenize_and_concatenate(short, chars, max_length=5, num_proc=None)
    assert padded[:]["tokens"].tolist() == [[bos, ids["a"], ids["b"], chars.pad_token_id, chars.pad_token_id]]
    other = datasets.Dataset.from_dict({"body": ["ab"], "text": ["zz"]})
    assert utils.keep_single_column(other, "body").column_names == ["body"]
    with pytest.raises(ValueError, match="`max_length`"):
        utils.tokenize_and_concatenate(short, chars, max_length=1, num_proc=None)


# -- tensors ------------------------------------------------------------------------------------------------------


def test_tensor_helpers():
    x = torch.arange(24).reshape(2, 3, 4)
    assert torch.equal(utils.get_corner(x, n=2), x[:2, :2, :2])
    assert utils.is_square(torch.zeros(3, 3)) and not utils.is_square(torch.zeros(3, 4))
    assert not utils.is_square(torch.zeros(1, 3, 3)) and not utils.is_lower_triangular(torch.zeros(2, 3))
    assert utils.is_lower_triangular(torch.tensor([[1, 0], [5, 1]])) and not utils.is_lower_triangular(torch.ones(2, 2))
    assert utils.get_cumsum_along_dim(torch.tensor([[1, 2, 3]]), -1).tolist() == [[1, 3, 6]]
    assert utils.get_cumsum_along_dim(torch.tensor([[1, 2, 3]]), 1, reverse=True).tolist() == [[6, 5, 3]]
    resid = torch.randn(2, 5, 7)
    copies = utils.repeat_along_head_dimension(resid, n_heads=3)
    assert copies.shape == (2, 5, 3, 7) and all(torch.equal(copies[:, :, h], resid) for h in range(3))
    assert copies.untyped_storage().data_ptr() != resid.untyped_storage().data_ptr()
    view = utils.repeat_along_head_dimension(resid, n_heads=3, clone_tensor=False)
    assert view.untyped_storage().data_ptr() == resid.untyped_storage().data_ptr()
    params = {"blocks.0.attn.W_Q": 1, "blocks.0.mlp.W_in": 2, "blocks.01.x": 3, "blocks.1.attn.W_Q": 4}
    assert utils.filter_dict_by_prefix(params, "blocks.0") == {"attn.W_Q": 1, "mlp.W_in": 2}
    assert utils.filter_dict_by_prefix(params, "blocks.0.") == {"attn.W_Q": 1, "mlp.W_in": 2}
    assert utils.remove_batch_dim(torch.tensor(3.0)).shape == () and utils.remove_batch_dim(x).shape == x.shape
    assert utils.to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype == np.float32
    assert torch.equal(utils.transpose(x), x.permute(0, 2, 1))
    with pytest.raises(TypeError, match="`tensor`"):
        utils.to_numpy(object())


def test_check_structure_prints_the_first_kind_of_mismatch(capsys):
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    utils.check_structure(a, a * 10)
    assert capsys.readouterr().out == "PASSED\n"
    utils.check_structure(a, torch.tensor([[3.0, 2.0], [1.0, 4.0]]))  # row 0 vs 1 flips in column 0
    assert capsys.readouterr().out == "row mismatch: [0]\n"
    utils.check_structure(a, torch.tensor([[1.0, 2.0], [4.0, 3.0]]), verbose=True)  # columns only
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Checking rows" and out[1] == "Checking columns" and out[-1] == "column mismatch: [0]"
    with pytest.raises(AssertionError, match="`t2`"):  # TransformerLens asserts; here also a ValueError
        utils.check_structure(a, torch.zeros(3, 3))


def test_composition_scores_and_matrix_corner_against_formed_products():
    torch.manual_seed(0)
    left = FactoredMatrix(torch.randn(2, 6, 3), torch.randn(2, 3, 5))  # 2 heads, [6, 5]
    right = FactoredMatrix(torch.randn(3, 5, 2), torch.randn(3, 2, 4))  # 3 heads, [5, 4]
    scores = utils.composition_scores(left, right)
    norm = torch.linalg.norm
    expected = torch.tensor([[
        float(norm(left.AB[i] @ right.AB[j]) / norm(left.AB[i]) / norm(right.AB[j])) for j in range(3)
    ] for i in range(2)])  # fmt: skip
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)
    same = FactoredMatrix(torch.randn(3, 5, 2), torch.randn(3, 2, 5))
    assert utils.composition_scores(same, same, broadcast_dims=False).shape == (3,)  # head by head
    with pytest.raises(ValueError, match=r"left\.rdim == right\.ldim"):
        utils.composition_scores(left, left)
    torch.testing.assert_close(utils.get_matrix_corner(left, n=2), left.AB[:2, :2, :2])


# -- Slice --------------------------------------------------------------------------------------------------------


def test_slice_modes():
    x = torch.arange(12).reshape(3, 4)
    assert utils.Slice(None).mode == "identity" and torch.equal(utils.Slice().apply(x, 1), x)
    for scalar in (2, np.int64(2), torch.tensor(2)):  # integer scalars drop the axis
        s = utils.Slice(scalar)
        assert s.mode == "int" and torch.equal(s.apply(x, dim=1), x[:, 2])
    assert torch.equal(utils.Slice((1, 3)).apply(x, dim=-1), x[:, 1:3])
    assert torch.equal(utils.Slice([3, 0]).apply(x, dim=1), x[:, [3, 0]])
    assert torch.equal(utils.Slice(torch.tensor([-1, 0])).apply(x, dim=1), x[:, [-1, 0]])
    mask = torch.tensor([True, False, True, False])
    assert torch.equal(utils.Slice(mask).apply(x, dim=1), x[:, mask])
    assert utils.Slice(np.array([False, True, True])).indices(3).tolist() == [1, 2]
    assert utils.Slice((None, None, 2)).indices(5).tolist() == [0, 2, 4]
    assert utils.Slice(-1).indices(4).tolist() == [-1] and utils.Slice(-1).indices().tolist() == [-1]  # as TL
    assert utils.Slice([-1]).indices(4).tolist() == [3]
    assert torch.equal(utils.Slice.unwrap(1).apply(x), x[[1]])  # an int keeps its axis through unwrap
    s = utils.Slice(slice(1, None))
    assert utils.Slice.unwrap(s) is s and torch.equal(utils.Slice(s).apply(x), x[1:])
    with pytest.raises(ValueError, match="`max_ctx`"):
        utils.Slice((0, 2)).indices()
    for bad in (1.5, True, "a", torch.zeros(2, 2, dtype=torch.long)):
        with pytest.raises(TypeError, match="`input_slice`"):
            utils.Slice(bad)


# -- language models ----------------------------------------------------------------------------------------------


def test_loss_with_a_bool_mask():
    logits = torch.randn(1, 4, 6)
    tokens = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[True, True, True, False]])
    log_probs = logits.log_softmax(-1)
    expected = -(log_probs[0, 0, 2] + log_probs[0, 1, 3]) / 2  # the last prediction's target is masked
    torch.testing.assert_close(utils.lm_cross_entropy_loss(logits, tokens, mask), expected)


def test_sample_logits_rules():
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    assert utils.sample_logits(logits, temperature=0.0).tolist() == [0]
    # repetition penalty 2 on token 0: 2 -> 1 (positive: divided), so token 1 wins; also under greedy
    assert utils.sample_logits(logits, temperature=0.0, repetition_penalty=2.0, tokens=torch.tensor([[0]])).item() == 1
    assert (
        utils.sample_logits(
            torch.tensor([[-1.0, -1.5]]), temperature=0.0, repetition_penalty=2.0, tokens=torch.tensor([[0]])
        ).item()
        == 1
    )  # fmt: skip  (negative: multiplied)
    assert set(utils.sample_logits(logits.expand(50, 3), top_k=1).tolist()) == {0}
    probs = torch.tensor([[0.5, 0.3, 0.2]]).expand(200, 3)
    torch.manual_seed(0)
    drawn = set(utils.sample_logits(probs.log(), top_p=0.6).tolist())  # 0.5 < 0.6 <= 0.8: keep 0 and 1
    assert drawn == {0, 1}
    # frequency penalty then temperature, as a seeded draw of the hand-computed logits
    tokens = torch.tensor([[0, 0, 2]])
    hand = (torch.tensor([[1.0, 1.0, 1.0]]) / 0.5 - 0.7 * torch.tensor([[2.0, 0.0, 1.0]])).float()
    torch.manual_seed(3)
    got = [utils.sample_logits(torch.ones(1, 3), temperature=0.5, freq_penalty=0.7, tokens=tokens) for _ in range(20)]
    torch.manual_seed(3)
    want = [torch.distributions.Categorical(logits=hand).sample() for _ in range(20)]
    assert torch.equal(torch.cat(got), torch.cat(want))
    assert utils.sample_logits(logits, top_k=10, temperature=1e-4).item() == 0  # top_k clamped to the vocabulary
    for kwargs, name in ((dict(top_k=0), "top_k"), (dict(top_p=1.5), "top_p"), (dict(freq_penalty=-1.0), "freq")):
        with pytest.raises(AssertionError, match=name):  # TransformerLens asserts; here also a ValueError
            utils.sample_logits(logits, **kwargs)
    with pytest.raises(ValueError, match="`tokens`"):
        utils.sample_logits(logits, freq_penalty=1.0)


def test_logits_to_df():
    logits = torch.tensor([0.0, 2.0, 1.0])
    df = utils.logits_to_df(logits, tokenizer=char_tokenizer(), top_k=2)
    assert list(df.columns) == ["token_index", "token_string", "logit", "log_prob", "probability"]
    assert df["token_index"].tolist() == [1, 2] and df["token_string"].tolist() == ["<bos>", "<eos>"]
    np.testing.assert_allclose(df["probability"], logits.softmax(-1)[[1, 2]].numpy(), rtol=1e-6)
    np.testing.assert_allclose(df["log_prob"], logits.log_softmax(-1)[[1, 2]].numpy(), rtol=1e-6)
    assert len(utils.logits_to_df(logits)) == 3


def test_get_act_name_takes_a_layer_string():
    assert utils.get_act_name("k", "6", "a") == "blocks.6.attn.hook_k" == utils.get_act_name("k6")
    with pytest.raises(TypeError, match="`layer`"):
        utils.get_act_name("k", "six")


# -- activations --------------------------------------------------------------------------------------------------


def test_activation_functions_against_hf():
    x = torch.linspace(-6, 6, 97)
    for name in ("gelu_new", "gelu_fast", "gelu_pytorch_tanh", "relu2"):
        torch.testing.assert_close(utils.SUPPORTED_ACTIVATIONS[name](x), ACT2FN[name](x), rtol=0, atol=1e-6)
    torch.testing.assert_close(utils.solu(x), x * torch.exp(x) / torch.exp(x).sum())
    assert utils.SUPPORTED_ACTIVATIONS["solu_ln"] is utils.solu
    xielu = utils.SUPPORTED_ACTIVATIONS["xielu"]
    assert xielu(torch.tensor([2.0])).item() == pytest.approx(0.8 * 4 + 0.5 * 2)
    assert xielu(torch.tensor([-1.0])).item() == pytest.approx((math.expm1(-1.0) + 1.0) * 0.8 - 0.5)
    assert set(utils.SUPPORTED_ACTIVATIONS) >= {"gelu", "relu", "silu", "gelu_new", "gelu_fast", "solu"}
    torch.testing.assert_close(utils.apply_softcap(x, 3.0), 3.0 * torch.tanh(x / 3.0))
    for off in (None, 0.0, utils.SOFTCAP_DISABLED):
        assert not utils.softcap_enabled(off) and utils.apply_softcap(x, off) is x


# -- defaults, attributes, environment ----------------------------------------------------------------------------


def test_locally_overriden_defaults_on_the_bridge(llama):
    assert utils.override_or_use_default_value(True, None) is True and utils.USE_DEFAULT_VALUE is None
    assert utils.override_or_use_default_value(True, False) is False
    with_bos = llama.to_tokens("ab")
    with utils.LocallyOverridenDefaults(llama, prepend_bos=False, padding_side="left"):
        assert llama.cfg.default_prepend_bos is False and llama.cfg.default_padding_side == "left"
        assert torch.equal(llama.to_tokens("ab"), with_bos[:, 1:])
        assert llama.to_tokens(["a", "abc"])[0, :2].tolist() == [llama.tokenizer.pad_token_id] * 2
    assert torch.equal(llama.to_tokens("ab"), with_bos) and llama.cfg.default_padding_side == "right"
    with utils.LocallyOverridenDefaults(llama, prepend_bos=None):  # None keeps the default
        assert torch.equal(llama.to_tokens("ab"), with_bos)
    with pytest.raises(AssertionError, match="'dtype' is not a default"):
        utils.LocallyOverridenDefaults(llama, dtype=torch.float16)
    with pytest.raises(ValueError, match="`padding_side` must be one of"):
        utils.LocallyOverridenDefaults(llama, padding_side="middle")
    try:
        with utils.LocallyOverridenDefaults(llama, prepend_bos=False):
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert llama.cfg.default_prepend_bos is True  # restored on an error too


def test_nested_attributes_and_parameter_swap(llama):
    assert utils.get_nested_attr(llama, "cfg.n_layers") == 2
    utils.set_nested_attr(llama, "cfg.default_padding_side", "left")
    assert llama.cfg.default_padding_side == "left"
    utils.set_nested_attr(llama, "cfg.default_padding_side", "right")
    tokens = torch.tensor([[5, 6, 7]])
    before = llama(tokens)
    weight = llama.hf_model.lm_head.weight
    try:
        with utils.temporarily_swap_parameter(weight, torch.zeros_like(weight)) as swapped:
            assert swapped is weight and not llama(tokens).any()  # zero unembedding: zero logits
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert torch.equal(llama(tokens), before)  # restored exactly, also after the error
    with pytest.raises(TypeError, match="`parameter`"):
        utils.temporarily_swap_parameter(torch.zeros(2), torch.zeros(2)).__enter__()
    with pytest.raises(ValueError, match="shape and dtype"):
        utils.temporarily_swap_parameter(weight, torch.zeros(2)).__enter__()


def test_device_and_library():
    assert utils.get_device() == ("cuda" if torch.cuda.is_available() else utils.get_device())
    assert utils.get_device() in ("cuda", "mps", "cpu")
    assert utils.is_library_available("numpy") and not utils.is_library_available("surely_not_a_module_name")


# -- statistics ---------------------------------------------------------------------------------------------------


def test_statistics():
    x = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    assert utils.standard_error(x).tolist() == [1.0, 0.0]  # std [√2, 0] / √2
    assert utils.standard_error(x.T, dim=0).tolist() == [1.0, 0.0]
    low, high = utils.bootstrap_ci(torch.full((2, 6), 4.0))
    assert low.tolist() == high.tolist() == [4.0, 4.0]  # a constant sample collapses to a point
    low, high = utils.bootstrap_ci(torch.arange(10.0), statistic="median", n_resamples=300, chunk_size=7)
    assert 0.0 <= low <= 4.5 <= high <= 9.0
    assert torch.equal(utils.bootstrap_ci(torch.arange(10.0))[0], utils.bootstrap_ci(torch.arange(10.0))[0])
    # all 2^3 sign patterns of [1, 2, 3]: |mean| reaches 2 only with all + or all -
    assert utils.sign_flip_permutation_pvalue(torch.tensor([1.0, 2.0, 3.0])).item() == 2 / 8
    assert utils.sign_flip_permutation_pvalue(torch.tensor([1.0, 2.0, 3.0]), alternative="greater").item() == 1 / 8
    big = utils.sign_flip_permutation_pvalue(torch.ones(20), n_permutations=99)  # random: (hits + 1) / 100
    assert big.item() == pytest.approx(0.01)  # no random pattern reaches |mean| 1
    ci = utils.success_rate_ci([True] * 3 + [False] * 7)  # R's binom.test(3, 10): 0.06673951 0.65245285
    assert (ci.point_estimate, ci.n_trials, ci.n_successes, ci.confidence) == (0.3, 10, 3, 0.95)
    assert ci.ci_low == pytest.approx(0.06673951, abs=1e-8) and ci.ci_high == pytest.approx(0.65245285, abs=1e-8)
    everything = utils.success_rate_ci([True] * 4)
    assert everything.ci_high == 1.0 and everything.ci_low == pytest.approx(0.025 ** (1 / 4))  # (α/2)^(1/n)
    key = int.from_bytes(hashlib.sha256(b"7:metric:2").digest()[:8], "little") & (2**63 - 1)
    assert utils.derive_generator(7, "metric", 2).initial_seed() == key
    with pytest.raises(ValueError, match="`statistic`"):
        utils.bootstrap_ci(x, statistic="mode")
    with pytest.raises(ValueError, match="at least 2"):
        utils.standard_error(torch.ones(1))
    with pytest.raises(TypeError, match="floating-point"):
        utils.standard_error(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="`successes`"):
        utils.success_rate_ci([])
