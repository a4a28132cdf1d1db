"""Generation speed: HF `generate` vs bridge `generate` on SmolLM2-135M-Instruct, CPU, greedy, 64 new tokens.

One process, the same model object for every variant. Variants run interleaved, one round at a time,
in alternating order (so drifting machine load hits all of them alike); the table reports the median
and the best round of each (on a shared machine the best round is the least disturbed one). Every
variant generates exactly ``--new`` tokens per row (``min_new_tokens`` for HF and the bridge alike,
so EOS never ends a run early), and the script checks that the bridge's tokens equal HF's.

    python benchmarks/generate.py [--rounds 5] [--new 64] [--threads N] [--flush-denormal]

On CPU, SmolLM2's unsteered activations produce denormal floats, which x86 computes slowly; a
steering hook that moves the activations can make a run *faster* for that reason alone.
``--flush-denormal`` (``torch.set_flush_denormal(True)``, for every variant, HF's included) removes
that effect, so the table then shows the cost of the hooks themselves.

Variants: ``hf`` (``hf_model.generate``), ``bridge`` (no hooks), ``steer`` (one hook adding a
direction to ``blocks.15.hook_resid_post``), ``return_cache`` (``return_cache=True`` caching every
``resid_post``), ``run_with_cache`` (one forward over the finished sequences with the same filter)
and ``recompute`` (the forward ``return_cache`` adds after decoding, timed alone: run-to-run noise on
a shared CPU is larger than the difference of two whole-generation timings).
"""

import argparse
import statistics
import sys
import time

import torch

from transformer_bridge import TransformerBridge
from transformer_bridge.generation.decode import recompute_cache
from transformer_bridge.real_model import smollm2_path

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "The three most important inventions of the twentieth century are",
]


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # rows appear as they are measured, also when piped
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--flush-denormal", action="store_true", help="flush denormal floats to zero")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)
    print(
        f"SmolLM2-135M-Instruct fp32, CPU, {torch.get_num_threads()} threads, greedy, {args.new} new tokens, "
        f"median of {args.rounds} rounds, flush_denormal={args.flush_denormal}, torch {torch.__version__}"
    )
    for batch in (1, 4):
        bench(model, PROMPTS[:batch], args.new, args.rounds)


def bench(model: TransformerBridge, prompts: list[str], n: int, rounds: int) -> None:
    batch = len(prompts)
    tokens, mask = model.to_tokens_and_mask(prompts, padding_side="left")
    common = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n)
    direction = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    steer = [("blocks.15.hook_resid_post", lambda resid, hook: resid + 4.0 * direction)]
    resid = lambda name: name.endswith("hook_resid_post")  # noqa: E731
    reference = model.generate(tokens, **common)
    full_mask = torch.cat([mask, torch.ones(batch, n, dtype=mask.dtype)], 1)
    finished = model.generate(tokens, **common, return_dict=True)
    names = model.names_matching(resid)

    def run_steer():
        with model.hooks(fwd_hooks=steer):
            return model.generate(tokens, **common)

    variants = {
        "hf": lambda: model.hf_model.generate(tokens, **common, do_sample=False),
        "bridge": lambda: model.generate(tokens, **common),
        "steer": run_steer,
        "return_cache": lambda: model.generate(tokens, **common, return_cache=True, names_filter=resid)[0],
        "run_with_cache": lambda: model.run_with_cache(reference, attention_mask=full_mask, names_filter=resid)[0],
        "recompute": lambda: recompute_cache(model, finished, names, None),  # return_cache's extra work alone
    }
    for name, fn in variants.items():  # warm-up, and the exactness check
        out = fn()
        if name in ("hf", "bridge", "return_cache"):
            assert torch.equal(out, reference), f"{name} tokens differ from the bridge's"
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants.items())
        for name, fn in order if r % 2 == 0 else order[::-1]:  # alternate, so load drift hits all alike
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    best = {name: min(t) for name, t in times.items()}
    print(f"\nbatch {batch} (prompt width {tokens.shape[1]})")
    print(f"{'variant':<16}{'median s':>9}{'tokens/s':>10}{'vs HF':>8}{'best s':>9}{'vs HF':>8}")
    for name in ("hf", "bridge", "steer", "return_cache"):
        print(
            f"{name:<16}{med[name]:>9.3f}{batch * n / med[name]:>10.1f}{med['hf'] / med[name]:>7.2f}x"
            f"{best[name]:>9.3f}{best['hf'] / best[name]:>7.2f}x"
        )
    print(f"return_cache = generate + one recompute forward: recompute {med['recompute']:.3f} s (best "
          f"{best['recompute']:.3f}); run_with_cache on the same tokens {med['run_with_cache']:.3f} s (best "
          f"{best['run_with_cache']:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
