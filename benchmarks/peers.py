"""The bridge beside its peers on SmolLM2-135M-Instruct (fp32, CPU), measured in one process.

Peers, each timed only where installed (neither is a dependency of this project):

- TransformerLens' own ``TransformerBridge`` (v3+, ``boot_transformers``; it forces eager attention),
- nnsight's ``TransformersModel`` (``LanguageModel`` before 0.8): ``trace`` / ``generate`` contexts
  around the unmodified HF model.

Every tool wraps its own copy of the same weights. Forward workloads (batch 1, ``--tokens`` random
tokens): no intervention; one steering edit (a fixed random vector added to the residual stream
after block 15); caching every hook point. Generation: greedy, exactly ``--gen-tokens`` new tokens
from a real prompt (EOS does not stop any tool), then the same with a cache of prompt + output.
Reported: median ms, ratio to raw HF (SDPA), and the largest logit difference to raw HF (no edit)
or to this bridge (steered) — the latter says the tools edit the same tensor.

    .venv/bin/python benchmarks/peers.py [--tokens 128] [--repeats 11] [--gen-tokens 32]
"""

import argparse
import importlib.metadata
import importlib.util
import os
import statistics
import time

import torch
from forward import median_times
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformer_bridge import TransformerBridge
from transformer_bridge.real_model import smollm2_path

LAYER = 15
PROMPT = "The Eiffel Tower is located in the city of"


def _load(path: str):
    """A fresh HF copy; its generation config never stops at EOS, like ``stop_at_eos=False`` elsewhere."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _not_result(name: str) -> bool:
    """TransformerLens' bridge has no per-head ``attn.hook_result``; this filter caches the same kinds of points."""
    return not name.endswith("attn.hook_result")


def _cache_size(cache) -> tuple[int, float]:
    """Names, and MB with each distinct storage counted once (aliases share storage)."""
    storages = {}
    for t in cache.values():
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return len(cache), sum(storages.values()) / 2**20


def _peers(path: str, tokenizer) -> dict:
    """The installed peers, each wrapping its own copy of the model: name → wrapped model."""
    found: dict = {}
    if importlib.util.find_spec("transformer_lens") is not None:
        try:
            from transformer_lens.model_bridge import TransformerBridge as LensBridge
        except ImportError:  # TransformerLens 2.x has no bridge: HookedTransformer cannot load a local Llama
            LensBridge = None  # noqa: N806
        if LensBridge is not None:
            lens = LensBridge.boot_transformers(path, hf_model=_load(path), tokenizer=tokenizer, device="cpu")
            found["TransformerLens bridge"] = lens
    if importlib.util.find_spec("nnsight") is not None:
        try:
            from nnsight import TransformersModel

            found["nnsight"] = TransformersModel(_load(path), tokenizer=tokenizer, task="text-generation")
        except ImportError:  # nnsight before 0.8
            from nnsight import LanguageModel

            found["nnsight"] = LanguageModel(_load(path), tokenizer=tokenizer)
    return found


def forward_table(path: str, tokenizer, peers: dict, tokens: torch.Tensor, repeats: int) -> None:
    raw = _load(path)
    ours = TransformerBridge(_load(path), tokenizer)
    steer = torch.randn(ours.cfg.d_model, generator=torch.Generator().manual_seed(1)) * 2.0
    name = f"blocks.{LAYER}.hook_resid_post"

    def add(x, hook):
        return x + steer

    fns, outputs = {}, {}
    fns["HF (sdpa)"] = lambda: raw(tokens).logits
    fns["this bridge"] = lambda: ours(tokens)
    fns["this bridge, steered"] = lambda: ours.run_with_hooks(tokens, fwd_hooks=[(name, add)])
    fns["this bridge, run_with_cache (all)"] = lambda: ours.run_with_cache(tokens)[0]
    fns["this bridge, run_with_cache (all but attn.hook_result)"] = lambda: ours.run_with_cache(
        tokens, names_filter=_not_result
    )[0]
    cache_sizes = {
        "this bridge": lambda: _cache_size(ours.run_with_cache(tokens)[1]),
        "this bridge without attn.hook_result (not in TL's set)": lambda: _cache_size(
            ours.run_with_cache(tokens, names_filter=_not_result)[1]
        ),
    }
    lens = peers.get("TransformerLens bridge")
    if lens is not None:
        fns["TL bridge"] = lambda: lens(tokens)
        fns["TL bridge, steered"] = lambda: lens.run_with_hooks(tokens, fwd_hooks=[(name, add)])
        fns["TL bridge, run_with_cache (all)"] = lambda: lens.run_with_cache(tokens)[0]
        cache_sizes["TL bridge"] = lambda: _cache_size(lens.run_with_cache(tokens)[1])
    nn = peers.get("nnsight")
    if nn is not None:

        def nn_plain():
            with nn.trace(tokens):
                out = nn.lm_head.output.save()
            return out

        def nn_steered():
            with nn.trace(tokens):
                nn.model.layers[LAYER].output[:] += steer
                out = nn.lm_head.output.save()
            return out

        fns["nnsight trace"] = nn_plain
        fns["nnsight trace, steered"] = nn_steered
    with torch.no_grad():
        for key, fn in fns.items():
            outputs[key] = fn()
        med = median_times(fns, repeats)
    base = med["HF (sdpa)"]
    print(f"\nForward, batch 1, {tokens.shape[1]} tokens, median of {repeats} (interleaved)")
    print("| tool, workload | median ms | ratio to HF | max logit diff |\n|---|---:|---:|---:|")
    for key, t in med.items():
        against = outputs["this bridge, steered"] if "steered" in key else outputs["HF (sdpa)"]
        ref = "vs this bridge steered" if "steered" in key else "vs HF"
        diff = "—" if key in ("HF (sdpa)", "this bridge, steered") else f"{_max_diff(outputs[key], against):.1e} {ref}"
        print(f"| {key} | {t * 1e3:.1f} | {t / base:.2f}x | {diff} |")
    with torch.no_grad():
        sizes = [f"{k}: {n} names, {mb:.0f} MB" for k, fn in cache_sizes.items() for n, mb in [fn()]]
    print(f"run_with_cache (all) at {tokens.shape[1]} tokens — " + "; ".join(sizes))


def generate_table(path: str, tokenizer, peers: dict, new_tokens: int, repeats: int) -> None:
    raw = _load(path)
    ours = TransformerBridge(_load(path), tokenizer)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    fns = {
        "HF generate": lambda: raw.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                            pad_token_id=tokenizer.eos_token_id),
        "this bridge": lambda: ours.generate(ids, max_new_tokens=new_tokens, stop_at_eos=False),
        "this bridge + return_cache (all)": lambda: ours.generate(ids, max_new_tokens=new_tokens, stop_at_eos=False,
                                                                  return_cache=True)[0],
    }  # fmt: skip
    lens = peers.get("TransformerLens bridge")
    if lens is not None:
        fns["TL bridge"] = lambda: lens.generate(ids, max_new_tokens=new_tokens, do_sample=False, stop_at_eos=False,
                                                 verbose=False)  # fmt: skip
        fns["TL bridge + return_cache (all)"] = lambda: lens.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, stop_at_eos=False, verbose=False, return_cache=True
        )[0]
    nn = peers.get("nnsight")
    if nn is not None:

        def nn_generate():
            with nn.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id) as tracer:  # fmt: skip
                out = tracer.result.save()
            return out

        fns["nnsight generate"] = nn_generate
    with torch.no_grad():
        outputs = {k: fn() for k, fn in fns.items()}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
    base = statistics.median(times["HF generate"])
    ref = outputs["HF generate"][0, ids.shape[1] :].tolist()
    print(f"\nGreedy generation, batch 1, {ids.shape[1]}-token prompt, {new_tokens} new tokens, median of {repeats}")
    print("| tool, workload | median ms | ratio to HF | same tokens as HF |\n|---|---:|---:|---|")
    for key, ts in times.items():
        t = statistics.median(ts)
        out = outputs[key]
        seq = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", out)
        same = torch.as_tensor(seq)[0, ids.shape[1] :].tolist() == ref
        print(f"| {key} | {t * 1e3:.0f} | {t / base:.2f}x | {'yes' if same else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--gen-repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    peers = _peers(path, tokenizer)
    versions = {name: importlib.metadata.version(pkg) for name, pkg in
                (("transformer_lens", "transformer-lens"), ("nnsight", "nnsight"))
                if importlib.util.find_spec(name) is not None}  # fmt: skip
    installed = versions or "none installed"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu fp32; peers: {installed}")
    tokens = torch.randint(0, len(tokenizer), (1, args.tokens), generator=torch.Generator().manual_seed(0))
    forward_table(path, tokenizer, peers, tokens, args.repeats)
    generate_table(path, tokenizer, peers, args.gen_tokens, args.gen_repeats)


if __name__ == "__main__":
    main()
