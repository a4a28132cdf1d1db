"""oneDNN-packed weights for the compiled step's products of several rows (`generation.packed`).

Oracles: ``x @ w.T`` with BLAS on the weight as it is *now* (after every kind of edit a user can make),
and the eager decode loop. Edits covered: in-place ops on the parameter, ``load_state_dict``, replacing
the Parameter, ``p.data = ...``, and edits through ``.data`` (which the version counter does not see).
"""

import gc

import pytest
import torch
from conftest import make_bridge
from test_compiled_step import _targets

from transformer_bridge.generation import packed
from transformer_bridge.generation.compiled import RowTimesMatrix

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


def test_pass_sends_products_of_several_rows_of_a_weight_to_the_packed_op():
    w, bias = torch.randn(5, 7), torch.randn(5)
    rows = torch.randn(3, 7)
    op = "transformer_bridge.packed_mm.default"
    assert op in _targets(lambda a, w: a @ w.t(), rows, w)
    got = _targets(lambda a, w, b: torch.addmm(b, a, w.t()), rows, w, bias)
    assert op in got and "aten.addmm.default" not in got and "aten.add.Tensor" in got
    assert op not in _targets(lambda a, w: a @ w.t(), torch.randn(1, 7), w)  # one row: multiply + sum
    assert "aten.mm.default" in _targets(lambda a, w: a @ w, rows, w.t().contiguous())  # Conv1D layout: BLAS
    assert "aten.mm.default" in _targets(lambda a, w: a @ w.t(), rows.double(), w.double())  # not fp32
    # an activation (not a graph input) times an activation: packing it once would not pay
    assert "aten.mm.default" in _targets(lambda a, w: a @ (w * 2).t(), rows, w)


def _check(x, w):
    torch.testing.assert_close(packed.packed_mm(x, w), x @ w.detach().T, atol=1e-5, rtol=1e-5)


def test_packed_product_follows_every_kind_of_weight_edit():
    packed.clear()
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(24, 10, bias=False)
    x = torch.randn(4, 24, generator=gen)
    with torch.no_grad():
        _check(x, lin.weight)
        assert len(packed._PACKS) == 1 and packed.memory_bytes() == 10 * 24 * 4
        lin.weight.mul_(-2.0)  # in-place op: the version counter
        _check(x, lin.weight)
        lin.load_state_dict({"weight": torch.randn(10, 24, generator=gen)})  # copies into the parameter
        _check(x, lin.weight)
        lin.weight = torch.nn.Parameter(torch.randn(10, 24, generator=gen))  # a new parameter
        _check(x, lin.weight)
        lin.weight.data = torch.randn(10, 24, generator=gen)  # a new storage under the same parameter
        _check(x, lin.weight)
        stale = lin.weight.detach().clone()
        lin.weight.data.copy_(torch.randn(10, 24, generator=gen))  # .data: no version bump...
        lin.weight.data[3, 5] += 1e-3  # ...nor here; one element, a small change
        assert torch.allclose(packed.packed_mm(x, lin.weight), x @ stale.T, atol=1e-5)  # what revalidate is for
        assert packed.revalidate() == 1
        _check(x, lin.weight)
        assert packed.revalidate() == 0
        w = lin.weight.detach()
        w.data[2, :] = w[2].flip(0)  # a permutation within a row keeps the row's sum
        assert packed.revalidate() == 1
        _check(x, lin.weight)
    gc.collect()
    assert len(packed._PACKS) == 1
    del lin, w
    gc.collect()
    assert len(packed._PACKS) == 0 and packed.memory_bytes() == 0  # the copy goes with its weight


def test_packed_op_rejects_what_it_cannot_pack():
    with pytest.raises(ValueError, match=r"weight.*float64"):
        packed.packed_mm(torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x.*\(2, 5\)"):
        packed.packed_mm(torch.randn(2, 5), torch.randn(4, 3))


def test_batch_compiled_with_packed_weights_equals_eager_and_sees_edits():
    """A compiled batch-3 step sends every linear layer and the unembedding to the packed op; tokens equal the
    eager loop's, before and after weights are edited between calls (in place, and through ``.data``)."""
    model = make_bridge("llama", seed=7)
    tokens, mask = model.to_tokens_and_mask(["Hello world", "The cat sat on", "Hi"], padding_side="left")
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, return_dict=True, output_logits=True)
    count = RowTimesMatrix.packs
    with torch._inductor.config.patch(fx_graph_cache=False):  # compile here, so that the pass runs
        first = model.generate(tokens, **kw, compile=True)
    assert RowTimesMatrix.packs - count == 7 * model.cfg.n_layers + 1
    layers = model.hf_model.model.layers
    for edit in (lambda: layers[0].self_attn.q_proj.weight.mul_(-2.0),
                 lambda: layers[1].mlp.down_proj.weight.data.copy_(torch.randn_like(layers[1].mlp.down_proj.weight)),
                 lambda: model.hf_model.lm_head.weight.data.mul_(1.5)):  # fmt: skip
        eager = model.generate(tokens, **kw)
        compiled = model.generate(tokens, **kw, compile=True)
        assert torch.equal(compiled.sequences, eager.sequences)
        torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-4, rtol=0)
        with torch.no_grad():
            edit()
    eager = model.generate(tokens, **kw)
    compiled = model.generate(tokens, **kw, compile=True)
    assert not torch.allclose(compiled.logits, first.logits, atol=1e-2)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-4, rtol=0)


def test_one_packed_copy_per_weight_whatever_the_batch_size():
    """Products of 2, 3, 8 and 37 rows share one packed copy (made for the first): memory stays one weight's."""
    packed.clear()
    w = torch.randn(24, 16)
    for m in (3, 2, 8, 37, 3):
        x = torch.randn(m, 16)
        torch.testing.assert_close(packed.packed_mm(x, w), x @ w.T, atol=1e-5, rtol=0)
        assert packed.memory_bytes() == w.numel() * 4
    packed.clear()
