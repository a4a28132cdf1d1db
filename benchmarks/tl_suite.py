"""Summarise a run of TransformerLens' own test suite against two bridges (issue #9).

TransformerLens 4.3's tests are ported outside this repository (only the imports and the model
construction change: the same tiny seeded HF models, built from configs, are wrapped by TL 4.3's
`TransformerBridge` on one side and by ours on the other) and run once per side with pytest's
``--junitxml``. This script reads the two XML files and writes the Markdown table: per test file,
passed / failed / errored / not portable / skipped for each side, the totals, and the most frequent
failure causes on each side. No TransformerLens code is here.

A test counts as *not portable* when it was skipped with a reason that says so (``NOT_PORTABLE: …``)
or because its oracle is TransformerLens' frozen goldens (a hub dataset of real-checkpoint activations).

Usage::

    python benchmarks/tl_suite.py TL.xml OURS.xml > benchmarks/results/tl_suite.md
"""

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "not_portable", "skipped")


def outcome(case: ET.Element) -> tuple[str, str]:
    """(outcome, message) of one junit ``testcase`` element."""
    for tag in ("failure", "error"):
        el = case.find(tag)
        if el is not None:
            return ("failed" if tag == "failure" else "error"), el.get("message") or ""
    el = case.find("skipped")
    if el is not None:
        msg = el.get("message") or ""
        portable = "NOT_PORTABLE" not in msg and "goldens" not in msg.lower()
        return ("skipped" if portable else "not_portable"), msg
    return "passed", ""


def read(path: Path) -> dict[str, tuple[str, str, str]]:
    """test id -> (file, outcome, message)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname") or ""
        file = cls.split(".")[1] if cls.startswith("tests.") else cls.split(".")[0]
        kind, msg = outcome(case)
        out[f"{cls}::{case.get('name')}"] = (file + ".py", kind, msg)
    return out


def cause(msg: str) -> str:
    """A failure message reduced to its kind: first line, numbers and quoted names blurred."""
    line = msg.strip().splitlines()[0] if msg.strip() else "(no message)"
    line = re.sub(r"tensor\(.*", "tensor(...)", line)
    line = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)
    return line[:110]


def table(tl: dict, ours: dict) -> str:
    per_file: dict[str, dict[str, Counter]] = defaultdict(lambda: {"tl": Counter(), "ours": Counter()})
    for side, res in (("tl", tl), ("ours", ours)):
        for file, kind, _ in res.values():
            per_file[file][side][kind] += 1
    head = "| file | " + " | ".join(f"TL {o}" for o in ("pass", "fail", "err", "n/p")) + " | "
    head += " | ".join(f"ours {o}" for o in ("pass", "fail", "err", "n/p")) + " |"
    lines = [head, "|---" * 9 + "|"]
    total = {"tl": Counter(), "ours": Counter()}
    for file in sorted(per_file):
        row = [file]
        for side in ("tl", "ours"):
            c = per_file[file][side]
            total[side].update(c)
            row += [str(c[k]) for k in ("passed", "failed", "error", "not_portable")]
        lines.append("| " + " | ".join(row) + " |")
    row = ["**total**"]
    for side in ("tl", "ours"):
        row += [f"**{total[side][k]}**" for k in ("passed", "failed", "error", "not_portable")]
    lines.append("| " + " | ".join(row) + " |")
    other = {s: total[s]["skipped"] for s in total}
    if any(other.values()):
        lines.append(f"\nOther skips (the test skipped itself): TL {other['tl']}, ours {other['ours']}.")
    return "\n".join(lines)


def causes(res: dict, n: int = 12) -> str:
    c = Counter(cause(msg) for _, kind, msg in res.values() if kind in ("failed", "error"))
    return "\n".join(f"| {k} | `{m}` |" for m, k in c.most_common(n)) or "| 0 | (none) |"


def both(tl: dict, ours: dict) -> str:
    keys = set(tl) & set(ours)
    pairs = Counter((tl[k][1] == "passed", ours[k][1] == "passed") for k in keys)
    skipped = ("not_portable", "skipped")
    same = [k for k in keys if tl[k][1] not in skipped and ours[k][1] not in skipped]
    return (
        f"Both pass: {pairs[(True, True)]}; only TL passes: {pairs[(True, False)]}; "
        f"only ours passes: {pairs[(False, True)]}; neither: {pairs[(False, False)]}.\n\n"
        f"On the {len(same)} tests that run on both sides (skipped or not portable on neither): "
        f"TL passes {sum(tl[k][1] == 'passed' for k in same)}, ours {sum(ours[k][1] == 'passed' for k in same)}."
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tl_xml", type=Path)
    ap.add_argument("ours_xml", type=Path)
    ap.add_argument("--failures", action="store_true", help="also list every test that fails on one side only")
    a = ap.parse_args(argv)
    tl, ours = read(a.tl_xml), read(a.ours_xml)
    out = [
        table(tl, ours),
        "",
        both(tl, ours),
        "",
        "Top failure causes, TL 4.3's bridge:",
        "",
        "| tests | first line of the failure |",
        "|---|---|",
        causes(tl),
        "",
        "Top failure causes, ours:",
        "",
        "| tests | first line of the failure |",
        "|---|---|",
        causes(ours),
    ]
    if a.failures:
        for name, side, other in (("TL only fails", tl, ours), ("ours only fails", ours, tl)):
            out += ["", f"{name}:", ""]
            out += [
                f"- `{k}`: {cause(side[k][2])}"
                for k in sorted(side)
                if side[k][1] in ("failed", "error") and other.get(k, ("", ""))[1] == "passed"
            ]
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
