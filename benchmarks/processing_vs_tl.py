"""Processed weights here vs TransformerLens 4.3's processed bridge, on the same HF weights (issue #20).

Both tools wrap their own copy of one HF model and process it (``enable_compatibility_mode()``: fold_ln,
center_writing_weights, center_unembed, fold_value_biases); then the numbers a TransformerLens user reads are
compared: ``W_Q`` … ``W_out``, ``W_U`` / ``b_U``, ``OV`` (``FactoredMatrix.AB``), the logits, the residual
stream, and ``cache.decompose_resid`` at the last position. Run in a venv holding transformer-lens 4.3 and this
package (as for benchmarks/tl_suite.py)::

    /tmp/tl20/bin/python benchmarks/processing_vs_tl.py [--models smollm2 gpt2 gpt_neox]

Prints one Markdown table: the largest absolute difference and its size relative to the largest entry.
"""

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch
from transformer_lens.model_bridge import TransformerBridge as TLBridge
from transformers import AutoModelForCausalLM, AutoTokenizer

from transformer_bridge import TransformerBridge
from transformer_bridge.real_model import smollm2_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import CONFIGS, char_tokenizer

PROMPT = "When Mary and John went to the store, John gave a drink to"
WEIGHTS = [
    "W_E",
    "W_Q",
    "W_K",
    "W_V",
    "W_O",
    "b_Q",
    "b_K",
    "b_V",
    "b_O",
    "W_in",
    "W_out",
    "b_in",
    "b_out",
    "W_U",
    "b_U",
]
TL_NAME = {"gpt2": "gpt2", "gpt_neox": "EleutherAI/pythia-14m", "llama": "meta-llama/Llama-3.2-1B"}


def load(model: str) -> tuple[torch.nn.Module, object, str]:
    """(HF model, tokenizer, a name TransformerLens knows the architecture of)."""
    if model == "smollm2":
        path = str(smollm2_path())
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return hf, AutoTokenizer.from_pretrained(path), path
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[model]()).eval()
    with torch.no_grad():  # perturbed, so zero biases and unit norms do not hide differences
        gen = torch.Generator().manual_seed(1)
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    folder = Path(tempfile.mkdtemp())
    char_tokenizer().save_pretrained(folder)  # TransformerLens re-loads a tokenizer by its name_or_path
    return hf, AutoTokenizer.from_pretrained(folder), TL_NAME[model]


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    d = float((a - b).abs().max())
    return f"{d:.1e} ({d / max(float(b.abs().max()), 1e-30):.0e})"


def compare(model: str) -> list[tuple[str, str]]:
    hf, tok, name = load(model)
    ours = TransformerBridge(copy.deepcopy(hf), tok)
    tl = TLBridge.boot_transformers(name, hf_model=copy.deepcopy(hf), tokenizer=tok, device="cpu")
    ours.enable_compatibility_mode()
    tl.enable_compatibility_mode(disable_warnings=True)
    rows = [(w, diff(getattr(ours, w), getattr(tl, w))) for w in WEIGHTS if hasattr(tl, w)]
    rows.append(("OV.AB", diff(ours.OV.AB, tl.OV.AB)))
    rows.append(("QK.AB", diff(ours.QK.AB, tl.QK.AB)))
    tokens = ours.to_tokens(PROMPT, prepend_bos=False)
    with torch.no_grad():
        lo, co = ours.run_with_cache(tokens)
        lt, ct = tl.run_with_cache(tokens)
    rows.append(("logits", diff(lo, lt)))
    rows.append(("log-probs vs unprocessed HF", diff(lo.log_softmax(-1), hf(tokens).logits.log_softmax(-1))))
    last = ours.cfg.n_layers - 1
    for point in ("hook_embed", "blocks.0.ln1.hook_normalized", "blocks.0.attn.hook_q"):
        rows.append((point, diff(co[point], ct[point])))
    rows.append(("last block's hook_resid_post", diff(co["resid_post", last], ct[f"blocks.{last}.hook_resid_post"])))
    do, labels_o = co.decompose_resid(pos_slice=-1, return_labels=True)
    dt, labels_t = ct.decompose_resid(pos_slice=-1, return_labels=True)
    same = "same labels" if labels_o == labels_t else "labels differ"
    rows.append(("decompose_resid (last position)", f"{diff(do, dt)}, {len(labels_o)} parts, {same}"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gpt2", "gpt_neox"])
    a = ap.parse_args()
    results = {m: dict(compare(m)) for m in a.models}
    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    print("| quantity | " + " | ".join(a.models) + " |")
    print("|---" * (len(a.models) + 1) + "|")
    for k in keys:
        print(f"| {k} | " + " | ".join(results[m].get(k, "—") for m in a.models) + " |")


if __name__ == "__main__":
    main()
