"""The exactness core, per family: what must hold on every transformers release the bridge declares.

- With no hooks, forward / ``run_with_cache`` / ``run_with_hooks`` give ``hf_model(ids).logits`` bitwise, over
  a sweep of batch sizes and odd and even lengths (one past every sliding window), on ids drawn from the whole
  vocabulary (rows led by pad, BOS and EOS ids included: without a mask every token is real, as in HF).
- Every hook point has its documented shape.
- Greedy ``generate`` gives HF's ``generate`` tokens, alone and in a left-padded batch.
- ``generate(return_cache=True)`` gives ``run_with_cache`` on its output, bitwise.

Marked ``core``: `.ci/run` runs this set on the oldest declared transformers release, and `scripts/compat.py`
on any release. A family whose HF module the installed release lacks is skipped, naming the release.
"""

import pytest
import torch
from conftest import CONFIGS, HYBRID_CONFIGS, SSM_CONFIGS, V, adapted_config, char_tokenizer
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge

pytestmark = pytest.mark.core

ALL = {**CONFIGS, **SSM_CONFIGS, **HYBRID_CONFIGS}
# (batch, pos): odd and even lengths, one batch of 1, one length past every window of the tiny configs (4).
SHAPES = [(1, 7), (2, 9), (2, 11), (3, 13), (4, 16), (2, 33)]
PROMPTS = ["Hello there", "Hi", "The capital of France is"]


@pytest.fixture(scope="module", params=list(ALL))
def model(request) -> TransformerBridge:
    # Skips a family the installed release lacks, or one whose adapter covers other releases.
    config = adapted_config(request.param, ALL[request.param])
    torch.manual_seed(0)
    return TransformerBridge(AutoModelForCausalLM.from_config(config).eval(), char_tokenizer())


def _ids(shape: tuple[int, int]) -> torch.Tensor:
    """Ids over the whole vocabulary; row 0 led by pad (0), row 1 by BOS (1), row 2 by EOS then BOS."""
    ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(shape[0] * 100 + shape[1]))
    leads = [[0, 0], [1], [2, 1], [0]]
    for row, lead in enumerate(leads[: shape[0]]):
        ids[row, : len(lead)] = torch.tensor(lead)
    return ids


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_no_hooks_is_bitwise_hf_at_every_shape(model, shape):
    ids = _ids(shape)
    with torch.no_grad():
        expected = model.hf_model(ids).logits
        assert torch.equal(model(ids), expected)
        logits, _ = model.run_with_cache(ids, names_filter="hook_embed")
        assert torch.equal(logits, expected)
        seen = []
        hooked = model.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: seen.append(1))])
        assert torch.equal(hooked, expected) and seen


def test_resid_post_is_hf_s_hidden_state(model):
    ids = _ids((2, 9))
    with torch.no_grad():
        hidden = model.hf_model(ids, output_hidden_states=True).hidden_states
        _, cache = model.run_with_cache(ids, names_filter="resid_post")
    # HF's last hidden state is after the final norm; before it come the blocks' outputs, after the embeddings
    # in attention families (Mamba records no embeddings).
    first = 0 if model.adapter.ssm is not None else 1
    for layer in range(model.cfg.n_layers - 1):
        assert torch.equal(cache["resid_post", layer], hidden[layer + first])


_HEADS = {"hook_q": "n_heads", "hook_rot_q": "n_heads", "hook_z": "n_heads",
          "hook_k": "n_kv_heads", "hook_rot_k": "n_kv_heads", "hook_v": "n_kv_heads"}  # fmt: skip
_STREAM = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out", "hook_embed",
           "hook_pos_embed", "hook_mixer_out")  # fmt: skip


def _expected_shape(model: TransformerBridge, name: str, b: int, p: int) -> tuple[int, ...] | None:
    """docs/hook_points.md's shape of a standard point; None for family-specific ones (their own tests)."""
    c, leaf = model.cfg, name.rsplit(".", 1)[-1]
    in_norm = "_norm." in name or "layernorm." in name  # per-head q/k norms, MLA's latent norms
    if leaf in _HEADS and ".attn." in name and not in_norm and not model.adapter.mla:
        return (b, p, getattr(c, _HEADS[leaf]), c.d_head)
    if leaf in ("hook_pattern", "hook_attn_scores"):
        return (b, c.n_heads, p, p)
    if leaf == "hook_result":
        return (b, p, c.n_heads, c.d_model)
    if leaf == "hook_scale" and not in_norm:
        return (b, p, 1)
    if leaf in _STREAM or (leaf == "hook_normalized" and not in_norm):
        return (b, p, c.d_model)
    return None


def test_hook_points_have_their_documented_shapes(model):
    b, p = 2, 9
    # Every point named, so the head results (computed on demand since use_attn_result=False) are there too.
    _, cache = model.run_with_cache(_ids((b, p)), names_filter=list(model.hook_dict))
    checked = 0
    for name in model.hook_dict:
        assert name in cache, name
        got = tuple(cache[name].shape)
        if name.endswith((".mlp.hook_pre", ".mlp.hook_post", ".mlp.hook_pre_linear")):
            # [batch, pos, d_mlp]; the width is the layer's own (dense layers of MoE models differ).
            assert len(got) == 3 and got[:2] == (b, p), (name, got)
        elif (expected := _expected_shape(model, name, b, p)) is not None:
            assert got == expected, (name, got, expected)
        checked += 1
    assert checked >= 2 * model.cfg.n_layers


def _hf_greedy(model: TransformerBridge, tokens: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    return model.hf_model.generate(tokens, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                   pad_token_id=model.pad_token_id)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_generate_equals_hf(model, rows):
    tokens, mask = model.to_tokens_and_mask(PROMPTS[:rows], padding_side="left")
    ours = model.generate(tokens, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict=True)
    hf = _hf_greedy(model, tokens, mask, 6)
    real = ours.attention_mask.bool()
    assert ours.sequences.shape == hf.shape
    assert torch.equal(ours.sequences[real], hf[real])


def test_return_cache_equals_run_with_cache(model):
    tokens, mask = model.to_tokens_and_mask(PROMPTS, padding_side="left")
    out, cache = model.generate(tokens, attention_mask=mask, max_new_tokens=5, return_dict=True, return_cache=True)
    _, expected = model.run_with_cache(out.sequences, attention_mask=out.attention_mask)
    assert sorted(cache.keys()) == sorted(expected.keys())
    for name in expected:
        assert torch.equal(cache[name], expected[name]), name
