"""One method protocol: every method takes a `Request`, declares its options once, and everything about
options (validation, errors, `method_options`, `relevance_hooks`) reads that declaration."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from _models import make_bridge, random_tokens, tiny_run

import transformer_bridge.relevance as relevance_package
from transformer_bridge.relevance import METHODS, explain, explained_from_positions, method_options, relevance_hooks
from transformer_bridge.relevance.protocol import Method, Option, Request
from transformer_bridge.relevance.result import MethodOutput


def first_column(request: Request) -> MethodOutput:
    """A toy method: ``weight`` on each explained token's first real column, in ``mode``'s sign."""
    scores = torch.zeros(len(request.explained), request.tokens.shape[1])
    first = request.attention_mask.long().argmax(-1)
    sign = 1.0 if request.options["mode"] == "plus" else -1.0
    for j, e in enumerate(request.explained):
        scores[j, first[e.batch_index]] = sign * request.options["weight"]
    return MethodOutput(scores)


TOY = Method(
    "first_column",
    first_column,
    "all relevance on the first real token",
    options=(
        Option("weight", int, 1, "the score given", minimum=0, maximum=9),
        Option("mode", str, "plus", "the sign", choices=("plus", "minus")),
        Option("shift", int, None, "unused; None allowed", optional=True, minimum=1),
        Option("tag", str, "", "a free-form string"),
    ),
    reads=lambda model, options: [f"blocks.0.hook_resid_{'pre' if options['mode'] == 'plus' else 'post'}"],
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(METHODS, TOY.name, TOY)
    return make_bridge("llama")


def test_a_registered_method_gets_a_request_with_validated_options(toy):
    tokens = random_tokens(2, 6)
    mask = torch.ones_like(tokens)
    mask[1, :2] = 0
    explained = explained_from_positions(tokens, mask, [(0, 5), (1, 4)])
    rel = explain(toy, tokens, mask, explained, method="first_column", weight=np.int64(3), mode="minus")
    assert rel.scores[0, 0].item() == -3.0 and rel.scores[1, 2].item() == -3.0 and rel.scores.abs().sum() == 6.0
    assert method_options("first_column") == ["weight", "mode", "shift", "tag"]
    assert relevance_hooks(toy, "first_column") == ["blocks.0.hook_resid_pre"]
    assert relevance_hooks(toy, "first_column", mode="minus") == ["blocks.0.hook_resid_post"]
    assert TOY.resolve({"weight": 2}) == {"weight": 2, "mode": "plus", "shift": None, "tag": ""}


@pytest.mark.parametrize(
    ("options", "error", "pattern"),
    [
        ({"wieght": 2}, TypeError, r"'first_column' got unknown option\(s\) `wieght`\. Did you mean 'weight'\?"),
        ({"weight": 10}, ValueError, r"`weight` must be an int in \[0, 9\], got 10"),
        ({"weight": 1.0}, TypeError, r"`weight` must be an int in \[0, 9\], got 1\.0"),
        ({"mode": "times"}, ValueError, r"`mode`='times' is not valid for method 'first_column'.*\('plus', 'minus'\)"),
        ({"shift": 0}, ValueError, r"`shift` must be an int >= 1, got 0"),
        ({"tag": 3}, TypeError, r"`tag` must be a string \(a free-form string\), got 3"),
    ],
)
def test_errors_come_from_the_declaration(toy, options, error, pattern):
    tokens = random_tokens(1, 6)
    explained = explained_from_positions(tokens, torch.ones_like(tokens), [(0, 5)])
    with pytest.raises(error, match=pattern):
        explain(toy, tokens, None, explained, method="first_column", **options)
    with pytest.raises(error, match=pattern):  # relevance_hooks checks the same declaration
        relevance_hooks(toy, "first_column", **options)


def test_every_builtin_method_follows_the_protocol():
    model = make_bridge("gpt2")
    tokens = random_tokens(1, 7)
    run = tiny_run(model, tokens, prompt_width=5)
    corrupted = tokens.clone()
    corrupted[0, 1] = 7
    given = {"attribution_patching": {"corrupted_tokens": corrupted}}
    for name, method in METHODS.items():
        assert method.name == name and method.summary
        assert method_options(name) == [o.name for o in method.options]
        for option in method.options:
            assert option.doc, (name, option.name)
        defaults = {o.name: o.default for o in method.options if not o.required}
        rel = run.relevance_pass(method=name, **given.get(name, {}))
        assert len(rel) == 2 and torch.isfinite(rel.scores).all(), name
        if method.reads is not None:
            names = relevance_hooks(model, name)
            assert names == method.reads(model, defaults) and all(n in model.hook_dict for n in names)
    assert method_options("integrated_gradients") == ["steps", "internal_batch_size", "keep_first"]
    assert [o.default for o in METHODS["integrated_gradients"].options] == [32, None, False]


def test_options_are_never_read_from_signatures():
    """The declaration is the only source: no module of the relevance package inspects signatures."""
    for path in Path(relevance_package.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "inspect" not in imported | modules, path.name


def test_the_docs_name_every_declared_option():
    """docs/relevance.md's methods table stays true to the declarations: every method and option is named."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "relevance.md").read_text(encoding="utf-8")
    for name, method in METHODS.items():
        assert f"| `{name}`" in page, name
        for option in method.options:
            assert f"`{option.name}" in page, (name, option.name)


def test_a_family_without_the_points_a_method_reads_fails_clearly(monkeypatch):
    """No cache can hold points a family does not have: both entry points say so (not "request them")."""
    absent = Method("absent", first_column, "reads a point no family has", reads=lambda m, o: ["blocks.0.hook_nope"])
    monkeypatch.setitem(METHODS, absent.name, absent)
    model = make_bridge("llama")
    run = tiny_run(model, random_tokens(1, 6), prompt_width=4)
    for call in (lambda: relevance_hooks(model, "absent"), lambda: run.relevance_pass(method="absent")):
        with pytest.raises(ValueError, match=r"'absent' reads hook points that this 'llama' model does not have: "
                                             r"\['blocks\.0\.hook_nope'\].*'grad_x_input'"):  # fmt: skip
            call()
