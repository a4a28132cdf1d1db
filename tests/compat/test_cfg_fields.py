"""The cfg rule: every field of ``model.cfg`` a user can assign takes effect where TransformerLens reads it, and
every other assignment raises `ConfigFieldError` naming the field. Each assignable field is checked where it
is read (to_tokens, forward, generate); every other field is checked to refuse."""

import copy
import dataclasses

import pytest
import torch
from conftest import make_bridge

from transformer_bridge.config import _ASSIGNABLE, BridgeConfig, ConfigFieldError

PROMPT = torch.tensor([[1, 40, 41, 42]])


@pytest.fixture
def model():
    return make_bridge("llama")


def greedy(model, n=4, **kw):
    return model.generate(PROMPT, max_new_tokens=n, do_sample=False, **kw)


def test_eos_token_id_stops_generate_and_none_disables_it(model):
    free = greedy(model, 4)
    first = int(free[0, 4])
    model.cfg.eos_token_id = first
    assert model.hf_model.generation_config.eos_token_id == first  # where generate reads it
    assert greedy(model).shape[1] == 5  # stopped at the new EOS
    model.cfg.eos_token_id = [50256, first]  # an id past the vocabulary is never produced (GPT-2's EOS)
    assert greedy(model).shape[1] == 5 and model.cfg.eos_token_id == [50256, first]
    model.cfg.eos_token_id = None
    assert model.hf_model.generation_config.eos_token_id == []
    assert torch.equal(greedy(model), free)  # no EOS: the full length


def test_bos_token_id_is_what_generate_starts_from(model):
    model.cfg.bos_token_id = 7
    out = model.generate(max_new_tokens=1, do_sample=False)
    assert int(out[0, 0]) == 7


def test_default_prepend_bos_and_padding_side(model):
    assert model.to_tokens("ab")[0, 0] == 1
    model.cfg.default_prepend_bos = False
    assert model.to_tokens("ab").tolist() == [[model.to_single_token("a"), model.to_single_token("b")]]
    model.cfg.default_padding_side = "left"
    tokens = model.to_tokens(["a", "abc"])
    assert tokens[0, 0] == model.pad_token_id
    padded = torch.tensor([[0, 0, 5, 6]])
    torch.testing.assert_close(model(padded)[:, -1], model(torch.tensor([[5, 6]]))[:, -1], atol=1e-5, rtol=1e-5)


def test_tokenizer_appends_eos_strips_trailing_eos(model):
    assert model.cfg.tokenizer_appends_eos is False  # the char tokenizer appends none
    with_eos = model.to_tokens("hi<eos>", prepend_bos=False)
    assert with_eos[0, -1] == 2
    model.cfg.tokenizer_appends_eos = True
    stripped = model.to_tokens(["hi<eos>", "a<eos><eos>"], prepend_bos=False)
    assert stripped.tolist() == [with_eos[0, :-1].tolist(), [model.to_single_token("a"), model.pad_token_id]]


def test_n_ctx_limits_inputs_and_truncates_text(model):
    model.cfg.n_ctx = 3
    assert model.to_tokens("abcdef").shape[1] == 3
    with pytest.raises(ValueError, match="context limit is 3"):
        model(torch.tensor([[1, 2, 3, 4]]))


def test_use_attn_result_switches_hook_result_in_and_out_of_full_caches(model):
    """TransformerLens' switch, False by default as there: caches of all points and predicates leave
    ``hook_result`` out (the point stays in ``hook_dict``), a hook or filter naming it computes it; True puts it in
    caches of all points. The logits are the same either way."""
    tokens = torch.tensor([[1, 2, 3, 4]])
    assert model.cfg.use_attn_result is False and "blocks.0.attn.hook_result" in model.hook_dict
    off_logits, off_cache = model.run_with_cache(tokens)
    assert not any(n.endswith("attn.hook_result") for n in off_cache)
    with pytest.raises(KeyError, match=r"not in this cache.*use_attn_result"):  # the cache says why it lacks it
        off_cache["blocks.0.attn.hook_result"]
    assert model.names_matching(lambda n: "attn.hook_" in n) == [
        n for n in model.hook_dict if "attn.hook_" in n and not n.endswith("hook_result")
    ]
    seen = []
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_result", lambda x, hook: seen.append(x.shape))])
    assert len(seen) == 1 and "blocks.0.attn.hook_result" in model.run_with_cache(tokens, names_filter="result")[1]
    model.set_use_attn_result(True)
    try:
        assert model.cfg.use_attn_result is True
        logits, cache = model.run_with_cache(tokens)
        assert torch.equal(off_logits, logits)
        assert set(off_cache.keys()) == set(cache.keys()) - {n for n in cache if n.endswith("hook_result")}
        assert torch.equal(model(tokens), model.hf_model(tokens).logits)  # the model is clean afterwards
    finally:
        model.set_use_attn_result(False)


def test_split_input_flags_take_bools(model):
    model.cfg.use_attn_result = True
    model.cfg.use_attn_result = False
    for flag in ("use_split_qkv_input", "use_attn_in", "use_hook_mlp_in"):  # what they do: test_split_inputs.py
        setattr(model.cfg, flag, True)
        setattr(model.cfg, flag, False)
        with pytest.raises(ConfigFieldError, match=f"cfg.{flag}"):
            setattr(model.cfg, flag, 1)


@pytest.mark.parametrize(
    ("name", "bad"),
    [("default_prepend_bos", "yes"), ("default_padding_side", "up"), ("eos_token_id", -1), ("eos_token_id", "x"),
     ("bos_token_id", 99),
     ("bos_token_id", -1), ("n_ctx", 0), ("tokenizer_appends_eos", 1), ("use_attn_result", None)],
)  # fmt: skip
def test_assignable_fields_validate_values(model, name, bad):
    with pytest.raises(ConfigFieldError, match=f"cfg.{name}"):
        setattr(model.cfg, name, bad)


READ_ONLY = [f.name for f in dataclasses.fields(BridgeConfig) if f.name not in _ASSIGNABLE]


@pytest.mark.parametrize("name", [*READ_ONLY, "n_key_value_heads", "normalization_type", "d_vocab_out", "model_name"])
def test_every_other_field_refuses_assignment(model, name):
    before = getattr(model.cfg, name)
    with pytest.raises(ConfigFieldError, match=f"`cfg.{name}` cannot be assigned") as info:
        setattr(model.cfg, name, before)
    assert isinstance(info.value, AttributeError) and "Assignable" in str(info.value)


def test_unknown_field_is_refused_with_the_assignable_list(model):
    with pytest.raises(ConfigFieldError, match=r"no field `n_layer`.*default_prepend_bos"):
        model.cfg.n_layer = 3
    assert set(_ASSIGNABLE) | set(READ_ONLY) == {f.name for f in dataclasses.fields(BridgeConfig)}


def test_a_copy_keeps_the_assigned_fields(model):
    model.cfg.default_prepend_bos = False
    model.cfg.n_ctx = 5
    twin = copy.deepcopy(model)
    assert twin.cfg.default_prepend_bos is False and twin.cfg.n_ctx == 5
