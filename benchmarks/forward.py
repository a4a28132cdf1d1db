"""Forward-pass cost of the bridge against the raw HF model, measured in one process.

For SmolLM2-135M-Instruct (fp32) and a tiny random Llama, times (median over interleaved repeats):
raw HF forward, the bridge with no hooks, with one residual-stream hook, and `run_with_cache` of
every hook point (under grad mode, TransformerLens' default, and under ``torch.no_grad()``;
`benchmarks/cache_cost.py` splits the cache's cost). Prints medians, ratios to raw HF, and cache size (MB and MB
per token, counting shared storage once).

    python benchmarks/forward.py [--tokens 128] [--repeats 15] [--skip-real]
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from transformer_bridge import TransformerBridge


def median_times(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so drift hits every variant alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench(label: str, hf_model, tokens: torch.Tensor, repeats: int) -> None:
    model = TransformerBridge(hf_model)
    steer = torch.zeros(model.cfg.d_model)
    mid = model.cfg.n_layers // 2

    def raw():
        with torch.no_grad():
            hf_model(tokens)

    def bridge():
        with torch.no_grad():
            model(tokens)

    def one_hook():
        with torch.no_grad(), model.hooks(fwd_hooks=[(f"blocks.{mid}.hook_resid_post", lambda x, hook: x + steer)]):
            model(tokens)

    def cache_all():
        model.run_with_cache(tokens)

    def cache_all_no_grad():
        with torch.no_grad():
            model.run_with_cache(tokens)

    med = median_times({"raw HF": raw, "bridge, no hooks": bridge, "bridge, 1 resid hook": one_hook,
                         "run_with_cache (all)": cache_all, "run_with_cache (all), no_grad": cache_all_no_grad},
                        repeats)  # fmt: skip
    _, cache = model.run_with_cache(tokens)
    n_tok = tokens.numel()
    mb = cache.nbytes() / 2**20
    naive_mb = sum(t.numel() * t.element_size() for t in cache.values()) / 2**20
    print(f"\n{label}: batch {tokens.shape[0]}, {tokens.shape[1]} tokens, {len(cache)} cached hook points")
    print("| variant | median ms | ratio to raw HF |\n|---|---:|---:|")
    base = med["raw HF"]
    for name, t in med.items():
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.3f}x |")
    print(f"cache: {mb:.1f} MB ({mb / n_tok:.3f} MB/token); with aliases counted twice it would be {naive_mb:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-real", action="store_true", help="only the tiny model")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device cpu (fp32)")
    g = torch.Generator().manual_seed(0)

    torch.manual_seed(0)
    tiny = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()  # fmt: skip
    bench("tiny Llama (2 layers, d_model 32)", tiny, torch.randint(0, 99, (1, args.tokens), generator=g), args.repeats)

    if not args.skip_real:
        from transformer_bridge.real_model import smollm2_path

        hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path()), dtype=torch.float32).eval()
        tokens = torch.randint(0, hf.config.vocab_size, (1, args.tokens), generator=g)
        bench("SmolLM2-135M-Instruct (30 layers)", hf, tokens, args.repeats)


if __name__ == "__main__":
    main()
