"""What the bridge knows about vLLM's internals: the tested range, and a clear error naming what moved."""

import pytest
from torch import nn

pytest.importorskip("vllm.entrypoints.llm")  # skipped without vLLM (the [vllm] extra)

from transformer_bridge.vllm import TESTED_RANGE, VLLMInternalsError, internals


def test_installed_release_is_in_the_tested_range():
    internals.check_version()
    lo, hi = TESTED_RANGE
    assert internals._parts(lo) <= internals._parts(internals.version()) < internals._parts(hi)


def test_a_release_outside_the_range_is_named(monkeypatch):
    monkeypatch.setattr(internals, "version", lambda: "0.40.1")
    with pytest.raises(VLLMInternalsError, match=r"vLLM 0\.40\.1: this release is outside the tested range.*>=0\.32"):
        internals.check_version()


def test_moved_internals_are_named():
    class Runner:  # a runner whose input batch lost `req_ids`
        input_batch = object()

    with pytest.raises(
        VLLMInternalsError, match=r"`object` has no attribute `req_ids` \(reading `input_batch.req_ids`\)"
    ):
        internals._need(Runner(), "input_batch.req_ids", "the runner's batch order")
    with pytest.raises(VLLMInternalsError, match=r"`Linear` has no `model.layers`"):
        internals.submodule(nn.Linear(2, 2), "model.layers", "the decoder layers")


def test_an_unmapped_model_class_is_named():
    class GemmaForCausalLM(nn.Module):
        pass

    with pytest.raises(VLLMInternalsError, match=r"`GemmaForCausalLM`.*supported classes: \['Gemma2ForCausalLM'"):
        internals.family_of(GemmaForCausalLM())
