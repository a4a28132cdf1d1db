"""Every hook point of vLLM's model against the HF bridge's `run_with_cache` on the same weights (fp32, CPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

from transformer_bridge.vllm import FusedPointError

# tests/conftest.py builds them (VLLM_FAMILIES)
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"]  # more: moe_parity.py, backend_parity.py

TOKENS = [[1, 5, 7, 9, 11, 13, 17], [1, 8, 3], [1, 30, 31, 32, 33]]


# vLLM's CPU GEMMs round differently from torch's: the first projection of a bitwise-equal input already differs by
# ~5e-7 relative, and Gemma 2's sandwich norms (each sublayer's output divided by its RMS) carry that to ~1.8e-6
# relative on a residual of ~7 by the second block (1.2e-5 absolute). So 1e-5, plus 2e-6 of the value's size.
RTOL = 2e-6


def max_diffs(cache, ref, fused=()):
    """Per name, the worst ``|a - b|`` less ``RTOL`` times the tensor's largest magnitude (must stay under 1e-5).
    ``fused``: the points the engine fuses away, which the reference alone has."""
    assert set(ref.keys()) - set(cache.keys()) == set(fused)
    assert sorted(cache.keys()) == sorted(n for n in ref if n not in fused)
    out = {}
    for name in cache:
        assert cache[name].shape == ref[name].shape, name
        a, b = cache[name].float(), ref[name].float()
        size = b[b.isfinite()].abs().max()
        out[name] = torch.where(a == b, 0.0, (a - b).abs()).max().item() - RTOL * size.item()  # -inf scores: equal
    return out


def assert_every_point_equals(model, references):
    """``model.run_with_cache(TOKENS)`` (ragged: one cache per request, in one engine call) against ``references``,
    the HF bridge's ``(logits, cache)`` of each row alone."""
    logits, caches = model.run_with_cache(TOKENS)
    assert len(caches) == len(TOKENS)
    for (ref_logits, ref_cache), lg, cache in zip(references, logits, caches, strict=True):
        assert (lg - ref_logits).abs().max() < 1e-5
        diffs = max_diffs(cache, ref_cache, model.names.fused)
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-5, (worst, diffs[worst])


def references(bridge):
    return [bridge.run_with_cache(torch.tensor([row])) for row in TOKENS]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_point_equals_hf(family, engine, oracle):
    assert_every_point_equals(engine(family), references(oracle(family)))


def test_same_length_requests_stack(engine, oracle):
    model, ref = engine("llama"), oracle("llama")
    tokens = torch.tensor([[1, 5, 7, 9], [1, 9, 8, 7]])
    logits, cache = model.run_with_cache(tokens, names_filter="resid_post")
    ref_logits, ref_cache = ref.run_with_cache(tokens, names_filter="resid_post")
    assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() < 1e-5
    assert (cache["resid_post", 1] - ref_cache["resid_post", 1]).abs().max() < 1e-5
    assert list(cache.keys()) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]


def test_patterns_only_for_layers_asked(engine, oracle):
    model, ref = engine("llama"), oracle("llama")
    _, cache = model.run_with_cache([[1, 4, 6, 8]], names_filter=["blocks.1.attn.hook_pattern"])
    _, ref_cache = ref.run_with_cache(torch.tensor([[1, 4, 6, 8]]), names_filter=["blocks.1.attn.hook_pattern"])
    assert list(cache.keys()) == ["blocks.1.attn.hook_pattern"]
    assert (cache["pattern", 1] - ref_cache["pattern", 1]).abs().max() < 1e-6


def test_unknown_and_fused_names_raise(engine):
    model = engine("llama")
    with pytest.raises(KeyError, match="hook_resid_post"):
        model.run_with_cache([[1, 2]], names_filter="blocks.0.hook_resid_pots")
    model.names.fused.append("blocks.0.mlp.experts.0.hook_in")  # as a fused-MoE engine lists its experts
    try:
        with pytest.raises(FusedPointError, match=r"blocks\.0\.mlp\.experts\.0\.hook_in.*fused away"):
            model.run_with_cache([[1, 2]], names_filter=["blocks.0.mlp.experts.0.hook_in"])
    finally:
        model.names.fused.pop()


@pytest.mark.parametrize(("script", "n_tests"), [("moe_parity.py", 3), ("backend_parity.py", 3)])
def test_in_a_process_of_its_own(script, n_tests):
    """The mixtures of experts (`moe_parity.py`: vLLM creates its expert-parallel group with the first engine of a
    process, so an MoE engine cannot follow this process's dense ones) and vLLM's Transformers backend
    (`backend_parity.py`: it patches HF's model classes in its process)."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).with_name(script))]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{n_tests} passed" in done.stdout
