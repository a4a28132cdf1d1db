"""Cost of gathering tensor-parallel shards for hooks, on 2 CPU processes over gloo.

Under HF tensor parallelism (``tp_plan="auto"``) the heads and MLP neurons are split across ranks; a
hooked point of those kinds gathers the full activation (an all-gather) before its hooks run. This
script times, on every rank, variants of one forward of a mid-size random Llama (median over
interleaved repeats) and prints the ratios to the tensor-parallel forward without hooks (rank 0):

- raw HF (TP) and the bridge with no hooks;
- one read-only hook on a whole point per layer (``hook_resid_post``: nothing to gather);
- one read-only hook per layer on a sharded point (``attn.hook_z``, ``mlp.hook_post``, ``attn.hook_pattern``),
  gathered (the default) and shard-local (`local_shards`);
- `run_with_cache` of every point, gathered and shard-local.

    python benchmarks/scaling.py [--tokens 128] [--repeats 15]   # launches torchrun with 2 processes itself
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from transformer_bridge import TransformerBridge
from transformer_bridge.distributed import local_shards

CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4)  # fmt: skip


def median_times(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so drift hits every variant alike
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def worker(path: str, n_tokens: int, repeats: int) -> None:
    warnings.filterwarnings("ignore")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto").eval()
    model = TransformerBridge(hf)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, n_tokens), generator=torch.Generator().manual_seed(0))
    n_layers = model.cfg.n_layers

    def read(x, hook):
        return None

    def hooked(point: str, local: bool = False):
        def run():
            with torch.no_grad(), model.hooks(fwd_hooks=[(point, read)], read_only=True):
                if local:
                    with local_shards(model):
                        model(tokens)
                else:
                    model(tokens)

        return run

    def raw():
        with torch.no_grad():
            hf(tokens)

    def bridge():
        with torch.no_grad():
            model(tokens)

    def cache(local: bool):
        def run():
            if local:
                with local_shards(model):
                    model.run_with_cache(tokens)
            else:
                model.run_with_cache(tokens)

        return run

    fns = {"raw HF (TP)": raw, "bridge, no hooks": bridge, "resid_post x layers (whole)": hooked("resid_post")}
    for point in ("z", "post", "pattern"):
        fns[f"{point} x layers, gathered"] = hooked(point)
        fns[f"{point} x layers, local_shards"] = hooked(point, local=True)
    fns["run_with_cache (all), gathered"] = cache(False)
    fns["run_with_cache (all), local_shards"] = cache(True)
    med = median_times(fns, repeats)
    if dist.get_rank() == 0:
        base = med["bridge, no hooks"]
        print(f"tensor parallel over {dist.get_world_size()} CPU processes (gloo), torch {torch.__version__}, "
              f"{torch.get_num_threads()} thread(s) each; Llama {CONFIG}, batch 1, {n_tokens} tokens, "
              f"median of {repeats}")  # fmt: skip
        print("| variant | median ms | ratio to TP bridge, no hooks | extra ms per hooked layer |")
        print("|---|---:|---:|---:|")
        for name, t in med.items():
            per_layer = (t - base) / n_layers * 1e3 if " x layers" in name else float("nan")
            extra = f"{per_layer:.2f}" if per_layer == per_layer else ""
            print(f"| {name} | {t * 1e3:.1f} | {t / base:.3f}x | {extra} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--model", help=argparse.SUPPRESS)  # set for the workers
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.model, args.tokens, args.repeats)
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).save_pretrained(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--model", tmp, "--tokens", str(args.tokens), "--repeats", str(args.repeats)]  # fmt: skip
        subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
