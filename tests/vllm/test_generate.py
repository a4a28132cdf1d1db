"""Generation on vLLM against the HF bridge: greedy tokens, `return_cache` caches, relevance, and rows that never mix
under continuous batching (staggered lengths, preemption, prefix caching)."""

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

from transformer_bridge.vllm import UnsupportedOptionError

PROMPTS = [[1, 5, 7, 9, 11, 13, 17, 19, 23], [1, 8], [1, 30, 31, 32, 33], [1, 4, 4, 4]]


def hf_greedy(ref, row, n):
    return ref.generate(torch.tensor([row]), max_new_tokens=n, do_sample=False, stop_at_eos=False)[0].tolist()


def assert_cache_equals_hf(ref, seq, cache, tol=1e-5):
    _, ref_cache = ref.run_with_cache(torch.tensor([seq]))
    assert sorted(cache.keys()) == sorted(ref_cache.keys())
    for name in ref_cache:
        assert cache[name].shape == ref_cache[name].shape, name
        a, b = cache[name], ref_cache[name]
        assert torch.where(a == b, 0.0, (a - b).abs()).max() < tol, name  # blocked scores are -inf in both


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_tokens_and_caches_equal_hf(family, engine, oracle):
    model, ref = engine(family), oracle(family)
    out, caches = model.generate(PROMPTS, max_new_tokens=6, return_cache=True, stop_at_eos=False)
    assert len(caches) == len(PROMPTS)
    for row, seq, cache in zip(PROMPTS, out, caches, strict=True):
        assert seq == hf_greedy(ref, row, 6)
        assert cache.prompt_lengths.tolist() == [len(row)]
        assert_cache_equals_hf(ref, seq, cache)


def test_return_cache_names_filter_and_device(engine):
    model = engine("llama")
    _out, caches = model.generate([[1, 2, 3]], max_new_tokens=2, return_cache=True, names_filter="resid_post",
                                 device="meta", stop_at_eos=False)  # fmt: skip
    assert list(caches[0].keys()) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    assert caches[0]["resid_post", 0].device.type == "meta" and caches[0]["resid_post", 0].shape[1] == 5


def test_relevance_reads_a_vllm_cache(engine, oracle):
    model, ref = engine("llama"), oracle("llama")
    out, caches = model.generate([PROMPTS[0]], max_new_tokens=4, return_cache=True, stop_at_eos=False)
    seq = torch.tensor(out)
    rel = ref.relevance((seq, caches[0]), method="dla", token_indices=[0, 3])
    ref_out, ref_cache = ref.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False,
                                      stop_at_eos=False, return_cache=True)  # fmt: skip
    expected = ref.relevance((ref_out, ref_cache), method="dla", token_indices=[0, 3])
    assert torch.equal(ref_out, seq)
    assert (rel.scores - expected.scores).abs().max() < 1e-4


def test_rows_never_mix_under_preemption_and_prefix_caching(fresh_engine, oracle):
    """A KV budget of 6 blocks of 32 for 6 requests of 36 to 58 tokens forces preemption (recompute); a shared
    prefix is served from the prefix cache at generation; every cache still equals the HF bridge's."""
    model = fresh_engine("llama", max_model_len=128, num_gpu_blocks_override=6, block_size=32,
                         enable_prefix_caching=True, disable_log_stats=False)  # fmt: skip
    ref = oracle("llama")
    shared = [1, *range(40, 71)]  # one full block: cacheable
    prompts = [[*shared, 5], [*shared, 6, 7], [1, 9] * 9, [*shared, 8, 9, 10], [1, 3], [1, *list(range(10, 40))]]
    model.generate([[*shared, 11]], max_new_tokens=2)  # fills the prefix cache
    out, caches = model.generate(prompts, max_new_tokens=24, return_cache=True, names_filter=["resid_post", "embed"],
                                 stop_at_eos=False)  # fmt: skip
    metrics = {m.name: m for m in model.llm.get_metrics()}
    assert metrics["vllm:num_preemptions"].value > 0
    assert metrics["vllm:prefix_cache_hits"].value > 0
    for row, seq, cache in zip(prompts, out, caches, strict=True):
        assert seq == hf_greedy(ref, row, 24)
        _, ref_cache = ref.run_with_cache(torch.tensor([seq]), names_filter=["resid_post", "embed"])
        for name in ref_cache:
            assert (cache[name] - ref_cache[name]).abs().max() < 1e-5, name


def test_sampling_options_map_and_refuse(engine):
    model = engine("llama")
    a = model.generate([[1, 5, 7]], max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                       min_p=0.01, seed=3, stop_at_eos=False)  # fmt: skip
    b = model.generate([[1, 5, 7]], max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                       min_p=0.01, seed=3, stop_at_eos=False)  # fmt: skip
    assert a == b and len(a[0]) == 11
    res = model.generate([[1, 5, 7]], max_new_tokens=3, top_logprobs=2, return_dict=True, stop_at_eos=False)[0]
    assert res.logprobs.shape == (3,) and res.top_tokens.shape == (3, 2)
    assert torch.equal(res.top_tokens[:, 0], res.sequences[0, 3:])  # greedy: the chosen token is the best one
    with pytest.raises(UnsupportedOptionError, match="`num_beams`"):
        model.generate([[1, 5]], max_new_tokens=2, num_beams=3)
    with pytest.raises(TypeError, match="`bogus`"):
        model.generate([[1, 5]], max_new_tokens=2, bogus=1)
