"""`generate`'s options on the command line: one flag per declared option (`generation.declare.OPTIONS` with a
``cli`` type), their parsers, and the interactive loop's ``:set`` command, which parses with the same functions.

Example:
    >>> parser = argparse.ArgumentParser()
    >>> add_generate_flags(parser)
    >>> given(parser.parse_args(["--top-k", "5", "--suppress-tokens", "3", "4", "--no-do-sample"]))
    {'top_k': 5, 'suppress_tokens': [3, 4], 'do_sample': False}
"""

import argparse
import difflib
import json
from collections.abc import Callable
from typing import Any

from ..generation.declare import OPTIONS, Option

CLI_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS if o.cli is not None)
BY_FLAG: dict[str, Option] = {o.name: o for o in CLI_OPTIONS}


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _json(text: str) -> Any:
    value = json.loads(text)
    if isinstance(value, dict):  # JSON keys are strings: token ids, or "(1, 2)"-like sequences, become ints
        return {_key(k): v for k, v in value.items()}
    return value


def _key(key: str) -> Any:
    parts = [p for p in key.strip("()[] ").replace(",", " ").split() if p]
    if len(parts) == 1 and parts[0].lstrip("-").isdigit():
        return int(parts[0])
    if parts and all(p.lstrip("-").isdigit() for p in parts):
        return tuple(int(p) for p in parts)
    return key


PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "bool": _bool, "str": str, "json": _json,
                                            "ints": int, "strs": str}  # fmt: skip


def flag(option: Option) -> str:
    return "--" + option.name.replace("_", "-")


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per command-line option, grouped as `generate`'s docs group them; every default is "not given"
    (`generate`'s own default applies)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in CLI_OPTIONS:
        group = groups.get(option.group) or groups.setdefault(option.group, parser.add_argument_group(option.group))
        help_text = option.doc.replace("%", "%%").replace("``", "")
        if option.cli == "bool":
            group.add_argument(flag(option), dest=option.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)  # fmt: skip
        elif option.cli in ("ints", "strs"):
            group.add_argument(flag(option), dest=option.name, nargs="+", type=PARSERS[option.cli], default=None,
                               help=help_text)  # fmt: skip
        else:
            metavar = "JSON" if option.cli == "json" else option.cli.upper()
            group.add_argument(flag(option), dest=option.name, type=PARSERS[option.cli], default=None,
                               metavar=metavar, help=help_text)  # fmt: skip


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The options the command line set (``None``: not given)."""
    return {o.name: getattr(args, o.name) for o in CLI_OPTIONS if getattr(args, o.name, None) is not None}


def parse_setting(text: str) -> tuple[str, Any]:
    """``"top_k 5"`` or ``"top-k=5"`` → ``("top_k", 5)``; ``"name"`` alone clears it (``None``). Raises
    `ValueError` naming the option and what it takes."""
    text = text.strip()
    name, _, value = text.replace("=", " ", 1).partition(" ")
    name = name.strip().lstrip("-").replace("-", "_")
    option = BY_FLAG.get(name)
    if option is None:
        close = difflib.get_close_matches(name, list(BY_FLAG), n=1)  # `checks.did_you_mean`'s words, without torch
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown option {name!r}.{hint} `:options` lists them.")
    value = value.strip()
    if not value:
        return option.name, None
    try:
        if option.cli in ("ints", "strs"):
            return option.name, [PARSERS[option.cli](v) for v in value.split()]
        return option.name, PARSERS[option.cli](value)
    except ValueError as e:
        raise ValueError(f"`{option.name}` takes {option.cli}: {e}") from e


__all__ = ["BY_FLAG", "CLI_OPTIONS", "add_generate_flags", "flag", "given", "parse_setting"]
