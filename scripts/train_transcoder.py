"""Train per-layer transcoders for SmolLM2-135M-Instruct (or a tiny random Llama with ``--tiny``) on the bridge's
activation store, and save them in circuit-tracer's folder format for `TranscoderSet.load` / circuit-tracer.

The text is the project's own documentation (offline); pass ``--text`` files for your own corpus.

    python scripts/train_transcoder.py --out smollm2-transcoders --d-transcoder 1024 --steps 500
"""

import argparse
import tempfile
from pathlib import Path

import torch

from transformer_bridge import TransformerBridge, harvest
from transformer_bridge.graphs import TranscoderSet
from transformer_bridge.graphs.train import harvest_points, train_transcoders

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write the transcoders to")
    parser.add_argument("--text", nargs="*", help="text files to train on (default: docs/*.md)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
    parser.add_argument("--d-transcoder", type=int, default=1024)
    parser.add_argument("--activation", choices=["relu", "topk", "jumprelu"], default="relu")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--l1", type=float, default=3e-4)
    parser.add_argument("--max-tokens", type=int, default=50_000)
    args = parser.parse_args()
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        model = TransformerBridge(LlamaForCausalLM(config).eval())
        texts = [torch.randint(3, 99, (64,)).tolist() for _ in range(64)]
    else:
        from transformer_bridge.real_model import smollm2_path

        model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)
        files = [Path(f) for f in args.text] if args.text else sorted((ROOT / "docs").glob("*.md"))
        texts = [f.read_text(encoding="utf-8") for f in files]
    init = TranscoderSet.random(model, d_transcoder=args.d_transcoder, activation=args.activation, seed=0)
    with tempfile.TemporaryDirectory() as acts:
        store = harvest(model, texts, harvest_points(init), acts, context_length=128, max_tokens=args.max_tokens,
                        progress=False, overwrite=True)  # fmt: skip
        tc, log = train_transcoders(store, init, steps=args.steps, batch_size=args.batch_size, lr=args.lr, l1=args.l1)
    tc.scan = f"trained-{Path(args.out).name}"
    tc.save(args.out)
    for entry in log:
        print(f"layer {entry['layer']}: normalised mse {entry['normalised_mse']:.3f}, L0 {entry['l0']:.1f}")


if __name__ == "__main__":
    main()
