"""Pictures: HTML heatmap and PNGs for every kind of result, long sequences included."""

import pytest
import torch
from _models import make_bridge, random_tokens, tiny_run

from transformer_bridge.viz import relevance_html


@pytest.fixture(scope="module")
def run():
    model = make_bridge("gpt2")
    tokens, mask = model.to_tokens(["a <b> & c", "The capital of France is Paris"])
    return tiny_run(model, tokens, prompt_width=tokens.shape[1] - 3, mask=mask)


def test_html_heatmap_escapes_and_colours(run):
    rel = run.relevance_pass(method="attnlrp")
    view = rel.show()
    text = str(view)
    assert "&lt;" in text and "&amp;" in text and "<b>" in text  # tokens escaped, markup ours
    assert text.count("rgba(") >= sum(len(s.source_tokens) for s in rel)
    assert rel._repr_html_() == view._repr_html_()
    assert "… " in relevance_html(rel, max_tokens=3)


@pytest.mark.parametrize("method", ["attnlrp", "dla", "logit_lens"])
def test_png_for_each_kind(run, method, tmp_path):
    path = run.relevance_pass(method=method).save_png(tmp_path / f"{method}.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_png_for_attribution_patching(run, tmp_path):
    corrupted = run.sequences.clone()
    corrupted[:, -5] = 40
    rel = run.relevance_pass([0], method="attribution_patching", corrupted_tokens=corrupted)
    assert rel.save_png(tmp_path / "ap.png").stat().st_size > 0
    assert "blocks.0.hook_resid_pre" in str(rel.show())


def test_long_sequence_png_stays_readable(tmp_path):
    model = make_bridge("llama")
    tokens = random_tokens(1, 300)
    rel = tiny_run(model, tokens, prompt_width=298, cache=False).relevance_pass(method="random")
    path = rel.save_png(tmp_path / "long.png", dpi=60)
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    assert width < 40 * 60 + 200 and height < 2000  # capped size; ticks thinned instead
    torch.testing.assert_close(rel.scores.sum(-1) > 0, torch.ones(2, dtype=torch.bool))
