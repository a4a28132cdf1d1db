"""Run the exactness core (``pytest -m core``) against given transformers releases, each in a scratch venv.

    python scripts/compat.py 5.24.0 5.20.2          # one row per release, printed
    python scripts/compat.py --oldest               # the oldest release pyproject.toml declares (CI)
    python scripts/compat.py 5.24.0 --write         # also record it and redraw docs/families.md's table

Each release gets its own venv under ``--venvs`` (default ``$TMPDIR/transformer-bridge-compat``, reused on a
rerun) with the CPU build of torch 2.13.0, that transformers release and the bridge's runtime dependencies;
the bridge itself is imported from this checkout. The core is `tests/test_exactness_core.py`: per family, no-hook
logits bitwise HF's over six shapes, hook shapes, greedy generate == HF, return_cache == run_with_cache.
A family the release does not ship, or whose adapter does not cover it, is "absent". Exit status 1 when any family
fails.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compat.json"
DOC = ROOT / "docs" / "families.md"
BEGIN, END = "<!-- compat-table: begin (scripts/compat.py --write) -->", "<!-- compat-table: end -->"
RUNTIME = ["einops>=0.8", "jaxtyping>=0.2.36", "safetensors>=0.4", "numpy", "packaging", "pytest>=8"]


def declared_range() -> tuple[str, str]:
    """``(oldest, below)`` from pyproject.toml's ``transformers>=A,<B``."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', text)
    if found is None:
        sys.exit("pyproject.toml declares no `transformers>=A,<B` range")
    return found.group(1), found.group(2)


def venv_for(version: str, venvs: Path) -> Path:
    """A venv with torch 2.13.0 (CPU), ``transformers==version`` and the runtime dependencies."""
    venv = venvs / f"transformers-{version}"
    python = venv / "bin" / "python"
    stamp = venv / ".ready"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        # torch first and pinned: an unpinned `torch` would pull several GB of CUDA wheels.
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, "torch==2.13.0", f"transformers=={version}", *RUNTIME], check=True)
        stamp.touch()
    return python


def run_core(python: Path, version: str) -> dict:
    """Run the core; returns ``{"families": {family: outcome}, "seconds": ..., ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "core.xml"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        start = time.monotonic()
        proc = subprocess.run(
            [str(python), "-m", "pytest", "-q", "-m", "core", "-p", "no:cacheprovider", f"--junitxml={report}",
             "tests/test_exactness_core.py"],
            cwd=ROOT, env=env, capture_output=True, text=True,
        )  # fmt: skip
        seconds = time.monotonic() - start
        if not report.exists():
            sys.stdout.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"transformers {version}: pytest produced no report (exit {proc.returncode})")
        families = outcomes(ET.parse(report))
    torch_version = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    return {"families": families, "seconds": round(seconds), "torch": torch_version, "failures": failed[:50],
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def outcomes(tree: ET.ElementTree) -> dict[str, str]:
    """Per family: "pass" (every core test), "absent" (skipped: not in the release), or "FAIL k/n"."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # passed, failed, skipped
    for case in tree.iter("testcase"):
        name = case.get("name", "")
        params = name[name.index("[") + 1 : -1].split("-") if "[" in name else []
        fam = next((p for p in params if not re.fullmatch(r"\d+x\d+|\d+", p)), "?")
        if case.find("skipped") is not None:
            counts[fam][2] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            counts[fam][1] += 1
        else:
            counts[fam][0] += 1
    result = {}
    for fam, (passed, failed, skipped) in sorted(counts.items()):
        if failed:
            result[fam] = f"FAIL {failed}/{passed + failed}"
        elif passed == 0 and skipped:
            result[fam] = "absent"
        else:
            result[fam] = "pass"
    return result


def draw_table(results: dict) -> str:
    """The family × release table for docs/families.md."""
    versions = sorted(results, key=lambda v: tuple(int(x) for x in v.split(".")))
    families = sorted({f for r in results.values() for f in r["families"]})
    mark = {"pass": "✓", "absent": "—"}
    lines = ["| family | " + " | ".join(versions) + " |", "|---|" + "---:|" * len(versions)]
    for fam in families:
        outcome = [results[v]["families"].get(fam, "absent") for v in versions]
        cells = [mark.get(o, o) for o in outcome]
        lines.append(f"| `{fam}` | " + " | ".join(cells) + " |")
    totals = [f"{sum(o == 'pass' for o in results[v]['families'].values())}" for v in versions]
    lines.append("| **families passing** | " + " | ".join(totals) + " |")
    lines.append("| core run time (s) | " + " | ".join(str(results[v]["seconds"]) for v in versions) + " |")
    dates = sorted({results[v]["date"] for v in versions})
    return (
        "\n".join(lines)
        + "\n\n✓ every core test passes; — skipped: the release has no such model, or HF's modules for it there are "
        f"outside the family's adapter range (`Adapter.transformers`, see Versions above). Measured {', '.join(dates)}."
    )


def write(version: str, row: dict) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[version] = row
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    doc = DOC.read_text()
    if BEGIN not in doc:
        raise SystemExit(f"{DOC} lacks the markers {BEGIN!r} … {END!r}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{draw_table(results)}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", help="transformers releases, e.g. 5.24.0")
    parser.add_argument("--oldest", action="store_true", help="the oldest release pyproject.toml declares")
    parser.add_argument("--write", action="store_true", help="record in benchmarks/results and docs/families.md")
    parser.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "transformer-bridge-compat")
    args = parser.parse_args()
    versions = list(args.versions) + ([declared_range()[0]] if args.oldest else [])
    if not versions:
        parser.error("give a release (e.g. 5.24.0) or --oldest")
    failed = False
    for version in versions:
        row = run_core(venv_for(version, args.venvs), version)
        fams = row["families"]
        passing = sum(o == "pass" for o in fams.values())
        print(f"transformers {version} (torch {row['torch']}): {passing}/{len(fams)} families pass the core, "
              f"{sum(o == 'absent' for o in fams.values())} absent, {row['seconds']} s")  # fmt: skip
        for fam, outcome in fams.items():
            if outcome.startswith("FAIL"):
                failed = True
                print(f"  {fam}: {outcome}")
        for line in row["failures"]:
            print(f"  {line}")
        if args.write:
            write(version, row)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
