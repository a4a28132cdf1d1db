"""Faithfulness of relevance methods on SmolLM2-135M-Instruct (fp32, CPU): perturbation curves and cost.

For each fixed factual-completion prompt (benchmarks/data/faithfulness_prompts.json) the model
generates 8 greedy tokens (``model.forward_pass``; EOS does not stop it); every generated token is
explained (target: its logit) by each method. Only prompt tokens are ranked and perturbed, never
position 0 (the attention sink) nor special tokens. For k = 0..K (K = all rankable tokens) the top-k
(MoRF, most relevant first) or bottom-k (LeRF) tokens by signed score are removed and the generated
token's log-probability is measured, given the (perturbed) prompt and the generated tokens before
it. Operators: ``delete`` (drop the tokens; rows left-padded with explicit positions) and ``zero``
(zero their token embeddings).

Per method: ABPC = mean_k(f_LeRF − f_MoRF) (higher is better), AOPC of each curve
(mean_k(f_0 − f_k)), comprehensiveness and sufficiency at 20 % of the rankable tokens, conservation
error |ΣR − f| / |f|, seconds per explained token and its ratio to one forward of the sequence;
mean ± standard error over targets, and a paired bootstrap over prompts of the ABPC difference
against ``random`` (mean of 3 seeds) and ``grad_x_input``, and of ``attnlrp`` against every method.

    .venv/bin/python benchmarks/faithfulness.py --smoke              # a few prompts, for CI (< 1 min)
    .venv/bin/python benchmarks/faithfulness.py --out results.json   # all 100 prompts (long on CPU)

Results are rewritten after every prompt, so a run stopped early still reports what it measured.
Parts run separately (``--start``/``--limit``, e.g. one process per core) are combined with
``--merge part0.json part1.json ... --out all.json``, which recomputes the table from their records
(``.json.gz`` files are read too: benchmarks/results/ keeps the measured run that way).
"""

import argparse
import gzip
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from transformer_bridge import TransformerBridge
from transformer_bridge.real_model import smollm2_path
from transformer_bridge.relevance import relevance_hooks

PROMPTS = Path(__file__).parent / "data" / "faithfulness_prompts.json"
RANDOM_SEEDS = (0, 1, 2)
LEAD = "attnlrp"  # the method every other one is also compared with (paired bootstrap)


def method_table(ig_steps: int) -> dict[str, tuple[str, dict]]:
    table = {
        "attnlrp": ("attnlrp", {}),
        "cp_lrp": ("cp_lrp", {}),
        f"integrated_gradients({ig_steps})": ("integrated_gradients", {"steps": ig_steps}),
        f"integrated_gradients_keep_first({ig_steps})": (
            "integrated_gradients",
            {"steps": ig_steps, "keep_first": True},
        ),
        "grad_norm": ("grad_norm", {}),
        "grad_x_input": ("grad_x_input", {}),
        "attention_last": ("attention", {"mode": "last"}),
        "attention_rollout": ("attention", {"mode": "rollout"}),
    }
    table.update({f"random_s{s}": ("random", {"seed": s}) for s in RANDOM_SEEDS})
    return table


@torch.no_grad()
def last_logprobs(model: TransformerBridge, rows: list[dict], chunk: int) -> list[float]:
    """Log-probability of each row's last token given the tokens before it.

    A row is ``{"ids": [...], "zero": [columns whose embedding is zeroed]}``. Rows are left-padded
    with explicit positions; only the last position is unembedded (that is all the score needs).
    """
    hf = model.hf_model
    base, head = hf.base_model, hf.get_output_embeddings()
    embed = hf.get_input_embeddings()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["ids"]))
    scores = [0.0] * len(rows)
    for start in range(0, len(order), chunk):
        idx = order[start : start + chunk]
        width = max(len(rows[i]["ids"]) for i in idx)
        ids = torch.full((len(idx), width), model.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        zero = torch.zeros((len(idx), width), dtype=torch.bool)
        for r, i in enumerate(idx):
            row = rows[i]["ids"]
            ids[r, width - len(row) :] = torch.tensor(row)
            mask[r, width - len(row) :] = 1
            for c in rows[i]["zero"]:
                zero[r, width - len(row) + c] = True
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        emb = embed(ids).masked_fill(zero[..., None], 0.0)
        hidden = base(inputs_embeds=emb[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1])
        logits = head(hidden.last_hidden_state[:, -1]).float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, -1:])[:, 0]
        for r, i in enumerate(idx):
            scores[i] = float(logp[r])
    return scores


class PerturbedRows:
    """The distinct perturbed inputs of one prompt: (target step, removed columns) → row index."""

    def __init__(self, seq: list[int], prompt_width: int, operator: str) -> None:
        self.seq, self.prompt_width, self.operator = seq, prompt_width, operator
        self.rows: list[dict] = []
        self._where: dict[tuple, int] = {}

    def index(self, step: int, removed: frozenset) -> int:
        key = (step, removed)
        if key not in self._where:
            kept = self.seq[: self.prompt_width + step + 1]  # prompt + generated tokens up to the explained one
            if self.operator == "delete":
                self.rows.append({"ids": [t for c, t in enumerate(kept) if c not in removed], "zero": []})
            else:
                self.rows.append({"ids": kept, "zero": sorted(removed)})
            self._where[key] = len(self.rows) - 1
        return self._where[key]


def curves_for_prompt(
    model: TransformerBridge,
    seq: list[int],
    prompt_width: int,
    rankable: list[int],
    scores: dict[str, torch.Tensor],
    operators: list[str],
    chunk: int,
) -> dict[str, dict[str, list[dict]]]:
    """{operator: {method: [per-target {"morf": [...], "lerf": [...]}]}} for one prompt."""
    n_gen = len(seq) - prompt_width
    k_max = len(rankable)
    results: dict[str, dict[str, list[dict]]] = {}
    for op in operators:
        rows = PerturbedRows(seq, prompt_width, op)
        plan: dict[str, list[tuple[list[int], list[int]]]] = {}
        for name, s in scores.items():
            plan[name] = []
            for i in range(n_gen):
                vals = s[i, rankable].tolist()
                # Stable sorts: ties keep position order, so equal scores never depend on the method's noise.
                morf = [rankable[j] for j in sorted(range(k_max), key=lambda j: -vals[j])]
                lerf = [rankable[j] for j in sorted(range(k_max), key=lambda j: vals[j])]
                plan[name].append(
                    ([rows.index(i, frozenset(morf[:k])) for k in range(k_max + 1)],
                     [rows.index(i, frozenset(lerf[:k])) for k in range(k_max + 1)])
                )  # fmt: skip
        logps = last_logprobs(model, rows.rows, chunk)
        results[op] = {
            name: [{"morf": [logps[r] for r in m], "lerf": [logps[r] for r in lf]} for m, lf in per_target]
            for name, per_target in plan.items()
        }
    return results


def target_metrics(curve: dict) -> dict[str, float]:
    morf, lerf = curve["morf"], curve["lerf"]
    k_max = len(morf) - 1
    f0 = morf[0]
    k20 = max(1, math.ceil(0.2 * k_max))
    return {
        "abpc": statistics.fmean(lo - mo for lo, mo in zip(lerf, morf, strict=True)),
        "aopc_morf": statistics.fmean(f0 - v for v in morf),
        "aopc_lerf": statistics.fmean(f0 - v for v in lerf),
        "comprehensiveness@20": f0 - morf[k20],
        "sufficiency@20": f0 - lerf[k_max - k20],
    }


def mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    if len(values) == 1:
        return values[0], float("nan")
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def paired_bootstrap(a: list[float], b: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of per-prompt differences a − b and its 95 % bootstrap interval over prompts."""
    diffs = torch.tensor([x - y for x, y in zip(a, b, strict=True)], dtype=torch.float64)
    if len(diffs) < 2:
        return float(diffs.mean()), float("nan"), float("nan")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(diffs), (n, len(diffs)), generator=g)
    means = diffs[idx].mean(1)
    return float(diffs.mean()), float(means.quantile(0.025)), float(means.quantile(0.975))


def summarise(records: list[dict], methods: list[str], operators: list[str]) -> dict:
    """Aggregate per-target records into the table (per operator) and the bootstrap comparisons."""
    summary: dict = {"n_prompts": len(records), "n_targets": sum(r["n_targets"] for r in records), "operators": {}}
    cost = {}
    for m in methods:
        secs = [r["seconds"][m] / r["n_targets"] for r in records]
        ratio = [r["seconds"][m] / r["n_targets"] / r["forward_seconds"] for r in records]
        cons = [e for r in records for e in (r["conservation_error"].get(m) or [])]
        cost[m] = {
            "seconds_per_token": statistics.fmean(secs),
            "forwards_per_token": statistics.fmean(ratio),
            "conservation_error": statistics.median(cons) if cons else None,
        }
    summary["cost"] = cost
    for op in operators:
        table = {}
        per_prompt: dict[str, list[float]] = {}
        for m in [*methods, "random"]:
            if m == "random":
                seeds = [f"random_s{s}" for s in RANDOM_SEEDS]
                tm = [
                    {k: statistics.fmean(target_metrics(r["curves"][op][s][i])[k] for s in seeds)
                     for k in target_metrics(r["curves"][op][seeds[0]][i])}
                    for r in records for i in range(r["n_targets"])
                ]  # fmt: skip
                pp = [
                    statistics.fmean(
                        statistics.fmean(target_metrics(r["curves"][op][s][i])["abpc"] for s in seeds)
                        for i in range(r["n_targets"])
                    )
                    for r in records
                ]
            else:
                tm = [target_metrics(c) for r in records for c in r["curves"][op][m]]
                pp = [statistics.fmean(target_metrics(c)["abpc"] for c in r["curves"][op][m]) for r in records]
            per_prompt[m] = pp
            table[m] = {k: mean_se([t[k] for t in tm]) for k in tm[0]}
        versus = {}
        for m in [*methods, "random"]:
            versus[m] = {
                base: paired_bootstrap(per_prompt[m], per_prompt[base])
                for base in ("random", "grad_x_input")
                if base in per_prompt and base != m and m != "random"
            }
            if LEAD in per_prompt and m != LEAD:  # the lead method against this one
                versus[m][LEAD] = paired_bootstrap(per_prompt[LEAD], per_prompt[m])
        summary["operators"][op] = {"table": table, "versus": versus}
    return summary


def markdown(summary: dict, methods: list[str]) -> str:
    lines = [f"{summary['n_prompts']} prompts, {summary['n_targets']} explained tokens (target: logit; "
             "score: log-probability); mean ± s.e. over tokens"]  # fmt: skip
    for op, block in summary["operators"].items():
        lines += [
            "",
            f"operator: {op}",
            "",
            "| method | ABPC ↑ | AOPC MoRF ↑ | AOPC LeRF ↓ | comp@20% ↑ | suff@20% ↓ | ABPC − random [95% CI] "
            f"| ABPC − grad×input [95% CI] | {LEAD} − this [95% CI] | cons. err. (median) | s / token | × forward |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        order = sorted([*[m for m in methods if not m.startswith("random_s")], "random"],
                       key=lambda m: -block["table"][m]["abpc"][0])  # fmt: skip
        for m in order:
            t = block["table"][m]
            cells = [f"{t[k][0]:.3f} ± {t[k][1]:.3f}" for k in
                     ("abpc", "aopc_morf", "aopc_lerf", "comprehensiveness@20", "sufficiency@20")]  # fmt: skip
            vs = block["versus"].get(m, {})
            for base in ("random", "grad_x_input", LEAD):
                if base in vs:
                    d, lo, hi = vs[base]
                    cells.append(f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
                else:
                    cells.append("—")
            if m == "random":
                cost = {k: statistics.fmean(summary["cost"][f"random_s{s}"][k] for s in RANDOM_SEEDS)
                        for k in ("seconds_per_token", "forwards_per_token")}  # fmt: skip
                cost["conservation_error"] = None
            else:
                cost = summary["cost"][m]
            ce = cost["conservation_error"]
            cells += ["—" if ce is None else f"{ce:.3g}", f"{cost['seconds_per_token']:.3f}",
                      f"{cost['forwards_per_token']:.2f}"]  # fmt: skip
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(paths: list[Path], out: Path | None) -> dict:
    """One table from several partial runs: records in prompt-file order, each prompt once."""
    parts = [json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text()) for p in paths]
    keys = ("max_new_tokens", "ig_steps", "operators")
    settings = {k: parts[0]["args"][k] for k in keys}
    for path, part in zip(paths, parts, strict=True):
        if {k: part["args"][k] for k in keys} != settings:
            got = [part["args"][k] for k in keys]
            raise SystemExit(f"{path}: settings {got} differ from {list(settings.values())} ({keys})")
    order = {p: i for i, p in enumerate(json.loads(PROMPTS.read_text())["prompts"])}
    by_prompt: dict[str, dict] = {}
    for path, part in zip(paths, parts, strict=True):
        for record in part["records"]:
            if record["prompt"] in by_prompt:
                raise SystemExit(f"{path}: prompt {record['prompt']!r} is already in an earlier file")
            by_prompt[record["prompt"]] = record
    records = sorted(by_prompt.values(), key=lambda r: order.get(r["prompt"], len(order)))
    methods = list(records[0]["seconds"])  # what was measured (the table may have grown since)
    if any(list(r["seconds"]) != methods for r in records):
        raise SystemExit("The files measured different methods; merge only runs of the same --methods.")
    operators = [o for o in settings["operators"].split(",") if o]
    summary = summarise(records, methods, operators)
    text = markdown(summary, methods)
    print(text)
    if out:
        merged_args = {**settings, "merged_from": [str(p) for p in paths]}
        out.write_text(json.dumps({"summary": summary, "records": records, "args": merged_args}, indent=1))
        out.with_suffix(".md").write_text(text + "\n")
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="2 prompts, 2 tokens, IG with 4 steps, deletion (CI)")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only")
    parser.add_argument("--start", type=int, default=0, help="skip the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--ig-steps", type=int, default=32)
    parser.add_argument("--operators", default="delete,zero", help="comma-separated: delete, zero")
    parser.add_argument("--chunk", type=int, default=64, help="rows per perturbation forward")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadiest on a shared CPU)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (rewritten after every prompt)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated names from the table (default: all); random always runs")  # fmt: skip
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                        help="combine the records of earlier runs (same settings) instead of measuring")  # fmt: skip
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.limit, args.max_new_tokens, args.ig_steps, args.operators = args.limit or 2, 2, 4, "delete"
    operators = [o for o in args.operators.split(",") if o]
    if not operators or any(o not in ("delete", "zero") for o in operators):
        parser.error(f"--operators must name delete and/or zero, got {args.operators!r}")
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    prompts = prompts[args.start :][: args.limit]
    table = method_table(args.ig_steps)
    if args.methods:
        chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in chosen if m not in table]
        if unknown:
            parser.error(f"--methods: unknown {unknown}; choose from {[m for m in table if 'random' not in m]}")
        table = {m: v for m, v in table.items() if m in chosen or m.startswith("random_s")}
    methods = list(table)

    torch.manual_seed(0)
    model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)
    specials = set(model.tokenizer.all_special_ids)
    patterns = relevance_hooks(model, "attention", mode="rollout")
    records: list[dict] = []
    started = time.perf_counter()
    for p_index, prompt in enumerate(prompts):
        # Step one of the two-step API: greedy, fixed length (EOS does not stop), patterns cached on the CPU.
        run = model.forward_pass(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, stop_at_eos=False,
                                 names_filter=patterns)  # fmt: skip
        seq, width = run.sequences, run.prompt_width
        with torch.no_grad():
            model(seq)  # warm-up, then the forward every cost is compared with
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                model(seq)
                times.append(time.perf_counter() - t0)
        forward_s = statistics.median(times)
        # The attention baselines read the cache; their cost is the cache-building forward.
        t0 = time.perf_counter()
        model.run_with_cache(seq, names_filter=patterns)
        cache_s = time.perf_counter() - t0
        scores, seconds, conservation = {}, {}, {}
        for name, (method, kwargs) in table.items():
            t0 = time.perf_counter()
            rel = run.relevance_pass(method=method, target="logit", **kwargs)
            seconds[name] = time.perf_counter() - t0 + (cache_s if method == "attention" else 0.0)
            scores[name] = rel.scores
            if rel.conservation_error is not None:
                conservation[name] = rel.conservation_error.tolist()
        ids = seq[0].tolist()
        rankable = [c for c in range(1, width) if ids[c] not in specials]
        curves = curves_for_prompt(model, ids, width, rankable, scores, operators, args.chunk)
        run.clear()
        records.append({
            "prompt": prompt, "generated": model.to_string(seq[0, width:]), "n_targets": seq.shape[1] - width,
            "n_rankable": len(rankable), "forward_seconds": forward_s, "seconds": seconds,
            "conservation_error": conservation, "curves": curves,
        })  # fmt: skip
        summary = summarise(records, methods, operators)
        elapsed = time.perf_counter() - started
        print(f"[{p_index + 1}/{len(prompts)}] {elapsed:.0f}s {prompt!r} → {records[-1]['generated']!r}",
              file=sys.stderr, flush=True)  # fmt: skip
        if args.out:
            args.out.write_text(json.dumps({"summary": summary, "records": records, "args": vars(args)},
                                           default=str, indent=1))  # fmt: skip
    text = markdown(summarise(records, methods, operators), methods)
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text + "\n")
    return summary


if __name__ == "__main__":
    main()
