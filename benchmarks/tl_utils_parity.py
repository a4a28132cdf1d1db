"""`transformer_bridge.utils` against TransformerLens' own utilities: signatures and outputs on shared inputs.

Run it with a Python that has TransformerLens installed next to this repository (nothing here is needed by
the project's tests; the same checks as oracles are tests/compat/test_utils.py)::

    python3 -m venv /tmp/tl43 && /tmp/tl43/bin/pip install torch==2.13.0 transformer-lens==4.3.0
    PYTHONPATH=. HF_HUB_OFFLINE=1 /tmp/tl43/bin/python benchmarks/tl_utils_parity.py \\
        --write benchmarks/results/tl_utils_parity.md

For every public name of ``transformer_lens.utilities`` (TransformerLens 4.x; ``transformer_lens.utils`` in 3.x)
it reports whether the bridge provides it, whether the parameters (names, kinds, defaults; annotations are
not compared) are TransformerLens', and whether the outputs agree on the inputs below (``equal``: ``==`` /
``torch.equal``; a tolerance is stated where the two compute in another order). Exit status 1 when a provided
name differs in a way not listed in ``KNOWN`` (the differences kept on purpose, with why).
"""

import argparse
import contextlib
import functools
import inspect
import io
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("COLUMNS", "1000")  # rich (TransformerLens' printer) would wrap at 80 columns
try:
    import transformer_lens
    import transformer_lens.utilities as tl
except ImportError:
    sys.exit("TransformerLens is not installed in this Python; see the docstring for a scratch venv.")

from transformer_lens.FactoredMatrix import FactoredMatrix as TLFactored
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from transformer_bridge import TransformerBridge
from transformer_bridge import utils as ours
from transformer_bridge.compat.factored import FactoredMatrix

# Differences kept on purpose: name -> why. The checks below assert each one as stated; anything else that
# differs fails the run.
KNOWN = {
    "LocallyOverridenDefaults": "`padding_side` sets `model.cfg.default_padding_side`, which the bridge reads "
    "(TL sets `model.tokenizer.padding_side`)",
    "tokenize_and_concatenate": "a tokenizer without a pad token is not given one (TL adds `<PAD>` to it); the rows "
    "are the same",
    "get_attention_mask": "a tokenizer without a pad token: every token is real (TL 4.3 raises a TypeError from "
    "`tokens.ne(None)`); compared on tokenizers with one",
    "get_tokenizer_with_bos": "a tokenizer built in memory (no folder to load again) is copied with "
    "`add_bos_token=True` (TL raises); compared on SmolLM2's folder when it is there",
}
ALIASES = {"ActivationFunction", "SliceInput"}

_HUB = "downloads from the HF hub or clears its cache: use `huggingface_hub` / `datasets.load_dataset` directly"
_PLACEMENT = (
    "places TransformerLens' own blocks on devices; the bridge runs the HF model where `device_map` / `.to()` put it "
    "(transformer_bridge.distributed)"
)
_INIT = (
    "initialises TransformerLens' own weights for training from scratch; an HF model initialises itself "
    "(`AutoModelForCausalLM.from_config`)"
)
NOT_PROVIDED = {  # name -> why it is not here
    **dict.fromkeys(["download_file_from_hf", "get_dataset", "clear_huggingface_cache"], _HUB),
    **dict.fromkeys(
        [
            "calculate_available_device_cuda_memory",
            "count_unique_devices",
            "find_embedding_device",
            "determine_available_memory_for_available_devices",
            "get_best_available_cuda_device",
            "get_best_available_device",
            "get_device_for_block_index",
            "resolve_device_map",
            "sort_devices_based_on_available_memory",
            "move_to_and_update_config",
            "ModelWithCfg",
            "warn_if_mps",
        ],
        _PLACEMENT,
    ),
    **dict.fromkeys(
        [
            "init_kaiming_normal_",
            "init_kaiming_uniform_",
            "init_xavier_normal_",
            "init_xavier_uniform_",
            "calc_fan_in_and_fan_out",
            "NonlinearityType",
        ],
        _INIT,
    ),
    "TypedModuleList": "the typed block list of TransformerLens' own model; the bridge's `model.blocks` is its own",
    "get_rotary_pct_from_config": "reads an HF config for TransformerLens' config; `model.cfg.rotary_dim` is the "
    "bridge's answer",
    "select_compatible_kwargs": "plumbing of TransformerLens' loaders (keyword filtering for `hf_hub_download`)",
    "print_gpu_mem": "a print of `torch.cuda.memory_allocated()` (TransformerLens' divides by 2e30, not 2**30): "
    "print `torch.cuda.memory_allocated() / 2**30` instead",
}
# type aliases: for annotations, nothing to run


def tiny_bridge() -> TransformerBridge:
    """A seeded two-layer Llama with a character tokenizer (the same one for both sides)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return TransformerBridge(AutoModelForCausalLM.from_config(config).eval(), tokenizer)


def stdout_of(fn: Callable, *args, **kwargs) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        fn(*args, **kwargs)
    return buffer.getvalue()


def same(a, b, atol: float = 0.0) -> bool:
    """Equal values: tensors / arrays (``atol`` for floats), DataFrames, sequences, dicts, the rest by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(np.asarray(a) if isinstance(a, np.ndarray) else a), torch.as_tensor(b)
        if a.shape != b.shape:
            return False
        return torch.equal(a, b) if atol == 0 else torch.allclose(a.double(), b.double(), rtol=0, atol=atol)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.asarray(a).shape == np.asarray(b).shape and bool(np.all(np.asarray(a) == np.asarray(b)))
    if hasattr(a, "equals"):  # pandas
        return bool(a.equals(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, atol) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], atol) for k in a)
    return a == b


def signature(obj) -> list[tuple] | None:
    """``(name, kind, default)`` per parameter (a class: its ``__init__``), or None for values and aliases."""
    if isinstance(obj, type):
        obj = obj.__init__
    if not callable(obj) or getattr(obj, "__module__", None) == "typing":
        return None
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind.name, repr(p.default)) for p in params if p.name != "self"]


def tok(pad, bos, side="left", cls=None):
    return types.SimpleNamespace(pad_token_id=pad, bos_token_id=bos, padding_side=side, cls_token_id=cls)


def output_checks(model: TransformerBridge) -> dict[str, Callable[[], list[bool]]]:
    """Name -> a function returning one bool per shared input (True: same output on both sides)."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    logits, tokens = rand(3, 6, 11), torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    padded = [
        torch.tensor(r)
        for r in (
            [[0, 0, 5, 0], [0, 7, 8, 9], [5, 6, 0, 0], [0, 0, 0, 0]],
            [[0, 1, 5, 6], [1, 7, 8, 9]],
            [[0, 0, 1, 5], [0, 1, 2, 3]],
        )
    ]
    tokenizers = [tok(0, 0), tok(0, 1), tok(0, 1, "right"), tok(None, 1), tok(0, None), tok(0, 1, cls=5)]
    mat = [rand(8, 8), rand(8, 8).tril(), rand(2, 3), rand(3, 3, 3)]
    factors = [(rand(2, 6, 3), rand(2, 3, 5)), (rand(3, 5, 2), rand(3, 2, 4)), (rand(3, 5, 2), rand(3, 2, 5))]

    def both(name: str, *args, atol: float = 0.0, **kwargs) -> bool:
        return same(getattr(tl, name)(*args, **kwargs), getattr(ours, name)(*args, **kwargs), atol)

    def raises(fn: Callable) -> bool:
        try:
            fn()
        except Exception:
            return True
        return False

    def either_raises(fn_tl: Callable, fn_ours: Callable) -> bool | None:
        """True when both raise, False when one does; None when neither does (compare the outputs)."""
        results = []
        for fn in (fn_tl, fn_ours):
            try:
                fn()
                results.append(False)
            except Exception:
                results.append(True)
        return None if not any(results) else all(results)

    def tokens_helper(name: str) -> list[bool]:
        out = []
        if name == "get_attention_mask":  # KNOWN: no pad token
            tl_raises = raises(lambda: tl.get_attention_mask(tok(None, 1), padded[0], True))
            out.append(tl_raises and bool(ours.get_attention_mask(tok(None, 1), padded[0], True).all()))
        for t in tokenizers:
            for ids in padded:
                for kwargs in ({}, {"padding_side": "right"}, {"padding_side": "left"}):
                    extra = {"prepend_bos": True} if name == "get_attention_mask" else {}
                    if extra and t.pad_token_id is None:  # TL 4.3 raises (KNOWN)
                        continue
                    # both raising (e.g. no BOS to remove) counts as the same
                    args = (t, ids)
                    raised = either_raises(
                        functools.partial(getattr(tl, name), *args, **extra, **kwargs),
                        functools.partial(getattr(ours, name), *args, **extra, **kwargs),
                    )
                    out.append(raised if raised is not None else both(name, t, ids, **extra, **kwargs))
        return out

    def seeded(fn: Callable, seed: int, *args, **kwargs):
        torch.manual_seed(seed)
        return fn(*args, **kwargs)

    def sampling() -> list[bool]:
        cases = [
            {},
            {"temperature": 0.0},
            {"top_k": 3},
            {"top_k": 50},
            {"top_p": 0.5},
            {"temperature": 0.7},
            {"freq_penalty": 0.8, "tokens": tokens},
            {"repetition_penalty": 1.7, "tokens": tokens},
            {"repetition_penalty": 1.3, "tokens": tokens, "temperature": 0.0},
        ]
        last = logits[:, -1]
        return [
            same(seeded(tl.sample_logits, i, last, **c), seeded(ours.sample_logits, i, last, **c))
            for i, c in enumerate(cases)
        ]

    def prompt() -> list[bool]:
        cases = [("Hi the", "cat"), ("Hi the", [" cat", "dog", "x"]), ("Hi", ["a"]), ("Hi", "ab")]
        return [
            stdout_of(tl.test_prompt, p, a, model, top_k=3) == stdout_of(ours.test_prompt, p, a, model, top_k=3)
            for p, a in cases
        ]

    def packing() -> list[bool]:
        from datasets import Dataset

        data = Dataset.from_dict({"text": ["Hello there.", "", "A longer document, " * 5, "end"], "id": [0, 1, 2, 3]})
        out = []
        for kwargs in ({"max_length": 8}, {"max_length": 64}, {"max_length": 5, "add_bos_token": False}):
            a = tl.tokenize_and_concatenate(data, model.tokenizer, num_proc=None, **kwargs)
            b = ours.tokenize_and_concatenate(data, model.tokenizer, num_proc=None, **kwargs)
            out.append(a.column_names == b.column_names and same(a[:]["tokens"], b[:]["tokens"]))
        out.append(ours.keep_single_column(data, "id").column_names == tl.keep_single_column(data, "id").column_names)
        return out

    def packing_without_pad() -> list[bool]:  # KNOWN: TL gives the tokenizer a pad token, the rows are the same
        import copy

        from datasets import Dataset

        data = Dataset.from_dict({"text": ["ab", "c"]})
        a_tok, b_tok = copy.deepcopy(model.tokenizer), copy.deepcopy(model.tokenizer)
        for t in (a_tok, b_tok):
            t.pad_token = None
        a = tl.tokenize_and_concatenate(data, a_tok, max_length=8, num_proc=None)[:]["tokens"]
        b = ours.tokenize_and_concatenate(data, b_tok, max_length=8, num_proc=None)[:]["tokens"]
        return [same(a, b), a_tok.pad_token == "<PAD>" and b_tok.pad_token is None]

    def defaults() -> list[bool]:
        out = []
        for value in (False, True, None):
            with tl.LocallyOverridenDefaults(model, prepend_bos=value):
                a = model.to_tokens("ab")
            with ours.LocallyOverridenDefaults(model, prepend_bos=value):
                b = model.to_tokens("ab")
            out.append(same(a, b) and model.cfg.default_prepend_bos is True)
        with tl.LocallyOverridenDefaults(model, padding_side="left"):  # KNOWN: where the padding side lives
            tl_side = (model.tokenizer.padding_side, model.cfg.default_padding_side)
        with ours.LocallyOverridenDefaults(model, padding_side="left"):
            our_side = (model.tokenizer.padding_side, model.cfg.default_padding_side)
        out.append(tl_side == ("left", "right") and our_side == ("right", "left"))
        return out

    def statistics() -> list[bool]:
        x = rand(4, 9)
        gens = lambda: (tl.derive_generator(3, "m"), ours.derive_generator(3, "m"))  # noqa: E731
        ga, gb = gens()
        out = [ga.initial_seed() == gb.initial_seed(), both("standard_error", x), both("standard_error", x.T, dim=0)]
        for kwargs in ({}, {"statistic": "median", "n_resamples": 300, "chunk_size": 7}, {"confidence": 0.8}):
            ga, gb = gens()
            out.append(same(tl.bootstrap_ci(x, generator=ga, **kwargs), ours.bootstrap_ci(x, generator=gb, **kwargs)))
        for alt in ("two-sided", "greater", "less"):
            out.append(both("sign_flip_permutation_pvalue", x, alternative=alt))
            ga, gb = gens()
            big = rand(3, 20)
            out.append(
                same(
                    tl.sign_flip_permutation_pvalue(big, generator=ga, alternative=alt, n_permutations=300),
                    ours.sign_flip_permutation_pvalue(big, generator=gb, alternative=alt, n_permutations=300),
                )
            )
        for k, n in ((0, 6), (3, 10), (10, 10), (1, 1000)):
            a, b = (
                tl.success_rate_ci([True] * k + [False] * (n - k)),
                ours.success_rate_ci([True] * k + [False] * (n - k)),
            )
            out.append(all(abs(getattr(a, f) - getattr(b, f)) < 1e-12 for f in ("point_estimate", "ci_low", "ci_high")))
        return out

    def slices() -> list[bool]:
        x = torch.arange(48).reshape(3, 4, 4)
        inputs = [
            -1,
            2,
            np.int64(1),
            torch.tensor(1),
            (1, 3),
            (None, None, 2),
            [2, 0],
            torch.tensor([1, 3]),
            np.array([0, 3]),
            torch.tensor([True, False, True, False]),
            [-1],
            None,
        ]
        out = [same(tl.Slice(s).apply(x, dim=d), ours.Slice(s).apply(x, dim=d)) for s in inputs for d in (1, -1)]
        out += [same(tl.Slice(s).indices(4), ours.Slice(s).indices(4)) for s in inputs[1:]]
        out.append(tl.Slice(-1).indices(4).tolist() == ours.Slice(-1).indices(4).tolist() == [-1])
        out += [same(tl.Slice.unwrap(s).apply(x, 1), ours.Slice.unwrap(s).apply(x, 1)) for s in inputs]
        return out

    def act_names() -> list[bool]:
        cases = [
            ("attn", 0),
            ("embed",),
            ("pos_embed",),
            ("resid_pre", 3),
            ("normalized", 27, "ln2"),
            ("scale",),
            ("k6",),
            ("scale4ln1",),
            ("pre5",),
            ("mlp_post", 1),
            ("attn_logits", 2),
            ("result", 1),
            ("z", 1, "a"),
            ("attn_out", 2),
            ("q", 0, "attn"),
            ("scale", 2, "ln2"),
            ("rot_k", 1),
            ("pre_linear", 1),
            ("hook_embed",),
            ("blocks.0.hook_resid_pre",),
            ("v", 1, "b"),
            ("resid_post", "3"),
            ("value", 4),
            ("key", 2, "attention"),
            ("ln_final.hook_scale",),
            ("foo", 0),
            ("in", 3),
            ("in", 3, "a"),
            ("mid", 2),
            ("mlp_mid", 2),
        ]
        return [both("get_act_name", *c) for c in cases]

    def tokenizer_with_bos() -> list[bool]:
        from transformers import AutoTokenizer

        from transformer_bridge.real_model import default_cache_dir

        tl_raises = raises(lambda: tl.get_tokenizer_with_bos(model.tokenizer))  # KNOWN: built in memory
        out = [tl_raises and ours.get_tokenizer_with_bos(model.tokenizer).add_bos_token]
        folder = default_cache_dir() / "SmolLM2-135M-Instruct"
        if not folder.is_dir():
            return out
        plain = AutoTokenizer.from_pretrained(folder)
        plain.padding_side = "left"
        a, b = tl.get_tokenizer_with_bos(plain), ours.get_tokenizer_with_bos(plain)
        texts = ["Hi there", "The capital of France is"]
        return out + [a(t).input_ids == b(t).input_ids for t in texts] + [a.padding_side == b.padding_side]

    def swap() -> list[bool]:
        ids = torch.tensor([[5, 6, 7, 8]])
        weight = model.hf_model.lm_head.weight
        before, inside = model(ids), []
        for fn in (tl.temporarily_swap_parameter, ours.temporarily_swap_parameter):
            with fn(weight, weight * 2):
                inside.append(model(ids))
        return [same(inside[0], inside[1]), same(model(ids), before)]

    return {
        "get_act_name": act_names,
        "to_numpy": lambda: [both("to_numpy", t) for t in (rand(3), torch.ones(2, dtype=torch.bfloat16), [1, 2], 3.5)],
        "get_corner": lambda: [both("get_corner", m, n=n) for m in mat for n in (1, 2, 3)],
        "remove_batch_dim": lambda: [both("remove_batch_dim", t) for t in (rand(1, 4), rand(2, 4), torch.tensor(1.0))],
        "transpose": lambda: [both("transpose", m) for m in mat],
        "is_square": lambda: [both("is_square", m) for m in mat],
        "is_lower_triangular": lambda: [both("is_lower_triangular", m) for m in mat],
        "check_structure": lambda: [
            stdout_of(tl.check_structure, a, b, verbose=v) == stdout_of(ours.check_structure, a, b, verbose=v)
            for a, b in ((mat[0], mat[0] * 3), (mat[0], mat[1]), (mat[0].T, mat[0]), (mat[1], -mat[1]))
            for v in (False, True)
        ],
        "get_offset_position_ids": lambda: [both("get_offset_position_ids", k, mask) for k in (0, 2, 5)],
        "get_cumsum_along_dim": lambda: [both("get_cumsum_along_dim", mat[3], d, r) for d in (0, -1) for r in (0, 1)],
        "repeat_along_head_dimension": lambda: [
            both("repeat_along_head_dimension", logits, 4, c) for c in (True, False)
        ],
        "filter_dict_by_prefix": lambda: [
            both("filter_dict_by_prefix", {"a.b.c": 1, "a.bc": 2, "a.b": 3, "x": 4}, p) for p in ("a", "a.", "a.b", "x")
        ],
        "composition_scores": lambda: [
            same(
                tl.composition_scores(TLFactored(*left), TLFactored(*right), broadcast_dims=b),
                ours.composition_scores(FactoredMatrix(*left), FactoredMatrix(*right), broadcast_dims=b),
                atol=1e-6,
            )
            for left, right, b in (
                (factors[0], factors[1], True),
                (factors[2], factors[2], False),
                (factors[2], factors[1], True),
            )
        ],
        "get_matrix_corner": lambda: [
            same(tl.get_matrix_corner(TLFactored(*f), n), ours.get_matrix_corner(FactoredMatrix(*f), n))
            for f in factors
            for n in (2, 4)
        ],
        "Slice": slices,
        "lm_cross_entropy_loss": lambda: [
            both("lm_cross_entropy_loss", logits, tokens, m, p, atol=1e-6)
            for m in (None, mask, mask.bool())
            for p in (False, True)
        ],
        "lm_accuracy": lambda: [both("lm_accuracy", logits, tokens, per_token=p) for p in (False, True)],
        "sample_logits": sampling,
        "logits_to_df": lambda: [
            both("logits_to_df", logits[0, 0], t, k) for t in (None, model.tokenizer) for k in (None, 4)
        ],
        "test_prompt": prompt,
        "get_attention_mask": lambda: tokens_helper("get_attention_mask"),
        "get_tokens_with_bos_removed": lambda: tokens_helper("get_tokens_with_bos_removed"),
        "get_input_with_manually_prepended_bos": lambda: [
            both("get_input_with_manually_prepended_bos", b, i) for b in ("<s>", None) for i in ("Hi", ["a", "b"])
        ],
        "tokenize_and_concatenate": lambda: packing() + packing_without_pad(),
        "keep_single_column": lambda: packing()[-1:],
        "gelu_new": lambda: [both("gelu_new", rand(4, 50) * 4)],
        "gelu_fast": lambda: [both("gelu_fast", rand(4, 50) * 4)],
        "solu": lambda: [both("solu", rand(4, 50))],
        "SUPPORTED_ACTIVATIONS": lambda: (
            [tl.SUPPORTED_ACTIVATIONS.keys() == ours.SUPPORTED_ACTIVATIONS.keys()]
            + [
                same(tl.SUPPORTED_ACTIVATIONS[k](x), ours.SUPPORTED_ACTIVATIONS[k](x))
                for x in [rand(4, 50) * 4]
                for k in tl.SUPPORTED_ACTIVATIONS
            ]
        ),
        "apply_softcap": lambda: [both("apply_softcap", logits, c) for c in (None, -1.0, 0.0, 2.5)],
        "softcap_enabled": lambda: [both("softcap_enabled", c) for c in (None, -1.0, 0.0, 2.5)],
        "SOFTCAP_DISABLED": lambda: [tl.SOFTCAP_DISABLED == ours.SOFTCAP_DISABLED],
        "USE_DEFAULT_VALUE": lambda: [tl.USE_DEFAULT_VALUE is ours.USE_DEFAULT_VALUE],
        "override_or_use_default_value": lambda: [
            both("override_or_use_default_value", d, o) for d in (True, "x") for o in (None, False, "y")
        ],
        "LocallyOverridenDefaults": defaults,
        "get_nested_attr": lambda: [both("get_nested_attr", model, "cfg.n_layers")],
        "set_nested_attr": lambda: [
            tl.set_nested_attr(model, "cfg.n_ctx", 64) is ours.set_nested_attr(model, "cfg.n_ctx", 64)
        ],
        "get_device": lambda: [both("get_device")],
        "is_library_available": lambda: [both("is_library_available", n) for n in ("numpy", "surely_not_a_module")],
        "derive_generator": statistics,
        "standard_error": lambda: statistics()[1:3],
        "bootstrap_ci": statistics,
        "sign_flip_permutation_pvalue": statistics,
        "success_rate_ci": statistics,
        "SuccessRateInterval": lambda: [
            list(inspect.signature(tl.SuccessRateInterval).parameters)
            == list(inspect.signature(ours.SuccessRateInterval).parameters)
        ],
        "get_tokenizer_with_bos": tokenizer_with_bos,
        "temporarily_swap_parameter": swap,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the Markdown table here")
    args = parser.parse_args()
    version = getattr(transformer_lens, "__version__", None) or __import__("importlib.metadata").metadata.version(
        "transformer-lens"
    )
    model = tiny_bridge()
    checks = output_checks(model)
    public = sorted(n for n in dir(tl) if not n.startswith("_") and not isinstance(getattr(tl, n), types.ModuleType))
    rows, problems = [], []
    for name in public:
        if not hasattr(ours, name) or name not in ours.__all__:
            rows.append((name, "not provided", "", NOT_PROVIDED.get(name, "")))
            if name not in NOT_PROVIDED:  # a new TransformerLens name: decide, and say why
                problems.append(name)
            continue
        if name in ALIASES:
            rows.append((name, "type alias", "(annotations only)", ""))
            continue
        sig_tl, sig_ours = signature(getattr(tl, name)), signature(getattr(ours, name))
        sig = "same" if sig_tl == sig_ours else f"differs: TL {sig_tl}, here {sig_ours}"
        try:
            results = checks[name]() if name in checks else None
            outputs = "no check" if not results else f"{sum(results)}/{len(results)} equal"
            bad = bool(results) and not all(results)
        except Exception as e:  # a crash on one side is a difference to report, not a reason to stop
            outputs, bad = f"error: {type(e).__name__}: {e}", True
        note = KNOWN.get(name, "")
        rows.append((name, sig, outputs, note))
        if sig != "same" or bad or not results:
            problems.append(name)
    provided = sum(r[1] != "not provided" for r in rows)
    lines = [
        f"TransformerLens {version} `transformer_lens.utilities` against `transformer_bridge.utils` "
        f"(torch {torch.__version__}): {len(rows)} public names, {provided} provided, {len(rows) - provided} not.",
        "",
        "| name | parameters | outputs on shared inputs | differs on purpose / not provided because |",
        "|---|---|---|---|",
        *[f"| `{n}` | {s} | {o} | {k} |" for n, s, o, k in rows],
        "",
        f"Unexpected differences: {', '.join(problems) if problems else 'none'}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        args.write.write_text(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
