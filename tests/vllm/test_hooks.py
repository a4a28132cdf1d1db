"""Hooks and declared interventions on vLLM, per request, against the HF bridge's steering."""

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

from transformer_bridge.vllm import CompiledEngineError, Intervention

PROMPTS = [[1, 5, 7, 9, 11], [1, 8, 3], [1, 30, 31, 32, 33, 34, 35]]
POINT = "blocks.0.hook_resid_post"


def direction(d_model=256):
    g = torch.Generator().manual_seed(1)
    return torch.randn(d_model, generator=g)


def test_hook_sees_one_request_with_context(engine):
    model = engine("llama")
    seen = []

    def record(x, hook):
        seen.append((hook.ctx.request, hook.ctx.phase, hook.ctx.positions[0].tolist(), tuple(x.shape)))

    with model.hooks(fwd_hooks=[(POINT, record)]):
        model.generate(PROMPTS[:2], max_new_tokens=3, stop_at_eos=False)
    by_request = {r: [s for s in seen if s[0] == r] for r in (0, 1)}
    for r, prompt in enumerate(PROMPTS[:2]):
        n = len(prompt)
        assert by_request[r][0] == (r, "prefill", list(range(n)), (1, n, 256))
        assert [s[2] for s in by_request[r][1:]] == [[n], [n + 1]]
        assert all(s[1] == "decode" and s[3] == (1, 1, 256) for s in by_request[r][1:])


def test_hook_edit_equals_hf(engine, oracle):
    model, ref = engine("llama"), oracle("llama")
    v = direction()

    def push(x, hook):
        return x + 3.0 * v * (hook.ctx.positions[..., None] >= 2)

    with model.hooks(fwd_hooks=[(POINT, push)]):
        out = model.generate(PROMPTS, max_new_tokens=5, stop_at_eos=False)
        logits = model.run_with_hooks([PROMPTS[0]], fwd_hooks=[])
    with ref.hooks(fwd_hooks=[(POINT, push)]):
        for row, seq in zip(PROMPTS, out, strict=True):
            expected = ref.generate(torch.tensor([row]), max_new_tokens=5, do_sample=False, stop_at_eos=False)
            assert seq == expected[0].tolist()
        assert (logits - ref(torch.tensor([PROMPTS[0]]))).abs().max() < 1e-5


@pytest.mark.parametrize("op", [dict(add=3.0), dict(scale=0.0), dict(set=1.0), dict(ablate=True)])
def test_intervention_per_request_equals_hf_and_spares_batch_mates(engine, oracle, op):
    model, ref = engine("llama"), oracle("llama")
    v = direction()
    value = {k: (w * v if k == "add" else w) for k, w in op.items()}
    iv = Intervention(POINT, positions=[1, 2, 6], **value)
    plain = model.generate(PROMPTS, max_new_tokens=5, stop_at_eos=False)
    plain_logits = model(PROMPTS)
    steered = model.generate(PROMPTS, max_new_tokens=5, stop_at_eos=False, interventions=[None, [iv], None])
    logits = model(PROMPTS, interventions=[None, [iv], None])
    assert steered[0] == plain[0] and steered[2] == plain[2]  # batch-mates untouched
    assert torch.equal(logits[0], plain_logits[0]) and torch.equal(logits[2], plain_logits[2])  # bitwise
    hf_op = {"ablate": {"scale": 0.0}}.get(next(iter(op)), value)
    if "set" in op:
        hf_op = {"set": torch.full((256,), 1.0)}
    with ref.steer(POINT, positions=[1, 2, 6], **hf_op):
        expected = ref.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=5, do_sample=False, stop_at_eos=False)
        ref_logits = ref(torch.tensor([PROMPTS[1]]))
    assert steered[1] == expected[0].tolist()
    assert (logits[1] - ref_logits[0]).abs().max() < 1e-5


def test_sixteen_distinct_vectors_in_one_batch(engine, oracle):
    model, ref = engine("llama"), oracle("llama")
    g = torch.Generator().manual_seed(2)
    vectors = [2.0 * torch.randn(256, generator=g) for _ in range(16)]
    prompts = [[1, 5 + i, 7, 9 + i % 3] for i in range(16)]
    out = model.generate(prompts, max_new_tokens=4, stop_at_eos=False,
                         interventions=[[Intervention(POINT, add=v)] for v in vectors])  # fmt: skip
    for i in (0, 7, 15):
        with ref.steer(POINT, add=vectors[i]):
            expected = ref.generate(torch.tensor([prompts[i]]), max_new_tokens=4, do_sample=False, stop_at_eos=False)
        assert out[i] == expected[0].tolist()


def test_global_steer_and_head_ablation(engine, oracle):
    model, ref = engine("llama"), oracle("llama")
    with model.steer("blocks.1.attn.hook_z", ablate=True, heads=[0, 2]):
        logits = model([PROMPTS[0]])
    with ref.steer("blocks.1.attn.hook_z", ablate_heads=[0, 2]):
        expected = ref(torch.tensor([PROMPTS[0]]))
    assert (logits - expected).abs().max() < 1e-5


def test_read_only_points_refuse_hooks(engine):
    model = engine("llama")
    read_only = [("blocks.0.attn.hook_pattern", lambda x, hook: x)]
    with pytest.raises(ValueError, match=r"hook_pattern.*caching only"), model.hooks(fwd_hooks=read_only):
        pass
    with pytest.raises(ValueError, match="`bwd_hooks`"), model.hooks(bwd_hooks=[(POINT, lambda x, hook: x)]):
        pass


def test_compiled_engine_refuses_python_hooks(fresh_engine):
    model = fresh_engine("llama", enforce_eager=False)
    assert model.compiled
    with pytest.raises(CompiledEngineError, match="enforce_eager=True"), model.hooks(fwd_hooks=[(POINT, print)]):
        pass
    assert len(model.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 5
