"""Run by test_tp.py in its own process (vLLM reads its thread binding once per process): TP=2 against TP=1 on the
tiny Llama at ``sys.argv[1]``. Exit status 0 when hooks saw whole tensors and caches and steered tokens match."""

import os
import sys

os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank; vLLM refuses TP=2 on this machine without it
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

from transformer_bridge.vllm import Intervention, VLLMBridge

PROMPTS = [[1, 5, 7, 9, 11], [1, 8, 3]]
NAMES = ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k", "blocks.1.attn.hook_z", "blocks.1.attn.hook_result",
         "blocks.0.mlp.hook_pre", "blocks.1.mlp.hook_post", "blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern",
         "unembed.hook_out"]  # fmt: skip
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256, seed=0)


def whole(x, hook):  # runs in each worker process: a sharded tensor fails here, and the call with it
    expected = {"hook_q": (4, 64), "hook_post": (148,)}[hook.name.rsplit(".", 1)[1]]
    if tuple(x.shape[2:]) != expected:
        raise AssertionError(f"{hook.name}: {tuple(x.shape)}")


def main(path: str) -> None:
    tp2 = VLLMBridge.from_pretrained(path, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    assert tp2.info["tp"] == 2 and tp2.cfg.n_heads == 4 and tp2.cfg.n_key_value_heads == 2
    steer = [[Intervention("blocks.0.hook_resid_post", add=3.0 * torch.ones(256), positions=[1, 2])], None]
    kw = dict(max_new_tokens=5, return_cache=True, names_filter=NAMES, interventions=steer, stop_at_eos=False)
    with tp2.hooks(fwd_hooks=[("blocks.0.attn.hook_q", whole), ("blocks.1.mlp.hook_post", whole)]):
        out2, caches2 = tp2.generate(PROMPTS, **kw)
    tp1 = VLLMBridge.from_pretrained(path, **ENGINE)
    out1, caches1 = tp1.generate(PROMPTS, **kw)
    assert out2 == out1, (out2, out1)
    worst = 0.0
    for c2, c1 in zip(caches2, caches1, strict=True):
        assert list(c2.keys()) == list(c1.keys()) and sorted(c2.keys()) == sorted(NAMES)
        for name in NAMES:
            assert c2[name].shape == c1[name].shape, name
            a, b = c2[name], c1[name]
            worst = max(worst, torch.where(a == b, 0.0, (a - b).abs()).max().item())
    assert worst < 1e-5, worst
    print(f"tp_check: TP=2 equals TP=1 (worst {worst:.1e})")


if __name__ == "__main__":
    main(sys.argv[1])
