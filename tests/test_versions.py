"""What the bridge knows about transformers releases (`transformer_bridge.versions`), and the loud failure when
a release moved something an adapter reads."""

import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_bridge, make_hf
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from transformer_bridge import TransformerBridge, versions
from transformer_bridge.adapters import UnsupportedArchitectureError, adapter_for

PYPROJECT = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()


def test_the_declared_ranges_are_the_ones_the_code_knows_and_hold_the_installed_release():
    declared = re.search(r'"transformers(>=[\d.]+,<[\d.]+)"', PYPROJECT).group(1)
    assert declared == versions.TRANSFORMERS_RANGE
    assert re.search(r'"torch(>=[\d.]+,<[\d.]+)"', PYPROJECT).group(1) == versions.TORCH_RANGE
    assert Version(transformers.__version__) in SpecifierSet(declared)
    assert versions.TORCH_VERSION in SpecifierSet(versions.TORCH_RANGE)


def test_the_cache_keyword_is_read_off_the_forward():
    model = make_bridge("llama")
    expected = "cache" if versions.in_range(">=5.24") else "past_key_values"
    assert model._cache_keyword == expected == versions.cache_keyword(type(model.hf_model))

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, kv_state=None): ...

    with pytest.raises(versions.MissingHFFeatureError, match="takes none of the cache keywords"):
        versions.cache_keyword(Renamed)


@pytest.mark.filterwarnings("error")
def test_no_deprecation_warning_from_the_bridge_s_own_calls():
    model = make_bridge("llama")
    tokens = torch.tensor([[1, 5, 6, 7]])
    model(tokens)
    model.run_with_cache(tokens)
    model.generate(tokens, max_new_tokens=3, do_sample=False)  # said: no TransformerLens sampling warning either
    model.generate(tokens, max_new_tokens=3, num_beams=2)
    _, kv = model(tokens, return_type="logits_and_cache")
    model(tokens[:, -1:], past_key_values=kv)


def test_gpt_j_adapter_follows_the_release():
    adapter = adapter_for("gptj")
    assert adapter.attn_registry == versions.in_range(">=5.24")
    model = make_bridge("gptj")
    names = set(model.hook_dict)
    assert "blocks.0.attn.hook_pattern" in names
    assert ("blocks.0.attn.hook_rot_q" in names) == versions.in_range(">=5.24")


def test_a_renamed_module_raises_naming_family_path_and_release():
    hf = make_hf("llama")
    attn = hf.model.layers[1].self_attn
    attn.query_proj = attn.q_proj
    del attn.q_proj
    with pytest.raises(UnsupportedArchitectureError) as info:
        TransformerBridge(hf)
    message = str(info.value)
    assert "model_type='llama'" in message and "self_attn.q_proj" in message
    assert f"transformers {transformers.__version__}" in message and versions.TRANSFORMERS_RANGE in message
    assert not isinstance(info.value.__cause__, UnsupportedArchitectureError)


def test_a_renamed_norm_is_not_silently_dropped():
    hf = make_hf("gpt2")
    block = hf.transformer.h[0]
    block.norm_before_mlp = block.ln_2
    del block.ln_2
    with pytest.raises(UnsupportedArchitectureError, match="ln_2"):
        TransformerBridge(hf)


def test_a_renamed_cache_keyword_raises_clearly(monkeypatch):
    hf = make_hf("llama")

    def forward(input_ids=None, attention_mask=None, kv_state=None):  # no cache keyword HF ever used
        ...

    monkeypatch.setattr(versions, "cache_keyword", versions.cache_keyword.__wrapped__)
    monkeypatch.setattr(type(hf), "forward", forward)
    with pytest.raises(UnsupportedArchitectureError, match="takes none of the cache keywords"):
        TransformerBridge(hf)


def test_an_adapter_for_other_releases_only_names_them():
    from transformer_bridge import adapters

    gptj = [a for a in adapters.ADAPTERS if "gptj" in a.model_types]
    assert len(gptj) == 2 and sum(versions.in_range(a.transformers) for a in gptj) == 1
    assert all(a.transformers for a in gptj)
