"""Run TransformerLens 4.3's demo notebooks on TL's bridge and on this one, cell by cell (issue #32, item 5).

    python benchmarks/tl_notebooks.py TL_SDIST/demos --tl-python /tmp/tl32b/bin/python --out /tmp/tlnb \\
        --notebooks Main_Demo Activation_Patching_in_TL_Demo Exploratory_Analysis_Demo Attribution_Patching_Demo \\
        > benchmarks/results/tl_notebooks.md
    python benchmarks/tl_notebooks.py TL_SDIST/demos --out /tmp/tlnb --compare-only ... > ...   (re-compare stored runs)

reads each notebook from TL_SDIST/demos (TransformerLens' source distribution, ``pip download
transformer-lens==4.3.0 --no-binary :all: --no-deps``, unpacked; no TransformerLens code or prose is kept in
this repository), ports its code cells twice and runs each port in a subprocess of ``--tl-python`` (a venv
holding TransformerLens 4.3, with torch and transformers as in the project; this repository goes on its
``PYTHONPATH``; the ours side refuses to import ``transformer_lens``), every cell in order in one namespace.

The port, applied cell by cell (the Markdown lists what each notebook needed):

- IPython magics (a line starting with ``%`` or ``!``) become ``pass``. Absent display libraries (``IPython``,
  ``plotly``, ``circuitsvis``) are stubbed with no-op modules, ``display`` is a no-op and, without ``ipywidgets``,
  ``tqdm.notebook`` is tqdm's console bar, on both sides.
- Ours only, the imports: ``transformer_lens`` becomes ``transformer_bridge`` in import statements
  (``import transformer_lens`` becomes ``import transformer_bridge as transformer_lens``).
- The model construction, by the explicit substitutions of ``SUBSTITUTIONS``: every model the notebook builds is
  SmolLM2-135M-Instruct cut to its first ``--layers`` blocks (``config.num_hidden_layers`` and the HF layer list
  truncated alike, saved once as an HF folder under ``--out``; fp32, CPU), bound to ``SMOLLM2`` in the
  namespace, the same text on both sides: ``TransformerBridge.boot_transformers(SMOLLM2, ...)`` (here the
  constructor of TransformerLens 4's name and defaults: eager attention, float32). Each substitution must match.

Each cell runs wrapped (an exception is recorded, the run goes on), with torch / numpy / random seeded by the
cell's index first (so unseeded ``torch.randint`` cells draw the same tokens on both sides), recording: ran or
the error's first line, the warnings (category and message; ``logging`` warnings too), printed output, the value
of the last expression, and the numbers of every name the cell binds, rebinds or changes (a tensor's version
counter, a list's or dict's items): tensors, numpy arrays, Python numbers and strings, inside lists, tuples,
dicts, DataFrames and objects with a tensor ``.values`` (patching results); a ``FactoredMatrix`` by its factors.
Tensors of up to 2**23 elements are stored whole (``torch.save``, one file per cell), larger ones as summary
statistics plus an evenly strided sample of 2**18 elements.

A cell is *equal* when it ran on both sides and every number matches: floats within ``rtol=1e-4, atol=1e-5``
(fp32; TransformerLens runs eager attention, this bridge HF's SDPA kernel), printed numbers within that plus the
printed precision, integers, booleans and strings exactly, the same shapes and dtype kinds. The report gives each
differing cell's largest absolute difference, and that difference relative to the largest entry of its tensor.
Printed text is compared after one normalisation: ``<class 'a.b.C'>`` becomes ``<class 'C'>``, memory addresses
are blanked and ``transformer_lens`` / ``transformer_bridge`` read as one name. Causes found by hand: ``NOTES``.

A third, diagnostic run (``--no-sdpa`` skips it) ports the notebook as for ours and adds
``attn_implementation="sdpa"`` to each ``boot_transformers``: the model's own kernel, which this bridge's
`from_pretrained` keeps (its logits are HF's bitwise), where TransformerLens' bridge and `boot_transformers` use
HF's eager attention; a cell equal in the main run and not there differs by the kernel only.
"""

import argparse
import ast
import builtins
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
import time
import traceback
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-4, 1e-5
FULL_LIMIT, SAMPLE = 2**23, 2**18
STUBBED = ("IPython", "plotly", "circuitsvis")

# The model construction of each notebook: (TL's text, TL side, ours). Every model a notebook builds becomes
# the truncated SmolLM2; nothing else changes. A notebook not listed here runs with its constructions as they
# are (which then fail offline on both sides).
_TL_BOOT = "TransformerBridge.boot_transformers(SMOLLM2"
_OURS_BOOT = _TL_BOOT  # `boot_transformers` here: TransformerLens 4's defaults (eager attention, float32)
SUBSTITUTIONS: dict[str, list[tuple[str, str, str]]] = {
    "Main_Demo": [
        ('TransformerBridge.boot_transformers("openai-community/gpt2",', _TL_BOOT + ",", _OURS_BOOT + ","),
        ('TransformerBridge.boot_transformers("distilgpt2",', _TL_BOOT + ",", _OURS_BOOT + ","),
    ],
    "Activation_Patching_in_TL_Demo": [
        ('TransformerBridge.boot_transformers("gpt2")', _TL_BOOT + ")", _OURS_BOOT + ")"),
        ('TransformerBridge.boot_tl_legacy("NeelNanda/Attn_Only_2L512W_C4_Code")', _TL_BOOT + ")", _OURS_BOOT + ")"),
    ],
    "Exploratory_Analysis_Demo": [
        ('TransformerBridge.boot_transformers("gpt2")', _TL_BOOT + ")", _OURS_BOOT + ")"),
        # GPT-2's option; both libraries refuse it on a rotary model (SmolLM2), which would stop the notebook there
        ("    refactor_factored_attn_matrices=True,\n", "", ""),
    ],
    "Attribution_Patching_Demo": [
        ('TransformerBridge.boot_transformers("gpt2", device="cpu")', _TL_BOOT + ', device="cpu")',
         _OURS_BOOT + ', device="cpu")'),
        ('TransformerBridge.boot_transformers("gpt2-xl", device="cpu")', _TL_BOOT + ', device="cpu")',
         _OURS_BOOT + ', device="cpu")'),
    ],
}  # fmt: skip

# Why a cell differs or fails here, found by hand: a short label per (notebook, cell), explained once in CAUSES.
# Printed next to the cell while it still differs; a note on a cell that has become equal is dropped.
CAUSES = {
    "kernel": "TL's bridge forces HF's eager attention; this one keeps the model's kernel (SDPA), whose logits are "
    "HF's bitwise. Float summation order only (at most 1e-4 on logits, ~1e-6 of the largest); the cell is equal "
    "in the eager run. Documented (docs/transformerlens.md, processed weights); HF is the oracle. Flagged: "
    "enable_compatibility_mode() on a non-eager kernel warns once (TransformerLensDifferenceWarning naming "
    "attn_implementation='eager'), in the cell that calls it.",
    "kernel (patching)": "the attention kernel, as under kernel, in a patching sweep: the eager run gives TL's "
    "numbers. (The eager run used to stop here on a bug of batched patching, fixed: with reuse_corrupted the "
    "copies' materialised attention mask was repeated for the first patched block only, a shape error.)",
    "kernel (p-values)": "the attention kernel, through a discrete statistic: sign-flip p-values over 8 prompts "
    "are multiples of 1/256, and ~1e-5 of kernel noise in the per-prompt values moves a tie (3 of 36 heads, by "
    "2/256); the cell's other numbers (values, bootstrap interval) are equal.",
    "use_attn_result (TL)": "TL 4.3 with set_use_attn_result(True) computes attention's output as the sum of the "
    "per-head results, which moves its own logits by ~2e-5 (checked: with the flag off, TL and this bridge under "
    "eager attention agree bitwise on Exploratory_Analysis_Demo's 8 prompts); this bridge keeps the model's "
    "computation and derives head results from hook_z, so the eager run does not remove it. Float summation order "
    "only; HF is the oracle. Flagged: set_use_attn_result(True) warns once (TransformerLensDifferenceWarning), in "
    "the cell that calls it.",
    "use_attn_result (TL), patching": "as use_attn_result (TL), in a patching sweep.",
    "hook names": "every hook here reports the one canonical name (documented: 'one name per hook point'); TL 4.3 "
    "reports its bridge's spellings (embed.hook_in, blocks.0.hook_in, ...; each resolves here to the same point) and "
    "also fires points this bridge lacks (rotary_emb.hook_cos/sin, attn.hook_cos/sin, ln_final.hook_out; naming one "
    "raises UnknownHookError). Printed names only; no number differs.",
    "get_params": "tl_named_parameters: the list now follows TL 4.3's (the norms' weights, a gated MLP's W_in, W_out, "
    "b_in, b_out, W_gate); what still differs is printed here.",
    "sampling": "sampled text: the two samplers draw differently from the same seed, so no tokens compare. Sampling "
    "without top_k uses HF's top 50 here (TL: the whole distribution): documented, and warned once per model "
    "(TransformerLensDifferenceWarning naming top_k=0).",
    "module path": "`from transformer_bridge.HookedRootModule import HookedRootModule`: TransformerLens' upper-case "
    "module paths import here now; what still differs is printed here.",
    "after 53": "follows from cell 53: the toy model was not built, so `model` is still the bridge.",
    "port: fresh tensor": "the port's record only: the loop's last `param` (unembed.b_U) is the same tensor object on "
    "TL at each call, so the port, which records a name only when its object changes, skips it there; here `b_U` is "
    "the folded bias, a new tensor each call. The printed list is identical.",
    "port: Mapping": "the port's record only: TL's HookedRootModule.run_with_cache returns a plain dict, which the "
    "port flattens; here an ActivationCache (a Mapping with the same keys and tensors; `return_cache_object=False` "
    "gives TL's dict), which it does not. The printed keys and values are identical.",
    "stand-in metric": "the notebook asserts the clean metric is 1 within 1e-5; with the stand-in the clean and "
    "corrupted logit differences are +-0.054, so the float noise between its two forwards decides it. On TL it "
    "fails (1.1e-5: TL's use_attn_result sums the heads into the output, see use_attn_result (TL)); here, on eager "
    "attention (`boot_transformers`), it passes, so the cells after it that need its caches run here and not on "
    "TL. With SDPA it fails here too (1.7e-5: backward hooks on hook_pattern / hook_attn_scores make this bridge "
    "compute attention from the pattern instead of SDPA, ~2e-5 on the logits).",
}
NOTES: dict[tuple[str, int], str] = {
    **{("Main_Demo", i): "kernel" for i in (10, 15, 16, 18)},
    ("Main_Demo", 23): "get_params",
    ("Main_Demo", 24): "port: fresh tensor",
    ("Main_Demo", 25): "hook names",
    ("Main_Demo", 52): "sampling",
    ("Main_Demo", 53): "module path",
    ("Main_Demo", 54): "port: Mapping",
    ("Main_Demo", 55): "after 53",
    **{("Activation_Patching_in_TL_Demo", i): "kernel (patching)" for i in (12, 13, 15, 16, 17, 18)},
    ("Activation_Patching_in_TL_Demo", 14): "kernel (p-values)",
    ("Activation_Patching_in_TL_Demo", 9): "kernel",
    ("Activation_Patching_in_TL_Demo", 20): "kernel",
    **{("Exploratory_Analysis_Demo", i): "use_attn_result (TL)" for i in (8, 18, 20, 22, 25, 30, 38, 42)},
    ("Attribution_Patching_Demo", 8): "use_attn_result (TL)",
    ("Attribution_Patching_Demo", 11): "stand-in metric",
    ("Attribution_Patching_Demo", 27): "use_attn_result (TL), patching",
    ("Attribution_Patching_Demo", 30): "use_attn_result (TL), patching",
    ("Attribution_Patching_Demo", 42): "kernel",
}


# -- the port ------------------------------------------------------------------------------------------------------
_IMPORTS = [
    (re.compile(r"^(\s*)from transformer_lens((?:\.\w+)*) import"), r"\1from transformer_bridge\2 import"),
    (re.compile(r"^(\s*)import transformer_lens((?:\.\w+)*) as (\w+)\s*$"), r"\1import transformer_bridge\2 as \3"),
    (re.compile(r"^(\s*)import transformer_lens\s*$"), r"\1import transformer_bridge as transformer_lens"),
]


def code_cells(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells
            if c["cell_type"] == "code"]  # fmt: skip


def port_cell(source: str, side: str, subs: list[tuple[str, str, str]], used: set[int]) -> str:
    lines = []
    for line in source.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            line = line[: len(line) - len(stripped)] + "pass  # (magic dropped)"
        elif side != "tl" and re.match(r"\s*(from|import)\s+transformer_lens\b", line):
            for pattern, repl in _IMPORTS:
                if pattern.match(line):
                    line = pattern.sub(repl, line)
                    break
            else:
                raise ValueError(f"An import form the port does not know: {line!r}")
        lines.append(line)
    text = "\n".join(lines)
    for k, (old, tl_new, ours_new) in enumerate(subs):
        if old in text:
            used.add(k)
            text = text.replace(old, tl_new if side == "tl" else ours_new)
    if side == "sdpa":  # the diagnostic side: this bridge on the model's own kernel (`from_pretrained`'s default)
        text = text.replace(_OURS_BOOT + ")", _OURS_BOOT + ', attn_implementation="sdpa")')
        text = text.replace(_OURS_BOOT + ",", _OURS_BOOT + ', attn_implementation="sdpa",')
    return text


def port(notebook: Path, side: str) -> list[str]:
    subs = SUBSTITUTIONS.get(notebook.stem, [])
    used: set[int] = set()
    cells = [port_cell(c, side, subs, used) for c in code_cells(notebook)]
    missing = [subs[k][0] for k in range(len(subs)) if k not in used]
    if missing:
        raise ValueError(f"{notebook.name}: substitutions that matched nothing: {missing}")
    return cells


def prepare_model(dest: Path, layers: int) -> Path:
    """SmolLM2-135M-Instruct's first `layers` blocks as an HF folder (made once)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformer_bridge.real_model import smollm2_path

    src = str(smollm2_path())
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    tmp.rename(dest)
    return dest


# -- one side: run the ported cells in one namespace ----------------------------------------------------------------
class _NoOp:
    """Stands for anything of an absent display library: calls, attributes and items give another no-op."""

    def __call__(self, *args, **kwargs):
        return _NoOp()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _NoOp()

    def __getitem__(self, key):
        return _NoOp()

    def __contains__(self, item):
        return False

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __repr__(self):
        return "<no-op>"

    def __mro_entries__(self, bases):  # a class deriving from a stubbed one (tqdm.notebook's widgets)
        return (object,)

    def __radd__(self, other):  # "<h2>title</h2>" + a rendered figure
        return other

    def __str__(self):
        return ""


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _NoOp()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the stubbed display packages, and refuses `transformer_lens` on the ours side."""

    def __init__(self, stubs: tuple[str, ...], refuse: tuple[str, ...]):
        self.stubs, self.refuse = stubs, refuse

    def find_spec(self, fullname, path, target=None):
        root = fullname.split(".")[0]
        if root in self.refuse:
            raise ModuleNotFoundError(f"{fullname} is not importable on the transformer-bridge side of the port")
        if root in self.stubs:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class _LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _signature(value):
    """What says a bound value changed in place: a tensor's version, a container's items."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("t", value._version)
    if isinstance(value, list):
        return ("l", len(value), tuple(id(x) for x in value[:1000]))
    if isinstance(value, dict):
        return ("d", len(value), tuple((repr(k)[:50], id(v)) for k, v in list(value.items())[:1000]))
    return None


def _tensor_leaf(t):
    import torch

    t = t.detach().cpu()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    if t.numel() <= FULL_LIMIT:
        return t.clone()
    flat = t.flatten()
    f64 = flat.double()
    step = max(1, flat.numel() // SAMPLE)
    stats = torch.stack([f64.mean(), f64.std(), f64.min(), f64.max(), f64.abs().mean()])
    return {"summary": True, "shape": list(t.shape), "dtype": str(t.dtype), "stats": stats,
            "sample": flat[::step][:SAMPLE].clone()}  # fmt: skip


def leaves(value, prefix: str, out: dict, depth: int = 0) -> None:
    """The numbers in `value`, flattened to `out[path] = tensor | summary | python scalar`."""
    import numpy as np
    import torch

    if depth > 4:
        return
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            out[prefix] = _tensor_leaf(value)
    elif isinstance(value, np.ndarray | np.generic):
        if value.dtype.kind in "biufc":
            out[prefix] = _tensor_leaf(torch.from_numpy(np.array(value)))
        elif value.dtype.kind in "OU" and np.ndim(value) and value.size <= 10000:
            leaves(value.tolist(), prefix, out, depth + 1)
    elif value is None or isinstance(value, bool | int | float | complex | str):
        out[prefix] = value if not isinstance(value, complex) else (value.real, value.imag)
    elif isinstance(value, list | tuple):
        if len(value) <= 1000:
            for i, item in enumerate(value):
                leaves(item, f"{prefix}[{i}]", out, depth + 1)
        else:
            try:
                out[prefix] = _tensor_leaf(torch.tensor(value))
            except (TypeError, ValueError, RuntimeError):
                out[prefix] = f"<{type(value).__name__} of {len(value)}>"
    elif isinstance(value, dict):
        if len(value) <= 300:
            for k, v in value.items():
                if isinstance(k, str | int):
                    leaves(v, f"{prefix}[{k!r}]", out, depth + 1)
    elif type(value).__name__ in ("DataFrame", "Series"):
        numbers = value.select_dtypes("number") if type(value).__name__ == "DataFrame" else value
        out[prefix] = _tensor_leaf(torch.as_tensor(numbers.to_numpy(dtype="float64")))
    elif type(value).__name__ == "FactoredMatrix":
        leaves(value.A, prefix + ".A", out, depth + 1)
        leaves(value.B, prefix + ".B", out, depth + 1)
    elif isinstance(getattr(value, "values", None), torch.Tensor):
        leaves(value.values, prefix + ".values", out, depth + 1)


def _interesting(name: str, value) -> bool:
    if name.startswith("_") or name == "SMOLLM2":
        return False
    return not isinstance(value, types.ModuleType | types.FunctionType | type | types.BuiltinFunctionType)


def run_side(spec: dict) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    stubs = tuple(name for name in STUBBED if importlib.util.find_spec(name) is None)
    refuse = ("transformer_lens",) if spec["side"] != "tl" else ()
    sys.meta_path.insert(0, _Finder(stubs, refuse))
    builtins.display = lambda *args, **kwargs: None  # IPython's builtin in a notebook; a no-op here
    if importlib.util.find_spec("ipywidgets") is None:  # tqdm's notebook bars need widgets: console bars instead
        sys.modules["tqdm.notebook"] = importlib.import_module("tqdm.std")
        stubs += ("tqdm.notebook (as tqdm.std)",)
    capture = _LogCapture()
    logging.getLogger().addHandler(capture)
    ns: dict = {"__name__": "__main__", "SMOLLM2": spec["model"]}
    records = []
    for i, source in enumerate(spec["cells"]):
        torch.manual_seed(i)
        np.random.seed(i)
        random.seed(i)
        before = {k: (v, _signature(v)) for k, v in ns.items()}
        buf = io.StringIO()
        rec: dict = {"index": i, "ran": True, "error": None}
        capture.records.clear()
        start = time.perf_counter()
        value = None
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(buf):
            warnings.simplefilter("always")
            try:
                tree = ast.parse(source)
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                exec(compile(tree, f"<cell {i}>", "exec"), ns)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), f"<cell {i}>", "eval"), ns)
            except BaseException as e:  # a cell's failure is data; the run goes on
                rec["ran"] = False
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                rec["error"] = f"{type(e).__name__}: {first}"[:400]
                rec["traceback"] = traceback.format_exc()[-4000:]
        rec["seconds"] = round(time.perf_counter() - start, 2)
        rec["stdout"] = buf.getvalue()[:20000]
        rec["warnings"] = [[w.category.__name__, str(w.message)[:500]] for w in caught]
        rec["warnings"] += [[f"logging.{r.levelname}", r.getMessage()[:500]] for r in capture.records]
        numbers: dict = {}
        rec["value_type"] = type(value).__name__ if value is not None else None
        if value is not None:
            leaves(value, "Out", numbers)
        rec["names"] = {}
        for name, v in list(ns.items()):
            if not _interesting(name, v):
                continue
            old = before.get(name)
            if old is not None and old[0] is v and old[1] == _signature(v):
                continue
            rec["names"][name] = type(v).__name__
            try:
                leaves(v, name, numbers)
            except Exception as e:  # an odd object is recorded, not fatal
                numbers[name] = f"<unreadable {type(v).__name__}: {e}>"
        torch.save(numbers, out / f"cell_{i:03d}.pt")
        records.append(rec)
        (out / "cells.json").write_text(json.dumps({"stubbed": list(stubs), "cells": records}, indent=1))
        print(f"[{spec['side']}] cell {i}: {'ok' if rec['ran'] else rec['error']} ({rec['seconds']}s)",
              file=sys.stderr, flush=True)  # fmt: skip


# -- comparing the two sides --------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def normalise(text: str) -> str:
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"<class '\1'>", text)
    text = re.sub(r"0x[0-9a-fA-F]+", "0x…", text)
    return text.replace("transformer_lens", "LIB").replace("transformer_bridge", "LIB")


def compare_text(a: str, b: str) -> tuple[bool, float, str]:
    """(equal, max abs diff of the numbers, what differs) of two printouts."""
    a, b = normalise(a), normalise(b)
    if a == b:
        return True, 0.0, ""
    na, nb = _NUMBER.findall(a), _NUMBER.findall(b)
    if _NUMBER.sub("#", a) != _NUMBER.sub("#", b) or len(na) != len(nb):
        la, lb = a.splitlines(), b.splitlines()
        k = next((j for j in range(min(len(la), len(lb))) if la[j] != lb[j]), min(len(la), len(lb)))
        shown = (la[k] if k < len(la) else "<end>")[:120], (lb[k] if k < len(lb) else "<end>")[:120]
        return False, math.nan, f"printed text: TL `{shown[0]}` / ours `{shown[1]}`"
    worst, bad = 0.0, None
    for x, y in zip(na, nb, strict=True):
        if x == y:
            continue
        fx, fy = float(x), float(y)
        if not any(c in x + y for c in ".eE"):
            bad = bad or (x, y)
            worst = max(worst, abs(fx - fy))
            continue
        decimals = max(len(s.split(".")[1].split("e")[0].split("E")[0]) if "." in s else 0 for s in (x, y))
        slack = 10.0**-decimals if not any(c in x + y for c in "eE") else 0.0
        mag = max(abs(fx), abs(fy))
        if "e" in x.lower() or "e" in y.lower():  # scientific: the mantissa's last digit
            mantissa = x.lower().split("e")[0]
            slack = (
                10.0 ** (math.floor(math.log10(mag)) - len(mantissa.split(".")[1])) if mag and "." in mantissa else 0
            )
        worst = max(worst, abs(fx - fy))
        if abs(fx - fy) > ATOL + RTOL * mag + slack:
            bad = bad or (x, y)
    if bad:
        return False, worst, f"printed number TL {bad[0]} / ours {bad[1]}"
    return True, worst, ""


def _kind(dtype) -> str:
    import torch

    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def compare_leaf(a, b) -> tuple[bool, float, float, str]:
    """(equal, max abs diff, max rel diff, what differs) of two stored leaves."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):  # summaries of big tensors
        if a["shape"] != b["shape"]:
            return False, math.nan, math.nan, f"shape {a['shape']} / {b['shape']}"
        ok1, d1, r1, _ = compare_leaf(a["stats"], b["stats"])
        ok2, d2, r2, _ = compare_leaf(a["sample"], b["sample"])
        return ok1 and ok2, max(d1, d2), max(r1, r2), "" if ok1 and ok2 else "values (summary + sample)"
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if tuple(a.shape) != tuple(b.shape):
            return False, math.nan, math.nan, f"shape {tuple(a.shape)} / {tuple(b.shape)}"
        if _kind(a.dtype) != _kind(b.dtype):
            return False, math.nan, math.nan, f"dtype {a.dtype} / {b.dtype}"
        if a.numel() == 0:
            return True, 0.0, 0.0, ""
        if _kind(a.dtype) != "float":
            same = torch.equal(a, b)
            diff = float((a.long() - b.long()).abs().max()) if not same else 0.0
            return same, diff, math.nan if not same else 0.0, "" if same else "integer values"
        x, y = a.double(), b.double()
        nan_same = torch.equal(torch.isnan(x), torch.isnan(y))
        fin = torch.isfinite(x) & torch.isfinite(y)
        inf_same = torch.equal(x[~fin & ~torch.isnan(x)], y[~fin & ~torch.isnan(y)]) if (~fin).any() else True
        d = (x[fin] - y[fin]).abs()
        dmax = float(d.max()) if d.numel() else 0.0
        rmax = dmax / max(float(y[fin].abs().max()), ATOL) if d.numel() else 0.0  # relative to the largest entry
        close = bool((d <= ATOL + RTOL * y[fin].abs()).all()) and nan_same and inf_same
        what = "" if close else ("values" if nan_same and inf_same else "NaN/inf positions")
        if close and a.dtype != b.dtype:
            return False, dmax, rmax, f"dtype {a.dtype} / {b.dtype}"
        return close, dmax, rmax, what
    if isinstance(a, str) and isinstance(b, str):
        ok, d, what = compare_text(a, b)
        return ok, d, math.nan, what.replace("printed text", "string").replace("printed number", "number in string")
    if isinstance(a, bool | int) and isinstance(b, bool | int) and type(a) is type(b):
        return a == b, float(abs(a - b)), math.nan, "" if a == b else f"{a} / {b}"
    if (
        isinstance(a, int | float)
        and isinstance(b, int | float)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        if isinstance(a, int) != isinstance(b, int):
            return False, abs(a - b), math.nan, f"type {type(a).__name__} / {type(b).__name__}"
        if math.isnan(a) and math.isnan(b):
            return True, 0.0, 0.0, ""
        d = abs(a - b)
        ok = d <= ATOL + RTOL * abs(b)
        return ok, d, d / max(abs(b), ATOL), "" if ok else f"{a:.6g} / {b:.6g}"
    if a == b:
        return True, 0.0, 0.0, ""
    return False, math.nan, math.nan, f"{type(a).__name__} {str(a)[:40]!r} / {type(b).__name__} {str(b)[:40]!r}"


def compare_cell(tl: dict, ours: dict, tl_dir: Path, ours_dir: Path) -> dict:
    import torch

    res = {"equal": False, "diffs": [], "max_abs": 0.0, "max_rel": 0.0, "compared": 0, "summarised": 0}
    if not (tl["ran"] and ours["ran"]):
        return res
    ok, d, what = compare_text(tl["stdout"], ours["stdout"])
    if not ok:
        res["diffs"].append(what)
    if not math.isnan(d):
        res["max_abs"] = max(res["max_abs"], d)
    a = torch.load(tl_dir / f"cell_{tl['index']:03d}.pt", weights_only=False)
    b = torch.load(ours_dir / f"cell_{ours['index']:03d}.pt", weights_only=False)
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            side = "TL" if key in a else "ours"
            res["diffs"].append(f"`{key}` only on {side}'s side")
            continue
        ok, d, r, what = compare_leaf(a[key], b[key])
        res["compared"] += 1
        res["summarised"] += isinstance(a[key], dict) and isinstance(b[key], dict)
        for field, x in (("max_abs", d), ("max_rel", r)):
            if not math.isnan(x):
                res[field] = max(res[field], x)
        if not ok:
            res["diffs"].append(f"`{key}`: {what}" + (f" (max abs {d:.2g})" if not math.isnan(d) and d else ""))
    res["equal"] = not res["diffs"]
    return res


# -- the report ------------------------------------------------------------------------------------------------------
def _first_line(source: str) -> str:
    for line in source.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            return s[:70].replace("|", "\\|")
    return "(comments only)"


def _flag(rec: dict) -> str:
    tlw = [m for c, m in rec.get("warnings", []) if c == "TransformerLensDifferenceWarning"]
    if tlw:
        return "warns: " + "; ".join(m.split(".")[0][:100] for m in tlw).replace("|", "\\|")
    if not rec["ran"]:
        return "raises"
    return "no"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _load(side_dir: Path, n: int) -> tuple[list[str], list[dict]]:
    """(stubbed modules, one record per code cell) of a side; cells its process never reached count as failed."""
    meta = json.loads((side_dir / "cells.json").read_text())
    cells = meta["cells"] + [
        {"index": i, "ran": False, "error": "not reached: the side's process ended", "warnings": [], "stdout": "",
         "seconds": 0.0}
        for i in range(len(meta["cells"]), n)
    ]  # fmt: skip
    return meta["stubbed"], cells


def report(notebooks: list[str], nb_dir: Path, out: Path) -> str:
    lines = [
        "# TransformerLens 4.3's demo notebooks, cell by cell: TL 4.3's bridge and this one",
        "",
        "Generated by `benchmarks/tl_notebooks.py` (its docstring: how the notebooks are ported and compared). "
        "Both sides run SmolLM2-135M-Instruct cut to its first "
        f"{json.loads((out / 'run.json').read_text())['layers']} blocks, fp32, CPU, one thread; equal = ran on both "
        f"sides and every number within rtol {RTOL:g} / atol {ATOL:g} (integers and strings exact). The last column "
        "is a diagnostic: this bridge's port again, with `attn_implementation=\"sdpa\"` (the model's own kernel, "
        "which `from_pretrained` keeps; TL's bridge and `boot_transformers` use eager attention), against TL.",
        "",
        "| notebook | code cells | runnable on TL's bridge | run here | equal | run here, not on TL | equal, SDPA "
        "here (diagnostic) |",
        "|---|---|---|---|---|---|---|",
    ]
    sections = []
    for name in notebooks:
        sources = code_cells(nb_dir / f"{name}.ipynb")
        n = len(sources)
        stubbed, tl_cells = _load(out / name / "tl", n)
        _, ours_cells = _load(out / name / "ours", n)
        results = [
            compare_cell(t, o, out / name / "tl", out / name / "ours")
            for t, o in zip(tl_cells, ours_cells, strict=True)
        ]
        eager_dir = out / name / "sdpa"
        eager = None
        if (eager_dir / "cells.json").exists():
            eager_cells = _load(eager_dir, n)[1]
            eager = [
                compare_cell(t, e, out / name / "tl", eager_dir) for t, e in zip(tl_cells, eager_cells, strict=True)
            ]
        runnable = sum(t["ran"] for t in tl_cells)
        here = sum(o["ran"] for o in ours_cells)
        equal = sum(r["equal"] for r in results)
        extra = sum(o["ran"] and not t["ran"] for t, o in zip(tl_cells, ours_cells, strict=True))
        n_eager = "—" if eager is None else str(sum(r["equal"] for r in eager))
        lines.append(f"| {name} | {n} | {runnable} | {here} | {equal} | {extra} | {n_eager} |")
        sec = [f"## {name}", "", f"{n} code cells; runnable on TL's bridge {runnable}, run here {here}, equal {equal}."]
        subs = SUBSTITUTIONS.get(name, [])
        sec += ["", "Model construction substituted (TL / ours):", ""]
        sec += [
            f"- `{old.strip()}` → " + (f"`{tl}` / `{ours}`" if tl or ours else "removed on both sides")
            for old, tl, ours in subs
        ] or ["- (none)"]
        if stubbed:
            sec += ["", f"Stubbed (absent from the venv): {', '.join(stubbed)}."]
        sec += ["", "Cells not equal, or failing here:", "",
                "| cell | first line | TL | here | what differs | max abs diff / relative | equal, SDPA here "
                "| flagged here | cause |",
                "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        labels: list[str] = []
        for t, o, r in zip(tl_cells, ours_cells, results, strict=True):
            i = t["index"]
            if r["equal"] or (not t["ran"] and not o["ran"] and not NOTES.get((name, i))):
                continue
            if NOTES.get((name, i)) and NOTES[(name, i)] not in labels:
                labels.append(NOTES[(name, i)])
            tl_s = "ran" if t["ran"] else _cell(t["error"][:80])
            ours_s = "ran" if o["ran"] else _cell(o["error"][:80])
            what = "; ".join(r["diffs"][:3]) + (f"; … {len(r['diffs']) - 3} more" if len(r["diffs"]) > 3 else "")
            if not (t["ran"] and o["ran"]):
                what = "—" if not t["ran"] and not o["ran"] else ("fails here" if t["ran"] else "fails on TL")
            diff = f"{r['max_abs']:.2g} / {r['max_rel']:.2g}" if t["ran"] and o["ran"] else "—"
            eq = "—" if eager is None or not t["ran"] else ("yes" if eager[i]["equal"] else "no")
            if eager is not None and t["ran"] and not eager_cells[i]["ran"]:
                eq = "fails: " + _cell(eager_cells[i]["error"][:60])
            sec.append(f"| {i} | `{_first_line(sources[i])}` | {tl_s} | {ours_s} | {_cell(what)} | {diff} | {eq} | "
                       f"{_flag(o) if t['ran'] else '—'} | {_cell(NOTES.get((name, i), ''))} |")  # fmt: skip
        if labels:
            sec += ["", "Causes:", "", *(f"- **{label}**: {CAUSES[label]}" for label in labels)]
        both_fail = [t["index"] for t, o in zip(tl_cells, ours_cells, strict=True) if not t["ran"] and not o["ran"]]
        if both_fail:
            sec += [
                "",
                "Not runnable on either side: "
                + ", ".join(f"{i} (TL: {_cell(tl_cells[i]['error'][:90])})" for i in both_fail)
                + ".",
            ]
        warned = [
            (o["index"], m) for o in ours_cells for c, m in o["warnings"] if c == "TransformerLensDifferenceWarning"
        ]
        sec += [
            "",
            "TransformerLensDifferenceWarning raised here: "
            + ("; ".join(f"cell {i}: {_cell(m[:160])}" for i, m in warned) if warned else "none")
            + ".",
        ]
        head = "| cell | first line | TL | here | equal | values compared (by summary) | max abs diff | TL s | here s |"
        sec += ["", "<details><summary>Every cell</summary>", "", head, "|---" * 9 + "|"]
        for t, o, r in zip(tl_cells, ours_cells, results, strict=True):
            status = ("ran" if t["ran"] else "error", "ran" if o["ran"] else "error", "yes" if r["equal"] else "no")
            numbers = f"{r['compared']} ({r['summarised']}) | {r['max_abs']:.2g} | {t['seconds']} | {o['seconds']}"
            sec.append(f"| {t['index']} | `{_first_line(sources[t['index']])}` | {' | '.join(status)} | {numbers} |")
        sec += ["", "</details>"]
        sections += ["", *sec]
    return "\n".join(lines + sections) + "\n"


# -- driver -------------------------------------------------------------------------------------------------------
def run_notebook(nb: Path, out: Path, python: str, model: Path, sides: tuple[str, ...]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("GITHUB_ACTIONS", None)  # the notebooks read it; a local run, as a user's
    for side in sides:
        d = out / nb.stem / side
        d.mkdir(parents=True, exist_ok=True)
        spec = {"side": side, "cells": port(nb, side), "out": str(d), "model": str(model)}
        (d / "spec.json").write_text(json.dumps(spec, indent=1))
        with open(d / "stderr.txt", "w") as err:
            subprocess.run([python, __file__, "--side", str(d / "spec.json")], env=env, cwd=str(d), stderr=err,
                           stdout=err, check=False)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks_dir", type=Path, nargs="?")
    ap.add_argument(
        "--notebooks",
        nargs="+",
        default=[
            "Main_Demo",
            "Activation_Patching_in_TL_Demo",
            "Exploratory_Analysis_Demo",
            "Attribution_Patching_Demo",
        ],
    )
    ap.add_argument("--tl-python", default=sys.executable, help="a Python with TransformerLens 4.3 installed")
    ap.add_argument("--out", type=Path, default=Path("/tmp/tl_notebooks"))
    ap.add_argument("--layers", type=int, default=4, help="SmolLM2 blocks kept")
    ap.add_argument("--compare-only", action="store_true", help="re-compare the runs stored under --out")
    ap.add_argument(
        "--no-sdpa",
        action="store_true",
        help="skip the diagnostic third run (this bridge with attn_implementation='sdpa', the model's own kernel)",
    )
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        run_side(json.loads(Path(a.side).read_text()))
        return
    if a.notebooks_dir is None:
        ap.error("give the notebooks folder (TransformerLens' demos/)")
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.compare_only:
        model = prepare_model(a.out / f"smollm2_{a.layers}l", a.layers)
        (a.out / "run.json").write_text(json.dumps({"layers": a.layers, "model": str(model)}))
        for name in a.notebooks:
            sides = ("tl", "ours") if a.no_sdpa else ("tl", "ours", "sdpa")
            run_notebook(a.notebooks_dir / f"{name}.ipynb", a.out, a.tl_python, model, sides)
    sys.stdout.write(report(a.notebooks, a.notebooks_dir, a.out))


if __name__ == "__main__":
    main()
