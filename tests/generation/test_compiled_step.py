"""The compiled decode step's CPU graph pass (`compiled.RowTimesMatrix`) against BLAS and the eager loop.

At batch 1 every linear layer of a decode step is a one-row matrix product, which the pass turns into a
multiply and a sum (products of several rows go to oneDNN-packed weights: tests/generation/test_packed.py).
Oracles: ``torch.mm`` / ``torch.addmm`` on the same inputs, and the eager decode loop.
"""

import pytest
import torch
from conftest import make_bridge
from torch.fx.experimental.proxy_tensor import make_fx

from transformer_bridge.generation.compiled import RowTimesMatrix, compile_options


def _targets(fn, *args) -> set[str]:
    gm = make_fx(fn, tracing_mode="fake")(*args)
    RowTimesMatrix()(gm.graph)
    gm.recompile()
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_pass_rewrites_one_row_products_only():
    w, bias = torch.randn(5, 7), torch.randn(5)
    row, rows = torch.randn(1, 7), torch.randn(3, 7)
    assert "aten.mm.default" not in _targets(lambda a, w: a @ w.t(), row, w)
    assert "aten.addmm.default" not in _targets(lambda a, w, b: torch.addmm(b, a, w.t()), row, w, bias)
    assert "aten.mm.default" not in _targets(lambda a, w: a @ w.t(), rows, w)  # batch > 1: packed (test_packed.py)
    assert "aten.mm.default" in _targets(lambda a, w: a @ w, row, w.t().contiguous())  # Conv1D layout: BLAS
    assert "aten.mm.default" in _targets(lambda a, w: a @ w.t(), row.double(), w.double())


@pytest.mark.parametrize("shape", [(1, 7, 5), (1, 576, 1536), (1, 3, 1)])
def test_compiled_pass_equals_blas(shape):
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    torch._dynamo.reset()
    f = torch.compile(lambda a, w, b: (a @ w.t(), torch.addmm(b, a, w.t())), dynamic=False,
                      **compile_options(torch.device("cpu")))  # fmt: skip
    got_mm, got_addmm = f(a, w, b)
    torch.testing.assert_close(got_mm, a @ w.t(), atol=1e-5 * k**0.5, rtol=1e-5)
    torch.testing.assert_close(got_addmm, torch.addmm(b, a, w.t()), atol=1e-5 * k**0.5, rtol=1e-5)


def test_options_per_device():
    assert isinstance(compile_options(torch.device("cpu"))["options"]["post_grad_custom_pre_pass"], RowTimesMatrix)
    assert compile_options(torch.device("cuda")) == {"mode": "reduce-overhead"}
    assert RowTimesMatrix().uuid() == RowTimesMatrix().uuid()  # inductor's cache key: stable


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_batch_of_one_compiled_equals_the_eager_loop(family):
    """Batch 1 is where the pass applies (gpt2: its Conv1D layout keeps BLAS, the unembedding is rewritten)."""
    model = make_bridge(family)
    tokens = model.to_tokens("Hello world, this is")
    kw = dict(max_new_tokens=12, min_new_tokens=12, return_dict=True, output_logits=True)
    plain = model.generate(tokens, **kw)
    before = RowTimesMatrix.rewrites
    with torch._inductor.config.patch(fx_graph_cache=False):  # compile here, so that the pass runs
        compiled = model.generate(tokens, **kw, compile=True)
    layers = model.cfg.n_layers
    # llama / qwen2: q k v o gate up down per layer and the unembedding; gpt2: the unembedding only
    assert RowTimesMatrix.rewrites - before == (1 if family == "gpt2" else 7 * layers + 1)
    assert torch.equal(compiled.sequences, plain.sequences)
    torch.testing.assert_close(compiled.logits, plain.logits, atol=1e-4, rtol=0)


def test_batch_of_one_with_steering_and_a_python_hook():
    """The rewritten step runs hooks as the eager loop does: one `steer` (updated without retracing) and a
    Python hook reading ``hook.ctx``."""
    model = make_bridge("llama", seed=5)
    tokens = model.to_tokens("Hello world")
    point = "blocks.1.hook_resid_post"
    v = 2 * torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=10, min_new_tokens=10, return_dict=True, output_logits=True)

    def late(x, hook):
        return x + v * (hook.ctx.positions >= 8)[..., None]

    def run(**options):
        return model.generate(tokens, **kw, **options)

    with model.steer(point, add=v) as s:
        plus_eager, plus = run(), run(compile=True)
        s.update(add=-v)
        minus_eager, minus = run(), run(compile=True)
    with model.hooks(fwd_hooks=[(point, late)]):
        late_eager, late_compiled = run(), run(compile=True)
    assert not torch.equal(plus.sequences, minus.sequences)
    for got, want in ((plus, plus_eager), (minus, minus_eager), (late_compiled, late_eager)):
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)


def test_weights_edited_after_compiling_are_used():
    """Nothing is frozen into the compiled step: an in-place weight edit shows in the next compiled call."""
    model = make_bridge("llama", seed=3)
    tokens = model.to_tokens("The cat sat")
    kw = dict(max_new_tokens=10, min_new_tokens=10, return_dict=True, output_logits=True)
    before = model.generate(tokens, **kw, compile=True)
    weight = model.hf_model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        weight.mul_(-3.0)
    after = model.generate(tokens, **kw, compile=True)
    eager = model.generate(tokens, **kw)
    assert not torch.allclose(after.logits, before.logits, atol=1e-3)
    assert torch.equal(after.sequences, eager.sequences)
    torch.testing.assert_close(after.logits, eager.logits, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_batch_of_one_compiled_equals_eager(smollm2):
    tokens = smollm2.to_tokens("The capital of France is")
    kw = dict(max_new_tokens=24, min_new_tokens=24, return_dict=True, output_logits=True)
    plain = smollm2.generate(tokens, **kw)
    out = smollm2.generate(tokens, **kw, compile=True)
    assert torch.equal(out.sequences, plain.sequences)
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-4, rtol=1e-5)
