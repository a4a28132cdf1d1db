"""Results that hold one tensor convert in one call (issue #32 item 6): ``torch.as_tensor(x)`` and
``np.asarray(x)`` give that tensor for a store's rows, a patching result, relevance results, the DLA tool's result,
generate's output and every analysis stack returned with its labels; the pairs still unpack."""

import numpy as np
import torch
from conftest import make_bridge

from transformer_bridge import harvest, patching
from transformer_bridge.compat import direct_logit_attribution
from transformer_bridge.convertible import LabelledStack
from transformer_bridge.relevance import relevance_hooks

TOKENS = torch.tensor([[1, 15, 16, 17, 18], [1, 25, 26, 27, 28]])


def _converts(obj, want):
    got = torch.as_tensor(obj)
    assert torch.equal(got, want.detach()) and torch.equal(torch.tensor(obj), want.detach())
    assert torch.equal(torch.as_tensor(obj, dtype=torch.float64), want.detach().double())
    np.testing.assert_array_equal(np.asarray(obj), want.detach().cpu().numpy())
    assert np.asarray(obj, dtype=np.float64).dtype == np.float64


def test_store_rows_convert(tmp_path):
    model = make_bridge("gpt2")
    tokens = torch.randint(4, 90, (3, 8), generator=torch.Generator().manual_seed(0))
    store = harvest(model, tokens, "blocks.1.hook_resid_post", tmp_path / "a", context_length=4, batch_size=2,
                    shard_size=5, progress=False)  # fmt: skip
    rows = store.read("blocks.1.hook_resid_post")
    _converts(rows, rows.to_tensor())
    assert len(rows.parts) > 1  # several shards, one tensor


def test_patching_and_stacks_with_labels_convert():
    model = make_bridge("gpt2")
    _, cache = model.run_with_cache(TOKENS)
    corrupted = TOKENS.clone()
    corrupted[:, 2] = 36
    res = patching.get_act_patch_resid_pre(model, corrupted, cache, lambda lg: lg[:, -1, 15] - lg[:, -1, 36],
                                           reduce="none", baseline=True)  # fmt: skip
    _converts(res, res.values)
    for pair in (
        cache.decompose_resid(return_labels=True),
        cache.accumulated_resid(return_labels=True),
        cache.stack_head_results(return_labels=True),
        cache.stack_neuron_results(1, return_labels=True),
        cache.get_full_resid_decomposition(return_labels=True),
    ):
        stack, labels = pair
        assert isinstance(pair, LabelledStack) and isinstance(pair, tuple) and len(labels) == stack.shape[0]
        _converts(pair, stack)
    assert torch.is_tensor(cache.decompose_resid())  # without labels: the tensor itself


def test_relevance_dla_and_generate_outputs_convert():
    model = make_bridge("llama")
    out, cache = model.generate(TOKENS, max_new_tokens=2, do_sample=False, return_dict=True, return_cache=True,
                                names_filter=relevance_hooks(model, "dla"))  # fmt: skip
    _converts(out, out.sequences)
    rel = model.relevance((out, cache), method="dla")
    _converts(rel, rel.scores)
    _converts(rel[0], rel[0].relevance)
    res = direct_logit_attribution(model, TOKENS, answer_tokens=15, incorrect_tokens=16, unit="head")
    _converts(res, res.attribution)
