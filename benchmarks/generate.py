"""Generation speed: HF `generate` vs bridge `generate` on SmolLM2-135M-Instruct, CPU, greedy, 64 new tokens.

One process, the same model object for every variant. Variants run interleaved, one round at a time,
in alternating order (so drifting machine load hits all of them alike); the table reports the median
and the best round of each (on a shared machine the best round is the least disturbed one). Every
variant generates exactly ``--new`` tokens per row (``min_new_tokens`` for HF and the bridge alike,
so EOS never ends a run early), and the script checks that the bridge's tokens equal HF's.

    python benchmarks/generate.py [--rounds 5] [--new 64] [--threads N] [--flush-denormal]
    python benchmarks/generate.py --fast [--rounds 3] [--batches 1,8] [--json out.json]   # see `bench_fast`
    python benchmarks/generate.py --fast --device cuda --dtype bfloat16   # the GPU table

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
import json
import os
import statistics
import sys
import time
import traceback

import torch
from transformers import CompileConfig

from transformer_bridge import TransformerBridge
from transformer_bridge.generation import fast
from transformer_bridge.generation.decode import recompute_cache
from transformer_bridge.real_model import smollm2_path

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "The three most important inventions of the twentieth century are",
    "My favourite recipe for a quick dinner is",
    "The main difference between a virus and a bacterium is",
    "import numpy as np\n\ndef normalize(x):",
    "In the year 2050, cities will",
]
# Extraction: the answer copies the input, so drafts from the prompt (prompt lookup) are mostly right.
PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the public library, to repair the old bridge over the river, and to hire two "
    "new teachers for the primary school.",
    "Our new phone has a six-inch screen, two cameras on the back and one on the front, a battery that lasts two "
    "days, and it comes in three colours: black, silver and a deep green that the designers call forest.",
    "To make the bread, mix the flour, the water, the salt and the yeast in a large bowl, knead the dough for ten "
    "minutes, let it rise for two hours in a warm place, then bake it for forty minutes in a hot oven.",
    "The train to the coast leaves the central station every hour from six in the morning until ten at night, "
    "stops at four towns on the way, and takes about two and a half hours to reach the harbour.",
]


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # rows appear as they are measured, also when piped
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=64, help="new tokens per row")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--flush-denormal", action="store_true", help="flush denormal floats to zero")
    parser.add_argument("--fast", action="store_true", help="the static-cache / compiled / speculative table")
    parser.add_argument("--batches", default="1,8", help="--fast: batch sizes, comma-separated")
    parser.add_argument("--json", default=None, help="--fast: also write the numbers to this JSON file")
    parser.add_argument("--cold", action="store_true", help="no inductor/FX caches: compile times from scratch")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    if args.cold:
        torch._inductor.config.force_disable_caches = True
    dtype = getattr(torch, args.dtype)
    model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=dtype, device=args.device)
    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "CPU"
    print(
        f"SmolLM2-135M-Instruct {args.dtype}, {where}, {torch.get_num_threads()} threads, greedy, {args.new} new "
        f"tokens, median of {args.rounds} rounds, flush_denormal={args.flush_denormal}, cold compile "
        f"caches={args.cold}, torch {torch.__version__}"
    )
    if args.fast:
        batches = [int(b) for b in args.batches.split(",")]
        record = bench_fast(model, args.new, args.rounds, batches)
        record.update(threads=torch.get_num_threads(), new_tokens=args.new, rounds=args.rounds, cold=args.cold,
                      torch=torch.__version__, time=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      device=where, dtype=args.dtype)  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        return
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


def bandwidth(device: torch.device) -> float:
    """Read bandwidth in bytes/s: the best of 5 sums over a 1 GiB fp32 tensor (on the CPU with torch's threads)."""
    x = torch.ones(2**28, device=device)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * x.element_size() / best


def _timed(fn) -> float:
    """Seconds ``fn()`` takes, its queued device work included."""
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved(variants: dict, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants.items())
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(_timed(fn))
    return times


def bench_fast(model: TransformerBridge, n: int, rounds: int, batches: list[int]) -> dict:
    """HF default / HF static + compile / bridge eager / bridge compiled (no hooks, one `steer`, one Python
    hook) per batch size, then prompt lookup on an extraction task; % of the decode roofline (weight bytes
    read once per step at the measured bandwidth), and the issue's CPU targets. Returns the numbers."""
    weights = sum(p.numel() * p.element_size() for p in model.hf_model.parameters())
    bw = bandwidth(model.device)
    print(f"weights {weights / 1e9:.3f} GB, read bandwidth {bw / 1e9:.1f} GB/s: decode roofline "
          f"{bw / weights:.1f} tokens/s per row; load average {_load()}")  # fmt: skip
    record: dict = {"weights_gb": weights / 1e9, "bandwidth_gbs": bw / 1e9, "load_start": _load(), "tables": {}}
    for batch in batches:
        record["tables"][batch] = _fast_table(model, batch, n, rounds, bw / weights)
    print(f"bridge compile seconds per (batch, cache bucket), latest compile: {fast.COMPILE_SECONDS}")
    record["lookup"] = {batch: _lookup_row(model, batch, n, rounds) for batch in batches}
    if model.device.type == "cuda":
        for batch, rows in record["tables"].items():
            _gpu_targets(batch, rows)
    record["load_end"] = _load()
    print(f"load average at the end {_load()}")
    return record


def _load() -> str:
    """The machine's 1/5/15-minute load averages (other processes share these cores)."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _fast_table(model: TransformerBridge, batch: int, n: int, rounds: int, roofline: float) -> dict:
    tokens, mask = model.to_tokens_and_mask(PROMPTS[:batch], padding_side="left")
    common = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n)
    direction = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    direction = direction.to(model.device, model.cfg.dtype)
    point = "blocks.15.hook_resid_post"
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # HF compiles on CUDA only unless told
    hf_static = dict(cache_implementation="static", compile_config=compile_config)

    def hooked(compile: bool):
        with model.hooks(fwd_hooks=[(point, lambda resid, hook: resid + 4.0 * direction)]):
            return model.generate(tokens, **common, compile=compile)

    def steered(compile: bool):
        with model.steer(point, add=4.0 * direction):
            return model.generate(tokens, **common, compile=compile)

    variants = {
        "HF default": lambda: model.hf_model.generate(tokens, **common, do_sample=False),
        "HF static+compile": lambda: model.hf_model.generate(tokens, **common, do_sample=False, **hf_static),
        "bridge eager": lambda: model.generate(tokens, **common),
        "bridge compiled": lambda: model.generate(tokens, **common, compile=True),
        "compiled + steer()": lambda: steered(True),
        "compiled + Python hook": lambda: hooked(True),
    }
    reference, steer_ref = model.generate(tokens, **common), steered(False)
    first: dict[str, float] = {}
    for name, fn in list(variants.items()):  # warm-up (compiles), and the exactness checks
        start = time.perf_counter()
        try:
            out = fn()
        except Exception:  # a broken variant is reported, and the others are still measured
            traceback.print_exc()
            print(f"  warm-up {name}: FAILED (above); left out of the table")
            del variants[name]
            continue
        _sync()
        first[name] = time.perf_counter() - start
        expected = steer_ref if "+" in name else reference
        same = (out[:, : expected.shape[1]] == expected).all(0).cumprod(0).sum().item()
        verdict = "equal to" if torch.equal(out, expected) else f"DIFFER (first {same} columns equal) from"
        print(f"  warm-up {name}: {first[name]:.1f} s, tokens {verdict} the eager bridge's")
    times = interleaved(variants, rounds)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in ("HF default", "HF static+compile", "bridge compiled", "compiled + steer()"):
        med.setdefault(name, float("nan"))
    print(f"\nbatch {batch}, {n} new tokens, median of {rounds} rounds (load average {_load()})")
    print(f"{'variant':<24}{'tokens/s':>9}{'vs HF':>8}{'vs HF static':>13}{'vs compiled':>12}{'roofline':>10}"
          f"{'compile s':>11}{'best tok/s':>11}")  # fmt: skip
    rows = {}
    for name in times:
        rate = batch * n / med[name]
        compile_s = first[name] - med[name] if "compile" in name else 0.0
        rows[name] = dict(tokens_per_s=rate, vs_hf=med["HF default"] / med[name],
                          vs_hf_static=med["HF static+compile"] / med[name],
                          vs_compiled=med["bridge compiled"] / med[name], roofline=rate / (batch * roofline),
                          compile_s=compile_s, best_tokens_per_s=batch * n / min(times[name]))  # fmt: skip
        r = rows[name]
        print(f"{name:<24}{rate:>9.1f}{r['vs_hf']:>7.2f}x{r['vs_hf_static']:>12.2f}x{r['vs_compiled']:>11.2f}x"
              f"{100 * r['roofline']:>9.0f}%{compile_s:>11.0f}{r['best_tokens_per_s']:>11.1f}")  # fmt: skip
    nan = {key: float("nan") for key in ("vs_hf_static", "roofline", "vs_compiled")}
    compiled, steer = rows.get("bridge compiled", nan), rows.get("compiled + steer()", nan)
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    print(f"targets (batch {batch}): compiled >= 1.0x HF static+compile: {verdict(compiled['vs_hf_static'] >= 1)}"
          f" ({compiled['vs_hf_static']:.2f}x); >= 50% of roofline: {verdict(compiled['roofline'] >= 0.5)}"
          f" ({100 * compiled['roofline']:.0f}%); one steer() >= 0.95x compiled: "
          f"{verdict(steer['vs_compiled'] >= 0.95)} ({steer['vs_compiled']:.2f}x)")  # fmt: skip
    return rows


def _gpu_targets(batch: int, rows: dict) -> None:
    """The issue's GPU targets (batch 1): compiled >= 3x HF default and >= 1.0x HF static+compile."""
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    for name in ("bridge compiled", "compiled + steer()", "compiled + Python hook"):
        r = rows.get(name)
        if r is not None:
            print(f"GPU targets, batch {batch}, {name}: >= 3x HF default: {verdict(r['vs_hf'] >= 3)} "
                  f"({r['vs_hf']:.2f}x); >= 1.0x HF static+compile: {verdict(r['vs_hf_static'] >= 1)} "
                  f"({r['vs_hf_static']:.2f}x)")  # fmt: skip


def _lookup_row(model: TransformerBridge, batch: int, n: int, rounds: int) -> dict:
    texts = [f"Copy the text exactly.\nText: {p}\nCopy: {p.split()[0]}" for p in (PASSAGES * 2)[:batch]]
    tokens, mask = model.to_tokens_and_mask(texts, padding_side="left")
    common = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n)
    variants = {
        "bridge eager": lambda: model.generate(tokens, **common),
        "prompt lookup (k=10)": lambda: model.generate(tokens, **common, prompt_lookup_num_tokens=10),
    }
    if model.device.type == "cuda":  # where a compiled step pays most: its one-token steps replay a CUDA graph
        variants["bridge compiled"] = lambda: model.generate(tokens, **common, compile=True)
        variants["lookup + compile"] = lambda: model.generate(tokens, **common, prompt_lookup_num_tokens=10,
                                                              compile=True)  # fmt: skip
        for fn in list(variants.values())[2:]:
            fn()  # compile outside the timed rounds
    # Equal in fp32; in bf16 a verify chunk's kernels round differently from one-token steps, so this is reported.
    same = torch.equal(variants["bridge eager"](), variants["prompt lookup (k=10)"]())
    med = {name: statistics.median(t) for name, t in interleaved(variants, rounds).items()}
    rates = ", ".join(f"{name} {batch * n / med[name]:.1f} tokens/s" for name in variants)
    ratio = med["bridge eager"] / med["prompt lookup (k=10)"]
    print(f"\nextraction, batch {batch}: {rates}; prompt lookup {ratio:.2f}x eager (tokens "
          f"{'equal' if same else 'DIFFER'}; target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'})")  # fmt: skip
    return {name: batch * n / m for name, m in med.items()} | {"ratio": ratio}


if __name__ == "__main__":
    main()
