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


def compiled(path: str) -> None:
    """A compiled TP=2 engine (vLLM's default compilation) with declared points: the taps are registered in each
    worker process before it compiles, interventions and captures gather whole tensors, and they equal an eager
    TP=1 engine's."""
    declared = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.0.mlp.hook_post", "unembed.hook_out"]
    engine = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}
    tp2 = VLLMBridge.from_pretrained(path, tensor_parallel_size=2, distributed_executor_backend="mp",
                                     compiled_points=declared, **engine)  # fmt: skip
    assert tp2.info["tp"] == 2 and tp2.compiled
    g = torch.Generator().manual_seed(3)
    kw = dict(max_new_tokens=5, return_cache=True, names_filter=declared, stop_at_eos=False)
    tp1 = VLLMBridge.from_pretrained(path, **ENGINE)
    worst = 0.0
    for _ in range(2):  # new vectors each round: data, never compiled in
        steer = [[Intervention("blocks.0.hook_resid_post", add=3.0 * torch.randn(256, generator=g))], None]
        out2, caches2 = tp2.generate(PROMPTS, interventions=steer, **kw)
        out1, caches1 = tp1.generate(PROMPTS, interventions=steer, **kw)
        assert out2 == out1, (out2, out1)
        for c2, c1 in zip(caches2, caches1, strict=True):
            assert sorted(c2.keys()) == sorted(declared)
            for name in declared:
                assert c2[name].shape == c1[name].shape, name
                worst = max(worst, (c2[name] - c1[name]).abs().max().item())
    assert worst < 1e-5, worst
    print(f"tp_check: compiled TP=2 equals eager TP=1 (worst {worst:.1e})")


def vllm_defaults(path: str) -> None:
    """vLLM's default runs the engine core in another process (``VLLM_ENABLE_V1_MULTIPROCESSING`` unset, read when an
    engine is built): `from_pretrained` builds its engine with the core in this process, and a compiled engine's
    taps reach the worker."""
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    engine = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}
    fast = VLLMBridge.from_pretrained(path, compiled_points=["blocks.0.hook_resid_post"], **engine)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and fast.declared == {"blocks.0.hook_resid_post"}
    steer = [[Intervention("blocks.0.hook_resid_post", add=3.0 * torch.ones(256))], None]
    kw = dict(max_new_tokens=4, return_cache=True, names_filter="blocks.0.hook_resid_post", stop_at_eos=False)
    out, caches = fast.generate(PROMPTS, interventions=steer, **kw)
    eager = VLLMBridge.from_pretrained(path, **ENGINE)
    out1, caches1 = eager.generate(PROMPTS, interventions=steer, **kw)
    assert out == out1 and out != eager.generate(PROMPTS, max_new_tokens=4, stop_at_eos=False)
    worst = max((a[n] - b[n]).abs().max().item() for a, b in zip(caches, caches1, strict=True) for n in a)
    assert worst < 1e-5, worst
    print(f"tp_check: vLLM's defaults served (worst {worst:.1e})")


def core_elsewhere(path: str) -> None:
    """An `LLM` built with its engine core in another process is refused by name when wrapped (vLLM reads the
    variable once per process, so in a process of its own)."""
    from vllm import LLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    elsewhere = LLM(model=path, **ENGINE)
    try:
        VLLMBridge(elsewhere)
    except ValueError as e:
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" in str(e) and "from_pretrained" in str(e), e
    else:
        raise AssertionError("an engine core in another process must be refused")
    print("tp_check: a multiprocess engine core refused")


if __name__ == "__main__":
    modes = {"compiled": compiled, "defaults": vllm_defaults, "core_elsewhere": core_elsewhere}
    modes.get(sys.argv[2] if sys.argv[2:] else "", main)(sys.argv[1])
