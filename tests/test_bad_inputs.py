"""Bad input to forward / run_with_cache / hooks / hook return values / cache files raises the builtin
exception a user would catch, with a message naming the parameter, the value and what is allowed;
the model is clean afterwards (no hooks; the next plain forward is bitwise HF's)."""

import json

import pytest
import torch
from _clean import assert_clean
from conftest import V, make_bridge
from safetensors.torch import save_file

from transformer_bridge import ActivationCache, TransformerBridge

TOKENS = torch.tensor([[5, 6, 7, 8, 9]])
PAIR = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
RESID = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return make_bridge(request.param)


def _returning(value):
    return lambda m: m.run_with_hooks(TOKENS, fwd_hooks=[(RESID, lambda x, hook: value(x))])


def _bwd_wrong_shape(m):
    with torch.enable_grad(), m.hooks(bwd_hooks=[(RESID, lambda g, hook: g[..., :3])]):
        m(TOKENS).sum().backward()


def _cache_file(tmp, tensors, meta):
    path = tmp / "cache.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def _load(kind):
    def call(m, tmp):
        t = {"blocks.0.hook_resid_post": torch.zeros(1, 2, 3)}
        if kind == "directory":
            return ActivationCache.load(tmp, m)
        if kind == "garbage":
            (tmp / "x.safetensors").write_bytes(b"not a safetensors file at all")
            return ActivationCache.load(tmp / "x.safetensors", m)
        if kind == "has_batch_dim":
            return ActivationCache.load(_cache_file(tmp, t, {"has_batch_dim": json.dumps("yes")}), m)
        if kind == "alias_target":
            return ActivationCache.load(_cache_file(tmp, t, {"aliases": json.dumps({"a": "missing"})}), m)
        if kind == "alias_json":
            return ActivationCache.load(_cache_file(tmp, t, {"aliases": "{not json"}), m)
        if kind == "alias_type":
            return ActivationCache.load(_cache_file(tmp, t, {"aliases": json.dumps([1, 2])}), m)
        if kind == "device":
            return ActivationCache.load(_cache_file(tmp, t, {}), m, device="cuda:7")
        if kind == "path_type":
            return ActivationCache.load(5, m)
        raise AssertionError(kind)

    return call


def _cached(call):
    def run(m):
        _, cache = m.run_with_cache(
            TOKENS, names_filter=["hook_embed", "resid_pre", "resid_post", "ln_final.hook_scale"]
        )
        return call(cache)

    return run


CASES = [
    # forward: tokens
    ("input_int", lambda m: m(5), TypeError, r"`input` must be a str.*got 5\."),
    ("input_empty_list", lambda m: m([]), TypeError, r"`input`"),
    ("tokens_float", lambda m: m(TOKENS.float()), TypeError, r"`input` tokens must be an integer tensor.*float32"),
    ("tokens_out_of_vocab", lambda m: m(TOKENS + V), ValueError, rf"`input` contains token id {V + 9}.*\[0, {V - 1}\]"),
    ("tokens_negative", lambda m: m(TOKENS - 10), ValueError, r"`input` contains token id -5"),
    ("tokens_meta", lambda m: m(TOKENS.to("meta")), ValueError, r"`input` tokens are on the meta device"),
    ("tokens_3d", lambda m: m(TOKENS[None]), ValueError, r"`input` tokens must have shape \[batch, pos\]"),
    ("tokens_empty", lambda m: m(TOKENS[:, :0]), ValueError, r"`input` tokens must have shape"),
    ("return_type", lambda m: m(TOKENS, return_type="probs"), ValueError, r"`return_type`.*'probs'"),
    # forward: attention masks
    (
        "mask_twos",
        lambda m: m(TOKENS, attention_mask=torch.full_like(TOKENS, 2)),
        ValueError,
        r"`attention_mask` must hold only 0.*holds 2",
    ),
    (
        "mask_half",
        lambda m: m(TOKENS, attention_mask=torch.full(TOKENS.shape, 0.5)),
        ValueError,
        r"`attention_mask`.*holds 0.5",
    ),
    (
        "mask_all_zero",
        lambda m: m(TOKENS, attention_mask=torch.zeros_like(TOKENS)),
        ValueError,
        r"`attention_mask` row 0 is all padding",
    ),
    (
        "mask_row_zero",
        lambda m: m(PAIR, attention_mask=torch.tensor([[1] * 5, [0] * 5])),
        ValueError,
        r"`attention_mask` row 1 is all padding",
    ),
    (
        "mask_shape",
        lambda m: m(TOKENS, attention_mask=torch.ones(1, 4, dtype=torch.long)),
        ValueError,
        r"`attention_mask` shape \(1, 4\) does not match the prompt shape \(1, 5\)",
    ),
    (
        "mask_list",
        lambda m: m(TOKENS, attention_mask=[[1, 1, 1, 1, 1]]),
        TypeError,
        r"`attention_mask` must be a tensor",
    ),
    (
        "mask_with_text",
        lambda m: m("hello", attention_mask=torch.ones(1, 6)),
        ValueError,
        r"`attention_mask` is only accepted with token inputs",
    ),
    (
        "generate_mask_shape",
        lambda m: m.generate(PAIR, max_new_tokens=2, attention_mask=torch.ones(2, 4, dtype=torch.long)),
        ValueError,
        r"`attention_mask` shape \(2, 4\) does not match the prompt shape \(2, 5\)",
    ),
    (
        "generate_all_zero",
        lambda m: m.generate(TOKENS, max_new_tokens=2, attention_mask=torch.zeros_like(TOKENS)),
        ValueError,
        r"`attention_mask` row 0 is all padding",
    ),
    (
        "generate_twos",
        lambda m: m.generate(TOKENS, max_new_tokens=2, attention_mask=2 * torch.ones_like(TOKENS)),
        ValueError,
        r"`attention_mask` must hold only 0",
    ),
    # run_with_cache
    (
        "pos_slice_100",
        lambda m: m.run_with_cache(TOKENS, pos_slice=100),
        IndexError,
        r"`pos_slice`=100 is out of range for 5 positions",
    ),
    (
        "pos_slice_-100",
        lambda m: m.run_with_cache(TOKENS, pos_slice=-100),
        IndexError,
        r"`pos_slice`=-100 is out of range",
    ),
    (
        "pos_slice_float",
        lambda m: m.run_with_cache(TOKENS, pos_slice=1.5),
        TypeError,
        r"`pos_slice` must be an int.*float 1.5",
    ),
    ("pos_slice_empty", lambda m: m.run_with_cache(TOKENS, pos_slice=[]), ValueError, r"`pos_slice` is an empty list"),
    (
        "pos_slice_list_out",
        lambda m: m.run_with_cache(TOKENS, pos_slice=[10]),
        IndexError,
        r"`pos_slice` holds position 10",
    ),
    ("pos_slice_str", lambda m: m.run_with_cache(TOKENS, pos_slice="ab"), TypeError, r"`pos_slice` must be.*str 'ab'"),
    (
        "pos_slice_neg_step",
        lambda m: m.run_with_cache(TOKENS, pos_slice=slice(None, None, -1)),
        ValueError,
        r"`pos_slice`.*step must be positive",
    ),
    (
        "pos_slice_selects_none",
        lambda m: m.run_with_cache(TOKENS, pos_slice=slice(7, 9)),
        IndexError,
        r"`pos_slice`.*selects no position",
    ),
    ("pos_slice_bool", lambda m: m.run_with_cache(TOKENS, pos_slice=True), TypeError, r"`pos_slice`.*bool"),
    (
        "names_filter_int",
        lambda m: m.run_with_cache(TOKENS, names_filter=5),
        TypeError,
        r"`names_filter` must be.*int 5",
    ),
    (
        "names_filter_unknown",
        lambda m: m.run_with_cache(TOKENS, names_filter="blocks.0.hook_resid_pots"),
        KeyError,
        r"Unknown hook point.*Closest",
    ),
    ("device_cuda7", lambda m: m.run_with_cache(TOKENS, device="cuda:7"), ValueError, r"`device`='cuda:7'"),
    (
        "device_nonsense",
        lambda m: m.run_with_cache(TOKENS, device="gpu please"),
        ValueError,
        r"`device`='gpu please' is not a valid torch device",
    ),
    (
        "metric_non_scalar",
        lambda m: m.run_with_cache(TOKENS, incl_bwd=True, metric=lambda lg: lg[0, -1]),
        ValueError,
        r"`metric` must return a scalar.*shape \(\d+,\)",
    ),
    (
        "metric_not_callable",
        lambda m: m.run_with_cache(TOKENS, incl_bwd=True, metric=3),
        TypeError,
        r"`metric` must be callable",
    ),
    (
        "metric_without_bwd",
        lambda m: m.run_with_cache(TOKENS, metric=lambda lg: lg.sum()),
        ValueError,
        r"`metric` is backpropagated only with `incl_bwd=True`",
    ),
    (
        "remove_batch_dim_batch2",
        lambda m: m.run_with_cache(PAIR, remove_batch_dim=True),
        ValueError,
        r"`remove_batch_dim=True` needs a batch of one",
    ),
    # hooks
    (
        "fwd_hooks_dict",
        lambda m: m.run_with_hooks(TOKENS, fwd_hooks={RESID: lambda x, h: x}),
        TypeError,
        r"`fwd_hooks` must be a list of \(name, fn\) pairs, got a dict",
    ),
    (
        "fwd_hooks_tuple_of_one",
        lambda m: m.run_with_hooks(TOKENS, fwd_hooks=[(RESID,)]),
        TypeError,
        r"`fwd_hooks` entries must be \(name, fn\) pairs",
    ),
    (
        "fwd_hooks_flat_pair",
        lambda m: m.run_with_hooks(TOKENS, fwd_hooks=(RESID, lambda x, h: x)),
        TypeError,
        r"`fwd_hooks` entries must be \(name, fn\) pairs",
    ),
    ("fwd_hooks_str", lambda m: m.run_with_hooks(TOKENS, fwd_hooks=RESID), TypeError, r"`fwd_hooks` must be a list"),
    (
        "hook_one_argument",
        lambda m: m.run_with_hooks(TOKENS, fwd_hooks=[(RESID, lambda x: x)]),
        TypeError,
        r"cannot be called as fn\(tensor, hook\)",
    ),
    ("hook_not_callable", lambda m: m.add_hook(RESID, "print"), TypeError, r"`hook` must be callable.*str 'print'"),
    (
        "hook_dir",
        lambda m: m.add_hook(RESID, lambda x, h: x, dir="up"),
        ValueError,
        r"`dir` must be 'fwd' or 'bwd', got 'up'",
    ),
    (
        "hooks_second_name_bad",
        lambda m: m.run_with_hooks(TOKENS, fwd_hooks=[(RESID, lambda x, h: x), ("nope", lambda x, h: x)]),
        KeyError,
        r"Unknown hook point 'nope'",
    ),
    (
        "bwd_hooks_dict",
        lambda m: m.run_with_hooks(TOKENS, bwd_hooks={RESID: lambda g, h: g}),
        TypeError,
        r"`bwd_hooks` must be a list",
    ),
    # hook return values
    (
        "hook_returns_int64",
        _returning(lambda x: x.long()),
        TypeError,
        r"returned dtype torch.int64, but the activation is torch.float32",
    ),
    ("hook_returns_float64", _returning(lambda x: x.double()), TypeError, r"returned dtype torch.float64"),
    (
        "hook_returns_meta",
        _returning(lambda x: torch.empty_like(x, device="meta")),
        ValueError,
        r"returned a tensor on device meta",
    ),
    (
        "hook_returns_wrong_shape",
        _returning(lambda x: x[:, :2]),
        ValueError,
        r"returned shape \(1, 2, 32\).*\(1, 5, 32\)",
    ),
    ("hook_returns_list", _returning(lambda x: [x]), TypeError, r"returned list; a hook must return a Tensor"),
    ("hook_returns_number", _returning(lambda x: 0.0), TypeError, r"returned float"),
    ("bwd_hook_wrong_shape", _bwd_wrong_shape, ValueError, r"\(backward\)' returned shape"),
    # cache lookups and helpers
    ("cache_key_int", _cached(lambda c: c[5]), TypeError, r"`key` must be a hook name"),
    ("cache_layer_out_of_range", _cached(lambda c: c["resid_post", 7]), IndexError, r"layer 7 is out of range.*0\.\.1"),
    ("cache_not_cached", _cached(lambda c: c["pattern", 0]), KeyError, r"valid hook point but is not in this cache"),
    (
        "cache_pos_slice",
        _cached(lambda c: c.accumulated_resid(pos_slice=100)),
        IndexError,
        r"`pos_slice`=100 is out of range",
    ),
    ("cache_decompose_mode", _cached(lambda c: c.decompose_resid(mode="heads")), ValueError, r"`mode` must be"),
]
LOAD_CASES = [
    ("load_directory", "directory", ValueError, r"`path`=.* is a directory"),
    ("load_garbage", "garbage", ValueError, r"is not a safetensors cache file"),
    ("load_has_batch_dim", "has_batch_dim", ValueError, r"`has_batch_dim` must be true or false, got 'yes'"),
    ("load_alias_target", "alias_target", ValueError, r"alias 'a' -> 'missing' names no stored tensor"),
    ("load_alias_json", "alias_json", ValueError, r"metadata `aliases` is not valid JSON"),
    ("load_alias_type", "alias_type", ValueError, r"metadata `aliases` must map names to names"),
    ("load_device", "device", ValueError, r"`device`='cuda:7'"),
    ("load_path_type", "path_type", TypeError, r"`path` must be a str or Path, got int"),
]


@pytest.mark.parametrize(("call", "error", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clearly_and_leaves_the_model_clean(model, call, error, message):
    with pytest.raises(error, match=message):
        call(model)
    assert_clean(model)


@pytest.mark.parametrize(("kind", "error", "message"), [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES])
def test_bad_cache_file_raises_clearly(model, kind, error, message, tmp_path):
    with pytest.raises(error, match=message):
        _load(kind)(model, tmp_path)
    assert_clean(model)


def test_from_pretrained_checks_the_device_before_loading(tmp_path):
    with pytest.raises(ValueError, match=r"`device`='cuda:7'"):
        TransformerBridge.from_pretrained(str(tmp_path), device="cuda:7")


def test_float_and_bool_binary_masks_are_accepted(model):
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    with torch.no_grad():
        ref = model(TOKENS, attention_mask=mask)
        assert torch.equal(model(TOKENS, attention_mask=mask.bool()), ref)
        assert torch.equal(model(TOKENS, attention_mask=mask.float()), ref)


def test_numpy_and_tensor_positions_are_accepted(model):
    import numpy as np

    _, a = model.run_with_cache(TOKENS, names_filter=RESID, pos_slice=np.int64(-1))
    _, b = model.run_with_cache(TOKENS, names_filter=RESID, pos_slice=torch.tensor([4]))
    assert torch.equal(a[RESID], b[RESID]) and a[RESID].shape[1] == 1
