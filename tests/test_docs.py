"""Every ```python block of README.md and docs/*.md runs as written.

The blocks of one page run in order in one namespace, as a reader would run them, so a later block
may use names from an earlier one. A block opts out only with a marker on its first line,
``# doctest: skip — <reason>``; skipped blocks are counted and printed. Pages run inside a
temporary folder (pictures and HTML files land there), with matplotlib's Agg backend.
"""

import os
import re
import tempfile
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"#\s*doctest:\s*skip\b\W*(.*)")  # on a block's first line; the group is the reason
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(first code line number, source)`` of each ```python block, in order."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if start is None:
            i += 1
            continue
        indent, lang = start.group(1), start.group(2)
        body, i = [], i + 1
        while i < len(lines) and not FENCE.fullmatch(lines[i].rstrip()) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if lang == "python":
            blocks.append((i - len(body) + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def run_page(page: Path) -> tuple[list[str], list[str]]:
    """Run the page's blocks in order in one namespace; returns ``(timings of the blocks run, skipped)``.

    Call inside a temporary folder. A failing block raises, its traceback at the markdown file's lines.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace: dict = {"__name__": f"docs_{page.stem}"}
    timings, skipped = [], []
    try:
        for line, source in python_blocks(page):
            marker = SKIP.match(source.strip().splitlines()[0] if source.strip() else "")
            if marker:
                assert marker.group(1).strip(), f"{page.name}:{line}: a skipped block must say why"
                skipped.append(f"{page.name}:{line}: {marker.group(1).strip()}")
                continue
            code = compile("\n" * (line - 1) + source, str(page), "exec")  # tracebacks at the page's lines
            start = time.perf_counter()
            exec(code, namespace)
            timings.append(f"{page.name}:{line} {time.perf_counter() - start:.1f}s")
            plt.close("all")
    finally:
        plt.close("all")
    return timings, skipped


def test_every_page_is_found():
    names = {p.name for p in PAGES}
    assert {"README.md", "generation.md", "relevance.md", "transformerlens.md"} <= names
    assert sum(len(python_blocks(p)) for p in PAGES) >= 10


def test_blocks_share_a_namespace_and_skips_are_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n```python\nx = 1\n```\n\n```bash\nexit 1\n```\n\n"
        "```python\n# doctest: skip — needs a GPU\nraise RuntimeError\n```\n\n"
        "- in a list:\n\n  ```python\n  assert x == 1\n  y = x + 1\n  ```\n"
    )
    monkeypatch.chdir(tmp_path)
    assert [line for line, _ in python_blocks(page)] == [4, 12, 19]
    timings, skipped = run_page(page)
    assert len(timings) == 2 and skipped == ["page.md:12: needs a GPU"]
    page.write_text("```python\n# doctest: skip\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="must say why"):
        run_page(page)
    page.write_text("```python\nx = 1\n\nundefined_name\n```\n")
    with pytest.raises(NameError) as failure:
        run_page(page)
    assert failure.traceback[-1].lineno + 1 == 4  # the page's own line number


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    monkeypatch.chdir(tmp_path)  # pictures land here
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and `Relevance.show()`'s HTML files
    # One thread: the pages' models are small, and on this 2-core machine two threads next to another busy
    # process made SmolLM2's decode steps ~30x slower (the thread pool waits for the busy core).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timings, skipped = run_page(page)
    finally:
        torch.set_num_threads(threads)
    with capsys.disabled():
        print(f"\n{page.name}: {len(timings)} block(s) ran, {len(skipped)} skipped ({', '.join(timings)})")
        for entry in skipped:
            print(f"  skipped {entry}")
