"""Rewrite the option table of docs/generation.md from `generation.declare.OPTIONS` (a test checks it is current).

python scripts/options_table.py
"""

import re
from pathlib import Path

from transformer_bridge.generation.declare import markdown_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "generation.md"
BEGIN, END = "<!-- options-table: begin -->", "<!-- options-table: end -->"


def main() -> None:
    text = DOC.read_text()
    if BEGIN not in text:
        raise SystemExit(f"{DOC} lacks the markers {BEGIN} … {END}")
    table = f"{BEGIN}\n{markdown_table()}\n{END}"
    DOC.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S))


if __name__ == "__main__":
    main()
