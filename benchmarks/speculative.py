"""Speculative decoding (prompt lookup) against eager `generate` on the extraction task of benchmarks/generate.py.

SmolLM2-135M-Instruct fp32, greedy, ``--new`` tokens per row (``min_new_tokens`` too, so EOS never ends a run
early), batch 1 and 8 (left-padded), variants interleaved round by round in alternating order, medians. The
script checks that the tokens equal eager decoding's, counts forwards with a hook on ``hook_embed``, and
reports how many tokens each verify forward gave per row (accepted drafts + the chosen token).

    python benchmarks/speculative.py [--rounds 3] [--new 64] [--k 10] [--batches 1,8] [--threads 1]

``--trace``: one prompt-lookup run per batch, round by round: each row's chunk (1 + drafts fed) and the tokens
it gained, the time from embedding to the final norm and from one forward's embedding to the next (the
rest: unembedding, verification, rewinds, drafting). ``--costs``: what one forward costs against the chunk
width at each batch size (the engine fed ``width`` tokens per row over a 96-token cache; minimum of 5).

``--assistant``: SmolLM2 drafting for itself (``assistant_model=model``, every draft accepted, so it measures
the drafter's overhead): eager vs assistant tokens/s, and the draft cost per round of the drafter that keeps
the draft model's KV cache (`speculative.Assistant`) against a full greedy `generate` of the draft over every
row's whole sequence (the drafter it replaced), replayed on the same rounds (same drafts checked).
"""

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

from transformer_bridge import TransformerBridge
from transformer_bridge.generation.engine import Engine, Row
from transformer_bridge.generation.speculative import Assistant
from transformer_bridge.real_model import smollm2_path

sys.path.insert(0, str(Path(__file__).parent))
from generate import PASSAGES  # the extraction task of benchmarks/generate.py


def interleaved_medians(variants: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each variant over ``rounds``, the variants interleaved (reversed every other round)."""
    times = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants.items())
        for name, fn in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--k", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--assistant", action="store_true", help="the model as its own assistant (see above)")
    parser.add_argument("--trace", action="store_true", help="round by round widths, gains and times")
    parser.add_argument("--costs", action="store_true", help="forward time against chunk width")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=getattr(torch, args.dtype))
    model.to(args.device)
    model.cfg.default_prepend_bos = False
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device} {args.dtype}, "
          f"{args.new} new tokens, k={args.k}, medians of {args.rounds} rounds")  # fmt: skip
    if args.costs:
        costs(model, [int(b) for b in args.batches.split(",")])
        return
    if args.trace:
        for batch in (int(b) for b in args.batches.split(",")):
            trace(model, batch, args.new, args.k)
        return
    if args.assistant:
        print("| batch | eager tok/s | assistant tok/s | ratio | draft ms/round: kept KV | full recompute | speed-up |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for batch in (int(b) for b in args.batches.split(",")):
            bench_assistant(model, batch, args.new, args.k, args.rounds)
        return
    print("| batch | eager tok/s | prompt lookup tok/s | ratio | forwards eager / lookup | tokens per verify row |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        bench(model, batch, args.new, args.k, args.rounds)


def prompts(model: TransformerBridge, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    texts = [f"Copy the text exactly.\nText: {p}\nCopy: {p.split()[0]}" for p in (PASSAGES * 4)[:batch]]
    return model.to_tokens_and_mask(texts, padding_side="left")


def full_drafts(draft: TransformerBridge, rows: list[list[int]], k: int) -> list[list[int]]:
    """The replaced drafter: a greedy `generate` of the draft over every row's whole sequence (left-padded)."""
    width = max(len(r) for r in rows)
    pad = draft.pad_token_id if draft.pad_token_id is not None else 0
    tokens = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=draft.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=draft.device)
    out = draft.generate(tokens, attention_mask=mask, max_new_tokens=k, do_sample=False, stop_at_eos=False,
                         pad_token_id=pad, return_type="tokens")  # fmt: skip
    return out[:, width:].tolist()


def bench_assistant(model: TransformerBridge, batch: int, n: int, k: int, rounds: int) -> None:
    tokens, mask = prompts(model, batch)
    tokens, mask = tokens.to(model.device), mask.to(model.device)
    common = dict(attention_mask=mask, max_new_tokens=n, min_new_tokens=n)
    variants = {
        "eager": lambda: model.generate(tokens, **common),
        "assistant": lambda: model.generate(tokens, **common, assistant_model=model, num_assistant_tokens=k),
    }
    out = {name: fn() for name, fn in variants.items()}  # warm-up
    assert torch.equal(out["eager"], out["assistant"]), "the assistant changed the tokens"
    med = interleaved_medians(variants, rounds)
    # The rounds of that run (every draft accepted): row i is its prompt + 1 + r (k + 1) generated tokens.
    width = tokens.shape[1]
    rows = [[t for t, m in zip(ts, ms, strict=True) if m] for ts, ms in zip(tokens.tolist(), mask.tolist(),
                                                                             strict=True)]  # fmt: skip
    new = out["eager"][:, width:].tolist()
    kept, full = [], []
    for _ in range(rounds):
        assistant = Assistant(model, k)
        for r in range(n // (k + 1)):
            now = [row + g[: 1 + r * (k + 1)] for row, g in zip(rows, new, strict=True)]
            start = time.perf_counter()
            a = assistant.propose(now, k, list(range(batch)))
            kept.append(time.perf_counter() - start)
            start = time.perf_counter()
            b = full_drafts(model, now, k)
            full.append(time.perf_counter() - start)
            assert a == b, "the drafters disagree"
    kept_ms, full_ms = 1000 * statistics.median(kept), 1000 * statistics.median(full)
    print(
        f"| {batch} | {batch * n / med['eager']:.1f} | {batch * n / med['assistant']:.1f} | "
        f"{med['eager'] / med['assistant']:.2f}x | {kept_ms:.0f} | {full_ms:.0f} | {full_ms / kept_ms:.2f}x |"
    )


def costs(model: TransformerBridge, batches: list[int], widths: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 11)) -> None:
    """Milliseconds of one forward of ``width`` tokens per row over a 96-token cache, per batch size."""
    print("| batch | " + " | ".join(f"width {w}" for w in widths) + " | per row x column |")
    print("|---:|" + "---:|" * (len(widths) + 1))
    engines = {}
    for b in batches:
        tokens, mask = prompts(model, b)
        rows = [Row(i, -1, [t for t, m in zip(ts, ms, strict=True) if m] + [100] * 32, 0, 0)
                for i, (ts, ms) in enumerate(zip(tokens.tolist(), mask.tolist(), strict=True))]  # fmt: skip
        for r in rows:
            r.pending = r.prompt_length = len(r.tokens)
        engines[b] = Engine(model, rows, model.pad_token_id or 0)
        with torch.no_grad():
            engines[b].feed(0)
    times = {}
    for _ in range(5):  # interleaved: every (batch, width) once per pass
        for b, engine in engines.items():
            for w in widths:
                for r in engine.rows:
                    r.tokens.extend([100] * w)
                    r.pending, r.kind = w, "verify"
                start = time.perf_counter()
                with torch.no_grad():
                    engine.feed(1, all_logits=True)
                times.setdefault((b, w), []).append(time.perf_counter() - start)
                engine.rewind([w] * b, [False] * b)
    for b in batches:
        ms = [1000 * min(times[(b, w)]) for w in widths]
        slope = (ms[-1] - ms[0]) / (b * (widths[-1] - widths[0]))
        print(f"| {b} | " + " | ".join(f"{t:.0f}" for t in ms) + f" | {slope:.2f} ms |")


def trace(model: TransformerBridge, batch: int, n: int, k: int) -> None:
    """One prompt-lookup run, round by round (see the module docstring)."""
    tokens, mask = prompts(model, batch)
    kw = dict(attention_mask=mask.to(model.device), max_new_tokens=n, min_new_tokens=n)
    tokens = tokens.to(model.device)
    model.generate(tokens, **kw, prompt_lookup_num_tokens=k)  # warm-up
    seen = []

    def embed(x, hook):
        real = ~hook.ctx.pad_mask
        starts = {row: int(p[r][0]) for row, p, r in zip(hook.ctx.rows, hook.ctx.positions, real, strict=True)
                  if row >= 0 and r.any()}  # fmt: skip
        counts = {row: int(r.sum()) for row, r in zip(hook.ctx.rows, real, strict=True) if row >= 0 and r.any()}
        seen.append([time.perf_counter(), None, starts, counts])

    def final(x, hook):
        seen[-1][1] = time.perf_counter()

    with model.hooks(fwd_hooks=[("hook_embed", embed), ("ln_final.hook_normalized", final)]):
        start = time.perf_counter()
        model.generate(tokens, **kw, prompt_lookup_num_tokens=k)
        total = time.perf_counter() - start
    print(f"\nbatch {batch}: {len(seen)} forwards, {total:.2f} s; per round: chunk per row (1 + drafts fed) -> "
          "tokens gained, ms embedding to final norm, ms to the next forward")  # fmt: skip
    for (t0, t1, starts, counts), nxt in itertools.pairwise([*seen, [start + total, None, {}, {}]]):
        gained = [nxt[2][r] - s if r in nxt[2] else "end" for r, s in starts.items()]
        chunks = [counts[r] for r in starts]
        print(f"  {chunks} -> {gained}: {1000 * (t1 - t0):.0f} ms model, {1000 * (nxt[0] - t0):.0f} ms round")


def bench(model: TransformerBridge, batch: int, n: int, k: int, rounds: int) -> None:
    tokens, mask = prompts(model, batch)
    common = dict(attention_mask=mask.to(model.device), max_new_tokens=n, min_new_tokens=n)
    tokens = tokens.to(model.device)
    variants = {
        "eager": lambda: model.generate(tokens, **common),
        "lookup": lambda: model.generate(tokens, **common, prompt_lookup_num_tokens=k),
    }
    counts = {}
    for name, fn in variants.items():  # warm-up, tokens, forwards and verify widths
        seen = []

        def look(x, hook, seen=seen):
            ctx = hook.ctx
            seen.append((ctx.rows, ctx.positions.clone(), ctx.pad_mask.clone()))

        with model.hooks(fwd_hooks=[("hook_embed", look)]):
            counts[name] = (fn(), seen)
    assert torch.equal(counts["eager"][0], counts["lookup"][0]), "prompt lookup changed the tokens"
    per_row = []  # tokens a verify forward gave each row: how far its next chunk starts past this one
    chunks = counts["lookup"][1]
    for a, b in itertools.pairwise(chunks[1:]):
        starts = {}
        for (rows, positions, pad_mask), side in ((a, 0), (b, 1)):
            for row, pos, pad in zip(rows, positions, pad_mask, strict=True):
                if row >= 0 and (~pad).any():
                    starts.setdefault(row, [None, None])[side] = int(pos[~pad][0])
        per_row += [s1 - s0 for s0, s1 in starts.values() if s0 is not None and s1 is not None]
    med = interleaved_medians(variants, rounds)
    rate = {name: batch * n / m for name, m in med.items()}
    print(f"| {batch} | {rate['eager']:.1f} | {rate['lookup']:.1f} | {med['eager'] / med['lookup']:.2f}x | "
          f"{len(counts['eager'][1])} / {len(counts['lookup'][1])} | "
          f"{statistics.mean(per_row) if per_row else 0:.2f} (min {min(per_row, default=0)}, "
          f"max {max(per_row, default=0)}) |")  # fmt: skip


if __name__ == "__main__":
    main()
