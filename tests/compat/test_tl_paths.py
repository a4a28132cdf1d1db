"""TransformerLens' import paths (issue #32): replacing ``transformer_lens`` with ``transformer_bridge`` in a
script's text keeps its imports working; `HookedTransformer` loads processed weights as TransformerLens' does; the
evals that build their own data run and give numbers computed independently here."""

import random

import pytest
import torch
import transformers
from conftest import char_tokenizer, make_bridge, make_hf

import transformer_bridge
from transformer_bridge import evals, utils


def test_tl_import_paths():
    from transformer_bridge import FactoredMatrix, HookedRootModule, HookedTransformer, utilities
    from transformer_bridge.compat.factored import FactoredMatrix as Factored
    from transformer_bridge.hook_points import HookedRootModule as Root
    from transformer_bridge.hook_points import HookPoint, LensHandle, NamesFilter  # noqa: F401
    from transformer_bridge.model_bridge import TransformerBridge
    from transformer_bridge.utilities import get_act_name, lm_cross_entropy_loss

    assert TransformerBridge is transformer_bridge.TransformerBridge and Root is HookedRootModule
    assert FactoredMatrix is Factored and issubclass(HookedTransformer, TransformerBridge)
    assert get_act_name is utils.get_act_name and lm_cross_entropy_loss is utils.lm_cross_entropy_loss
    assert set(utilities.__all__) == set(utils.__all__)
    point = HookPoint()
    entry = point.add_hook(lambda x, hook: x * 2)
    assert isinstance(entry, LensHandle) and torch.equal(point(torch.ones(2)), torch.full((2,), 2.0))


def test_tl_upper_case_module_paths_run_in_a_fresh_interpreter():
    """TransformerLens' upper-case module paths (Main_Demo: ``from transformer_lens.HookedRootModule import
    HookedRootModule``) with ``transformer_lens`` replaced in the text: each names the module here that defines the
    class, and afterwards the package attribute is still the class, as in TransformerLens. In a fresh interpreter,
    so that no earlier import has loaded the modules."""
    import subprocess
    import sys

    script = """
import transformer_bridge
from transformer_bridge.HookedRootModule import HookedRootModule
from transformer_bridge.FactoredMatrix import FactoredMatrix
from transformer_bridge.ActivationCache import ActivationCache
from transformer_bridge.HookedTransformer import HookedTransformer
import transformer_bridge.HookedRootModule
from transformer_bridge import compat, hooked_transformer
from transformer_bridge.cache import activation_cache
assert HookedRootModule is transformer_bridge.HookedRootModule is compat.HookedRootModule
assert FactoredMatrix is transformer_bridge.FactoredMatrix and ActivationCache is activation_cache.ActivationCache
assert HookedTransformer is transformer_bridge.HookedTransformer is hooked_transformer.HookedTransformer
try:
    import transformer_bridge.SVDInterpreter
except ModuleNotFoundError as e:
    assert "transformer_bridge.SVDInterpreter" in str(e)
else:
    raise AssertionError("a TransformerLens module that has no counterpart here must not import")
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_boot_transformers_loads_with_tl4_defaults(tmp_path, family):
    """TransformerLens 4's constructor: eager attention and float32 (TransformerLens 4's bridge forces eager), so its
    scripts run unchanged and give its numbers; the keywords override; logits equal the HF model's on eager."""
    make_hf(family).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    booted = transformer_bridge.TransformerBridge.boot_transformers(str(tmp_path))
    assert booted.hf_model.config._attn_implementation == "eager" and booted.cfg.dtype == torch.float32
    plain = transformer_bridge.TransformerBridge.from_pretrained(str(tmp_path))
    assert plain.hf_model.config._attn_implementation == "sdpa"
    tokens = torch.tensor([[5, 17, 3, 42, 8]])
    with torch.no_grad():
        hf_eager = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
        assert torch.equal(booted(tokens), hf_eager(tokens).logits)
    kept = transformer_bridge.TransformerBridge.boot_transformers(str(tmp_path), attn_implementation="sdpa")
    assert kept.hf_model.config._attn_implementation == "sdpa"


def test_hooked_transformer_processes_as_tl(tmp_path):
    make_hf("gpt2").save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    processed = transformer_bridge.HookedTransformer.from_pretrained(str(tmp_path))
    assert processed.weight_processing.applied == (
        "fold_ln",
        "center_writing_weights",
        "center_unembed",
        "fold_value_biases",
    )
    raw = transformer_bridge.HookedTransformer.from_pretrained_no_processing(str(tmp_path))
    plain = transformer_bridge.TransformerBridge.from_pretrained(str(tmp_path))
    assert raw.weight_processing is None and plain.weight_processing is None
    tokens = torch.tensor([[5, 17, 3, 42, 8]])
    torch.testing.assert_close(processed(tokens).log_softmax(-1), raw(tokens).log_softmax(-1), atol=1e-5, rtol=0)


def test_induction_loss_is_the_loss_on_the_repeat():
    model = make_bridge("llama")
    model.cfg.default_prepend_bos = False
    torch.manual_seed(3)
    got = evals.induction_loss(model, batch_size=2, subseq_len=5)
    torch.manual_seed(3)
    first = torch.randint(min(100, model.cfg.d_vocab - 1), model.cfg.d_vocab, (2, 5))
    tokens = torch.cat([first, first], dim=1)
    with torch.no_grad():
        logp = model.hf_model(tokens).logits.log_softmax(-1)
    per_token = -logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    torch.testing.assert_close(got, per_token[:, 6:].mean())


def test_ioi_eval_matches_a_hand_count():
    model = make_bridge("llama")
    tok = char_tokenizer()
    model.tokenizer = tok
    names = ["A", "B", "C"]
    ds = evals.IOIDataset(tok, templates=["[A] met [B]. [B] gave it to [A]"], names=names, nouns={}, num_samples=3,
                          symmetric=True)  # fmt: skip
    assert len(ds) == 2 and ds.samples[0]["IO"] == ds.samples[1]["S"]
    rng = random.Random(42)
    rng.choice(ds.templates)
    a, b = rng.sample(names, 2)
    assert ds.samples[0] == {"text": f"{a} met {b}. {b} gave it to {a}", "IO": " " + a, "S": " " + b}
    got = evals.ioi_eval(model, dataset=ds, batch_size=1)
    diffs = []
    for i in range(len(ds)):
        item = ds[i]
        with torch.no_grad():
            logits = model.hf_model(item["prompt"][None]).logits[0]
        first = int(torch.nonzero(item["IO"] != item["S"])[0])
        at = len(item["prompt"]) - len(item["IO"]) + first - 1
        diffs.append(float(logits[at, item["IO"][first]] - logits[at, item["S"][first]]))
    assert got["Logit Difference"] == pytest.approx(sum(diffs) / 2, abs=1e-5)
    assert got["Accuracy"] == sum(d > 0 for d in diffs) / 2


def test_evaluate_on_dataset_and_sanity_check():
    model = make_bridge("llama")
    batches = [{"tokens": torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(i))} for i in range(4)]
    with torch.no_grad():
        want = sum(float(model(b["tokens"], return_type="loss")) for b in batches[:2]) / 2
    assert evals.evaluate_on_dataset(model, batches, truncate=1) == pytest.approx(want)
    model.tokenizer = char_tokenizer()
    assert torch.isfinite(evals.sanity_check(model))


@pytest.mark.parametrize("fn", [evals.make_wiki_data_loader, evals.make_pile_data_loader, evals.evaluate,
                                evals.mmlu_eval])  # fmt: skip
def test_evals_that_download_say_so(fn):
    with pytest.raises(evals.DatasetDownloadError, match="load_dataset"):
        fn(None)
    assert issubclass(evals.DatasetDownloadError, RuntimeError)


def test_hooked_transformer_samples_by_default_as_tl():
    """TransformerLens' generate samples (whole distribution, temperature 1); `TransformerBridge.generate` is HF's
    greedy default; `HookedTransformer` gives TransformerLens' behaviour, and a sampling argument given wins."""
    bridge = make_bridge("llama")
    model = transformer_bridge.HookedTransformer(bridge.hf_model)
    prompt = torch.tensor([[5, 17, 3]])
    torch.manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=6)
    torch.manual_seed(0)
    want = bridge.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    assert torch.equal(sampled, want)
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(greedy, bridge.generate(prompt, max_new_tokens=6))
