"""The ``transformer-bridge`` command: prepare the local SmolLM2 model, list hook points, generate.

    transformer-bridge prepare-smollm2              # convert the GGUF once (``make setup`` does this)
    transformer-bridge hooks smollm2 --filter attn  # hook point names, with shapes for a short input
    transformer-bridge generate smollm2 "The capital of France is" --max-new-tokens 8

``MODEL`` is a local HF folder, or ``smollm2`` for the converted SmolLM2-135M-Instruct. Nothing is
downloaded.
"""

import argparse
import sys
from collections.abc import Sequence

import torch

from .bridge import TransformerBridge
from .real_model import smollm2_path


def _load(model: str) -> TransformerBridge:
    path = str(smollm2_path()) if model == "smollm2" else model
    return TransformerBridge.from_pretrained(path, dtype=torch.float32)


def _hooks(args: argparse.Namespace) -> None:
    model = _load(args.model)
    names = [n for n in model.hook_dict if args.filter is None or args.filter in n]
    if not names:
        raise SystemExit(f"No hook point name contains {args.filter!r}; try a shorter --filter.")
    tokens = torch.full((1, 4), model.cfg.bos_token_id or 1, dtype=torch.long)
    _, cache = model.run_with_cache(tokens, names_filter=names)
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {list(cache[name].shape)}")
    print(f"{len(names)} of {len(model.hook_dict)} hook points (shapes for batch 1, 4 tokens)")


def _generate(args: argparse.Namespace) -> None:
    model = _load(args.model)
    kwargs = {"temperature": args.temperature, "seed": args.seed} if args.temperature else {}
    print(model.generate(args.prompt, max_new_tokens=args.max_new_tokens, **kwargs))


def _prepare(args: argparse.Namespace) -> None:
    print(smollm2_path())


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``transformer-bridge`` command.

    Example:
        >>> main(["hooks", "smollm2", "--filter", "blocks.0.attn"])
    """
    parser = argparse.ArgumentParser(prog="transformer-bridge", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare-smollm2", help="convert SmolLM2 from its GGUF once; print the folder").set_defaults(
        run=_prepare
    )
    hooks = sub.add_parser("hooks", help="list hook point names and shapes")
    hooks.add_argument("model", help="local HF folder, or 'smollm2'")
    hooks.add_argument("--filter", default=None, help="only names containing this text")
    hooks.set_defaults(run=_hooks)
    gen = sub.add_parser("generate", help="KV-cached generation (greedy unless --temperature)")
    gen.add_argument("model", help="local HF folder, or 'smollm2'")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=20)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(run=_generate)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
