"""`from_pretrained`'s loader options (TransformerLens' ``n_ctx`` / ``hf_config_overrides`` / ``load_weights``) on
saved tiny checkpoints: a rotary family (Llama) and one with learned positions (GPT-2)."""

import re
import warnings

import pytest
import torch
from conftest import char_tokenizer, make_hf

from transformer_bridge import TransformerBridge

TOKENS = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folders = {}
    for family in ("llama", "gpt2"):
        folder = tmp_path_factory.mktemp(family)
        make_hf(family).save_pretrained(folder)
        char_tokenizer().save_pretrained(folder)
        folders[family] = str(folder)
    return folders


def test_no_option_is_the_plain_load(saved):
    model = TransformerBridge.from_pretrained(saved["llama"])
    reference = TransformerBridge(make_hf("llama"))
    assert torch.equal(model(TOKENS), reference(TOKENS))
    # cfg.model_name is what it was loaded from (TransformerLens' meaning), the model type for an unsaved model
    assert model.cfg.model_name == str(saved["llama"]) and reference.cfg.model_name == "llama"


def test_n_ctx_of_a_rotary_model_sets_the_context_and_keeps_the_weights(saved):
    plain = TransformerBridge.from_pretrained(saved["llama"])
    default = plain.hf_model.config.max_position_embeddings
    with pytest.warns(UserWarning, match=f"n_ctx={default * 2} is larger than the model's default context length"):
        longer = TransformerBridge.from_pretrained(saved["llama"], n_ctx=default * 2)
    assert longer.cfg.n_ctx == longer.hf_model.config.max_position_embeddings == default * 2
    assert torch.equal(longer(TOKENS), plain(TOKENS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shorter = TransformerBridge.from_pretrained(saved["llama"], n_ctx=3)
    assert shorter.cfg.n_ctx == 3
    with pytest.raises(ValueError, match="context limit is 3"):
        shorter(TOKENS)


def test_learned_positions_keep_their_length_when_loaded(saved):
    with pytest.raises(RuntimeError, match=r"n_ctx=16: this checkpoint has \d+ learned positional embeddings"):
        TransformerBridge.from_pretrained(saved["gpt2"], n_ctx=16)
    model = TransformerBridge.from_pretrained(saved["gpt2"], n_ctx=16, load_weights=False)
    assert model.hf_model.config.n_positions == model.cfg.n_ctx == 16  # GPT-2's own field
    assert model.W_pos.shape == (16, model.cfg.d_model)


def test_load_weights_false_is_the_architecture_randomly_initialised(saved):
    torch.manual_seed(123)
    fresh = TransformerBridge.from_pretrained(saved["llama"], load_weights=False)
    loaded = TransformerBridge.from_pretrained(saved["llama"])
    assert fresh.hf_model.config.to_dict()["num_hidden_layers"] == loaded.cfg.n_layers
    assert not torch.equal(fresh.W_E, loaded.W_E)
    torch.manual_seed(123)
    again = TransformerBridge.from_pretrained(saved["llama"], load_weights=False)
    assert torch.equal(again.W_E, fresh.W_E)


def test_hf_config_overrides_are_read_as_hf_reads_config_keywords(saved):
    model = TransformerBridge.from_pretrained(saved["gpt2"], hf_config_overrides={"attn_implementation": "eager"})
    assert model.hf_model.config._attn_implementation == "eager"
    n = model.hf_model.config.n_positions
    with pytest.warns(UserWarning, match=r"Both n_ctx=8 and hf_config_overrides\['n_positions'\]=12 .*n_ctx takes"):
        small = TransformerBridge.from_pretrained(
            saved["gpt2"], n_ctx=8, hf_config_overrides={"n_positions": 12}, load_weights=False
        )
    assert small.cfg.n_ctx == 8 and n != 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TransformerBridge.from_pretrained(
            saved["gpt2"], n_ctx=8, hf_config_overrides={"n_positions": 8}, load_weights=False
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_ctx": 0}, ValueError, r"`n_ctx` must be a positive integer .*got 0"),
        ({"n_ctx": -1}, ValueError, r"`n_ctx` must be a positive integer"),
        ({"n_ctx": 2.5}, ValueError, r"`n_ctx` must be a positive integer"),
        ({"load_weights": "no"}, TypeError, r"`load_weights` must be True or False"),
        ({"hf_config_overrides": {"not_a_field": 1}}, ValueError, r"names \['not_a_field'\], no field of LlamaConfig"),
        ({"hf_config_overrides": [("n_ctx", 3)]}, TypeError, r"`hf_config_overrides` must be a dict"),
        ({"load_weights": False, "device_map": "auto"}, ValueError, r"`load_weights=False`.*\['device_map'\]"),
    ],
    ids=["zero", "negative", "float", "load_weights", "unknown_field", "not_a_dict", "device_map"],
)
def test_bad_loader_options(saved, kwargs, error, match):
    with pytest.raises(error, match=match):
        TransformerBridge.from_pretrained(saved["llama"], **kwargs)


def test_a_loaded_tokenizer_without_a_pad_token_pads_with_its_eos(tmp_path):
    """TransformerLens' load: the tokenizer read from the folder gets EOS as its pad token, so text batches
    pad with it and the tokenizer itself pads; padded rows equal the rows run alone. A tokenizer passed in
    is not changed."""
    make_hf("llama").save_pretrained(tmp_path)
    tok = char_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    model = TransformerBridge.from_pretrained(str(tmp_path))
    assert model.tokenizer.pad_token == "<eos>" and model.tokenizer.pad_token_id == 2
    texts = ["Hi", "Hello there"]
    tokens = model.to_tokens(texts, padding_side="left")
    assert tokens[0, 0].item() == model.tokenizer.pad_token_id and tokens[0, -1].item() != 2
    assert model.tokenizer(texts, padding=True)["input_ids"][0][-1] == 2  # the tokenizer pads by itself now
    logits = model(texts, padding_side="left")
    for i, text in enumerate(texts):
        alone = model(text)
        torch.testing.assert_close(logits[i, -alone.shape[1] :], alone[0], atol=1e-5, rtol=1e-5)
    passed = char_tokenizer()
    passed.pad_token = None
    assert TransformerBridge.from_pretrained(str(tmp_path), tokenizer=passed).tokenizer.pad_token is None


@pytest.mark.parametrize("where", ["/nonexistent/SmolLM2", "./no/such/model", "~/no-such-folder-35", "missing/a/b"])
def test_a_missing_local_folder_says_so(where):
    with pytest.raises(FileNotFoundError, match=re.escape(where) + r"'?: no such folder \(the closest folder that"):
        TransformerBridge.from_pretrained(where)


def test_a_file_in_place_of_the_folder_says_so(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"is a file, not a folder.*gguf_file="):
        TransformerBridge.from_pretrained(str(weights))
