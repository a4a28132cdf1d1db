"""Attribution graphs at growing prompt lengths: peak memory and time, this bridge against circuit-tracer 0.5
(TransformerLens backend, its own venv), on the same small random Llama and the same transcoders; and a graph over
32 generated tokens against a single last-token graph of the same sequence.

Each measurement runs in a fresh process (peak RSS of that process, so the numbers do not mix); both sides use the
same ``batch_size`` and ``max_feature_nodes``. Prints markdown tables.

    python benchmarks/graphs.py --lengths 128 512 1024 2048 4096 --ct-python /work/venvs/ct/bin/python
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import compare_circuit_tracer as shared  # noqa: E402 (the shared model setup)

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             rms_norm_eps=1e-5)  # fmt: skip
BATCH, FEATURES, D_TRANSCODER = 32, 128, 256


def _tokens(n: int):
    import torch

    tokens = torch.randint(4, SIZES["vocab_size"], (n,), generator=torch.Generator().manual_seed(n))
    tokens[0] = 1
    return tokens


def setup(work: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import char_tokenizer

    from transformer_bridge import TransformerBridge
    from transformer_bridge.graphs import TranscoderSet

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    hf.save_pretrained(work / "model")
    char_tokenizer().save_pretrained(work / "model")
    model = TransformerBridge(hf, char_tokenizer())
    TranscoderSet.random(model, d_transcoder=D_TRANSCODER, density=0.02, seed=0).save(work / "tc")


def run_ours(work: Path, n: int, mode: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import char_tokenizer

    from transformer_bridge import TransformerBridge
    from transformer_bridge.graphs import TranscoderSet, attribute

    model = TransformerBridge(LlamaForCausalLM.from_pretrained(work / "model").eval(), char_tokenizer())
    tc = TranscoderSet.load(work / "tc")
    tokens = _tokens(n)
    start = time.perf_counter()
    if mode == "last":
        graph = attribute(model, tokens, tc, max_n_logits=5, batch_size=BATCH, max_feature_nodes=FEATURES)
    elif mode == "generated":  # the last 32 tokens as a generation: one target per generated token
        from transformer_bridge.graphs import Target

        targets = [Target(p - 1, int(tokens[p])) for p in range(n - 32, n)]
        graph = attribute(model, tokens, tc, targets=targets, batch_size=BATCH, max_feature_nodes=FEATURES)
    else:
        raise ValueError(mode)
    seconds = time.perf_counter() - start
    del torch
    return dict(seconds=seconds, nodes=graph.n_nodes, edges=int(graph.edge_weight.numel()),
                active=graph.meta["n_active_features"])  # fmt: skip


def run_ct(work: Path, n: int, mode: str) -> dict:
    import torch
    from circuit_tracer import attribute

    cfg, weights, tok = shared.ct_setup(work, SIZES)
    model = shared.ct_model(cfg, weights, tok, work / "tc", "plt")
    tokens = _tokens(n)
    start = time.perf_counter()
    graph = attribute(tokens, model, max_n_logits=5, batch_size=BATCH, max_feature_nodes=FEATURES)
    seconds = time.perf_counter() - start
    nodes = graph.adjacency_matrix.shape[0]
    return dict(seconds=seconds, nodes=nodes, edges=int((graph.adjacency_matrix != 0).sum()),
                active=int(graph.active_features.shape[0]), dense_mb=nodes * nodes * 4 / 2**20,
                torch=torch.__version__)  # fmt: skip


def child(args) -> None:
    # a cap on the address space, so that a run that does not fit fails with an allocation error instead of
    # pushing the machine into its out-of-memory killer
    limit = int(args.memory_limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    work = Path(args.work)
    result = (run_ct if args.side == "ct" else run_ours)(work, args.n, args.mode)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def measure(python: str, side: str, work: Path, n: int, mode: str, timeout: int, limit_gb: float = 14.0) -> dict:
    cmd = [python, __file__, "--child", "--side", side, "--work", str(work), "--n", str(n), "--mode", mode,
           "--memory-limit-gb", str(limit_gb)]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        if "can't allocate memory" in out.stderr or "MemoryError" in out.stderr:
            return {"error": "out of memory"}
        return {"error": ("killed" if out.returncode < 0 else tail)[:80]}
    return json.loads(lines[-1][7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--work", default="/tmp/graphs_bench")
    parser.add_argument("--ct-python", default="/work/venvs/ct/bin/python")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--side", default="ours")
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--mode", default="last")
    parser.add_argument("--memory-limit-gb", type=float, default=14.0)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    setup(work)
    print(f"Llama {SIZES['num_hidden_layers']} layers, d_model {SIZES['hidden_size']}, {SIZES['num_attention_heads']} "
          f"heads; PLT ReLU d_transcoder {D_TRANSCODER}; batch_size {BATCH}, max_feature_nodes {FEATURES}, "
          "5 logits")  # fmt: skip
    print("\n| tokens | ours: s | ours: peak MB | ours: edges kept | circuit-tracer: s | circuit-tracer: peak MB "
          "| its dense matrix MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in args.lengths:
        o = measure(sys.executable, "ours", work, n, "last", args.timeout, args.memory_limit_gb)
        c = measure(args.ct_python, "ct", work, n, "last", args.timeout, args.memory_limit_gb)
        fmt = lambda r, k, f: r["error"] if "error" in r else format(r[k], f)  # noqa: E731
        print(f"| {n} | {fmt(o, 'seconds', '.1f')} | {fmt(o, 'peak_rss_mb', '.0f')} | {fmt(o, 'edges', 'd')} | "
              f"{fmt(c, 'seconds', '.1f')} | {fmt(c, 'peak_rss_mb', '.0f')} | {fmt(c, 'dense_mb', '.0f')} |",
              flush=True)  # fmt: skip
    n = 128
    last = measure(sys.executable, "ours", work, n, "last", args.timeout)
    gen = measure(sys.executable, "ours", work, n, "generated", args.timeout)
    print(f"\n32 generated tokens of a {n}-token sequence in one graph: {gen['seconds']:.2f} s, "
          f"{gen['peak_rss_mb']:.0f} "
          f"MB; the last token alone: {last['seconds']:.2f} s, {last['peak_rss_mb']:.0f} MB; ratio "
          f"{gen['seconds'] / last['seconds']:.2f}x time, "
          f"{gen['peak_rss_mb'] / last['peak_rss_mb']:.2f}x memory")  # fmt: skip


if __name__ == "__main__":
    main()
