"""Summarise a run of TransformerLens' own test suite against two bridges (issue #9).

TransformerLens 4.3's tests are ported outside this repository (only the imports and the model
construction change: the same tiny seeded HF models, built from configs, are wrapped by TL 4.3's
`TransformerBridge` on one side and by ours on the other) and run once per side with pytest's
``--junitxml``. This script reads the two XML files and writes the Markdown table: per test file,
passed / failed / errored / not portable / skipped for each side, the totals, and the most frequent
failure causes on each side. No TransformerLens code is here.

The tests TransformerLens' bridge passes and this one fails are listed with their reasons, read from
``tl_suite_port/reasons.tsv`` (issue #32, item 5): per test, a category (``a``: it inspects TransformerLens'
implementation, not counted; ``b``: different on purpose, documented; ``c``: a generation detail; ``d``: the
port's stand-in model; ``e``: not done here), what a TransformerLens user meets here (``raises``, ``warns``,
``same`` numbers, ``none`` compared, ``silent``: a different result with no error and no warning), where it is
documented, and the reason. A test with no reason is listed as such and counted; a reason for a test that
no longer fails here is reported on stderr.

A test counts as *not portable* when it was skipped with a reason that says so (``NOT_PORTABLE: …``)
or because its oracle is TransformerLens' frozen goldens (a hub dataset of real-checkpoint activations).

Usage::

    python benchmarks/tl_suite.py TL.xml OURS.xml   # benchmarks/results/tl_suite.md below "Result, test by test"
"""

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "not_portable", "skipped")
REASONS = Path(__file__).resolve().parent / "tl_suite_port" / "reasons.tsv"
CATEGORIES = {
    "a": "Inspects TransformerLens' implementation (not counted)",
    "b": "Different on purpose, documented",
    "c": "A generation detail",
    "d": "The port's stand-in model",
    "e": "Not done here",
}
SEEN = ("raises", "warns", "same", "none", "silent")


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
        where = cls or case.get("name") or ""  # a file skipped at collection has only a name: `tests.test_x`
        file = where.split(".")[1] if where.startswith("tests.") else where.split(".")[0]
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


def read_reasons(path: Path) -> dict[str, tuple[str, str, str, str]]:
    """test id -> (category, seen, where documented, reason), from the tab-separated ``path``."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 5 or fields[1] not in CATEGORIES or fields[2] not in SEEN:
            raise ValueError(f"{path}:{n}: expected `id, category (a-e), seen {SEEN}, docs, reason`, got {fields[:3]}")
        out[fields[0]] = tuple(fields[1:])
    return out


def _names(ids: list[str]) -> str:
    """Test ids, parametrized cases of one test folded into one entry: `file::test[p1 | p2]`."""
    cases: dict[str, list[str]] = defaultdict(list)
    for k in ids:
        base, _, param = k.partition("[")
        cases[base].append(param.rstrip("]"))
    return ", ".join(
        f"`{base}`" if params == [""] else f"`{base}[{' | '.join(params)}]`" for base, params in cases.items()
    )


def tl_only(tl: dict, ours: dict, reasons: dict) -> str:
    """The tests TL's bridge passes and this one fails or errors, by category, each with its reason."""
    ids = sorted(k for k in ours if ours[k][1] in ("failed", "error") and tl.get(k, ("", ""))[1] == "passed")
    for k in sorted(set(reasons) - set(ids)):
        print(f"reasons.tsv: {k} does not fail here and pass on TL's bridge; not shown", file=sys.stderr)
    why = {k: reasons.get(k, ("?", "?", "-", f"The failure: {cause(ours[k][2])}")) for k in ids}
    titles = {**CATEGORIES, "?": "No reason recorded yet"}
    counted = [k for k in ids if why[k][0] != "a"]
    silent = [k for k in ids if why[k][1] == "silent"]

    def row(title: str, members: list[str]) -> str:
        return f"| {title} | {len(members)} | " + " | ".join(str(sum(why[k][1] == s for k in members)) for s in SEEN)

    lines = [
        f"{len(ids)} tests pass on TL 4.3's bridge and fail or error here. {len(ids) - len(counted)} of them inspect "
        f"TransformerLens' implementation, so **{len(counted)} tests that TransformerLens passes fail here**, not "
        "counting those. Each is listed below, by category, with what a TransformerLens user meets here: "
        "`raises` (an exception that says why), `warns` (a warning names the difference), "
        "`same` (the numbers the test compares are the same here, and it fails on something else), `none` (no "
        "number involved: names, types, flags), `silent` (a different result with no error and no warning).",
        "",
        "| category | tests | " + " | ".join(SEEN) + " |",
        "|---" * (len(SEEN) + 2) + "|",
        *(row(t, m) + " |" for c, t in titles.items() if (m := [k for k in ids if why[k][0] == c])),
        row("**counted: all but the first row**", counted) + " |",
        "",
        f"Silent differences (a different result with no error and no warning): **{len(silent)}**"
        + (f". They are {_names(silent)}." if silent else "."),
    ]
    for c, title in titles.items():
        groups: dict[tuple, list[str]] = defaultdict(list)
        for k in ids:
            if why[k][0] == c:
                groups[why[k]].append(k)
        if groups:
            lines += ["", f"**{title}** ({sum(map(len, groups.values()))}):", ""]
        for (_, seen, docs, reason), members in groups.items():
            count = f"{len(members)} tests: " if len(members) > 1 else ""
            where = f" Documented: {docs}." if docs != "-" else ""
            lines.append(f"- {count}{_names(members)} ({seen}). {reason}{where}")
    return "\n".join(lines)


def one_side(res: dict, other: dict, kinds: tuple[str, ...]) -> str:
    """The tests ``other`` passes that have one of ``kinds`` in ``res``, each with its message's first line."""
    ids = sorted(k for k in res if res[k][1] in kinds and other.get(k, ("", ""))[1] == "passed")
    return "\n".join(f"- `{k}`: {cause(res[k][2])}" for k in ids) or "(none)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tl_xml", type=Path)
    ap.add_argument("ours_xml", type=Path)
    ap.add_argument("--failures", action="store_true", help="also list every test that fails on one side only")
    ap.add_argument("--reasons", type=Path, default=REASONS, help="the reasons file (default: %(default)s)")
    a = ap.parse_args(argv)
    tl, ours = read(a.tl_xml), read(a.ours_xml)
    out = [
        table(tl, ours),
        "",
        both(tl, ours),
        "",
        "## TransformerLens passes, this bridge fails",
        "",
        tl_only(tl, ours, read_reasons(a.reasons) if a.reasons.exists() else {}),
        "",
        "## TransformerLens passes, not portable or skipped here",
        "",
        one_side(ours, tl, ("not_portable", "skipped")),
        "",
        "## This bridge passes, TransformerLens fails (TransformerLens' first failure line)",
        "",
        one_side(tl, ours, ("failed", "error")),
        "",
        "## Top failure causes",
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
