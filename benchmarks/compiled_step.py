"""The compiled decode step at batch > 1 on CPU: BLAS products vs oneDNN-packed weights (`generation.packed`).

Two bridges over the same SmolLM2 weights, one compiled with the packed products turned off
(``packed.MIN_ROWS`` past the batch), one with them on; plus the eager bridge. Interleaved rounds of one
``generate(compile=True)`` call each; reports ms per decode step (median, best; the eager prefill shared
out over the steps), the packed copies' memory, checks that the tokens equal the eager bridge's, and
reports each variant's largest logit difference from the eager bridge and from an fp64 oracle (the same
weights in float64, one teacher-forced forward over the eager tokens). ``--profile`` prints the top ops
of one call of each compiled variant.

    python benchmarks/compiled_step.py [--batch 8] [--new 32] [--rounds 5] [--threads 1] [--profile]
"""

import argparse
import statistics
import sys
import time

import torch

from transformer_bridge import TransformerBridge
from transformer_bridge.generation import packed
from transformer_bridge.real_model import smollm2_path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from generate import PROMPTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = lambda: TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)  # noqa: E731
    blas_model, packed_model = load(), load()
    tokens, mask = blas_model.to_tokens_and_mask(PROMPTS[: args.batch], padding_side="left")
    kw = dict(attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new, return_dict=True,
              output_logits=True)  # fmt: skip

    def run(model: TransformerBridge, rows: int, compile: bool = True):
        packed.MIN_ROWS = rows  # read by the graph pass when it compiles; the graph is then kept per model
        return model.generate(tokens, **kw, compile=compile)

    variants = {"eager": lambda: run(blas_model, 10**9, False), "compiled, BLAS": lambda: run(blas_model, 10**9),
                "compiled, oneDNN packed": lambda: run(packed_model, 2)}  # fmt: skip
    reference = variants["eager"]()
    # fp64 oracle: the same weights in float64, one forward over the eager tokens (teacher forced)
    exact = load().to(torch.float64)
    full_mask = torch.cat([mask, torch.ones(args.batch, args.new, dtype=mask.dtype)], 1)
    with torch.no_grad():
        oracle = exact(reference.sequences, attention_mask=full_mask)[:, -args.new - 1 : -1]
    del exact
    for name, fn in variants.items():
        start = time.perf_counter()
        out = fn()
        same = torch.equal(out.sequences, reference.sequences)
        err = (out.logits - reference.logits).abs().max().item()
        assert out.logits.shape == oracle.shape, (out.logits.shape, oracle.shape)
        err64 = (out.logits.double() - oracle).abs().max().item()
        print(f"{name}: first call {time.perf_counter() - start:.1f} s; tokens equal eager: {same}; "
              f"max |logit - eager| {err:.1e}; max |logit - fp64| {err64:.1e}")  # fmt: skip
        if not same:
            raise SystemExit(f"{name} is not exact")
    print(f"packed copies: {len(packed._PACKS)} weights, {packed.memory_bytes() / 2**20:.0f} MiB")
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            variants[name]()
            times[name].append((time.perf_counter() - start) / args.new * 1e3)
    base = statistics.median(times["compiled, BLAS"])
    print(f"batch {args.batch}, {args.new} new tokens, {args.threads} thread(s), median of {args.rounds} rounds")
    print(f"{'variant':<26}{'ms/step':>9}{'best':>8}{'tokens/s':>10}{'vs BLAS':>9}")
    for name in names:
        med = statistics.median(times[name])
        print(f"{name:<26}{med:>9.1f}{min(times[name]):>8.1f}{args.batch * 1e3 / med:>10.1f}{base / med:>8.2f}x")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name in names[1:]:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                variants[name]()
            print(f"--- {name}: one call ({args.new - 1} compiled steps and the eager prefill)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
