"""Tensor parallelism: with `tensor_parallel_size=2` (two worker processes on this 2-core CPU), hooks see whole
tensors, and caches and steered tokens equal those at TP=1."""

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

from transformer_bridge.vllm import Intervention

PROMPTS = [[1, 5, 7, 9, 11], [1, 8, 3]]
NAMES = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.1.attn.hook_z", "blocks.1.attn.hook_result",
         "blocks.0.mlp.hook_pre", "blocks.1.mlp.hook_post", "blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern",
         "unembed.hook_out"]  # fmt: skip


@pytest.mark.slow
def test_tp2_equals_tp1(fresh_engine, engine, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank; vLLM refuses TP=2 here without it
    tp2 = fresh_engine("llama", tensor_parallel_size=2, distributed_executor_backend="mp")
    tp1 = engine("llama")
    assert tp2.info["tp"] == 2 and tp2.cfg.n_heads == 4 and tp2.cfg.n_key_value_heads == 2
    steer = [[Intervention("blocks.0.hook_resid_post", add=3.0 * torch.ones(256), positions=[1, 2])], None]

    def whole(x, hook):  # runs in each worker process: a sharded tensor would fail here, and the call with it
        expected = {"hook_q": (4, 64), "hook_post": (148,)}[hook.name.rsplit(".", 1)[1]]
        if tuple(x.shape[2:]) != expected:
            raise AssertionError(f"{hook.name}: {tuple(x.shape)}")

    hooks = [("blocks.0.attn.hook_q", whole), ("blocks.1.mlp.hook_post", whole)]
    with tp2.hooks(fwd_hooks=hooks):
        out2, caches2 = tp2.generate(PROMPTS, max_new_tokens=5, return_cache=True, names_filter=NAMES,
                                     interventions=steer, stop_at_eos=False)  # fmt: skip
    out1, caches1 = tp1.generate(PROMPTS, max_new_tokens=5, return_cache=True, names_filter=NAMES,
                                 interventions=steer, stop_at_eos=False)  # fmt: skip
    assert out2 == out1
    for c2, c1 in zip(caches2, caches1, strict=True):
        assert list(c2.keys()) == list(c1.keys()) and sorted(c2.keys()) == sorted(NAMES)
        for name in NAMES:
            assert c2[name].shape == c1[name].shape, name
            assert (c2[name] - c1[name]).abs().max() < 1e-5, name
