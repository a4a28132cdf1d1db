"""Pictures: HTML and PNGs for every kind of result, labelled so a person reads them without help."""

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch
from _models import make_bridge, random_tokens, tiny_run

from transformer_bridge import viz
from transformer_bridge.relevance.result import HTMLView
from transformer_bridge.viz import label_legend, relevance_figure, relevance_html, visible_token


@pytest.fixture(scope="module")
def run():
    model = make_bridge("gpt2")
    tokens, mask = model.to_tokens_and_mask(["a <b> & c", "The capital of France is Paris"], padding_side="left")
    return tiny_run(model, tokens, prompt_width=tokens.shape[1] - 3, mask=mask)


@pytest.fixture(scope="module")
def rels(run):
    corrupted = run.sequences.clone()
    corrupted[:, -5] = 40
    return {
        "attnlrp": run.relevance_pass(method="attnlrp"),
        "dla": run.relevance_pass(method="dla"),
        "logit_lens": run.relevance_pass(method="logit_lens"),
        "attribution_patching": run.relevance_pass([0], method="attribution_patching", corrupted_tokens=corrupted),
    }


def _texts(fig) -> dict[str, list[str]]:
    """Every label a reader sees on a figure, by role (colour bars are axes of their own)."""
    return {
        "xlabel": [ax.get_xlabel() for ax in fig.axes],
        "ylabel": [ax.get_ylabel() for ax in fig.axes],
        "xticks": [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()],
        "yticks": [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()],
        "caption": [fig.get_supxlabel()],
    }


def test_visible_token_marks_whitespace():
    assert visible_token(" Paris") == "␣Paris"
    assert visible_token("\n\t x\r") == "↵⇥␣x␍"
    assert visible_token("Paris") == "Paris"


def test_label_legend_explains_each_kind_once():
    lines = label_legend(["L29H1", "L3.mlp", "L0H2", "L1.attn_bias", "embed", "bias:unembed"])
    assert "L29H1 = layer 29, attention head 1" in lines and "L3.mlp = layer 3 MLP" in lines
    assert "L1.attn_bias = layer 1 attention output bias" in lines and "embed = token embedding" in lines
    assert sum("head" in line for line in lines) == 2  # one example line, plus "layers and heads count from 0"
    assert lines[-1] == "layers and heads count from 0"
    assert label_legend(["blocks.3.hook_resid_pre"]) == [
        "blocks.3.hook_resid_pre = residual stream entering layer 3",
        "layers count from 0",
    ]
    assert label_legend(["something_else"]) == []


def test_html_heatmap_escapes_colours_and_legend(rels):
    rel = rels["attnlrp"]
    text = relevance_html(rel)
    assert "&lt;" in text and "&amp;" in text and "<b>" in text  # tokens escaped, markup ours
    assert text.count("rgba(") >= sum(len(s.source_tokens) for s in rel)
    assert "␣" in text  # the spaces of "The capital of …" are drawn
    assert "relevance for the logit ÷ the largest |value| in its row" in text
    assert rel._repr_html_() == text
    assert "… " in relevance_html(rel, max_tokens=3)


def test_html_draws_newlines_and_breaks_the_line(rels):
    rel = rels["attnlrp"]
    rows = [list(row) for row in rel.str_tokens]
    rows[1][3] = "\n"
    text = relevance_html(dataclasses.replace(rel, str_tokens=rows))
    assert "↵" in text and "flex-basis:100%" in text


def test_html_explains_component_labels(rels):
    text = relevance_html(rels["dla"])
    assert "= layer" in text and "attention head" in text and "MLP" in text
    assert "direct contribution to the logit" in text
    lens = relevance_html(rels["logit_lens"])
    assert "probability of the explained token" in lens and "rank" in lens


@pytest.mark.parametrize("method", ["attnlrp", "dla", "logit_lens", "attribution_patching"])
def test_png_for_each_kind(rels, method, tmp_path):
    path = rels[method].save_png(tmp_path / f"{method}.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_token_heatmap_labels(rels):
    rel = rels["attnlrp"]
    fig = relevance_figure(rel)
    texts = _texts(fig)
    panels = [ax for ax in fig.axes if ax.get_images()]  # colour bars are axes too, without images
    assert all(ax.get_xlabel().startswith("source token") for ax in panels)
    assert all(ax.get_ylabel() == "explained token" for ax in panels)
    bars = [label for label in texts["ylabel"] if "÷ row's largest |value|" in label]
    assert len(bars) == len(panels) == 2  # one colour bar per batch row
    assert "␣" in " ".join(texts["xticks"])  # source tokens keep their leading spaces
    assert any(t.startswith("step 0 → ") for t in texts["yticks"])
    assert "grey" in texts["caption"][0]
    # Cells the explained token cannot see are blank (NaN → grey), the rest are the normalised scores.
    image = panels[0].get_images()[0].get_array()
    assert image.mask.any() and not image.mask.all()


def test_dla_bars_explain_their_labels(rels):
    fig = relevance_figure(rels["dla"], top_k=5)
    texts = _texts(fig)
    assert all(x == "direct contribution to the logit" for x in texts["xlabel"])
    assert all(y == "component" for y in texts["ylabel"])
    assert "= layer" in texts["caption"][0] and "count from 0" in texts["caption"][0]
    # The bars are the top 5 by |score|, largest at the top.
    bars = [p.get_width() for p in fig.axes[0].patches]
    expected = rels["dla"].scores[0].abs().sort(descending=True).values[:5].flip(0)
    torch.testing.assert_close(torch.tensor(bars).abs().float(), expected)


def test_logit_lens_on_log_probability_and_rank_axes(rels):
    rel = rels["logit_lens"]
    fig = relevance_figure(rel)
    prob, rank = fig.axes[:2]
    assert prob.get_yscale() == "log" and "probability" in prob.get_ylabel() and "log scale" in prob.get_ylabel()
    assert rank.get_yscale() == "log" and "rank" in rank.get_ylabel() and "1 = most likely" in rank.get_ylabel()
    assert rank.yaxis_inverted() and rank.get_xlabel().startswith("layer")
    torch.testing.assert_close(torch.tensor(prob.get_lines()[0].get_ydata()), rel.scores[0].float())
    torch.testing.assert_close(torch.tensor(rank.get_lines()[0].get_ydata()), rel.extras["rank"][0] + 1)


def test_hook_heatmap_labels(rels):
    texts = _texts(relevance_figure(rels["attribution_patching"]))
    assert "hook point" in texts["ylabel"] and "estimated change in the logit" in texts["ylabel"]
    assert "blocks.0.hook_resid_pre = residual stream entering layer 0" in texts["caption"][0]


def test_show_outside_a_notebook_writes_html(rels, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    rel = rels["dla"]
    path = rel.show()
    assert isinstance(path, Path) and path.parent == tmp_path and path.suffix == ".html"
    page = path.read_text(encoding="utf-8")
    assert "charset='utf-8'" in page and relevance_html(rel) in page
    assert rel.show() != path  # a new file each call, nothing overwritten
    assert rels["attnlrp"].show(path=tmp_path / "why.html") == tmp_path / "why.html"
    assert "␣" in (tmp_path / "why.html").read_text(encoding="utf-8")


def test_show_in_a_notebook_displays_inline(rels, monkeypatch):
    monkeypatch.setattr(viz, "in_notebook", lambda: True)
    view = rels["attnlrp"].show(max_tokens=3)
    assert isinstance(view, HTMLView) and view._repr_html_() == relevance_html(rels["attnlrp"], max_tokens=3)


class ZMQInteractiveShell:
    config: dict = {}  # noqa: RUF012


@pytest.mark.parametrize(
    ("shell", "expected"),
    [
        (None, False),
        (type("TerminalInteractiveShell", (), {"config": {}}), False),
        (ZMQInteractiveShell, True),
        (type("Shell", (ZMQInteractiveShell,), {}), True),  # Colab's kernel shell subclasses it
        (type("CustomShell", (), {"config": {"IPKernelApp": {}}}), True),
    ],
)
def test_in_notebook_detects_a_kernel(monkeypatch, shell, expected):
    instance = None if shell is None else shell()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: instance))
    assert viz.in_notebook() is expected


def test_in_notebook_without_ipython(monkeypatch):
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert viz.in_notebook() is False


def test_top_by_value_or_magnitude(rels):
    step = rels["dla"][0]
    scores = step.relevance
    by_value = step.top(5)
    by_abs = step.top(5, by="abs")
    assert [v for _, v in by_value] == scores.sort(descending=True).values[:5].tolist()
    assert [abs(v) for _, v in by_abs] == scores.abs().sort(descending=True).values[:5].tolist()
    assert all(float(scores[step.labels.index(name)]) == v for name, v in by_abs)  # signed, named right
    assert any(v < 0 for _, v in step.top(len(scores), by="abs"))
    with pytest.raises(ValueError, match=r"`by`='absolute'.*'value'.*'abs'"):
        step.top(3, by="absolute")


def test_long_sequence_png_stays_readable(tmp_path):
    model = make_bridge("llama")
    tokens = random_tokens(1, 300)
    rel = tiny_run(model, tokens, prompt_width=298, cache=False).relevance_pass(method="random")
    path = rel.save_png(tmp_path / "long.png", dpi=60)
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    assert width < 40 * 60 + 200 and height < 2000  # capped size; ticks thinned instead
    torch.testing.assert_close(rel.scores.sum(-1) > 0, torch.ones(2, dtype=torch.bool))
