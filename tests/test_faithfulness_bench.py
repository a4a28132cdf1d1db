"""The faithfulness benchmark's arithmetic (metrics, bootstrap, merging partial runs) on synthetic records."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[1] / "benchmarks" / "faithfulness.py"
_spec = importlib.util.spec_from_file_location("faithfulness_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SETTINGS = {"max_new_tokens": 2, "ig_steps": 4, "operators": "delete"}
METHODS = list(bench.method_table(SETTINGS["ig_steps"]))


def test_target_metrics_by_hand():
    # k = 0..4; MoRF drops fast, LeRF slowly.
    curve = {"morf": [0.0, -2.0, -3.0, -4.0, -4.0], "lerf": [0.0, 0.0, -1.0, -1.0, -4.0]}
    m = bench.target_metrics(curve)
    assert m["abpc"] == pytest.approx((0 + 2 + 2 + 3 + 0) / 5)
    assert m["aopc_morf"] == pytest.approx((0 + 2 + 3 + 4 + 4) / 5)
    assert m["aopc_lerf"] == pytest.approx((0 + 0 + 1 + 1 + 4) / 5)
    # 20 % of 4 rankable tokens rounds up to 1 token.
    assert m["comprehensiveness@20"] == pytest.approx(2.0)
    assert m["sufficiency@20"] == pytest.approx(1.0)  # all but one token removed, least relevant first


def test_paired_bootstrap_interval_covers_the_mean_and_excludes_zero_for_a_clear_lead():
    a = [1.0 + 0.1 * (i % 3) for i in range(30)]
    b = [0.1 * (i % 5) for i in range(30)]
    mean, lo, hi = bench.paired_bootstrap(a, b)
    assert lo < mean < hi and lo > 0
    assert mean == pytest.approx(sum(a) / 30 - sum(b) / 30)
    same = bench.paired_bootstrap(a, a)
    assert same == (0.0, 0.0, 0.0)


def _record(prompt: str, lead: float) -> dict:
    """One prompt with two targets; ``attnlrp`` separates MoRF from LeRF by ``lead``, others by less."""
    curves = {}
    for i, name in enumerate(METHODS):
        gap = lead if name == "attnlrp" else lead / (i + 2)
        curves[name] = [{"morf": [0.0, -gap, -2 * gap], "lerf": [0.0, 0.0, -gap]} for _ in range(2)]
    return {
        "prompt": prompt, "generated": "x", "n_targets": 2, "n_rankable": 2, "forward_seconds": 0.5,
        "seconds": dict.fromkeys(METHODS, 1.0), "conservation_error": {"attnlrp": [0.5, 0.7]},
        "curves": {"delete": curves},
    }  # fmt: skip


def _write(path: Path, records: list[dict], **settings) -> Path:
    path.write_text(json.dumps({"summary": {}, "records": records, "args": {**SETTINGS, **settings}}))
    return path


def test_merge_orders_by_prompt_file_and_recomputes_the_table(tmp_path, capsys):
    prompts = json.loads(bench.PROMPTS.read_text())["prompts"]
    late = _write(tmp_path / "b.json", [_record(prompts[5], 1.0), _record(prompts[3], 2.0)])
    early = _write(tmp_path / "a.json", [_record(prompts[0], 3.0)])
    summary = bench.merge([late, early], tmp_path / "all.json")
    merged = json.loads((tmp_path / "all.json").read_text())
    assert [r["prompt"] for r in merged["records"]] == [prompts[0], prompts[3], prompts[5]]
    assert summary["n_prompts"] == 3 and summary["n_targets"] == 6
    table = summary["operators"]["delete"]["table"]
    # attnlrp's ABPC: mean over targets of mean_k (lerf − morf) = mean(gap) · (0 + 1 + 1) / 3.
    assert table["attnlrp"]["abpc"][0] == pytest.approx((1 + 2 + 3) / 3 * 2 / 3)
    assert summary["cost"]["attnlrp"]["forwards_per_token"] == pytest.approx(1.0)  # 1 s / 2 targets / 0.5 s
    assert summary["cost"]["attnlrp"]["conservation_error"] == pytest.approx(0.6)
    lead_vs_cp, lo, hi = summary["operators"]["delete"]["versus"]["cp_lrp"]["attnlrp"]
    assert 0 < lo <= lead_vs_cp <= hi
    assert "attnlrp − this" in capsys.readouterr().out
    assert (tmp_path / "all.md").read_text().startswith("3 prompts, 6 explained tokens")


def test_merge_refuses_duplicate_prompts_and_mixed_settings(tmp_path):
    prompts = json.loads(bench.PROMPTS.read_text())["prompts"]
    a = _write(tmp_path / "a.json", [_record(prompts[0], 1.0)])
    with pytest.raises(SystemExit, match="already in an earlier file"):
        bench.merge([a, a], None)
    other = _write(tmp_path / "c.json", [_record(prompts[1], 1.0)], max_new_tokens=8)
    with pytest.raises(SystemExit, match="differ"):
        bench.merge([a, other], None)


def test_merge_reads_gzipped_results(tmp_path):
    prompts = json.loads(bench.PROMPTS.read_text())["prompts"]
    plain = _write(tmp_path / "a.json", [_record(prompts[0], 1.0), _record(prompts[1], 2.0)])
    packed = tmp_path / "a.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert bench.merge([packed], None) == bench.merge([plain], None)


@pytest.mark.parametrize("name", ["faithfulness_smollm2", "faithfulness_smollm2_ig_baselines"])
def test_the_committed_results_reproduce_the_committed_table(name, capsys):
    results = _PATH.parent / "results"
    bench.merge([results / f"{name}.json.gz"], None)
    assert capsys.readouterr().out == (results / f"{name}.md").read_text()
