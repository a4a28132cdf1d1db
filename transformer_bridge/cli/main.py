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

This module parses and checks the arguments without importing torch or transformers (``--help`` and a mistyped
flag answer at once); `commands` does the work.
"""

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .options import add_generate_flags

DTYPES = ("bfloat16", "float16", "float32")
BOS = (
    "Text gets a BOS token as the model's `cfg.default_prepend_bos` says (one when the tokenizer has one), except "
    "for `smollm2`, whose BOS is its chat marker <|im_start|>: raw text gets none, as the README advises; "
    "--prepend-bos / --no-prepend-bos decide for any model."
)


def check_generate(args: argparse.Namespace) -> None:
    """Refuse, before any model is loaded, what the flags cannot mean together; a ``--cache`` file that could not
    be written."""
    if args.names_filter is not None and args.cache is None:
        raise SystemExit("--names-filter selects what --cache saves; add --cache OUT.safetensors.")
    if args.interactive and args.cache is not None:
        raise SystemExit("--cache saves one generation's activations; it does not go with --interactive.")
    if args.prompt is None and not args.interactive:
        raise SystemExit("Give a PROMPT, or --interactive for a prompt loop.")
    least, most = args.min_new_tokens, args.max_new_tokens
    if least is not None and most is not None and least > most:
        raise SystemExit(
            f"--min-new-tokens {least} is more than --max-new-tokens {most}; lower one or raise the other."
        )
    if args.cache is not None:
        check_cache_file(args.cache)


def check_cache_file(path: str) -> None:
    """``--cache``: a file name whose folder exists and can be written (checked before generating)."""
    file = Path(path).expanduser()
    folder = file.parent
    if file.is_dir():
        raise SystemExit(
            f"--cache {path!r} is a folder; give a file name in it, e.g. {str(file / 'acts.safetensors')!r}."
        )
    if not folder.is_dir():
        raise SystemExit(f"--cache {path!r}: no such folder {str(folder)!r}; create it first or choose another.")
    if not os.access(folder, os.W_OK):
        raise SystemExit(f"--cache {path!r}: the folder {str(folder)!r} is not writable; choose another.")


def parser() -> argparse.ArgumentParser:
    """The command line's parser (subcommands and every flag).

    Example:
        >>> parser().parse_args(["generate", "smollm2", "Hi", "--top-k", "5"]).top_k
        5
    """
    top = argparse.ArgumentParser(prog="transformer-bridge", description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare-smollm2", help="convert SmolLM2 from its GGUF once; print the folder").set_defaults(
        run="prepare"
    )
    hooks = sub.add_parser("hooks", help="list hook point names and shapes")
    hooks.add_argument("model", help="local HF folder, or 'smollm2'")
    hooks.add_argument("--filter", default=None, help="only names containing this text")
    hooks.set_defaults(run="hooks")
    gen = sub.add_parser("generate", help="KV-cached generation with every generate option as a flag",
                         description=BOS, formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    gen.add_argument("model", help="local HF folder, or 'smollm2'")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the text to complete (with --interactive: the first prompt of the loop)")  # fmt: skip
    gen.add_argument("--device", default=None, help="where the model runs (cpu, cuda, cuda:1, mps)")
    gen.add_argument("--dtype", default="float32", choices=DTYPES, help="the model's dtype")
    gen.add_argument("--interactive", action="store_true", help="a prompt loop that streams each completion")
    gen.add_argument("--cache", default=None, metavar="OUT.safetensors",
                     help="save the generation's activation cache (return_cache) to this file; its folder must "
                          "exist")  # fmt: skip
    add_generate_flags(gen)
    gen.set_defaults(run="generate", check=check_generate)
    return top


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``transformer-bridge`` command.

    Example:
        >>> main(["hooks", "smollm2", "--filter", "blocks.0.attn"])
    """
    args = parser().parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:
        check(args)
    # The work needs torch and the bridge: imported only now, so that --help and refusals answer at once.
    commands = importlib.import_module(f"{__package__}.commands")
    getattr(commands, args.run)(args)


if __name__ == "__main__":
    main(sys.argv[1:])
