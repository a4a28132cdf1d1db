"""Forward exactness, inputs and bad input for `TransformerBridge` on every tiny family."""

import pytest
import torch
from conftest import FAMILIES, V, make_bridge, make_hf

from transformer_bridge import SUPPORTED_MODEL_TYPES, TransformerBridge, UnsupportedArchitectureError


def _tokens(batch=2, pos=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, V, (batch, pos), generator=g)


def test_no_hooks_is_bitwise_hf(bridge):
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(bridge(tokens), bridge.hf_model(tokens).logits)


def test_all_hooks_active_within_tolerance(bridge):
    tokens = _tokens()
    with torch.no_grad():
        ref = bridge.hf_model(tokens).logits
        out = bridge.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, lambda x, hook: x.clone())])
    assert (out - ref).abs().max() <= 1e-5
    # Routed through the bridge's attention function during the call only: the HF config stays the user's.
    assert not bridge.hf_model.config._attn_implementation.startswith("bridge_")


def test_string_and_list_inputs(bridge):
    text = "Hello there"
    tokens, mask = bridge.to_tokens_and_mask(text, padding_side="left")
    assert tokens[0, 0] == 1 and mask.all()  # the char tokenizer adds BOS, like Llama's
    with torch.no_grad():
        assert torch.equal(bridge(text), bridge.hf_model(tokens).logits)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_rows_equal_single_runs(bridge, side):
    """A list of texts is laid out as `to_tokens` lays it out (right padding by default, as TransformerLens) or
    as ``padding_side`` says; either way each row's real positions are that row run alone."""
    texts = ["Hi", "The capital of France is", "abc def"]
    _, mask = bridge.to_tokens_and_mask(texts, padding_side=side)
    assert mask[0, -1 if side == "right" else 0] == 0 and mask[1].all()
    with torch.no_grad():
        batch = bridge(texts) if side == "right" else bridge(texts, padding_side=side)
        for i, text in enumerate(texts):
            alone = bridge(text)[0]
            torch.testing.assert_close(batch[i][mask[i].bool()], alone, atol=1e-5, rtol=1e-5)


def test_token_inputs_with_mask_and_1d(bridge):
    tokens = _tokens(1, 5)
    with torch.no_grad():
        assert torch.equal(bridge(tokens[0]), bridge(tokens))
        assert torch.equal(bridge(tokens, attention_mask=torch.ones_like(tokens)), bridge(tokens))


def test_loss_return_type(bridge):
    tokens = _tokens()
    with torch.no_grad():
        logits, loss = bridge(tokens, return_type="both")
        ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref)


def test_token_helpers():
    model = make_bridge("llama")
    assert model.to_str_tokens("Hi") == ["<bos>", "H", "i"]
    assert model.to_str_tokens("Hi", prepend_bos=False) == ["H", "i"]
    assert model.to_single_token("H") == 44
    assert model.to_string(torch.tensor([44, 77])) == "Hi"
    assert model.to_string(torch.tensor([[44], [77]])) == ["H", "i"]
    tokens, _ = model.to_tokens_and_mask("Hi", prepend_bos=True, padding_side="left")
    assert tokens[0].tolist() == [1, 44, 77]  # BOS not doubled
    with pytest.raises(ValueError, match="not exactly one"):
        model.to_single_token("Hi")


def test_from_config_and_repr():
    from conftest import CONFIGS

    torch.manual_seed(0)
    model = TransformerBridge.from_config(CONFIGS["gpt2"]())
    assert "n_layers=2" in repr(model)
    assert model.cfg.d_mlp == 37 and model.cfg.d_vocab == V and model.cfg.n_kv_heads == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_config_sizes(family):
    cfg = make_bridge(family).cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_mlp, cfg.d_vocab) == (2, 32, 4, 37, V)
    assert cfg.d_head == 8
    no_gqa, multi_query = (
        ("gpt2", "opt", "gpt_neox", "gptj", "gpt_neo", "deepseek_v3", "youtu", "persimmon"),
        ("falcon", "gpt_bigcode"),
    )
    assert cfg.n_kv_heads == (4 if family in no_gqa else 1 if family in multi_query else 2)


def test_hook_point_names_follow_transformerlens():
    names = set(make_bridge("llama").hook_dict)
    block = {f"blocks.0.{n}" for n in (
        "hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post",
        "ln1.hook_scale", "ln1.hook_normalized", "ln2.hook_scale", "ln2.hook_normalized",
        "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k",
        "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "attn.hook_result",
        "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")}  # fmt: skip
    assert block <= names
    assert {"hook_embed", "ln_final.hook_scale", "ln_final.hook_normalized"} <= names
    gpt2 = set(make_bridge("gpt2").hook_dict)
    assert "hook_pos_embed" in gpt2 and "blocks.0.attn.hook_rot_q" not in gpt2
    _, cache = make_bridge("gpt2").run_with_cache(torch.ones(3, 5, dtype=torch.long), names_filter="hook_pos_embed")
    assert cache["hook_pos_embed"].shape == (3, 5, 32)  # shown per row, like every other activation
    assert "blocks.0.hook_resid_mid" not in make_bridge("gpt_neox").hook_dict  # parallel attention + MLP


# -- bad input ---------------------------------------------------------------------------------------


def test_unsupported_architecture_lists_supported():
    from transformers import BertConfig, BertLMHeadModel

    hf = BertLMHeadModel(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=37, is_decoder=True))  # fmt: skip
    with pytest.raises(UnsupportedArchitectureError, match="bert") as info:
        TransformerBridge(hf)
    assert all(t in str(info.value) for t in SUPPORTED_MODEL_TYPES)
    assert isinstance(info.value, ValueError)


def test_not_a_model():
    with pytest.raises(TypeError, match="hf_model"):
        TransformerBridge("gpt2")


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        (3.5, TypeError, "input"),
        ([1, 2, 3], TypeError, "input"),
        (torch.tensor([[1.0, 2.0]]), TypeError, "integer"),
        (torch.tensor([[1, V]]), ValueError, r"token id 99, outside the vocabulary \[0, 98\]"),
        (torch.tensor([[-1, 2]]), ValueError, "token id -1, outside the vocabulary"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, "pos ≥ 1"),
        (torch.zeros(0, 3, dtype=torch.long), ValueError, "batch ≥ 1"),
        (torch.ones(1, 200, dtype=torch.long), ValueError, "context limit is 128"),
    ],
)
def test_bad_inputs(bad, exc, match):
    model = make_bridge("llama")
    with pytest.raises(exc, match=match):
        model(bad)


def test_bad_mask_shape_and_return_type():
    model = make_bridge("gpt2")
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="return_type"):
        model(torch.ones(1, 4, dtype=torch.long), return_type="probs")


def test_text_without_tokenizer():
    model = TransformerBridge(make_hf("gpt2"))
    with pytest.raises(ValueError, match="no tokenizer"):
        model("hello")


def test_invalid_device():
    model = make_bridge("gpt2")
    with pytest.raises(ValueError, match="not a valid torch device"):
        model.run_with_cache(torch.ones(1, 3, dtype=torch.long), device="gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            model.run_with_cache(torch.ones(1, 3, dtype=torch.long), device="cuda")


def test_a_module_assigned_to_a_read_only_property_is_refused():
    """nn.Module would register a module assigned to ``blocks`` as a submodule (its parameters would join the
    bridge's) while the property still answers: refused, and the bridge is unchanged."""
    model = make_bridge("gpt2")
    before = [name for name, _ in model.named_parameters()]
    with pytest.raises(AttributeError, match="`blocks` is read off the wrapped HF model"):
        model.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    assert [name for name, _ in model.named_parameters()] == before
    assert type(model.blocks).__name__ == "Blocks"
    model.probe = torch.nn.Linear(2, 2)  # other attributes are assigned as nn.Module assigns them
    assert "probe.weight" in dict(model.named_parameters())
