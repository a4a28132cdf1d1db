"""Activation-patching sweeps on SmolLM2-135M (fp32, CPU): batched against a serial loop and against
TransformerLens 4.3's ``patching`` module on its own bridge over the same HF weights, measured in one process.

Sweeps (the clean prompt "The Eiffel Tower is located in the city of", the corrupted one with "Colosseum",
metric the logit difference " Paris" − " Rome" at the last position):

- ``resid_pre`` by layer and position (30 × pos patches): the issue's case;
- ``attn_head_out_all_pos`` (30 × 9 heads) and ``attn_head_v_all_pos`` (30 × 3 key-value heads: GQA).

Variants: this bridge batched (``transformer_bridge.patching``, default memory budget); the same function with
``patches_per_forward=1, reuse_corrupted=False`` (TransformerLens' loop: one whole forward and one metric per
patch); TransformerLens 4.3's
function of the same name on ``transformer_lens.model_bridge.TransformerBridge.boot_transformers`` (only where
transformer_lens is importable: run this file with a venv that has both, e.g. a scratch venv with
``transformer-lens==4.3.0`` and this repository on its path). Times are medians over rounds in which every
variant runs once, in turn;
"forwards" counts the HF model's forward calls (batched: the unpatched run, the once-per-model check that the
batch may grow between blocks, then one forward per patched layer); "max |Δ|" is the largest
difference to the batched result.

    .venv/bin/python benchmarks/patching.py [--threads 1] [--rounds 2] [--sweeps resid_pre,head_out,v]
"""

import argparse
import importlib.util
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformer_bridge import TransformerBridge, patching
from transformer_bridge.real_model import smollm2_path

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPTED = "The Colosseum is located in the city of"
SWEEPS = {
    "resid_pre": "get_act_patch_resid_pre",
    "head_out": "get_act_patch_attn_head_out_all_pos",
    "v": "get_act_patch_attn_head_v_all_pos",
}


def _load(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _interleaved(
    fns: dict, rounds: int, models: dict
) -> tuple[dict[str, float], dict[str, torch.Tensor], dict[str, int], dict[str, list[float]]]:
    """Median seconds of each variant over ``rounds`` rounds, the variants taking turns in each round; its output;
    the HF forwards it ran (counted on its HF model); every round's seconds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    outs: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            count = [0]
            handle = models[name].register_forward_hook(lambda *_, count=count: count.__setitem__(0, count[0] + 1))
            start = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - start)
            handle.remove()
            calls[name] = count[0]
    return {k: statistics.median(v) for k, v in times.items()}, outs, calls, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (every variant once per round)")
    parser.add_argument("--sweeps", default="resid_pre,v")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = TransformerBridge(_load(path), tokenizer)
    model.cfg.default_prepend_bos = False  # SmolLM2's BOS is its chat marker: raw text, as HF tokenizes it
    clean, corrupted = model.to_tokens(CLEAN), model.to_tokens(CORRUPTED)
    assert clean.shape == corrupted.shape, (clean.shape, corrupted.shape)
    paris, rome = model.to_single_token(" Paris"), model.to_single_token(" Rome")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[0, -1, paris] - logits[0, -1, rome]

    _, cache = model.run_with_cache(clean)
    lens = None
    if importlib.util.find_spec("transformer_lens") is not None:
        from transformer_lens import patching as tl_patching
        from transformer_lens.model_bridge import TransformerBridge as LensBridge

        lens_hf = _load(path)
        lens = LensBridge.boot_transformers(path, hf_model=lens_hf, tokenizer=tokenizer, device="cpu")
        _, lens_cache = lens.run_with_cache(clean)
    print(f"SmolLM2-135M fp32, CPU, {args.threads} thread(s); {clean.shape[1]} tokens; torch {torch.__version__}")
    print("\n| sweep | patches | variant | forwards | median s | speed-up vs serial | max \\|Δ\\| to batched |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for key in args.sweeps.split(","):
        fn = getattr(patching, SWEEPS[key])
        fns = {
            "this bridge, batched": lambda fn=fn: fn(model, corrupted, cache, metric),
            "this bridge, one patch per forward": lambda fn=fn: fn(model, corrupted, cache, metric,
                                                                  patches_per_forward=1, reuse_corrupted=False),
        }  # fmt: skip
        if lens is not None:
            tl_fn = getattr(tl_patching, SWEEPS[key])
            fns["TransformerLens 4.3 bridge + patching"] = lambda f=tl_fn: f(lens, corrupted, lens_cache, metric)
        fns["this bridge, batched"]()  # warm-up
        models = {name: model.hf_model for name in fns}
        if lens is not None:
            models["TransformerLens 4.3 bridge + patching"] = lens_hf
        med, outs, calls, every = _interleaved(fns, args.rounds, models)
        batched = outs["this bridge, batched"]
        n = batched.numel()
        serial_s = med["this bridge, one patch per forward"]
        for name, seconds in med.items():
            delta = float((outs[name].float().cpu() - batched.float().cpu()).abs().max())
            print(f"| {key} | {n} | {name} | {calls[name]} | {seconds:.2f} | {serial_s / seconds:.1f}× | {delta:.1e} |")
        print("seconds per round:", {k: [round(t, 1) for t in v] for k, v in every.items()})
        if lens is not None:
            tl_s = med["TransformerLens 4.3 bridge + patching"]
            print(f"batched ÷ TransformerLens: {tl_s / med['this bridge, batched']:.1f}× faster")


if __name__ == "__main__":
    main()
