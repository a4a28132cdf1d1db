"""The fast-generation table on a SmolLM2-shaped model with random weights: no model files needed.

Same architecture and shapes as SmolLM2-135M (30 layers, d_model 576, GQA 9/3 heads, vocab 49152), so the
same speed; the tokens are meaningless, and every variant generates exactly ``--new`` tokens
(``min_new_tokens``). Used on the lent GPU machine, where the real model has to travel in pieces.
Variants as in ``benchmarks/generate.py --fast`` (HF default, HF static+compile, bridge eager, bridge
compiled with no hook / one ``steer`` / one Python hook), interleaved rounds, medians.

    python benchmarks/shaped.py [--device cuda] [--dtype bfloat16] [--batches 1,8] [--rounds 5] [--new 64]
"""

import argparse
import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, LlamaConfig

from transformer_bridge import TransformerBridge

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0, pad_token_id=2,
                    eos_token_id=2, bos_token_id=1)  # fmt: skip


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    hf_model = TransformerBridge.from_config(LlamaConfig(**SMOLLM2_135M), dtype=getattr(torch, args.dtype)).hf_model
    model = TransformerBridge(hf_model.to(args.device), None)
    where = torch.cuda.get_device_name() if model.device.type == "cuda" else "CPU"
    print(f"SmolLM2-shaped random weights, {args.dtype}, {where}, torch {torch.__version__}, {args.new} new tokens, "
          f"median of {args.rounds} interleaved rounds")  # fmt: skip
    for batch in (int(b) for b in args.batches.split(",")):
        table(model, batch, args.new, args.rounds)
    print("graph breaks:", dict(counters["graph_break"]) or "none")


def table(model: TransformerBridge, batch: int, n: int, rounds: int) -> None:
    tokens = torch.randint(3, model.cfg.d_vocab, (batch, 12), device=model.device)
    kw = dict(max_new_tokens=n, min_new_tokens=n, attention_mask=torch.ones_like(tokens))
    point = "blocks.15.hook_resid_post"
    direction = torch.randn(model.cfg.d_model, device=model.device, dtype=model.cfg.dtype)

    def steer():
        with model.steer(point, add=4.0 * direction):
            return model.generate(tokens, **kw, compile=True)

    def hook():
        with model.hooks(fwd_hooks=[(point, lambda x, hook: x + 4.0 * direction)]):
            return model.generate(tokens, **kw, compile=True)

    hf_static = dict(cache_implementation="static", compile_config=CompileConfig())
    variants = {
        "HF default": lambda: model.hf_model.generate(tokens, **kw, do_sample=False),
        "HF static+compile": lambda: model.hf_model.generate(tokens, **kw, do_sample=False, **hf_static),
        "bridge eager": lambda: model.generate(tokens, **kw),
        "bridge compiled": lambda: model.generate(tokens, **kw, compile=True),
        "compiled + steer()": steer,
        "compiled + Python hook": hook,
    }
    for name, fn in variants.items():
        graphs = counters["stats"]["unique_graphs"]
        first = timed(fn)
        fn()
        print(f"batch {batch} warm-up {name}: {first:.1f} s, new graphs {counters['stats']['unique_graphs'] - graphs}")
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants.items())
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(timed(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nbatch {batch}\n{'variant':<24}{'tokens/s':>9}{'vs HF':>8}{'vs HF static':>13}{'vs compiled':>12}"
          f"{'best tok/s':>11}")  # fmt: skip
    for name in variants:
        print(f"{name:<24}{batch * n / med[name]:>9.1f}{med['HF default'] / med[name]:>7.2f}x"
              f"{med['HF static+compile'] / med[name]:>12.2f}x{med['bridge compiled'] / med[name]:>11.2f}x"
              f"{batch * n / min(times[name]):>11.1f}")  # fmt: skip


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
