"""Port TransformerLens 4.3's own tests and run them against TL's bridge and this one (issue #9, #20).

    python benchmarks/tl_suite_port/port.py TL_SDIST_TESTS OUT --tl-python /tmp/tl20/bin/python

copies the files listed in files.txt from TL's source distribution (``pip download transformer-lens==4.3.0
--no-binary :all: --no-deps``, unpacked: its ``tests/``) into OUT/tests (flat; TL's own conftests replaced by
this folder's conftest.py), then runs pytest twice with the same interpreter (a venv holding TL 4.3, this
package on its path, torch and transformers as in the project's): ``TLS_SIDE=tl`` (real TransformerLens) and
``TLS_SIDE=ours`` (shim/ first on the path: TransformerLens' import paths answered by transformer-bridge),
writing OUT/tl.xml and OUT/ours.xml for benchmarks/tl_suite.py. TransformerLens' test code is not kept in
this repository.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def files() -> list[tuple[str, str]]:
    out = []
    for line in (HERE / "files.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            src, *dst = line.split()
            out.append((src, dst[0] if dst else Path(src).name))
    return out


def port(tl_tests: Path, out: Path) -> None:
    tests = out / "tests"
    shutil.rmtree(tests, ignore_errors=True)
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    # Helpers some files import as `tests.<path>`, copied where they live in TL's tree.
    for helper in ("goldens.py", "typecheck_errors.py", "tiny_checkpoints.py", "integration/model_bridge/helpers.py"):
        if (tl_tests / helper).exists():
            (tests / helper).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tl_tests / helper, tests / helper)
    for package in ("integration", "integration/model_bridge"):
        (tests / package / "__init__.py").touch()
    for src, dst in files():
        shutil.copy(tl_tests / src, tests / dst)
    for name in ("conftest.py", "tiny.py"):
        shutil.copy(HERE / name, tests / name)


def run(python: str, out: Path, side: str, extra: list[str]) -> None:
    # One thread: on a shared 2-core machine a second torch thread next to a busy process slows every op.
    env = {**os.environ, "TLS_SIDE": side, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if side == "ours":
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "shim"), env.get("PYTHONPATH", "")])
    targets = [] if any(x.startswith("tests") for x in extra) else ["tests"]
    opts = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore", "--continue-on-collection-errors"]
    cmd = [python, "-m", "pytest", *targets, *opts, f"--junitxml={out / (side + '.xml')}", *extra]
    subprocess.run(cmd, cwd=out, env=env, check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tl_tests", type=Path, help="the tests/ folder of TransformerLens 4.3's source distribution")
    ap.add_argument("out", type=Path)
    ap.add_argument("--tl-python", default=sys.executable)
    ap.add_argument("--side", choices=["tl", "ours", "both"], default="both")
    a, pytest_args = ap.parse_known_args()
    port(a.tl_tests, a.out)
    for side in ("tl", "ours") if a.side == "both" else (a.side,):
        run(a.tl_python, a.out, side, [x for x in pytest_args if x != "--"])


if __name__ == "__main__":
    main()
