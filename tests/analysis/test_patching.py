"""Batched activation-patching sweeps against the serial loop TransformerLens runs (one patch per forward).

Oracle: an independent loop, one `run_with_hooks` per index with TransformerLens' hook and setter; every
batched sweep must equal it within 1e-5 on several families (llama with 2 key-value heads for 4 query heads,
GPT-2, Gemma 2, GPT-J's parallel blocks, Qwen 3, a mixture of experts) and on SmolLM2.
"""

import itertools
from functools import partial

import pytest
import torch
from conftest import FAMILIES as ALL_FAMILIES
from conftest import char_tokenizer, make_bridge, make_hf

from transformer_bridge import TransformerBridge, patching
from transformer_bridge.cache.activation_cache import ActivationCache
from transformer_bridge.relevance import attribution_patching
from transformer_bridge.utils import get_act_name

pandas = pytest.importorskip("pandas")

FAMILIES = ["llama", "gpt2", "gemma2", "gptj", "qwen3", "mixtral"]
CLEAN = torch.tensor([[1, 15, 16, 17, 18, 19]])
CORRUPTED = torch.tensor([[1, 15, 26, 17, 18, 19]])

# (function, setter, activation, axes) as TransformerLens defines each sweep.
SWEEPS = {
    "resid_pre": (patching.get_act_patch_resid_pre, patching.layer_pos_patch_setter, "resid_pre", ("layer", "pos")),
    "resid_mid": (patching.get_act_patch_resid_mid, patching.layer_pos_patch_setter, "resid_mid", ("layer", "pos")),
    "attn_out": (patching.get_act_patch_attn_out, patching.layer_pos_patch_setter, "attn_out", ("layer", "pos")),
    "mlp_out": (patching.get_act_patch_mlp_out, patching.layer_pos_patch_setter, "mlp_out", ("layer", "pos")),
    "z_by_pos": (patching.get_act_patch_attn_head_out_by_pos, patching.layer_pos_head_vector_patch_setter, "z",
                 ("layer", "pos", "head")),
    "q_by_pos": (patching.get_act_patch_attn_head_q_by_pos, patching.layer_pos_head_vector_patch_setter, "q",
                 ("layer", "pos", "head")),
    "k_by_pos": (patching.get_act_patch_attn_head_k_by_pos, patching.layer_pos_head_vector_patch_setter, "k",
                 ("layer", "pos", "head")),
    "v_by_pos": (patching.get_act_patch_attn_head_v_by_pos, patching.layer_pos_head_vector_patch_setter, "v",
                 ("layer", "pos", "head")),
    "pattern_by_pos": (patching.get_act_patch_attn_head_pattern_by_pos, patching.layer_head_pos_pattern_patch_setter,
                       "pattern", ("layer", "head_index", "dest_pos")),
    "z_all_pos": (patching.get_act_patch_attn_head_out_all_pos, patching.layer_head_vector_patch_setter, "z",
                  ("layer", "head")),
    "q_all_pos": (patching.get_act_patch_attn_head_q_all_pos, patching.layer_head_vector_patch_setter, "q",
                  ("layer", "head")),
    "k_all_pos": (patching.get_act_patch_attn_head_k_all_pos, patching.layer_head_vector_patch_setter, "k",
                  ("layer", "head")),
    "v_all_pos": (patching.get_act_patch_attn_head_v_all_pos, patching.layer_head_vector_patch_setter, "v",
                  ("layer", "head")),
    "pattern_all_pos": (patching.get_act_patch_attn_head_pattern_all_pos, patching.layer_head_pattern_patch_setter,
                        "pattern", ("layer", "head_index")),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread: on a shared 2-core machine the second thread waits on a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[0, -1, 15] - logits[0, -1, 26]


def serial(model, corrupted, cache, metric, setter, activation, axes):
    """TransformerLens' loop: every index, one forward with one hook, the metric read back each time."""
    n_heads = model.cfg.n_kv_heads if activation in ("k", "v") else model.cfg.n_heads
    ranges = {"layer": model.cfg.n_layers, "pos": corrupted.shape[-1], "dest_pos": corrupted.shape[-1],
              "src_pos": corrupted.shape[-1]}  # fmt: skip
    shape = [ranges.get(a, n_heads) for a in axes]
    out = torch.zeros(shape)

    def hook(activation_, hook, index, clean):
        return setter(activation_, index, clean)

    for index in itertools.product(*map(range, shape)):
        name = model.names.key((activation, index[0]))
        fn = partial(hook, index=list(index), clean=cache[name])
        out[index] = metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, fn)])).item()
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    model = make_bridge(request.param)
    with torch.no_grad():  # non-zero biases and norms, so every point matters
        gen = torch.Generator().manual_seed(1)
        for p in model.hf_model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    _, cache = model.run_with_cache(CLEAN)
    return model, cache


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_batched_sweep_equals_the_serial_loop(setup, sweep):
    model, cache = setup
    fn, setter, activation, axes = SWEEPS[sweep]
    if get_act_name(activation, 0) not in model.hook_dict:
        pytest.skip(f"{model.cfg.model_type} has no {activation}")
    want = serial(model, CORRUPTED, cache, metric, setter, activation, axes)
    got = fn(model, CORRUPTED, cache, metric)
    assert got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)
    assert got.abs().max() > 0
    if sweep in ("k_by_pos", "v_by_pos", "k_all_pos", "v_all_pos"):
        assert got.shape[-1] == model.cfg.n_kv_heads  # one result per key-value head (2 of 4 heads in llama)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_resid_pre_and_head_outputs_equal_the_serial_loop(family):
    """The copies start at the patched block by repeating its inputs along the batch: checked on every family."""
    model = make_bridge(family)
    _, cache = model.run_with_cache(CLEAN)
    for sweep in ("resid_pre", "z_all_pos"):
        fn, setter, activation, axes = SWEEPS[sweep]
        if get_act_name(activation, 0) not in model.hook_dict:
            continue
        want = serial(model, CORRUPTED, cache, metric, setter, activation, axes)
        torch.testing.assert_close(fn(model, CORRUPTED, cache, metric).cpu(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("family", "attn"),
    [(f, a) for f in ("llama", "gpt2", "qwen3", "gptj", "mixtral") for a in ("sdpa", "eager")] + [("gemma2", "eager")],
)  # HF refuses Gemma 2's soft-cap under SDPA
def test_padded_batches_and_materialised_masks_equal_the_serial_loop(family, attn):
    """A padded corrupted batch of two, under SDPA and eager attention (both materialise a per-row mask): the copies
    that start at the patched block get every later block's mask and position embeddings repeated too (the mask
    was once repeated for the first patched block only, a shape error), and every number equals the serial loop
    and the run without reuse."""
    hf = make_hf(family)
    hf.config._attn_implementation = attn
    model = TransformerBridge(hf, char_tokenizer())
    clean = torch.tensor([[1, 15, 16, 17, 18, 19], [1, 25, 26, 27, 28, 29]])
    corrupted = torch.tensor([[1, 15, 26, 17, 18, 19], [1, 25, 16, 27, 28, 29]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    _, cache = model.run_with_cache(clean, attention_mask=mask)

    def batch_metric(logits):
        return logits[0, -1, 15] - logits[1, 3, 26]

    want = torch.zeros(model.cfg.n_layers, 6)
    for layer, pos in itertools.product(range(model.cfg.n_layers), range(6)):
        name = f"blocks.{layer}.hook_resid_pre"
        hook = partial(lambda x, hook, index, clean: patching.layer_pos_patch_setter(x, index, clean),
                       index=[layer, pos], clean=cache[name])  # fmt: skip
        want[layer, pos] = batch_metric(model.run_with_hooks(corrupted, attention_mask=mask, fwd_hooks=[(name, hook)]))
    fast = patching.get_act_patch_resid_pre(model, corrupted, cache, batch_metric, attention_mask=mask)
    slow = patching.get_act_patch_resid_pre(model, corrupted, cache, batch_metric, attention_mask=mask,
                                            reuse_corrupted=False)  # fmt: skip
    torch.testing.assert_close(fast.cpu(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(slow.cpu(), want, atol=1e-5, rtol=0)
    assert want.abs().max() > 0


def test_pattern_dest_src_and_every_helpers_equal_the_serial_loop():
    model = make_bridge("llama")
    clean, corrupted = CLEAN[:, :4], CORRUPTED[:, :4]
    _, cache = model.run_with_cache(clean)
    want = serial(model, corrupted, cache, metric, patching.layer_head_dest_src_pos_pattern_patch_setter, "pattern",
                  ("layer", "head_index", "dest_pos", "src_pos"))  # fmt: skip
    got = patching.get_act_patch_attn_head_pattern_dest_src_pos(model, corrupted, cache, metric)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    every = patching.get_act_patch_attn_head_all_pos_every(model, corrupted, cache, metric)
    assert every.shape == (5, 2, 4)
    torch.testing.assert_close(every[2, :, :2], patching.get_act_patch_attn_head_k_all_pos(model, corrupted, cache,
                                                                                           metric))  # fmt: skip
    assert (every[2:4, :, 2:] == 0).all()  # key/value sweeps padded to n_heads, as TransformerLens does
    assert not torch.all(every == every[0, 0, 0]) and torch.isfinite(every).all()
    by_pos = patching.get_act_patch_attn_head_by_pos_every(model, corrupted, cache, metric)
    assert by_pos.shape == (5, 2, 4, 4)
    pattern = patching.get_act_patch_attn_head_pattern_by_pos(model, corrupted, cache, metric)
    torch.testing.assert_close(by_pos[4], pattern.permute(0, 2, 1))
    block = patching.get_act_patch_block_every(model, corrupted, cache, metric)
    assert block.shape == (3, 2, 4)
    torch.testing.assert_close(block[1], patching.get_act_patch_attn_out(model, corrupted, cache, metric))


def test_many_patches_share_a_forward():
    model = make_bridge("llama")
    _, cache = model.run_with_cache(CLEAN)
    forwards = []
    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append(x.shape[0]))], read_only=True):
        whole = patching.get_act_patch_resid_pre(model, CORRUPTED, cache, metric)
        assert forwards == [1, 12]  # the unpatched run (the last-position check), then 2 layers × 6 positions at once
        forwards.clear()
        chunked = patching.get_act_patch_resid_pre(model, CORRUPTED, cache, metric, patches_per_forward=5)
        assert forwards == [1, 5, 5, 2]
        forwards.clear()
        tight = patching.get_act_patch_resid_pre(model, CORRUPTED, cache, metric, memory_budget=1)
        assert forwards == [1] * 13  # a budget below one sequence still runs, one patch per forward
    torch.testing.assert_close(whole, chunked)
    torch.testing.assert_close(whole, tight)
    small, large = (patching.chunk_size(model, 1, 6, memory_budget=b) for b in (1 << 16, 1 << 22))
    assert 1 <= small < large and patching.chunk_size(model, 3, 6, memory_budget=1 << 22) == large // 3
    assert patching.chunk_size(model, 1, 6, memory_budget=1 << 22, last_logits_only=True) > large


def test_copies_start_at_the_patched_block_and_only_needed_logits_are_made():
    """Without other hooks, the blocks below the patched layer run once on the corrupted batch; a metric that
    reads only the last position gets that position unembedded. Neither changes a number."""
    model = make_bridge("llama")
    _, cache = model.run_with_cache(CLEAN)
    blocks = model.hf_model.model.layers
    sizes: dict[int, list[int]] = {0: [], 1: []}

    def record(i):
        return lambda module, args, out: sizes[i].append((out[0] if isinstance(out, tuple) else out).shape[0])

    handles = [blocks[i].register_forward_hook(record(i)) for i in range(2)]
    expanded = []

    def last_only(logits):
        expanded.append(logits.stride(1) == 0)
        return logits[0, -1, 15] - logits[0, -1, 26]

    try:
        fast = patching.get_act_patch_resid_pre(model, CORRUPTED, cache, last_only)
    finally:
        for h in handles:
            h.remove()
    # The unpatched run; the check that the batch may grow between blocks (once per model: the last block's input
    # doubled); layer 0's 6 patches; layer 1's, for which block 0 ran the corrupted row once.
    assert sizes[0] == [1, 1, 6, 1] and sizes[1] == [1, 2, 6, 6]
    assert expanded[-1]  # one position unembedded, shown at every position
    slow = patching.get_act_patch_resid_pre(model, CORRUPTED, cache, last_only, reuse_corrupted=False)
    assert not expanded[-1]
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=0)

    def all_positions(logits):
        expanded.append(logits.stride(1) == 0)
        return logits[0, :, 15].sum()

    patching.get_act_patch_resid_pre(model, CORRUPTED, cache, all_positions)
    assert not expanded[-1]  # a metric that reads other positions gets them all


def test_per_example_metrics_baseline_and_statistics():
    model = make_bridge("gpt2")
    clean = torch.tensor([[1, 15, 16, 17, 18], [1, 25, 26, 27, 28]])
    corrupted = torch.tensor([[1, 15, 36, 17, 18], [1, 25, 46, 27, 28]])
    _, cache = model.run_with_cache(clean)

    def per_example(logits):
        return logits[:, -1, 15] - logits[:, -1, 36]

    res = patching.get_act_patch_resid_pre(model, corrupted, cache, per_example, reduce="none", baseline=True)
    assert isinstance(res, patching.PatchingResult) and res.values.shape == (2, 5, 2) and not res.reduced
    with torch.no_grad():
        unpatched = per_example(model(corrupted))
        patched_clean = per_example(model(clean))
    torch.testing.assert_close(res.baseline, unpatched, atol=1e-5, rtol=0)
    mean = patching.get_act_patch_resid_pre(model, corrupted, cache, per_example, reduce="mean")
    torch.testing.assert_close(res.mean(), mean)
    torch.testing.assert_close(res.effect(), res.values - unpatched, atol=1e-5, rtol=0)
    assert res.stderr().shape == (2, 5)
    low, high = res.bootstrap_ci(n_resamples=50, seed=1)
    assert low.shape == (2, 5) and bool((low <= high + 1e-6).all())
    torch.testing.assert_close(res.bootstrap_ci(n_resamples=50, seed=1)[0], low)  # reproducible per seed
    p = res.permutation_pvalue()
    assert p.shape == (2, 5) and bool(((p > 0) & (p <= 1)).all())
    recovery = res.normalized(patched_clean)
    torch.testing.assert_close(recovery[0, 2], torch.ones(2), atol=1e-4, rtol=0)  # the changed token, at the start
    frame = res.to_dataframe()
    assert len(frame) == 2 * 5 * 2 and {"layer", "pos", "example", "value"} <= set(frame.columns)
    assert list(res.index_df.columns) == ["layer", "pos"] and len(res.index_df) == 10

    both = patching.get_act_patch_attn_out(model, corrupted, cache, {"diff": per_example, "sum": lambda lg: lg[:, -1]
                                           .sum(-1)}, reduce="none")  # fmt: skip
    assert both.has_metric_axis and both.values.shape == (2, 2, 5, 2) and both.metric_names == ["diff", "sum"]
    torch.testing.assert_close(both["diff"].values, patching.get_act_patch_attn_out(model, corrupted, cache,
                               per_example, reduce="none").values)  # fmt: skip
    every = patching.get_act_patch_block_every(model, corrupted, cache, per_example, reduce="none", baseline=True)
    assert every.values.shape == (3, 2, 5, 2) and every.patch_type_names == ["resid_pre", "attn_out", "mlp_out"]
    torch.testing.assert_close(every.baseline, unpatched, atol=1e-5, rtol=0)


def test_index_df_gives_a_flat_result_of_the_chosen_cells():
    model = make_bridge("qwen3")
    _, cache = model.run_with_cache(CLEAN)
    full = patching.get_act_patch_attn_head_out_by_pos(model, CORRUPTED, cache, metric)
    frame = pandas.DataFrame({"layer": [1, 0, 1], "pos": [5, 2, 0], "head": [3, 1, 2]})
    flat, df = patching.generic_activation_patch(model, CORRUPTED, cache, metric,
                                                 patching.layer_pos_head_vector_patch_setter, "z", index_df=frame,
                                                 return_index_df=True)  # fmt: skip
    torch.testing.assert_close(flat, torch.stack([full[1, 5, 3], full[0, 2, 1], full[1, 0, 2]]))
    assert df.equals(frame)
    rows = torch.tensor([[1, 5, 3], [0, 2, 1]])
    torch.testing.assert_close(patching.generic_activation_patch(model, CORRUPTED, cache, metric,
                               patching.layer_pos_head_vector_patch_setter, "z", index_df=rows), flat[:2])  # fmt: skip
    grid = patching.get_act_patch_resid_pre(model, CORRUPTED, cache, metric)
    _, index = patching.generic_activation_patch(model, CORRUPTED, cache, metric, patching.layer_pos_patch_setter,
                                                 "resid_pre", ("layer", "pos"), return_index_df=True)  # fmt: skip
    assert index.equals(patching.make_df_from_ranges([2, 6], ["layer", "pos"])) and grid.shape == (2, 6)


def test_a_setter_that_returns_a_new_tensor_and_text_input():
    model = make_bridge("llama")
    _, cache = model.run_with_cache(CLEAN)

    def functional(corrupted, index, clean):  # no in-place edit: a new tensor
        out = corrupted.clone()
        out[:, index[1]] = clean[:, index[1]]
        return out

    got = patching.generic_activation_patch(model, CORRUPTED, cache, metric, functional, "resid_pre", ("layer", "pos"))
    torch.testing.assert_close(got, patching.get_act_patch_resid_pre(model, CORRUPTED, cache, metric))
    _, text_cache = model.run_with_cache("Hello")
    scan = patching.get_act_patch_resid_pre(model, "Hellp", text_cache, metric)
    assert scan.shape == (2, 6)  # BOS + 5 characters


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda m, c: patching.get_act_patch_resid_pre(m, CORRUPTED, c, metric, reduce="sum"), ValueError,
         r"`reduce`='sum' is not allowed: reduce must be one of \('scalar', 'mean', 'none'\)"),
        (lambda m, c: patching.get_act_patch_resid_pre(m, CORRUPTED, c, "logit diff"), TypeError,
         r"`patching_metric` 'metric' must be a function"),
        (lambda m, c: patching.get_act_patch_resid_pre(m, CORRUPTED, c, lambda lg: lg[0, -1]), ValueError,
         r"must return a scalar with reduce='scalar'"),
        (lambda m, c: patching.get_act_patch_resid_pre(m, CORRUPTED, c, metric, reduce="none"), ValueError,
         r"one value per corrupted example \(length 1\)"),
        (lambda m, c: patching.get_act_patch_resid_pre(m, CORRUPTED, c, metric, patches_per_forward=0), ValueError,
         r"`patches_per_forward` must be an int >= 1, got 0"),
        (lambda m, c: patching.get_act_patch_resid_pre(m, CORRUPTED, c, metric, patches_per_froward=2), TypeError,
         r"Did you mean 'patches_per_forward'"),
        (lambda m, c: patching.generic_activation_patch(m, CORRUPTED, c, metric, patching.layer_pos_patch_setter,
                                                        "resid_pree", ("layer", "pos")), KeyError, r"resid_pre"),
        (lambda m, c: patching.generic_activation_patch(m, CORRUPTED, c, metric, patching.layer_pos_patch_setter,
                                                        "resid_pre", ("pos", "layer")), ValueError,
         r"start with 'layer'"),
        (lambda m, c: patching.generic_activation_patch(m, CORRUPTED, c, metric, patching.layer_pos_patch_setter,
                                                        "resid_pre", index_df=torch.tensor([[5, 0]])), IndexError,
         r"layer 5; this model has 2 layers"),
        (lambda m, c: patching.get_act_patch_attn_head_out_by_pos(m, CORRUPTED, c, metric), KeyError,
         r"`clean_cache` lacks 'blocks.0.attn.hook_z'"),
        (lambda m, c: patching.get_act_patch_resid_pre(m, CORRUPTED, {}, metric), TypeError,
         r"`clean_cache` must be the ActivationCache"),
    ],
)  # fmt: skip
def test_errors_name_the_parameter_and_the_value(call, error, pattern):
    model = make_bridge("llama")
    _, cache = model.run_with_cache(CLEAN, names_filter=lambda n: "resid" in n)
    with pytest.raises(error, match=pattern):
        call(model, cache)


@pytest.mark.parametrize(
    ("corrupted", "shown"),
    [(CORRUPTED[:, :4], r"\(1, 4\)"), (CORRUPTED.repeat(2, 1), r"\(2, 6\)")],
)
def test_clean_and_corrupted_of_different_shapes_are_refused_naming_both(corrupted, shown):
    model = make_bridge("llama")
    _, cache = model.run_with_cache(CLEAN)
    for sweep in (patching.get_act_patch_resid_pre, patching.get_act_patch_attn_head_pattern_by_pos):
        with pytest.raises(ValueError, match=rf"`corrupted_tokens`.*{shown}.*`clean_cache`.*\(1, 6\)"):
            sweep(model, corrupted, cache, metric)


def test_a_training_model_is_refused():
    model = make_bridge("llama")
    _, cache = model.run_with_cache(CLEAN)
    model.hf_model.train()
    try:
        with pytest.raises(ValueError, match=r"evaluation mode.*model.eval\(\)"):
            patching.get_act_patch_resid_pre(model, CORRUPTED, cache, metric)
    finally:
        model.hf_model.eval()


def test_attribution_patching_is_the_first_order_term_of_the_exact_sweep():
    """A clean cache a small step δ from the corrupted one: the exact patch moves the metric by ∇m·δ + O(δ²), and
    attribution patching estimates ∇m·δ, so their difference shrinks as δ² (100× for δ/10) while the effect shrinks
    as δ. A large step (a different token) is where the estimate can fail: docs/analysis.md measures it. In float64,
    so that rounding does not blur the δ² term."""
    model = TransformerBridge(make_hf("llama").double(), char_tokenizer())
    _, corrupted_cache = model.run_with_cache(CORRUPTED)
    with torch.no_grad():
        base = metric(model(CORRUPTED))
    errors = []
    for step in (1e-4, 1e-5):
        gen = torch.Generator().manual_seed(0)
        nudged = {k: v + step * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
                  for k, v in corrupted_cache.items()}  # fmt: skip
        clean_cache = ActivationCache(nudged, model, attention_mask=corrupted_cache.attention_mask)
        exact = patching.get_act_patch_resid_pre(model, CORRUPTED, clean_cache, metric) - base
        estimate = attribution_patching(model, CORRUPTED, CORRUPTED, metric, clean_cache=clean_cache)
        linear = torch.stack([estimate[f"blocks.{layer}.hook_resid_pre"][0] for layer in range(2)])
        errors.append(((linear - exact).abs().max() / exact.abs().max()).item())
    assert errors[1] < 3e-3 and errors[0] / 20 < errors[1] < errors[0] / 5  # relative error ∝ δ: first-order exact


@pytest.mark.real
def test_smollm2_resid_pre_and_kv_heads_equal_the_serial_loop(smollm2):
    model = smollm2
    clean = model.to_tokens("The Eiffel Tower is located in the city of")
    corrupted = model.to_tokens("The Colosseum is located in the city of")
    assert clean.shape == corrupted.shape
    _, cache = model.run_with_cache(clean)
    paris, rome = model.to_single_token(" Paris"), model.to_single_token(" Rome")

    def diff(logits):
        return logits[0, -1, paris] - logits[0, -1, rome]

    # Batched and serial forwards sum in other orders (batch sizes pick other GEMM blockings); over 30 layers that
    # reaches 1.6e-5 on these logit differences (|x| ~ 5) with some thread counts: tested at 5e-5.
    want = serial(model, corrupted, cache, diff, patching.layer_pos_patch_setter, "resid_pre", ("layer", "pos"))
    got = patching.get_act_patch_resid_pre(model, corrupted, cache, diff)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=0)
    want = serial(model, corrupted, cache, diff, patching.layer_head_vector_patch_setter, "v", ("layer", "head"))
    got = patching.get_act_patch_attn_head_v_all_pos(model, corrupted, cache, diff)
    assert got.shape == (model.cfg.n_layers, model.cfg.n_kv_heads) == (30, 3)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=0)
