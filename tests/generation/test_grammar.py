"""Grammar controllers (llguidance) on every family and SmolLM2: outputs match, forced tokens cost one
forward, backtracks roll the matcher back, per-row grammars, and clear errors."""

import json
import re

import pytest
from conftest import FAMILIES, make_bridge

from transformer_bridge import Branch, grammar
from transformer_bridge.generation import grammar as grammar_module

pytest.importorskip("llguidance")

PROMPTS = ["Hello world, this is", "Hi"]
PATTERN = r"(ab|cd)[0-9]{2,3}!"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tag": {"enum": ["red", "green"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return make_bridge(request.param)


def texts(model, out):
    w = out.prompt_width
    return [model.tokenizer.decode(row[w:][m[w:].bool()].tolist()) for row, m in
            zip(out.sequences, out.attention_mask, strict=True)]  # fmt: skip


def valid(obj):
    return set(obj) == {"n", "tag"} and isinstance(obj["n"], int) and obj["tag"] in ("red", "green")


def test_regex_and_json_schema_outputs_match_sampled_or_greedy(model):
    for kw in ({}, {"do_sample": True, "seed": 0, "temperature": 1.5}):
        out = model.generate(PROMPTS, max_new_tokens=40, controller=grammar.regex(PATTERN), return_dict=True, **kw)
        assert all(re.fullmatch(PATTERN, t) for t in texts(model, out)), texts(model, out)
        assert out.finish_reasons == ["controller"] * 2
        out = model.generate(PROMPTS, max_new_tokens=60, controller=grammar.json_schema(SCHEMA), return_dict=True,
                             **kw)  # fmt: skip
        for t, reason in zip(texts(model, out), out.finish_reasons, strict=True):
            if reason == "controller":  # a long integer may hit the length limit first
                assert valid(json.loads(t)), t


def test_forced_text_costs_one_forward(model):
    forwards = []
    literal = "the answer is: "
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append((hook.ctx.kind, x.shape[1])))]):
        out = model.generate("Hi", max_new_tokens=30, controller=grammar.regex(literal + "[0-9]"), return_dict=True)
    assert texts(model, out)[0].startswith(literal)
    assert forwards[1] == ("forced", len(literal))  # the whole literal in the forward after the prompt
    assert len(forwards) == 3  # prompt, the literal, the sampled digit (then the grammar is complete)


def test_choice_force_and_stop_on(model):
    out = model.generate(PROMPTS, max_new_tokens=20, controller=grammar.choice(["yes please", "no way"]),
                         return_dict=True)  # fmt: skip
    assert set(texts(model, out)) <= {"yes please", "no way"}
    c = grammar.force(" ok", then=grammar.stop_on(when=lambda v: len(v.generated) >= 5))
    out = model.generate(PROMPTS, max_new_tokens=20, controller=c, return_dict=True)
    assert all(t.startswith(" ok") for t in texts(model, out)) and out.new_lengths.tolist() == [5, 5]
    assert out.finish_reasons == ["controller"] * 2


def test_per_row_grammars(model):
    c = [grammar.regex("[a-c]{4}"), grammar.regex("[0-9]{3}")]
    out = model.generate(PROMPTS, max_new_tokens=10, controller=c, return_dict=True)
    a, b = texts(model, out)
    assert re.fullmatch("[a-c]{4}", a) and re.fullmatch("[0-9]{3}", b)


class RewindTwice:
    """Delegates to a grammar but rewinds each row by 2 tokens once, when it has 4: the matcher must follow."""

    def __init__(self, inner):
        self.inner, self.rewound = inner, False

    def bind(self, model):
        return type(self)(self.inner.bind(model))

    def fork(self):
        return type(self)(self.inner.fork())

    def appended(self, generated):
        self.inner.appended(generated)

    def mid_process(self, view):
        if len(view.generated) == 4 and not self.rewound:
            self.rewound = True
            return Branch(backtrack=2, ff_tokens=[[]])
        return self.inner.mid_process(view)


def test_backtrack_rolls_the_matcher_back(model):
    pattern = "[a-e]{3}[0-9]{3}"
    forwards = []
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append(hook.ctx.kind))]):
        out = model.generate(PROMPTS, max_new_tokens=12, controller=RewindTwice(grammar.regex(pattern)),
                             do_sample=True, seed=3, return_dict=True)  # fmt: skip
    assert "refeed" in forwards or "mixed" in forwards
    assert all(re.fullmatch(pattern, t) for t in texts(model, out)), texts(model, out)


def test_forks_get_their_own_matcher(model):
    class ForkOnce(RewindTwice):
        def mid_process(self, view):
            branches = self.inner.mid_process(view)
            return branches * 3 if view.step == 0 else branches

    pattern = "[a-z]{5}"
    out = model.generate(PROMPTS[:1], max_new_tokens=8, controller=ForkOnce(grammar.regex(pattern)),
                         do_sample=True, seed=0, return_dict=True)  # fmt: skip
    assert out.parents == [-1, 0, 0]
    assert all(re.fullmatch(pattern, t) for t in texts(model, out))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: grammar.regex("[a-"), grammar.GrammarError, r"`pattern` is not a valid grammar"),
        (lambda: grammar.regex(5), TypeError, r"`pattern` must be a str"),
        (lambda: grammar.json_schema("{not json"), grammar.GrammarError, r"`schema`"),
        (lambda: grammar.json_schema(3), TypeError, r"`schema` must be a JSON schema"),
        (lambda: grammar.lark("start: ("), grammar.GrammarError, r"`text` is not a valid grammar"),
        (lambda: grammar.choice([]), ValueError, r"`options` must be a non-empty list"),
        (lambda: grammar.choice("yes"), TypeError, r"`options` must be a list of str"),
        (lambda: grammar.force(""), TypeError, r"`text` must be a non-empty str"),
        (lambda: grammar.stop_on(1.5), TypeError, r"`stop_on` takes"),
    ],
)
def test_invalid_grammars_raise_naming_the_parameter(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_llguidance_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(grammar_module, "llguidance", None)
    with pytest.raises(ImportError, match=r"transformer-bridge\[grammar\]"):
        grammar.regex("a")


def test_unbound_grammar_says_so():
    with pytest.raises(ValueError, match="not bound"):
        grammar.regex("a").mid_process(None)


@pytest.mark.real
def test_smollm2_json_schema_validates(smollm2):
    prompts = [f"Give a JSON object for item {i}: " for i in range(4)]
    out = smollm2.generate(prompts, max_new_tokens=40, controller=grammar.json_schema(SCHEMA), return_dict=True)
    for t in texts(smollm2, out):
        assert valid(json.loads(t)), t
    assert make_bridge  # the tiny-model factory is shared with the family tests above
