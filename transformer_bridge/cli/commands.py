"""What each subcommand does once its arguments are checked (`main` parses and checks them, then imports this
module, which loads torch and the bridge): ``hooks``, ``generate`` and ``prepare-smollm2``.

Example:
    >>> hooks(argparse.Namespace(model="smollm2", filter="blocks.0.attn"))
"""

import argparse
import fnmatch
import sys

import torch

from ..bridge import TransformerBridge
from ..real_model import smollm2_path
from .options import given
from .repl import run_repl

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(model: str, dtype: str = "float32", device: str | None = None) -> TransformerBridge:
    """``MODEL``: a local HF folder, or ``smollm2``, whose BOS (the chat marker ``<|im_start|>``) text does not get
    by default (the README's advice for raw text; ``--prepend-bos`` brings it back)."""
    path = str(smollm2_path()) if model == "smollm2" else model
    bridge = TransformerBridge.from_pretrained(path, dtype=DTYPES[dtype], device=device)
    if model == "smollm2":
        bridge.cfg.default_prepend_bos = False
    bridge._warned_greedy = True  # the command line decodes as HF's generate does; TransformerLens' default is moot
    return bridge


def hooks(args: argparse.Namespace) -> None:
    model = load(args.model)
    names = [n for n in model.hook_dict if args.filter is None or args.filter in n]
    if not names:
        raise SystemExit(f"No hook point name contains {args.filter!r}; try a shorter --filter.")
    tokens = torch.full((1, 4), model.cfg.bos_token_id or 1, dtype=torch.long)
    _, cache = model.run_with_cache(tokens, names_filter=names)
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {list(cache[name].shape)}")
    print(f"{len(names)} of {len(model.hook_dict)} hook points (shapes for batch 1, 4 tokens)")


def generate(args: argparse.Namespace) -> None:
    model = load(args.model, args.dtype, args.device)
    options = {"max_new_tokens": 20, **given(args)}
    names = _names(model, args.names_filter)
    if args.interactive:
        run_repl(model, options, sys.stdin, sys.stdout, first_prompt=args.prompt)
        return
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


def prepare(args: argparse.Namespace) -> None:
    print(smollm2_path())


__all__ = ["DTYPES", "generate", "hooks", "load", "prepare"]
