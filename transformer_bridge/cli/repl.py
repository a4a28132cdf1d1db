"""``transformer-bridge generate MODEL --interactive``: a prompt loop that streams each completion.

Each line read is a prompt, completed with the current options and printed as it is generated. Lines starting
with ``:`` are commands: ``:set NAME VALUE`` (any command-line option, parsed as its flag is: ``:set top_k 5``,
``:set stop_strings . !``), ``:unset NAME``, ``:options`` (what is set), ``:help``, ``:quit``. Ctrl-C stops the
generation in progress and the loop goes on; at the prompt, end of input (Ctrl-D) ends it. Options that cannot
stream (beam search, records, a cache) complete the prompt with `generate` and print the result at once.

Example:
    >>> run_repl(model, {"max_new_tokens": 16}, io.StringIO("Hello\\n:set temperature 0.7\\nHi\\n"), sys.stdout)
"""

import signal
import threading
from collections.abc import Iterator
from typing import Any, TextIO

from ..core import BridgeCore
from ..generation import generate, generate_stream
from ..generation.declare import not_streamed
from .options import BY_FLAG, parse_setting

HELP = (":set NAME VALUE  set an option (e.g. `:set temperature 0.7`, `:set suppress_tokens 3 4`)\n"
        ":unset NAME      back to the default\n:options         the options set now\n"
        ":help            this text\n:quit            leave (Ctrl-D too)\n"
        "Ctrl-C stops the generation in progress.")  # fmt: skip
PROMPT = ">>> "


def run_repl(
    model: BridgeCore, options: dict[str, Any], stdin: TextIO, stdout: TextIO, first_prompt: str | None = None
) -> None:
    """Read prompts and commands from ``stdin`` until it ends (or ``:quit``); print completions to ``stdout``.
    ``first_prompt`` (the command line's PROMPT) is completed first, as if it were the first line read."""
    options = dict(options)
    streamed = set(not_streamed())
    print(f"transformer-bridge interactive: {type(model.hf_model).__name__}. `:help` for commands.", file=stdout)
    pending = [] if first_prompt is None else [first_prompt + "\n"]
    while True:
        stdout.write(PROMPT)
        stdout.flush()
        try:
            if pending:
                line = pending.pop()
                stdout.write(line)
            else:
                line = stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt
            stdout.write("\n")
            continue
        if not line:
            stdout.write("\n")
            return
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.startswith(":"):
            if _command(line[1:].strip(), options, stdout):
                return
            continue
        can_stream = not any(options.get(name) not in (None, False) for name in streamed)
        with _Interruptible(at_once=not can_stream) as stop:
            try:
                if can_stream:
                    _stream(generate_stream(model, line, **options), stop, stdout)
                else:
                    print(generate(model, line, **options), file=stdout)
            except KeyboardInterrupt:
                print("\n[stopped]", file=stdout)
            except (ValueError, TypeError) as e:  # a bad option: say so, keep the loop
                print(f"error: {e}", file=stdout)


def _stream(chunks: Iterator[Any], stop: threading.Event, stdout: TextIO) -> None:
    for piece in chunks:
        stdout.write(piece if isinstance(piece, str) else " ".join(map(str, piece)))
        stdout.flush()
        if stop.is_set():
            print("\n[stopped]", file=stdout)
            return
    stdout.write("\n")


def _command(text: str, options: dict[str, Any], stdout: TextIO) -> bool:
    """Run one ``:`` command; True to quit."""
    verb, _, rest = text.partition(" ")
    if verb in ("quit", "q", "exit"):
        return True
    if verb == "help":
        print(HELP, file=stdout)
    elif verb == "options":
        shown = {k: v for k, v in options.items() if v is not None}
        print(" ".join(f"{k}={v!r}" for k, v in shown.items()) or "(defaults)", file=stdout)
    elif verb in ("set", "unset"):
        try:
            name, value = parse_setting(rest if verb == "set" else rest.split(" ")[0])
        except ValueError as e:
            print(f"error: {e}", file=stdout)
            return False
        if verb == "set" and value is None:
            print(f"error: `:set {name}` needs a value ({BY_FLAG[name].cli}); `:unset {name}` clears it.", file=stdout)
            return False
        options[name] = value if verb == "set" else None
        print(f"{name} = {options[name]!r}", file=stdout)
    else:
        print(f"error: unknown command :{verb}. `:help` lists them.", file=stdout)
    return False


class _Interruptible:
    """Ctrl-C during a generation sets an event the stream checks between tokens (``at_once``: interrupts right
    away, for a `generate` call), so the loop goes on; outside, Ctrl-C keeps its default meaning."""

    def __init__(self, at_once: bool) -> None:
        self.at_once = at_once

    def __enter__(self) -> threading.Event:
        self.stop = threading.Event()
        self.calls = 0

        def handler(signum: int, frame: Any) -> None:
            self.calls += 1
            self.stop.set()
            if self.at_once or self.calls > 1:  # a second Ctrl-C while streaming: stop now, even inside a forward
                raise KeyboardInterrupt

        self.previous = signal.signal(signal.SIGINT, handler)
        return self.stop

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)


__all__ = ["run_repl"]
