"""accelerate device maps: layers on "cpu" and on "disk" (offloaded, loaded for each use), against the same
model on one device. The checks of `tp_checks.py` (logits, the whole cache, every kind of point edited,
gradients, greedy generation plain / steered / with cache, grad_x_input relevance, weights) must agree
bitwise: on one CPU a device map changes where weights wait, not the arithmetic.

With a GPU, `test_cpu_and_cuda_split` also runs a layer on ``cuda:0`` and one on CPU.
"""

import pytest
import torch
from tp_checks import FAMILIES, TOKENS, run_checks, save_tiny
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.filterwarnings("ignore:No tokenizer could be loaded")


def _prefix(family: str) -> tuple[str, str, str]:
    """(base model attribute, embedding, final norm) names in the HF module tree."""
    return ("gpt_neox", "embed_in", "final_layer_norm") if family == "gpt_neox" else ("model", "embed_tokens", "norm")


def split_map(family: str, first: str = "cpu", second: str = "disk") -> dict[str, str]:
    """Embedding, final norm and layer 1 on ``second``, layer 0 and the unembedding on ``first``."""
    base, embed, norm = _prefix(family)
    # Gemma 2 ties the unembedding to the embedding: accelerate cannot load one tensor on two devices.
    embed_device = first if family == "gemma2" else second
    dm = {f"{base}.{embed}": embed_device, f"{base}.layers.0": first, f"{base}.layers.1": second,
          f"{base}.{norm}": second, f"{base}.rotary_emb": first, "lm_head": first}  # fmt: skip
    if family == "gpt_neox":
        dm[f"{base}.emb_dropout"] = first
    return dm


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("device_map")
    out = {}
    for family in FAMILIES:
        save_tiny(family, str(root / family))
        single = TransformerBridge(AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.float32).eval())
        out[family] = (root / family, run_checks(single))
    return out


def _assert_same(expected: dict, got: dict) -> None:
    problems = []
    for key, a in expected.items():
        b = got.get(key)
        if b is None or a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{key}: {None if b is None else (tuple(b.shape), b.dtype)} != {(tuple(a.shape), a.dtype)}")
        elif not torch.equal(a, b.to(a.device)):
            diff = (a.double() - b.double().to(a.device)).abs().max().item()
            problems.append(f"{key}: max |diff| {diff:.3g}")
    assert not problems, "; ".join(problems[:10])


def _offloaded(model: TransformerBridge, family: str) -> torch.nn.Module:
    base, _, _ = _prefix(family)
    return model.hf_model.get_submodule(f"{base}.layers.1")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cpu_and_disk_map_from_pretrained(folders, family: str, tmp_path) -> None:
    path, expected = folders[family]
    model = TransformerBridge.from_pretrained(
        str(path), dtype=torch.float32, tokenizer=None, device_map=split_map(family), offload_folder=str(tmp_path)
    )
    assert model.device == torch.device("cpu")  # the embedding waits on disk (meta) but runs on the CPU
    _assert_same(expected, run_checks(model))
    # Every hook put back what it onloaded: offloaded weights wait on meta again.
    assert {p.device.type for p in _offloaded(model, family).parameters()} == {"meta"}


def test_auto_map_with_max_memory(folders, tmp_path) -> None:
    """``device_map="auto"`` with a CPU budget smaller than the model offloads the rest to disk."""
    path, expected = folders["llama"]
    model = TransformerBridge.from_pretrained(
        str(path), dtype=torch.float32, tokenizer=None, device_map="auto", max_memory={"cpu": 30_000},
        offload_folder=str(tmp_path),
    )  # fmt: skip
    assert "disk" in set(model.hf_model.hf_device_map.values())
    _assert_same(expected, run_checks(model))


def test_wrap_a_model_dispatched_by_accelerate(folders, tmp_path) -> None:
    path, expected = folders["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf = accelerate.dispatch_model(hf, device_map=split_map("llama"), offload_dir=str(tmp_path))
    _assert_same(expected, run_checks(TransformerBridge(hf)))


def test_device_and_device_map_together_is_refused(folders) -> None:
    path, _ = folders["llama"]
    with pytest.raises(ValueError, match="`device`=cpu or `device_map`"):
        TransformerBridge.from_pretrained(str(path), device="cpu", device_map="auto")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cpu_and_cuda_split(folders) -> None:
    """Layer 0 on cuda:0, the rest on the CPU: hooks see each tensor where its module ran, edits stay there,
    the cache is gathered where asked, and the results equal one device to float tolerance."""
    path, expected = folders["llama"]
    model = TransformerBridge.from_pretrained(
        str(path), dtype=torch.float32, tokenizer=None, device_map=split_map("llama", "cuda:0", "cpu")
    )
    seen = {}

    def where(x, hook) -> None:
        seen[hook.name] = x.device

    names = ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    model.run_with_hooks(TOKENS, fwd_hooks=[(n, where) for n in names])
    assert seen == {names[0]: torch.device("cuda", 0), names[1]: torch.device("cpu")}
    _, cache = model.run_with_cache(TOKENS, device="cpu")
    assert {t.device.type for t in cache.values()} == {"cpu"}
    got = run_checks(model)
    for key, a in expected.items():
        b = got[key].to(a.device)
        if a.is_floating_point():
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), key
        elif key.startswith(("generate", "gen_cache/tokens")):
            assert torch.equal(a, b), key
