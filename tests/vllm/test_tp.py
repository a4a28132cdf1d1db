"""Tensor parallelism: with `tensor_parallel_size=2` (two worker processes on this 2-core CPU), hooks see whole
tensors, and caches and steered tokens equal those at TP=1 (`tp_check.py`, in its own process: vLLM reads its
thread binding once per process, and this process's engines already read theirs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)


def _check(path: str, *mode: str) -> str:
    script = Path(__file__).with_name("tp_check.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(script), path, *mode], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_tp2_equals_tp1(tiny_dir):
    assert "TP=2 equals TP=1" in _check(tiny_dir("llama"))


@pytest.mark.slow
def test_compiled_tp2_taps_reach_the_spawned_workers(tiny_dir):
    """vLLM spawns its workers (always on CPU): the declared taps are installed in each through vLLM's worker
    extension, and interventions and captures equal an eager TP=1 engine's."""
    assert "compiled TP=2 equals eager TP=1" in _check(tiny_dir("llama"), "compiled")


@pytest.mark.slow
def test_vllm_default_multiprocessing(tiny_dir):
    assert "vLLM's defaults served" in _check(tiny_dir("llama"), "defaults")
    assert "a multiprocess engine core refused" in _check(tiny_dir("llama"), "core_elsewhere")
