"""A compiled engine (vLLM's default) with declared points: interventions and captures traced in when it is built,
against an eager engine on the same weights; new vectors or captures take effect without recompiling."""

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

from transformer_bridge.vllm import CompiledEngineError, Intervention

POINT = "blocks.0.hook_resid_post"
DECLARED = [POINT, "blocks.1.attn.hook_z", "unembed.hook_out"]
PROMPTS = [[1, 5, 7, 9, 11], [1, 8, 3], [1, 30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="session")  # engines of one process live as long as it does (docs/vllm.md)
def compiled(tiny_dir):
    from conftest import VLLM_ENGINE

    from transformer_bridge.vllm import VLLMBridge

    kwargs = {k: v for k, v in VLLM_ENGINE.items() if k != "enforce_eager"}
    return VLLMBridge.from_pretrained(tiny_dir("llama"), compiled_points=DECLARED, **kwargs)


def vectors(n):
    g = torch.Generator().manual_seed(5)
    return [3.0 * torch.randn(256, generator=g) for _ in range(n)]


def graphs():
    from torch._dynamo.utils import counters

    return dict(counters["stats"])


def test_declared_interventions_per_request_equal_eager(compiled, engine):
    eager = engine("llama")
    assert compiled.compiled and not eager.compiled
    kw = dict(max_new_tokens=5, stop_at_eos=False)
    plain = compiled.generate(PROMPTS, **kw)
    assert plain == eager.generate(PROMPTS, **kw)
    before = graphs()
    for round_ in range(2):  # new vectors each round: values are data, never compiled in
        vs = vectors(2 + round_)
        steer = [[Intervention(POINT, add=vs[0])], None, [Intervention(POINT, add=vs[1], positions=[2, 3])]]
        out = compiled.generate(PROMPTS, interventions=steer, **kw)
        assert out == eager.generate(PROMPTS, interventions=steer, **kw)
        assert out[1] == plain[1] and out[0] != plain[0]  # the unsteered batch-mate is untouched
    assert graphs() == before  # nothing recompiled


def test_declared_captures_equal_eager(compiled, engine):
    eager = engine("llama")
    names = [POINT, "blocks.1.attn.hook_z"]
    logits, caches = compiled.run_with_cache(PROMPTS, names_filter=names)
    ref_logits, ref_caches = eager.run_with_cache(PROMPTS, names_filter=names)
    for lg, ref_lg, c, ref in zip(logits, ref_logits, caches, ref_caches, strict=True):
        assert (lg - ref_lg).abs().max() < 1e-5
        assert list(c.keys()) == names
        for name in names:
            assert (c[name] - ref[name]).abs().max() < 1e-5, name
    _, gen_caches = compiled.generate(PROMPTS[:2], max_new_tokens=3, return_cache=True, names_filter=POINT,
                                        stop_at_eos=False)  # fmt: skip
    assert [c[POINT].shape[1] for c in gen_caches] == [len(p) + 3 for p in PROMPTS[:2]]


def test_undeclared_points_and_python_hooks_raise(compiled):
    with pytest.raises(CompiledEngineError, match=r"blocks\.1\.hook_resid_post.*compiled_points"):
        compiled.run_with_cache(PROMPTS[:1], names_filter="blocks.1.hook_resid_post")
    with pytest.raises(CompiledEngineError, match=r"blocks\.1\.hook_mlp_out.*compiled_points"):
        compiled.generate(
            PROMPTS[:1], max_new_tokens=2, interventions=[[Intervention("blocks.1.hook_mlp_out", scale=0.0)]]
        )
    with pytest.raises(CompiledEngineError, match="enforce_eager=True"), compiled.hooks([(POINT, print)]):
        pass
