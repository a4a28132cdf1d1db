"""The clients check: the newest release of each tool that users run on the bridge, installed into a scratch
venv, runs a short real job against the bridge on SmolLM2, and its result is compared with an independent answer.

    python3 scripts/clients.py                 # every client; prints the table
    python3 scripts/clients.py --write         # also writes it into docs/ecosystem.md
    python3 scripts/clients.py --only circuitsvis --reuse

Each client gets a fresh venv under ``--venvs`` (default ``$TMPDIR/transformer-bridge-clients``; ``--reuse``
keeps one that is already there) with the CPU build of torch 2.13.0 pinned, the client's newest release that
installs next to the bridge's declared transformers range, and the bridge's runtime dependencies; the bridge
itself is imported from this checkout (``PYTHONPATH``). The job runs offline (``HF_HUB_OFFLINE=1``) on SmolLM2
converted once by ``make setup`` (`transformer_bridge.real_model.smollm2_path`):

- SAELens: its training runner (``LanguageModelSAETrainingRunner`` with ``override_model=bridge``) on a
  pre-tokenized dataset of packed rows, EOS between documents, rows led by EOS or BOS, no attention mask; every
  activation batch the runner stores is compared with HF's hidden state for the same ids (bitwise).
- TransformerLens: its ``patching`` sweeps and ``head_detector`` on the bridge against a manual loop over the
  bridge's hooks (bitwise), and benchmarks/tl_utils_parity.py (the bridge's utils against this release's).
- circuitsvis: ``attention_patterns`` renders a cached pattern: HTML, with the prompt's tokens in it.

The table (client, version, what ran, result, install and run seconds) goes between the markers in
docs/ecosystem.md. Exit status 1 when a job fails.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ecosystem.md"
BEGIN, END = "<!-- clients-table: begin (scripts/clients.py --write) -->", "<!-- clients-table: end -->"
HOOK, LAYER = "blocks.3.hook_resid_post", 3  # hidden_states[LAYER + 1] in HF's numbering
CONTEXT, ROWS = 32, 16  # SAELens: 16 packed rows of 32 tokens = 512 training tokens
DOCUMENTS = [
    "The capital of France is Paris, a city on the Seine.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "def add(a, b):\n    return a + b",
    "Once upon a time there was a small fox who lived in a forest.",
    "The mitochondria is the powerhouse of the cell.",
    "Please reply by Friday with the signed contract attached.",
    "In 1969 two astronauts walked on the Moon.",
    "Prime numbers have exactly two divisors: one and themselves.",
]

# name -> (pip requirement, distribution, what the job does)
CLIENTS = {
    "SAELens": (
        "sae-lens>=6,<7",
        "sae-lens",
        f"`LanguageModelSAETrainingRunner(override_model=bridge)`: {ROWS * CONTEXT} tokens of packed rows "
        f"(EOS between documents, rows led by EOS or BOS, no mask), standard SAE on `{HOOK}`; every stored "
        "activation batch vs HF's hidden state",
    ),
    "TransformerLens": (
        "transformer-lens>=4,<5",
        "transformer-lens",
        "`patching.get_act_patch_resid_pre` and `get_act_patch_attn_head_out_all_pos`, "
        "`head_detector.detect_head` (previous-token, induction) vs a manual loop over the bridge's "
        "hooks; `benchmarks/tl_utils_parity.py` (the bridge's utils vs this release's)",
    ),
    "circuitsvis": (
        "circuitsvis",
        "circuitsvis",
        "`attention.attention_patterns` on a cached `blocks.0.attn.hook_pattern`: HTML with the tokens",
    ),
}


# -- outside: venvs, timing, the table ----------------------------------------------------------------------------


def runtime_requirements() -> list[str]:
    """The bridge's own dependencies from pyproject.toml (torch pinned to 2.13.0 separately)."""
    block = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)
    if block is None:
        sys.exit("pyproject.toml has no `dependencies = [...]` list")
    return [d for d in re.findall(r'"([^"]+)"', block.group(1)) if not d.startswith("torch")]


def install(name: str, venvs: Path, reuse: bool) -> tuple[Path, float | None]:
    """A venv with torch 2.13.0 (CPU), the client's newest compatible release and the bridge's dependencies;
    returns ``(python, seconds spent installing)`` (None: an installed venv was reused)."""
    venv = venvs / re.sub(r"\W", "-", name.lower())
    python, stamp = venv / "bin" / "python", venv / ".ready"
    if reuse and stamp.exists():
        return python, None
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # torch first and pinned in every call: an unpinned `torch` would pull several GB of CUDA wheels.
    for packages in (["torch==2.13.0"], ["torch==2.13.0", CLIENTS[name][0], *runtime_requirements()]):
        done = subprocess.run([*pip, *packages], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{name}: `pip install {' '.join(packages)}` failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    stamp.touch()
    return python, time.monotonic() - start


def dev_beside_transformer_lens() -> tuple[bool, str]:
    """Whether ``pip`` resolves the bridge's ``[dev]`` extra together with TransformerLens 4.x (a dry run, nothing is
    installed): a developer's venv must hold both. Returns ``(ok, what pip said)``."""
    requirement = CLIENTS["TransformerLens"][0]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd = [*pip, "--disable-pip-version-check", "--report", str(report), f"{ROOT}[dev]", requirement]
        cmd.append("torch==2.13.0")
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        said = "\n".join(line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("WARNING"))
        if done.returncode != 0 or not report.exists():
            return False, f"`pip install .[dev] '{requirement}'` does not resolve:\n{said[-2000:]}"
        picked = {
            i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
        }
    return True, f"[dev] resolves beside transformer-lens {picked.get('transformer-lens', '?')}"


def run_job(name: str, python: Path) -> tuple[dict, float]:
    """Run the client's job in its venv; returns ``(report, seconds)``."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        start = time.monotonic()
        proc = subprocess.run(
            [str(python), str(Path(__file__).resolve()), "--job", name, "--report", str(out)],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.monotonic() - start
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            return {"ok": False, "version": "?", "result": "job crashed: " + " / ".join(tail)[-600:]}, seconds
        return json.loads(out.read_text()), seconds


def table(rows: list[dict]) -> str:
    lines = ["| client | version | what ran | result | install (s) | run (s) |", "|---|---|---|---|---:|---:|"]
    for r in rows:
        mark = "pass" if r["ok"] else "**FAIL**"
        install_s = "reused" if r["install_s"] is None else f"{r['install_s']:.0f}"
        what, result = (text.replace("|", "\\|") for text in (r["what"], r["result"]))  # a cell holds no pipe
        lines.append(f"| {r['client']} | {r['version']} | {what} | {mark}: {result} | {install_s} | "
                     f"{r['run_s']:.0f} |")  # fmt: skip
    total = sum((r["install_s"] or 0) + r["run_s"] for r in rows)
    return "\n".join(lines) + (
        f"\n\nMeasured {time.strftime('%Y-%m-%d')} on this project's machine kind (2 CPU cores, shared with other "
        f"work), torch 2.13.0 (CPU), pip's cache as the machine had it: {total:.0f} s in all ({total / 60:.1f} min)."
    )


def write_doc(text: str) -> None:
    page = DOC.read_text()
    if BEGIN not in page or END not in page:
        sys.exit(f"{DOC} has no {BEGIN} … {END} markers")
    head, rest = page.split(BEGIN, 1)
    DOC.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CLIENTS), help="run these clients only")
    parser.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "transformer-bridge-clients")
    parser.add_argument("--reuse", action="store_true", help="keep a venv that is already installed")
    parser.add_argument("--write", action="store_true", help="write the table into docs/ecosystem.md")
    parser.add_argument("--job", choices=sorted(CLIENTS), help=argparse.SUPPRESS)  # inside the client's venv
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        report = JOBS[args.job]()
        args.report.write_text(json.dumps(report))
        return 0
    resolves, said = dev_beside_transformer_lens()
    print(f"[dev] with {CLIENTS['TransformerLens'][0]}: {said}", flush=True)
    rows = []
    for name in args.only or list(CLIENTS):
        python, install_s = install(name, args.venvs, args.reuse)
        report, run_s = run_job(name, python)
        rows.append({"client": name, "what": CLIENTS[name][2], "install_s": install_s, "run_s": run_s, **report})
        spent = "venv reused" if install_s is None else f"{install_s:.0f} s install"
        verdict = "pass" if report["ok"] else "FAIL"
        print(f"{name} {report['version']}: {verdict} ({spent}, {run_s:.0f} s run): {report['result']}", flush=True)
    text = table(rows)
    print(text)
    if args.write:
        write_doc(text)
    return 0 if resolves and all(r["ok"] for r in rows) else 1


# -- inside a client's venv: the jobs -----------------------------------------------------------------------------


def smollm2():
    """SmolLM2-135M-Instruct in float32 from the local conversion (no hub)."""
    import torch

    from transformer_bridge import TransformerBridge
    from transformer_bridge.real_model import smollm2_path

    # One thread: on a 2-core machine next to any other busy process, two threads made each forward ~10x slower.
    torch.set_num_threads(1)
    return TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)


def version_of(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


def packed_rows(tokenizer) -> list[list[int]]:
    """``ROWS`` rows of ``CONTEXT`` ids from the documents joined by EOS; even rows led by EOS, odd by BOS."""
    stream: list[int] = []
    while len(stream) < ROWS * (CONTEXT - 1):
        for text in DOCUMENTS:
            stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    lead = [tokenizer.eos_token_id, tokenizer.bos_token_id]
    return [[lead[i % 2], *stream[i * (CONTEXT - 1) : (i + 1) * (CONTEXT - 1)]] for i in range(ROWS)]


def job_saelens() -> dict:
    import datasets
    import torch
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
        StandardTrainingSAEConfig,
    )

    model = smollm2()
    rows = packed_rows(model.tokenizer)
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=model.cfg.d_model, d_sae=4 * model.cfg.d_model, l1_coefficient=1.0),
        model_name="SmolLM2-135M-Instruct (transformer-bridge)",
        hook_name=HOOK,
        dataset_path="packed-rows",
        is_dataset_tokenized=True,
        streaming=False,
        context_size=CONTEXT,
        prepend_bos=False,
        training_tokens=ROWS * CONTEXT,
        train_batch_size_tokens=2 * CONTEXT,
        store_batch_size_prompts=4,
        n_batches_in_buffer=2,
        device="cpu",
        seed=0,
        logger=LoggingConfig(log_to_wandb=False),
        output_path=None,
        checkpoint_path=None,
        n_checkpoints=0,
        verbose=False,
    )
    runner = LanguageModelSAETrainingRunner(
        cfg, override_dataset=datasets.Dataset.from_dict({"tokens": rows}), override_model=model
    )
    store, seen = runner.activations_store, []
    runner_activations = store.get_activations

    def recorded(batch_tokens):  # the runner's own call, its result kept for the comparison
        activations = runner_activations(batch_tokens)
        seen.append((batch_tokens.clone(), activations.clone()))
        return activations

    store.get_activations = recorded
    initial = runner.sae.W_enc.detach().clone()
    sae = runner.run()
    trained = not torch.equal(initial, sae.W_enc.detach())
    equal, worst, leads = 0, 0.0, set()
    with torch.no_grad():
        for tokens, stored in seen:
            hidden = model.hf_model(tokens, output_hidden_states=True).hidden_states[LAYER + 1]
            equal += int(torch.equal(stored, hidden))
            worst = max(worst, float((stored - hidden).abs().max()))
            leads |= set(tokens[:, 0].tolist())
    n_rows = sum(len(t) for t, _ in seen)
    names = {model.tokenizer.eos_token_id: "EOS", model.tokenizer.bos_token_id: "BOS"}
    ok = bool(seen) and equal == len(seen) and trained
    result = (
        f"{len(seen)} stored batches ({n_rows} rows led by {'/'.join(sorted(names.get(i, str(i)) for i in leads))})"
        f" {'bitwise' if ok else 'NOT bitwise'} HF's `hidden_states[{LAYER + 1}]` (max |diff| {worst:.1e}); "
        f"{type(sae).__name__} (d_sae {sae.cfg.d_sae}) {'trained' if trained else 'NOT trained'}"
    )
    return {"ok": ok, "version": version_of("sae-lens"), "result": result}


def job_transformer_lens() -> dict:
    import torch
    from transformer_lens import head_detector, patching

    model = smollm2()
    model.cfg.default_prepend_bos = False  # SmolLM2's BOS is a chat-turn marker; raw text as HF reads it
    clean = model.to_tokens("The Eiffel Tower is in")
    corrupted = model.to_tokens("The Colosseum is in")
    if clean.shape != corrupted.shape:
        raise RuntimeError(f"the prompts must tokenize to one length, got {clean.shape} and {corrupted.shape}")
    answer = int(model(clean)[0, -1].argmax())

    def metric(logits):
        return logits[0, -1, answer]

    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
        note = ""
        try:  # TransformerLens 4.3 refuses a model in training mode: is the bridge, as loaded, in eval mode?
            resid_pre = patching.get_act_patch_resid_pre(model, corrupted, cache, metric)
        except ValueError as e:
            if "evaluation mode" not in str(e):
                raise
            note = "; NOTE: `model.eval()` was needed first (the bridge's root module reports training mode)"
            model.eval()
            resid_pre = patching.get_act_patch_resid_pre(model, corrupted, cache, metric)
        sweeps = {
            "resid_pre": resid_pre,
            "attn_head_out_all_pos": patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric),
        }
        manual = {
            "resid_pre": torch.zeros(model.cfg.n_layers, clean.shape[1]),
            "attn_head_out_all_pos": torch.zeros(model.cfg.n_layers, model.cfg.n_heads),
        }
        for layer in range(model.cfg.n_layers):
            for pos in range(clean.shape[1]):
                name = f"blocks.{layer}.hook_resid_pre"

                def resid(x, hook, pos=pos, name=name):
                    x[:, pos] = cache[name][:, pos]
                    return x

                manual["resid_pre"][layer, pos] = metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, resid)]))
            for head in range(model.cfg.n_heads):
                name = f"blocks.{layer}.attn.hook_z"

                def z(x, hook, head=head, name=name):
                    x[:, :, head] = cache[name][:, :, head]
                    return x

                manual["attn_head_out_all_pos"][layer, head] = metric(
                    model.run_with_hooks(corrupted, fwd_hooks=[(name, z)])
                )
        text = "Mr and Mrs Dursley of number four, Privet Drive. Mr and Mrs Dursley of number four, Privet Drive."
        tokens = model.to_tokens(text)
        _, text_cache = model.run_with_cache(tokens)
        detected, by_hand = {}, {}
        n = tokens.shape[1]
        previous = torch.zeros(n, n)
        previous[1:, :-1] = torch.eye(n - 1)
        same = (tokens[0, :, None] == tokens[0, None, :]).float().tril(-1)  # earlier copies of the token
        induction = torch.zeros(n, n)
        induction[:, 1:] = same[:, :-1]  # the token after an earlier copy
        for kind, pattern in (("previous_token_head", previous), ("induction_head", induction)):
            detected[kind] = head_detector.detect_head(model, text, kind)
            scores = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)
            for layer in range(model.cfg.n_layers):
                p = text_cache["pattern", layer][0]  # [head, query, key]
                scores[layer] = (p * pattern).sum((-2, -1)) / p.sum((-2, -1))
            by_hand[kind] = scores
    checks = {k: torch.equal(sweeps[k], manual[k]) for k in sweeps}
    diffs = {k: float((detected[k] - by_hand[k]).abs().max()) for k in detected}
    checks |= {k: diffs[k] <= 1e-6 for k in diffs}  # sums over the pattern, in another order: float32 rounding
    parity = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tl_utils_parity.py")], capture_output=True, text=True
    )
    summary = next((line for line in parity.stdout.splitlines() if line.startswith("TransformerLens ")), "")
    counts = re.search(r"(\d+) public names, (\d+) provided", summary)
    checks["utils parity"] = parity.returncode == 0
    top = divmod(int(by_hand["induction_head"].argmax()), model.cfg.n_heads)
    shapes = " and ".join(f"{k} {tuple(v.shape)}" for k, v in sweeps.items())
    same_sweeps = "bitwise" if all(checks[k] for k in sweeps) else "NOT equal to"
    utils = f"{counts.group(2)} of {counts.group(1)} names" if counts else "?"
    unexpected = re.search(r"Unexpected differences: (.*)\.", parity.stdout)
    names = unexpected.group(1).split(", ") if unexpected else []
    rows = [line for line in parity.stdout.splitlines() if any(line.startswith(f"| `{n}` |") for n in names)]
    verdict = (
        "no unexpected difference"
        if checks["utils parity"]
        else ("DIFFERENCES: " + " / ".join(rows or [parity.stdout[-300:] + parity.stderr[-300:]]))
    )
    result = (
        f"patching: {shapes} {same_sweeps} the manual loop; detect_head (previous-token, induction) vs by hand: "
        f"max |diff| {max(diffs.values()):.1e} (top induction head L{top[0]}H{top[1]}); utils parity: {utils}, "
        f"{verdict}{note}"
    )
    return {"ok": all(checks.values()), "version": version_of("transformer-lens"), "result": result}


def job_circuitsvis() -> dict:
    import circuitsvis as cv

    model = smollm2()
    model.cfg.default_prepend_bos = False
    text = "The quick brown fox jumps over the lazy dog"
    _, cache = model.run_with_cache(text, names_filter="blocks.0.attn.hook_pattern")
    tokens = model.to_str_tokens(text)
    html = cv.attention.attention_patterns(tokens=tokens, attention=cache["pattern", 0][0])
    # `local_src` inlines circuitsvis' JavaScript (works offline); `_repr_html_` would first probe the network.
    page = html.local_src
    found = [t for t in tokens if json.dumps(t)[1:-1] in page]
    ok = "<script" in page and len(page) > 10_000 and len(found) == len(tokens)
    result = (
        f"{len(page) / 1e3:.0f} kB of self-contained HTML for {model.cfg.n_heads} heads × {len(tokens)} "
        f"tokens; {len(found)}/{len(tokens)} tokens in it"
    )
    return {"ok": ok, "version": version_of("circuitsvis"), "result": result}


JOBS = {"SAELens": job_saelens, "TransformerLens": job_transformer_lens, "circuitsvis": job_circuitsvis}

if __name__ == "__main__":
    sys.exit(main())
