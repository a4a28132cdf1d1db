"""`harvest` with a vLLM engine as the runner: the same shards and manifest as with the HF bridge, resumable."""

import json

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

from transformer_bridge import harvest
from transformer_bridge.vllm.harvest import HarvestModel

NAMES = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.1.mlp.hook_post"]
KW = dict(context_length=16, batch_size=4, shard_size="8KB", progress=False)


def documents(n=14):
    g = torch.Generator().manual_seed(3)
    return [[1, *torch.randint(3, 99, (5 + (9 * i) % 31,), generator=g).tolist()] for i in range(n)]


def assert_same_store(a, b, atol=1e-5):
    assert a.names == b.names and len(a) == len(b)
    for meta in ("tokens", "documents", "positions"):
        assert torch.equal(getattr(a, meta).to_tensor(), getattr(b, meta).to_tensor()), meta
    for name in a.names:
        assert (a.read(name).to_tensor() - b.read(name).to_tensor()).abs().max() < atol, name


def test_vllm_harvest_equals_the_hf_bridges(engine, oracle, tmp_path):
    docs = documents()
    ours = harvest(engine("llama"), docs, NAMES, tmp_path / "vllm", **KW)
    ref = harvest(oracle("llama"), docs, NAMES, tmp_path / "hf", **KW)
    assert len(ours.manifest["shards"]) > 2 and ours.manifest["complete"]
    assert {k: v for k, v in ours.manifest.items() if k not in ("model", "shards")} == {
        k: v for k, v in ref.manifest.items() if k not in ("model", "shards")
    }
    assert_same_store(ours, ref)


def test_vllm_harvest_resumes_after_a_crash(engine, tmp_path, monkeypatch):
    docs, model = documents(), engine("llama")
    whole = harvest(model, docs, NAMES, tmp_path / "whole", **KW)
    calls, real = [0], HarvestModel.forward_tokens

    def crash_on_the_fifth_batch(self, tokens, mask, **kw):
        calls[0] += 1
        if calls[0] == 5:
            raise KeyboardInterrupt("killed")
        return real(self, tokens, mask, **kw)

    monkeypatch.setattr(HarvestModel, "forward_tokens", crash_on_the_fifth_batch)
    with pytest.raises(KeyboardInterrupt):
        harvest(model, docs, NAMES, tmp_path / "resumed", **KW)
    monkeypatch.setattr(HarvestModel, "forward_tokens", real)
    left = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert not left["complete"] and 0 < len(left["shards"]) < len(whole.manifest["shards"])  # a run half done
    resumed = harvest(model, docs, NAMES, tmp_path / "resumed", **KW)
    assert resumed.manifest["complete"]
    assert_same_store(resumed, whole)
