"""Bad controllers and branches raise clearly (naming the row, step and parameter) and leave the model clean."""

import pytest
import torch
from _clean import assert_clean
from conftest import SSM_CONFIGS, V, char_tokenizer, make_bridge
from transformers import AutoModelForCausalLM, TextStreamer

from transformer_bridge import Branch, TransformerBridge, UnknownHookError
from transformer_bridge.generation import ControllerError


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return make_bridge(request.param)


def at_step(n, branch):
    """A controller that samples freely, then answers ``branch`` once the row has ``n`` generated tokens."""

    def controller(view):
        return branch if len(view.generated) == n else None

    return controller


BAD_BRANCHES = [
    (Branch(), ValueError, r"row 0 at step 0: a branch without `sample_mask` appends exactly one `ff_tokens` .* got 0"),
    (Branch(ff_tokens=[[5], [6]]), ValueError, r"exactly one `ff_tokens` sequence, got 2"),
    (Branch(ff_tokens=[[]]), ValueError, r"a branch must change the row"),
    (Branch(backtrack=-1, ff_tokens=[[5]]), ValueError, r"`backtrack` must be an int >= 0 .* got -1"),
    (Branch(backtrack=1.5, ff_tokens=[[5]]), ValueError, r"`backtrack` must be an int"),
    (Branch(backtrack=1, ff_tokens=[[5]]), ValueError, r"`backtrack`=1 reaches into the prompt; the row has 0"),
    (Branch.forced([5, V]), ValueError, rf"`ff_tokens` holds {V}, outside the vocabulary \[0, {V - 1}\]"),
    (Branch.forced([-1]), ValueError, r"`ff_tokens` holds -1, outside the vocabulary"),
    (Branch(ff_tokens="abc"), TypeError, r"`ff_tokens` must be a list of token-id lists"),
    (Branch(ff_tokens=[5, 6]), TypeError, r"`ff_tokens` must be a list of token-id lists \(e.g. \[\[5, 6\]\]\)"),
    (Branch.sample([3, V + 2]), ValueError, rf"`sample_mask` holds {V + 2}, outside the vocabulary"),
    (Branch.sample(torch.ones(V - 1, dtype=torch.bool)), ValueError, rf"shape \[d_vocab\]=\[{V}\], got \({V - 1},\)"),
    (Branch.sample(torch.zeros(V, dtype=torch.bool)), ValueError, r"`sample_mask` allows no token; return no branch"),
    (Branch.sample([]), ValueError, r"allows no token"),
    (Branch.sample("abc"), TypeError, r"`sample_mask` must be a bool tensor \[d_vocab\], a collection of token ids"),
]  # fmt: skip


@pytest.mark.parametrize("branch, error, match", BAD_BRANCHES)
def test_bad_branch_raises_naming_row_and_step(model, branch, error, match):
    with pytest.raises(error, match=match):
        model.generate("Hello", max_new_tokens=5, controller=at_step(0, branch))
    assert_clean(model)


def test_backtrack_past_the_generated_tokens_names_the_count(model):
    with pytest.raises(ValueError, match=r"row 0 at step 3: `backtrack`=4 reaches into the prompt; the row has 3"):
        model.generate("Hello", max_new_tokens=8, controller=at_step(3, Branch(backtrack=4, ff_tokens=[[5]])))
    assert_clean(model)


def test_a_controller_that_raises_names_row_and_step_and_hooks_are_removed(model):
    def boom(view):
        if view.row == 1 and len(view.generated) == 2:
            raise KeyError("my bug")
        return None

    boom.reads = ["blocks.0.hook_resid_post"]
    with pytest.raises(ControllerError, match=r"raised at row 1, step 2: KeyError: 'my bug'") as info:
        model.generate(["Hello", "Hi"], max_new_tokens=8, controller=boom)
    assert isinstance(info.value.__cause__, KeyError)
    assert_clean(model)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(controller=5), TypeError, r"`controller` must have a `mid_process\(view\)` method or be a callable"),
        (dict(controller=[None, None, None]), ValueError, r"`controller` is a list of 3; give one per prompt \(2\)"),
        (dict(controller=lambda v: "go"), TypeError, r"must return a list of `Branch`.*got 'go'"),
        (dict(controller=lambda v: [Branch.sample(), 3]), TypeError, r"must return a list of `Branch`"),
        (dict(max_steps=3), ValueError, r"`max_steps` bounds a controlled generation: it needs a `controller`"),
        (dict(controller=lambda v: None, max_steps=0), ValueError, r"`max_steps` must be"),
    ],
)
def test_bad_controller_arguments(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        model.generate(["Hello", "Hi"], max_new_tokens=4, **kwargs)
    assert_clean(model)


def test_streamer_and_stream_refuse_a_controller(model):
    with pytest.raises(ValueError, match=r"a controller may backtrack \(rewind\) tokens a streamer"):
        model.generate("Hello", max_new_tokens=3, controller=lambda v: None, streamer=TextStreamer(model.tokenizer))
    with pytest.raises(TypeError, match=r"does not take `controller`: a controller may backtrack"):
        model.generate_stream("Hello", max_new_tokens=3, controller=lambda v: None)


def test_reads_with_an_unknown_hook_name(model):
    class Reader:
        reads = ("blocks.0.hook_resid_psot",)

        def mid_process(self, view):
            return None

    with pytest.raises(UnknownHookError, match="hook_resid_post"):
        model.generate("Hello", max_new_tokens=3, controller=Reader())
    assert_clean(model)


def test_reads_must_be_a_list_of_names(model):
    class Reader:
        reads = "blocks.0.hook_resid_post"

        def mid_process(self, view):
            return None

    with pytest.raises(TypeError, match=r"`controller.reads` must be a list of hook names"):
        model.generate("Hello", max_new_tokens=3, controller=Reader())


def test_endless_backtracking_stops_at_max_steps(model):
    forwards = []

    def rewind_forever(view):
        return Branch.forced([7]) if not view.generated else Branch(backtrack=1, ff_tokens=[[7]])

    with model.hooks(fwd_hooks=[("hook_embed", lambda x, hook: forwards.append(1))]):
        out = model.generate("Hello", max_new_tokens=4, controller=rewind_forever, max_steps=6, return_dict=True)
    assert out.finish_reasons == ["max_steps"] and len(forwards) == 7  # the prompt + 6 steps
    assert out.new_tokens[0].tolist() == [7]


def test_a_state_space_model_refuses_a_controller():
    mamba = TransformerBridge(AutoModelForCausalLM.from_config(SSM_CONFIGS["mamba"]()).eval(), char_tokenizer())
    with pytest.raises(ValueError, match=r"`controller` cannot drive a state-space model \(mamba\)"):
        mamba.generate("Hello", max_new_tokens=3, controller=lambda v: None)
    with pytest.raises(ValueError, match="state-space model"):
        mamba.generate("Hello", max_new_tokens=3, prompt_lookup_num_tokens=2)
    assert_clean(mamba)
