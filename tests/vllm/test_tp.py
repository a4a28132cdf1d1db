"""Tensor parallelism: with `tensor_parallel_size=2` (two worker processes on this 2-core CPU), hooks see whole
tensors, and caches and steered tokens equal those at TP=1 (`tp_check.py`, in its own process: vLLM reads its
thread binding once per process, and this process's engines already read theirs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)


@pytest.mark.slow
def test_tp2_equals_tp1(tiny_dir):
    script = Path(__file__).with_name("tp_check.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(script), tiny_dir("llama")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TP=2 equals TP=1" in done.stdout
