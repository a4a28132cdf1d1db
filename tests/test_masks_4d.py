"""Masks mean what they mean to HF: 4-D custom masks, positions only where padding moves a token, ``labels``.

- A 4-D mask ``[batch, 1, pos, pos]`` is HF's custom mask, the whole attention pattern: bool keeps True, float
  is added to the scores. Given the causal-and-padding pattern HF builds from a 2-D mask, the logits are
  bitwise HF's for that 2-D mask, under eager and SDPA attention. Oracle for packed rows: each sequence of a
  block-diagonal mask gives the logits of that sequence run alone.
- Positions: a forward passes ``position_ids`` only when some row has padding before a real token; unpadded
  and right-padded batches are bitwise ``hf_model(ids, attention_mask=mask)``, pads included; OPT derives its
  positions from the mask itself and gets none.
- ``labels`` give HF's loss (``hf_model(ids, labels=labels).loss``).
"""

import pytest
import torch
from conftest import CONFIGS
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge
from transformer_bridge.inputs import MaskConventionError

FAMILIES = ["gpt2", "llama", "qwen2", "gemma2", "gpt_neox", "opt"]
TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
RIGHT = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])


def _bridge(family: str, implementation: str) -> TransformerBridge:
    config = CONFIGS[family]()
    config._attn_implementation = "eager" if family == "gemma2" else implementation  # Gemma 2: eager only
    torch.manual_seed(0)
    return TransformerBridge(AutoModelForCausalLM.from_config(config).eval())


def _keep(mask_2d: torch.Tensor) -> torch.Tensor:
    """HF's pattern for a 2-D mask: causal, and no padded key."""
    pos = mask_2d.shape[1]
    return torch.ones(pos, pos, dtype=torch.bool).tril()[None, None] & mask_2d.bool()[:, None, None, :]


@pytest.fixture(
    scope="module",
    params=[(f, i) for f in FAMILIES for i in ("eager", "sdpa") if (f, i) != ("gemma2", "sdpa")],
    ids=str,
)
def model(request) -> TransformerBridge:
    return _bridge(*request.param)


ARANGE = torch.arange(6).expand(2, 6)  # HF's default positions (OPT derives its own from a 2-D mask)


def test_bool_4d_mask_is_hf_2d_mask(model):
    hf = model.hf_model(TOKENS, attention_mask=RIGHT, position_ids=ARANGE).logits
    got = model(TOKENS, attention_mask=_keep(RIGHT))
    torch.testing.assert_close(got, hf, rtol=0, atol=0)
    assert model.adapter.bool_4d_mask_is_keep is True


def test_float_4d_mask_is_added_to_the_scores(model):
    additive = torch.zeros(_keep(RIGHT).shape).masked_fill(~_keep(RIGHT), torch.finfo(torch.float32).min)
    hf = model.hf_model(TOKENS, attention_mask=additive, position_ids=ARANGE).logits  # the float mask as given
    torch.testing.assert_close(model(TOKENS, attention_mask=additive), hf, rtol=0, atol=0)
    real = RIGHT.bool()
    torch.testing.assert_close(model(TOKENS, attention_mask=additive)[real], model(TOKENS, attention_mask=RIGHT)[real])


def test_loss_of_a_4d_mask_counts_real_tokens(model):
    loss_2d = model(TOKENS, attention_mask=RIGHT, return_type="loss")
    loss_4d = model(TOKENS, attention_mask=_keep(RIGHT), return_type="loss")
    torch.testing.assert_close(loss_4d, loss_2d, rtol=0, atol=0)
    per_token = model(TOKENS, attention_mask=_keep(RIGHT), return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 5) and torch.count_nonzero(per_token[0, 3:]) == 0
    logits = model(TOKENS, attention_mask=_keep(RIGHT))
    torch.testing.assert_close(model.loss_fn(logits, TOKENS, attention_mask=_keep(RIGHT)), loss_2d)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_packed_rows_are_separate_sequences(family):
    """A block-diagonal mask with positions restarting per sequence gives each sequence's own logits."""
    model = _bridge(family, "sdpa")
    first, second = torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9, 10, 11]])
    packed = torch.cat([first, second], dim=1)
    segment = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    keep = (segment[:, None] == segment[None, :]) & torch.ones(7, 7, dtype=torch.bool).tril()
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    got = model(packed, attention_mask=keep[None, None], position_ids=positions)
    torch.testing.assert_close(got[:, :3], model(first), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 3:], model(second), rtol=1e-5, atol=1e-5)


def test_4d_mask_with_hooks_and_cache():
    """Hooks see the pattern the 4-D mask makes; a hooked run gives the unhooked logits."""
    model = _bridge("llama", "sdpa")
    keep = _keep(RIGHT)
    seen = {}

    def read(pattern, hook):
        seen["pattern"] = pattern.clone()

    logits = model.run_with_hooks(TOKENS, attention_mask=keep, fwd_hooks=[("blocks.0.attn.hook_pattern", read)])
    torch.testing.assert_close(logits, model(TOKENS, attention_mask=keep), rtol=1e-6, atol=1e-6)
    pattern = seen["pattern"]
    assert pattern.shape == (2, model.cfg.n_heads, 6, 6)
    assert bool((pattern[0, :, :, 4:] == 0).all())  # the padded keys get no attention
    assert bool((pattern.triu(1) == 0).all())


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (torch.ones(2, 1, 1, 6, dtype=torch.bool), ValueError, r"shape \[2 or 1, 1, 6, 6\].*got \(2, 1, 1, 6\)"),
        (torch.ones(2, 4, 6, 6, dtype=torch.bool), ValueError, r"4-D `attention_mask` must have shape"),
        (torch.ones(3, 1, 6, 6, dtype=torch.bool), ValueError, r"4-D `attention_mask` must have shape"),
        (torch.ones(2, 1, 6, 6, dtype=torch.long), TypeError, r"bool .* or float .*got dtype torch.int64"),
    ],
    ids=["key_only", "heads", "batch", "integer"],
)
def test_bad_4d_masks_are_refused(mask, error, match):
    model = _bridge("gpt2", "sdpa")
    with pytest.raises(error, match=match):
        model(TOKENS, attention_mask=mask)
    torch.testing.assert_close(model(TOKENS), model.hf_model(TOKENS).logits, rtol=0, atol=0)  # clean afterwards


def test_tl_convention_bool_masks_are_refused():
    """TransformerLens' bool masks block True; read as HF's (True attends) they would run silently with other
    numbers. Each is refused naming both conventions; HF's own masks (padding on either side, packed rows) pass."""
    model = _bridge("llama", "sdpa")
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    tl_masks = {
        "causal": ~causal,  # TransformerLens' causal: the future blocked
        "causal_and_padding": ~_keep(left),  # ... and the padded keys
        "no_self": causal & ~torch.eye(6, dtype=torch.bool),  # a mask that blocks the diagonal everywhere
    }
    for name, mask in tl_masks.items():
        with pytest.raises(MaskConventionError, match=r"True = attend.*True = blocked.*`~mask`") as info:
            model(TOKENS, attention_mask=mask)
        assert isinstance(info.value, ValueError), name
        with pytest.raises(MaskConventionError):
            model.run_with_cache(TOKENS, attention_mask=mask)
    packed = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool() & causal[0, 0]
    for mask in (_keep(left), _keep(RIGHT), packed[None, None].expand(2, 1, 6, 6)):
        model(TOKENS, attention_mask=mask)  # HF's convention: runs


def test_4d_mask_refused_with_text_and_flash():
    model = _bridge("gpt2", "sdpa")
    with pytest.raises(ValueError, match="goes with token ids, not text"):
        model(["ab", "cd"], attention_mask=_keep(torch.ones(2, 2)))
    model.hf_model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"attention implementation 'eager' or 'sdpa'.*'flex_attention'"):
        model(TOKENS, attention_mask=_keep(RIGHT))


@pytest.mark.parametrize("family", FAMILIES)
def test_right_padded_forward_is_hf_forward_at_every_position(family):
    model = _bridge(family, "sdpa")
    seen = {}
    original = model.hf_model.forward

    def spy(*args, **kwargs):
        seen["position_ids"] = kwargs.get("position_ids")
        return original(*args, **kwargs)

    model.hf_model.forward = spy
    try:
        got = model(TOKENS, attention_mask=RIGHT)
    finally:
        del model.hf_model.forward
    assert seen["position_ids"] is None
    torch.testing.assert_close(got, model.hf_model(TOKENS, attention_mask=RIGHT).logits, rtol=0, atol=0)


def test_left_padded_rows_get_positions_and_others_keep_hf_defaults():
    model = _bridge("gpt2", "sdpa")
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1] * 6])
    tokens = torch.cat([TOKENS, TOKENS[:1]])
    seen = {}

    def read(x, hook):
        seen["positions"] = hook.ctx.positions.clone()

    logits = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=[("hook_embed", read)])
    expected = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    torch.testing.assert_close(seen["positions"], expected)
    hf = model.hf_model(tokens, attention_mask=mask, position_ids=expected).logits
    torch.testing.assert_close(logits, hf, rtol=0, atol=0)


def test_opt_derives_its_own_positions():
    model = _bridge("opt", "sdpa")
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    hf = model.hf_model(TOKENS, attention_mask=mask).logits
    torch.testing.assert_close(model(TOKENS, attention_mask=mask), hf, rtol=0, atol=0)
    alone = model(TOKENS[:1, 2:])
    torch.testing.assert_close(model(TOKENS, attention_mask=mask)[:1, 2:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_labels_give_hf_loss(family):
    model = _bridge(family, "sdpa")
    labels = TOKENS.clone()
    labels[:, :2] = -100
    hf = model.hf_model(TOKENS, labels=labels).loss
    torch.testing.assert_close(model(TOKENS, labels=labels, return_type="loss"), hf, rtol=1e-6, atol=1e-6)
    per_token = model(TOKENS, labels=labels, attention_mask=RIGHT, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 5)
    assert torch.count_nonzero(per_token[:, 0]) == 0 and torch.count_nonzero(per_token[0, 3:]) == 0
    with pytest.raises(ValueError, match=r"`labels` must be an integer tensor of the tokens' shape \(2, 6\)"):
        model(TOKENS, labels=labels[:, 1:], return_type="loss")


def test_run_with_cache_takes_a_4d_mask(model):
    names = ["blocks.0.hook_resid_post", "blocks.0.attn.hook_pattern"]
    logits_2d, cache_2d = model.run_with_cache(TOKENS, attention_mask=RIGHT, names_filter=names)
    logits_4d, cache_4d = model.run_with_cache(TOKENS, attention_mask=_keep(RIGHT), names_filter=names)
    # OPT derives pad positions from a 2-D mask itself (-1); under a 4-D mask they are HF's default: compare
    # the real tokens there.
    real = (slice(None),) if not model.adapter.positions_from_mask else (RIGHT.bool(),)
    torch.testing.assert_close(logits_4d[real], logits_2d[real], rtol=0, atol=0)
    torch.testing.assert_close(cache_4d[names[0]][real], cache_2d[names[0]][real], rtol=0, atol=0)
    if not model.adapter.positions_from_mask:
        torch.testing.assert_close(cache_4d[names[1]], cache_2d[names[1]], rtol=0, atol=0)
    loss_4d, _ = model.run_with_cache(TOKENS, attention_mask=_keep(RIGHT), names_filter=names, return_type="loss")
    torch.testing.assert_close(loss_4d, model(TOKENS, attention_mask=RIGHT, return_type="loss"), rtol=0, atol=0)


def test_hooks_see_hf_default_positions_under_a_4d_mask():
    model = _bridge("llama", "sdpa")
    seen = {}

    def read(x, hook):
        seen["positions"], seen["padding"] = hook.ctx.positions.clone(), hook.ctx.pad_mask.clone()

    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    model.run_with_hooks(TOKENS, attention_mask=_keep(left), fwd_hooks=[("hook_embed", read)])
    assert torch.equal(seen["positions"], torch.arange(6).expand(2, 6))  # what HF runs with: no positions derived
    assert torch.equal(seen["padding"], ~left.bool())


def test_generate_and_cached_steps_take_a_2d_mask():
    model = _bridge("gpt2", "sdpa")
    with pytest.raises(ValueError, match=r"`attention_mask` is 4-D \(2, 1, 6, 6\).*give the 2-D"):
        model.generate(TOKENS, attention_mask=_keep(RIGHT), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"`attention_mask` is 4-D"):
        model(TOKENS, attention_mask=_keep(RIGHT), return_type="logits_and_cache")
