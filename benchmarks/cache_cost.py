"""What a full activation cache costs, and where (issue #32's goal: `run_with_cache` of every point ≤ 1.1× HF).

On SmolLM2-135M-Instruct (fp32, batch 1, ``--tokens`` tokens), in one process, variants interleaved round by
round, medians printed with their ratio to the raw HF forward:

* two references that keep activations without the bridge: plain torch forward hooks holding every HF module's
  output, and HF's own ``output_hidden_states=True, output_attentions=True`` (eager attention);
* `run_with_cache` of every point, then without one group of points at a time (the ablation says which points
  cost the time).

    python benchmarks/cache_cost.py [--tokens 128] [--rounds 9] [--threads N]
"""

import argparse
import re
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge
from transformer_bridge.real_model import smollm2_path

# Groups left out of the full cache, one at a time (a regex over the point names).
ABLATIONS = {
    "without norm scale / normalized": r"ln.*hook_(scale|normalized)$",
    "without attn scores / pattern": r"hook_(attn_scores|pattern)$",
    "without q / k / v / rot": r"attn\.hook_(q|k|v|rot_q|rot_k)$",
    "without mlp pre / post": r"mlp\.hook_(pre|post|pre_linear)$",
}


def keep_module_outputs(hf_model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every module's (first) tensor output, kept detached: hand-written caching with plain torch hooks."""
    kept: list[torch.Tensor] = []

    def keep(module, args, out):
        first = out[0] if isinstance(out, tuple) else out
        if isinstance(first, torch.Tensor):
            kept.append(first.detach())

    handles = [m.register_forward_hook(keep) for m in hf_model.modules()]
    try:
        with torch.no_grad():
            hf_model(tokens)
    finally:
        for h in handles:
            h.remove()
    return kept


def medians(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - t0)
            del result
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(smollm2_path())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model = TransformerBridge(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    names = list(model.run_with_cache(tokens)[1].keys())

    def raw():
        with torch.no_grad():
            return hf(tokens)

    def hf_outputs():
        with torch.no_grad():
            return eager(tokens, output_hidden_states=True, output_attentions=True)

    fns: dict[str, Callable[[], object]] = {
        "raw HF": raw,
        "torch hooks keeping every module output": lambda: keep_module_outputs(hf, tokens),
        "HF output_hidden_states + output_attentions": hf_outputs,
        f"run_with_cache (all {len(names)} points)": lambda: model.run_with_cache(tokens),
    }
    for label, pattern in ABLATIONS.items():
        kept = [n for n in names if not re.search(pattern, n)]
        fns[f"run_with_cache {label} ({len(kept)})"] = lambda kept=kept: model.run_with_cache(tokens, names_filter=kept)
    fns["run_with_cache, residual stream only"] = lambda: model.run_with_cache(
        tokens, names_filter=[n for n in names if "resid" in n]
    )
    med = medians(fns, args.rounds)
    kept_mb = sum(t.numel() * t.element_size() for t in keep_module_outputs(hf, tokens)) / 2**20
    cache_mb = model.run_with_cache(tokens)[1].nbytes() / 2**20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens; module outputs "
          f"kept {kept_mb:.0f} MB, full cache {cache_mb:.0f} MB")  # fmt: skip
    print("| variant | median ms | ratio to raw HF |\n|---|---:|---:|")
    for name, t in med.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / med['raw HF']:.3f}x |")


if __name__ == "__main__":
    main()
