"""One hook-name grammar for every entry point: the same spellings work, and fail the same way, in
`hooks`, `add_hook`, `run_with_hooks`, `run_with_cache`, `generate(names_filter=)` and cache lookups."""

import re

import pytest
import torch
from _clean import assert_clean
from conftest import make_bridge

from transformer_bridge import LayerOutOfRangeError, NotCachedError, UnknownHookError, get_act_name

TOKENS = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def model():
    return make_bridge("llama")


def _stable_id(value: object) -> str:
    """A test id without memory addresses (xdist workers must collect the same ids)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))[:30]


SPELLINGS = [
    ("blocks.1.hook_resid_post", ["blocks.1.hook_resid_post"]),
    (("resid_post", 1), ["blocks.1.hook_resid_post"]),
    (("resid_post", -1), ["blocks.1.hook_resid_post"]),
    ("resid_post", ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]),
    ("pattern", ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]),
    (("scale", 0, "ln2"), ["blocks.0.ln2.hook_scale"]),
    ("scale", ["ln_final.hook_scale"]),
    ("embed", ["hook_embed"]),
    (lambda n: n.endswith("hook_z"), ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]),
]


@pytest.mark.parametrize(
    ("spec", "expected"), SPELLINGS, ids=lambda v: re.sub(r" at 0x[0-9a-f]+", "", repr(v))[:30]
)  # no addresses: xdist workers compare ids
def test_every_entry_point_accepts_the_same_spellings(model, spec, expected):
    assert model.names_matching(spec) == expected
    seen: set[str] = set()

    def record(x, hook):
        seen.add(hook.name)

    with torch.no_grad():
        with model.hooks(fwd_hooks=[(spec, record)]):
            model(TOKENS)
        assert seen == set(expected)
        seen.clear()
        handle = model.add_hook(spec, record)
        model(TOKENS)
        handle.remove()
        assert seen == set(expected)
        seen.clear()
        model.run_with_hooks(TOKENS, fwd_hooks=[(spec, record)])
        assert seen == set(expected)
        _, cache = model.run_with_cache(TOKENS, names_filter=spec)
        assert list(cache) == expected
        _, gen_cache = model.generate(TOKENS, max_new_tokens=1, return_cache=True, names_filter=spec)
        assert list(gen_cache) == expected
    assert_clean(model)


def test_list_filters_mix_forms_without_repeats(model):
    names = model.names_matching(["blocks.0.hook_resid_post", ("resid_post", 0), "pattern", lambda n: "embed" in n])
    assert names == [
        "hook_embed",
        "blocks.0.attn.hook_pattern",
        "blocks.0.hook_resid_post",
        "blocks.1.attn.hook_pattern",
        "unembed.hook_in",
        "unembed.hook_out",
    ]


def _entry_points(model, spec):
    fn = lambda x, hook: None  # noqa: E731
    return {
        "hooks": lambda: model.hooks(fwd_hooks=[(spec, fn)]).__enter__(),
        "add_hook": lambda: model.add_hook(spec, fn),
        "run_with_hooks": lambda: model.run_with_hooks(TOKENS, fwd_hooks=[(spec, fn)]),
        "run_with_cache": lambda: model.run_with_cache(TOKENS, names_filter=spec),
        "generate": lambda: model.generate(TOKENS, max_new_tokens=1, return_cache=True, names_filter=spec),
    }


FAILURES = [
    ("blocks.1.hook_resid_pots", UnknownHookError, "Closest valid names: \\['blocks.1.hook_resid_post'"),
    ("blocks.2.hook_resid_post", LayerOutOfRangeError, "layer 2 is out of range.*0..1"),
    (("resid_post", 2), LayerOutOfRangeError, "layer 2 is out of range.*0..1"),
    (("resid_post", -3), LayerOutOfRangeError, "out of range"),
    (("resid_post", 1.0), TypeError, "layer must be an int"),
    (lambda n: "nothing" in n, ValueError, "matched no hook point"),
    ([], ValueError, "is empty"),
    (5, TypeError, "got int 5"),
    ("hook_resid_post", UnknownHookError, "Unknown hook point"),
]


@pytest.mark.parametrize(
    ("spec", "error", "message"), FAILURES, ids=lambda v: re.sub(r" at 0x[0-9a-f]+", "", repr(v))[:30]
)  # no addresses: xdist workers compare ids
def test_every_entry_point_fails_the_same_way(model, spec, error, message):
    for entry, call in _entry_points(model, spec).items():
        with pytest.raises(error, match=message):
            call()
        assert not any(p.active for p in model.hook_dict.values()), entry
    assert_clean(model)


def test_layer_out_of_range_is_both_key_and_index_error(model):
    with pytest.raises(KeyError):
        model.add_hook("blocks.2.hook_resid_post", lambda x, hook: None)
    with pytest.raises(IndexError):
        model.add_hook("blocks.2.hook_resid_post", lambda x, hook: None)


def test_cache_lookup_errors_distinguish_unknown_out_of_range_and_not_cached(model):
    _, cache = model.run_with_cache(TOKENS, names_filter="resid_post")
    assert torch.equal(cache["resid_post", -1], cache["blocks.1.hook_resid_post"])
    with pytest.raises(NotCachedError, match=r"valid hook point but is not in this cache.*names_filter"):
        cache["pattern", 1]
    with pytest.raises(LayerOutOfRangeError, match=r"0\.\.1"):
        cache["resid_post", 2]
    with pytest.raises(LayerOutOfRangeError, match=r"0\.\.1"):
        cache["blocks.30.hook_resid_post"]
    with pytest.raises(UnknownHookError, match="Closest"):
        cache["blocks.1.hook_resid_pots"]
    with pytest.raises(KeyError, match="needs a layer index"):
        cache["resid_post"]
    assert ("pattern", 1) not in cache and ("resid_post", 1) in cache and 5 not in cache


def test_get_act_name_shorthands():
    assert get_act_name("pattern", 3) == "blocks.3.attn.hook_pattern"
    assert get_act_name("scale") == "ln_final.hook_scale"
    # TransformerLens builds a name for shorthand it does not know; the model names the close ones
    assert get_act_name("resid_psot", 0) == "blocks.0.hook_resid_psot"
