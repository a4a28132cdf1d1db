"""Harvest speed and memory on SmolLM2-135M (fp32, CPU), measured in one process (memory in subprocesses).

1. Throughput. The same token windows (``--docs`` × ``--context`` random ids, batch ``--batch``) go through
   - the plain forward: the bridge with no hooks, logits of every position (HF's own code path);
   - ``harvest`` of one residual point, ``blocks.{L}.hook_resid_post``, for L = the last block (the forward
     runs every block but skips the unembedding) and L = the middle one (the forward stops there);
   - for each, the forward that computes exactly as much (``stop_at_layer=L + 1``, no hooks): the harvest's own
     overhead (hooks, the gather, the shard writes).
   Interleaved repeats, medians; tokens/s, the ratio to the plain forward, and GB/s written.
2. Memory. Peak RSS of a whole harvest (and one shuffled pass over the store) for 1× and 4× the documents, each
   in a fresh process (``--skip-memory`` to skip).
3. Reading. ``ActivationStore.batches`` rows/s: shuffled across shards (batch 4096), sequential, and a small
   SAE's training step (d_model → 8·d_model, ReLU, L1) on those batches, for scale.

    .venv/bin/python benchmarks/harvest.py [--threads 1] [--docs 64] [--context 128] [--batch 8] [--repeats 3]
"""

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from transformer_bridge import ActivationStore, TransformerBridge, harvest
from transformer_bridge.real_model import smollm2_path


def _median_times(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so drift hits every variant alike
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _tokens(n: int, context: int, vocab: int) -> torch.Tensor:
    return torch.randint(100, vocab, (n, context), generator=torch.Generator().manual_seed(0))


def throughput(model: TransformerBridge, tokens: torch.Tensor, batch: int, repeats: int, root: Path) -> None:
    n_layers = model.cfg.n_layers
    batches = list(tokens.split(batch))
    ones = [torch.ones_like(b) for b in batches]

    def forward(stop: int | None = None):
        def run():
            with torch.no_grad():
                for b, m in zip(batches, ones, strict=True):
                    model.forward_tokens(b, m, stop_at_layer=stop)

        return run

    def harvested(layer: int):
        def run():
            out = root / f"h{layer}"
            shutil.rmtree(out, ignore_errors=True)
            harvest(model, tokens, f"blocks.{layer}.hook_resid_post", out, context_length=tokens.shape[1],
                    batch_size=batch, exclude_bos=False, progress=False)  # fmt: skip

        return run

    layers = [n_layers - 1, n_layers // 2]
    fns = {"plain forward (logits)": forward()}
    for layer in layers:
        fns[f"forward to block {layer + 1} (no hooks)"] = forward(layer + 1)
        fns[f"harvest blocks.{layer}.hook_resid_post"] = harvested(layer)
    for fn in fns.values():  # warm-up
        fn()
    med = _median_times(fns, repeats)
    n_tok = tokens.numel()
    plain = med["plain forward (logits)"]
    row_bytes = model.cfg.d_model * 4
    print(f"\n### Throughput: {tokens.shape[0]} windows × {tokens.shape[1]} tokens, batch {batch}\n")
    print("| variant | median s | tokens/s | ÷ plain forward | GB/s written |\n|---|---:|---:|---:|---:|")
    for name, seconds in med.items():
        written = f"{n_tok * row_bytes / seconds / 1e9:.4f}" if name.startswith("harvest") else ""
        print(f"| {name} | {seconds:.2f} | {n_tok / seconds:,.0f} | {plain / seconds:.2f}× | {written} |")
    for layer in layers:
        same = med[f"forward to block {layer + 1} (no hooks)"] / med[f"harvest blocks.{layer}.hook_resid_post"]
        print(f"harvest of layer {layer} ÷ the forward that computes as much: {same:.2f}×")


def memory(docs: int, context: int, batch: int, threads: int, root: Path) -> None:
    print("\n### Peak RSS of a harvest and one shuffled pass (fresh process each)\n")
    print("| documents | tokens | rows | shards | MB written | peak RSS MB |\n|---:|---:|---:|---:|---:|---:|")
    for scale in (1, 4):
        out = root / f"mem{scale}"
        shutil.rmtree(out, ignore_errors=True)
        code = (
            "import json, resource, sys, torch\n"
            f"torch.set_num_threads({threads})\n"
            "from transformer_bridge import TransformerBridge, harvest\n"
            "from transformer_bridge.real_model import smollm2_path\n"
            "model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)\n"
            f"def docs():\n    g = torch.Generator().manual_seed(0)\n    for _ in range({docs * scale}):\n"
            f"        yield torch.randint(100, model.cfg.d_vocab, ({context},), generator=g)\n"
            f"store = harvest(model, docs(), 'blocks.29.hook_resid_post', {str(out)!r}, context_length={context}, "
            f"batch_size={batch}, shard_size='16MB', exclude_bos=False, progress=False)\n"
            "n = sum(b.shape[0] for b in store.batches(batch_size=4096, seed=0))\n"
            "print(json.dumps({'rows': len(store), 'read': n, 'shards': len(store.manifest['shards']),"
            " 'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        res = json.loads(done.stdout.strip().splitlines()[-1])
        mb = sum(f.stat().st_size for f in out.glob("shard-*")) / 2**20
        print(f"| {docs * scale} | {docs * scale * context} | {res['rows']} | {res['shards']} | {mb:.1f} | "
              f"{res['rss']:.0f} |")  # fmt: skip


def reading(store: ActivationStore, repeats: int) -> None:
    name = store.names[0]
    d = store.read(name).shape[1]
    sae = torch.nn.Sequential(torch.nn.Linear(d, 8 * d), torch.nn.ReLU(), torch.nn.Linear(8 * d, d))
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)

    def shuffled():
        return sum(b.shape[0] for b in store.batches(name, batch_size=4096, seed=1))

    def sequential():
        return sum(b.shape[0] for b in store.batches(name, batch_size=4096, shuffle=False))

    def train():
        n = 0
        for x in store.batches(name, batch_size=4096, seed=2):
            h = sae[1](sae[0](x))
            loss = (sae[2](h) - x).pow(2).sum(-1).mean() + 1e-3 * h.abs().sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += x.shape[0]
        return n

    fns = {"batches(shuffle=True), 4096 rows": shuffled, "batches(shuffle=False)": sequential,
           f"SAE {d}→{8 * d} training step on shuffled batches": train}  # fmt: skip
    med = _median_times(fns, repeats)
    rows = len(store)
    print(f"\n### Reading the store back: {rows} rows × {d} fp32, {len(store.manifest['shards'])} shards\n")
    print("| variant | median s | rows/s |\n|---|---:|---:|")
    for k, seconds in med.items():
        print(f"| {k} | {seconds:.3f} | {rows / seconds:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)
    print(f"SmolLM2-135M fp32, CPU, {args.threads} thread(s); torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokens = _tokens(args.docs, args.context, model.cfg.d_vocab)
        throughput(model, tokens, args.batch, args.repeats, root)
        reading(ActivationStore(root / f"h{model.cfg.n_layers - 1}"), args.repeats)
        if not args.skip_memory:
            memory(args.docs, args.context, args.batch, args.threads, root)
    print(f"\npeak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
