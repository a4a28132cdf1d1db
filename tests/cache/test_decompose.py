"""The one residual-stream decomposition (`transformer_bridge.cache.decompose`) on every family.

Oracles: the cached residual stream itself (the parts must sum to what each layer reads, 1e-5), and
the model's logits (direct logit attribution must sum to them). ``dla`` and the cache's
TransformerLens methods (`get_full_resid_decomposition`, `decompose_resid`, `logit_attrs`) are views of
the same decomposition, so their numbers must agree component by component. Every parameter is
perturbed first: HF initialises biases to 0 and norm weights to 1, which would hide a missing term.
"""

import pytest
import torch
from conftest import CONFIGS, FAMILIES, V, adapted_config, char_tokenizer, perturb_
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge
from transformer_bridge.cache.decompose import Activations, components
from transformer_bridge.relevance import RelevanceRun

TOKENS = torch.randint(4, V, (2, 7), generator=torch.Generator().manual_seed(4))
TOL = dict(atol=1e-5, rtol=1e-5)
# Output biases on o_proj / down_proj; for Gemma 2 a bias that enters the stream through a sandwich norm.
WITH_BIASES: list[tuple[str, dict]] = [
    ("llama", dict(attention_bias=True, mlp_bias=True)),
    ("gemma2", dict(attention_bias=True)),
]


def make(family: str, **config) -> TransformerBridge:
    cfg = adapted_config(family, CONFIGS[family])  # a skip where the installed transformers has no adapter for it
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return perturb_(TransformerBridge(AutoModelForCausalLM.from_config(cfg).eval(), char_tokenizer()))


@pytest.fixture(
    scope="module", params=[(f, {}) for f in FAMILIES] + WITH_BIASES, ids=lambda p: p[0] + "+bias" * bool(p[1])
)
def run(request):
    family, config = request.param
    model = make(family, **config)
    return model, model.run_with_cache(TOKENS)[1]


def _resid_read_by(model, cache, layer: int, mlp_input: bool) -> torch.Tensor:
    n = model.cfg.n_layers
    if layer == n:
        return cache["resid_post", n - 1]
    return cache["resid_mid" if mlp_input else "resid_pre", layer]


@pytest.mark.parametrize(("heads", "neurons"), [(False, False), (True, False), (False, True), (True, True)])
def test_components_sum_to_the_residual_stream(run, heads, neurons):
    model, cache = run
    acts = Activations(cache.__getitem__, cache.__contains__)
    n, parallel = model.cfg.n_layers, model.cfg.parallel_attn_mlp
    for layer in range(n + 1):
        for mlp_input in (False, True) if layer < n and not parallel else (False,):
            parts, comps = components(model, acts, layer, mlp_input, heads=heads, neurons=neurons)
            assert len(parts) == len(comps) and comps[0].kind == "embed"
            torch.testing.assert_close(parts.sum(0), _resid_read_by(model, cache, layer, mlp_input), **TOL)
            if heads and layer == n:
                assert sum(c.kind == "head" for c in comps) == n * model.cfg.n_heads
    # Mixtures of experts split by expert (+ the rest: a shared expert); a no-op on dense families.
    parts, comps = components(model, acts, n, heads=heads, neurons=neurons, experts=True)
    torch.testing.assert_close(parts.sum(0), cache["resid_post", -1], **TOL)
    moe = [i for i in range(n) if f"blocks.{i}.mlp.hook_expert_result" in cache]
    assert {c.layer for c in comps if c.kind == "expert"} == set(moe)
    # The same parts at chosen (row, position) pairs, as `dla` reads them.
    rows, cols = torch.tensor([1, 0, 1]), torch.tensor([6, 3, 2])
    picked = Activations(lambda name: cache[name][rows, cols], cache.__contains__)
    parts, _ = components(model, picked, n, heads=True)
    torch.testing.assert_close(parts.sum(0), cache["resid_post", -1][rows, cols], **TOL)


def _mlp(dla: dict[str, float], layer: int) -> float:
    """``dla``'s MLP of ``layer``: one component, or a mixture split by expert (the cache holds everything)."""
    if f"L{layer}.mlp" in dla:
        return dla[f"L{layer}.mlp"]
    return sum(v for k, v in dla.items() if k.startswith(f"L{layer}E") or k == f"L{layer}.mlp_rest")


def test_dla_equals_the_cache_logit_attributions(run):
    """``dla`` on a cache gives the numbers of ``cache.logit_attrs`` on that cache's decompositions."""
    model, cache = run
    rel = RelevanceRun(model, TOKENS, None, 4, cache=cache).relevance_pass(method="dla", target=("logit_diff", 9))
    full, full_labels = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
    outs, out_labels = cache.decompose_resid(return_labels=True)
    n = model.cfg.n_layers
    for i, step in enumerate(rel):
        b, p, t = step.batch_index, step.position - 1, step.token_id
        dla = dict(zip(rel.labels, rel.scores[i].tolist(), strict=True))

        def attrs(stack, b=b, p=p, t=t):
            return cache.logit_attrs(stack[:, b, p], t, incorrect_tokens=9, pos_slice=p, batch_slice=b,
                                     has_batch_dim=False)  # fmt: skip

        tl = dict(zip(full_labels, attrs(full).tolist(), strict=True))
        by_block = dict(zip(out_labels, attrs(outs).tolist(), strict=True))
        for label, value in tl.items():
            if label == "bias":  # one row in TransformerLens' layout, one per layer in dla's
                want = sum(v for k, v in dla.items() if k.endswith(".attn_bias"))
            elif label.endswith("_mlp_out"):
                want = _mlp(dla, int(label.split("_")[0]))
            else:
                want = dla[label]
            assert value == pytest.approx(want, abs=1e-5), label
        for layer in range(n):
            heads = sum(v for k, v in dla.items() if k.startswith(f"L{layer}H") or k == f"L{layer}.attn_bias")
            assert by_block[f"{layer}_attn_out"] == pytest.approx(heads, abs=1e-5)
            assert by_block[f"{layer}_mlp_out"] == pytest.approx(_mlp(dla, layer), abs=1e-5)


@pytest.mark.parametrize(("family", "config"), WITH_BIASES)
def test_dla_with_output_biases_sums_to_the_logit(family, config):
    """The attention bias behind Gemma 2's sandwich norm passes through that norm (at its cached scale)."""
    model = make(family, **config)
    rel = RelevanceRun(model, TOKENS, None, 4, cache=model.run_with_cache(TOKENS)[1]).relevance_pass(method="dla")
    assert any(label.endswith(".attn_bias") for label in rel.labels)
    with torch.no_grad():
        logits = model(TOKENS).float()
    cap = getattr(model.hf_model.config, "final_logit_softcapping", None)
    logits = torch.atanh(logits / cap) * cap if cap else logits
    for i, step in enumerate(rel):
        want = logits[step.batch_index, step.position - 1, step.token_id]
        assert rel.scores[i].sum().item() == pytest.approx(want.item(), abs=1e-4, rel=1e-5)
