"""docs/vllm.md's tour runs as written, in order, in one namespace (the main suite skips its blocks: no vLLM there)."""

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
MARKER = "# doctest: skip — needs vLLM (runs in tests/vllm/test_docs_vllm.py)"


def test_tour_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert blocks and all(b.startswith(MARKER) for b in blocks)
    namespace: dict = {"__name__": "docs_vllm"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), namespace)
