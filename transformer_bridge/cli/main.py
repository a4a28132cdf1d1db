"""The ``transformer-bridge`` command: prepare the local SmolLM2 model, list hook points, generate.

    transformer-bridge prepare-smollm2              # convert the GGUF once (``make setup`` does this)
    transformer-bridge hooks smollm2 --filter attn  # hook point names, with shapes for a short input
    transformer-bridge generate smollm2 "The capital of France is" --max-new-tokens 8 --top-k 40 --top-p 0.9
    transformer-bridge generate smollm2 "Hi" --cache out.safetensors --names-filter "blocks.*.hook_resid_post"
    transformer-bridge generate smollm2 --interactive --temperature 0.7   # a prompt loop (see `repl`)

``MODEL`` is a local HF folder, or ``smollm2`` for the converted SmolLM2-135M-Instruct. Nothing is
downloaded. ``generate`` takes every option of `TransformerBridge.generate` that has a command-line form as a
flag (``--help`` lists them; they are derived from `generation.declare.OPTIONS`), plus ``--device``, ``--dtype``,
``--interactive`` and ``--cache``.
"""

import argparse
import fnmatch
import sys
from collections.abc import Sequence

import torch

from ..bridge import TransformerBridge
from ..real_model import smollm2_path
from .options import add_generate_flags, given
from .repl import run_repl

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load(model: str, dtype: str = "float32", device: str | None = None) -> TransformerBridge:
    path = str(smollm2_path()) if model == "smollm2" else model
    return TransformerBridge.from_pretrained(path, dtype=DTYPES[dtype], device=device)


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
    model = _load(args.model, args.dtype, args.device)
    options = {"max_new_tokens": 20, **given(args)}
    if args.names_filter is not None and args.cache is None:
        raise SystemExit("--names-filter selects what --cache saves; add --cache OUT.safetensors.")
    names = _names(model, args.names_filter)
    if args.interactive:
        if args.cache is not None:
            raise SystemExit("--cache saves one generation's activations; it does not go with --interactive.")
        run_repl(model, options, sys.stdin, sys.stdout)
        return
    if args.prompt is None:
        raise SystemExit("Give a PROMPT, or --interactive for a prompt loop.")
    if args.cache is None:
        print(model.generate(args.prompt, **options))
        return
    options.pop("names_filter", None)
    text, cache = model.generate(args.prompt, return_cache=True, names_filter=names, device="cpu", **options)
    cache.save(args.cache)
    print(text)
    print(f"saved {len(cache)} activations to {args.cache}", file=sys.stderr)


def _names(model: TransformerBridge, pattern: str | None) -> list[str] | None:
    """``--names-filter``: comma-separated hook names or shorthands (``resid_post``), or globs (``blocks.*.attn.*``)."""
    if pattern is None:
        return None
    names: list[str] = []
    for part in (p.strip() for p in pattern.split(",") if p.strip()):
        if any(c in part for c in "*?["):
            matched = [n for n in model.hook_dict if fnmatch.fnmatchcase(n, part)]
            if not matched:
                raise SystemExit(
                    f"--names-filter {part!r} matches no hook point; `transformer-bridge hooks` lists them."
                )
            names += matched
        else:
            try:
                names += model.names_matching(part, "--names-filter")
            except KeyError as e:
                raise SystemExit(str(e)) from e
    return list(dict.fromkeys(names))


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
    gen = sub.add_parser("generate", help="KV-cached generation with every generate option as a flag",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    gen.add_argument("model", help="local HF folder, or 'smollm2'")
    gen.add_argument("prompt", nargs="?", default=None, help="the text to complete (omit with --interactive)")
    gen.add_argument("--device", default=None, help="where the model runs (cpu, cuda, cuda:1, mps)")
    gen.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the model's dtype")
    gen.add_argument("--interactive", action="store_true", help="a prompt loop that streams each completion")
    gen.add_argument("--cache", default=None, metavar="OUT.safetensors",
                     help="save the generation's activation cache (return_cache) to this file")  # fmt: skip
    add_generate_flags(gen)
    gen.set_defaults(run=_generate)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
