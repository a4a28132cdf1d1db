"""Grammar-constrained generation: the bridge's controller (with and without fast-forward) against unconstrained
`generate` and against HF `generate` with an llguidance logits processor (the route users take today).

SmolLM2-135M-Instruct fp32 on CPU, greedy, batch 1, JSON-schema extraction from ``--prompts`` short texts
(at least 20). One process and one model for every variant; variants run interleaved, prompt by prompt,
in alternating order, so drifting machine load hits them alike. Reported per variant: output tokens
(the JSON, without EOS), forwards per output token (counted by a torch hook on the embedding, HF's
route included), tokens/s, and for the bridge's grammar the controller's time: ``blocking`` is what the
loop waits for (the mask of a step is computed in a worker while the forward runs), ``decide`` the
mask / forced-token computation itself; both per output token and as a share of an unconstrained
decode step. Every output is parsed and validated against the schema.

    python benchmarks/control.py [--prompts 20] [--rounds 1] [--threads N] [--flush-denormal] [--compile]

``--compile`` adds the grammar (with fast-forward) and unconstrained generation with ``compile=True``
(static KV cache, compiled one-token step; the grammar's forced chunks run eagerly over the same cache),
and ``cache_implementation="static"`` for the grammar; each compiled variant is warmed up on the first
prompt before the timings (compile seconds printed).

Unconstrained runs generate as many tokens as the constrained output of the same prompt
(``min_new_tokens``), so past where SmolLM2 would stop; on CPU its activations can then hold denormal
floats, which x86 computes slowly (see benchmarks/generate.py): ``--flush-denormal`` removes that effect.
"""

import argparse
import json
import statistics
import sys
import time

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import LogitsProcessor

from transformer_bridge import TransformerBridge, grammar
from transformer_bridge.real_model import smollm2_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = [
    ("Alice", 31, "Paris"), ("Bob", 45, "Berlin"), ("Chen", 27, "Shanghai"), ("Dana", 52, "Toronto"),
    ("Emeka", 38, "Lagos"), ("Fatima", 24, "Cairo"), ("Goran", 61, "Zagreb"), ("Hana", 19, "Kyoto"),
    ("Ivan", 33, "Moscow"), ("Julia", 29, "Madrid"), ("Kofi", 47, "Accra"), ("Lena", 36, "Vienna"),
    ("Marco", 58, "Rome"), ("Nadia", 22, "Tunis"), ("Omar", 40, "Dubai"), ("Priya", 35, "Mumbai"),
    ("Quinn", 26, "Dublin"), ("Rosa", 64, "Lima"), ("Sven", 49, "Oslo"), ("Tara", 30, "Sydney"),
    ("Umar", 43, "Karachi"), ("Vera", 55, "Prague"), ("Wei", 21, "Taipei"), ("Yara", 37, "Beirut"),
]  # fmt: skip
MAX_NEW = 48


def prompt(person: tuple[str, int, str]) -> str:
    name, age, city = person
    text = f"{name} is {age} years old and lives in {city}."
    return f"Extract the person as JSON with keys name, age, city.\nText: {text}\nJSON: "


def valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        set(obj) == {"name", "age", "city"}
        and isinstance(obj["name"], str)
        and isinstance(obj["city"], str)
        and isinstance(obj["age"], int)
        and 0 <= obj["age"] <= 130
    )


class LLGuidanceProcessor(LogitsProcessor):
    """The usual HF route: one matcher, consume the last token, mask the scores (EOS once complete).
    It gets the same grammar text as the bridge's `json_schema` (compact JSON, no free whitespace)."""

    def __init__(self, ll_tokenizer, grammar_text: str, prompt_length: int) -> None:
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar_text)
        self.prompt_length, self.seconds = prompt_length, 0.0

    def __call__(self, input_ids, scores):
        start = time.perf_counter()
        if input_ids.shape[1] > self.prompt_length:
            self.matcher.consume_token(int(input_ids[0, -1]))
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
        n = min(len(bits), scores.shape[-1])
        allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        self.seconds += time.perf_counter() - start
        return scores.masked_fill(~allowed, -torch.inf)


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--flush-denormal", action="store_true", help="flush denormal floats to zero (all variants)")
    parser.add_argument("--compile", action="store_true", help="add compiled (static-cache) variants")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)
    model.cfg.default_prepend_bos = False
    tok = model.tokenizer
    prompts = [prompt(p) for p in (PEOPLE * 2)[: args.prompts]]
    # A tensor, not a Python int: a compiled step traces the hook, and an int it reads would be a guard
    # (one recompile per forward).
    forwards = torch.zeros((), dtype=torch.long)
    embed = model.hf_model.get_input_embeddings()

    def count(*args) -> None:
        forwards.add_(1)

    counter = embed.register_forward_hook(count)
    grammar.json_schema(SCHEMA).bind(model)  # build llguidance's tokenizer once, outside the timings
    ll_tokenizer = llguidance.hf.from_tokenizer(tok)  # the same grammar text and tokenizer for the HF route

    def json_tokens(ids: list[int]) -> list[int]:
        return [t for t in ids if t != tok.eos_token_id]

    def bridge(fast_forward: bool, **options):
        def run(text: str):
            g = grammar.json_schema(SCHEMA, fast_forward=fast_forward)
            out = model.generate(text, max_new_tokens=MAX_NEW, controller=g, return_dict=True, **options)
            return json_tokens(out.new_tokens[0][out.attention_mask[0, out.prompt_width :].bool()].tolist()), g.stats

        return run

    lengths: dict[str, int] = {}

    def unconstrained(text: str):
        n = lengths.get(text, MAX_NEW)
        out = model.generate(text, max_new_tokens=n, min_new_tokens=n, return_dict=True)
        return out.new_tokens[0].tolist(), None

    def unconstrained_compiled(text: str):
        # The static cache's bucket follows max_new_tokens: MAX_NEW for every prompt (one compiled graph),
        # stopped after n tokens by a criterion (the same tokens as max_new_tokens=n).
        n, width = lengths.get(text, MAX_NEW), len(tok(text).input_ids)
        stop = [lambda ids, scores: torch.full((ids.shape[0],), ids.shape[1] >= width + n)]
        out = model.generate(text, max_new_tokens=MAX_NEW, min_new_tokens=n, stopping_criteria=stop,
                             return_dict=True, compile=True)  # fmt: skip
        return out.new_tokens[0][out.attention_mask[0, out.prompt_width :].bool()].tolist(), None

    def hf_route(text: str):
        ids = tok(text, return_tensors="pt").input_ids
        proc = LLGuidanceProcessor(ll_tokenizer, grammar.json_schema(SCHEMA).grammar, ids.shape[1])
        out = model.hf_model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, logits_processor=[proc],
                                      pad_token_id=tok.eos_token_id)  # fmt: skip
        return json_tokens(out[0, ids.shape[1] :].tolist()), {"blocking_s": proc.seconds, "decide_s": proc.seconds}

    variants = {"grammar (ff)": bridge(True), "grammar (no ff)": bridge(False), "HF + llguidance processor": hf_route,
                "unconstrained": unconstrained}  # fmt: skip
    if args.compile:
        variants["grammar (ff, static cache)"] = bridge(True, cache_implementation="static")
        variants["grammar (ff, compiled)"] = bridge(True, compile=True)
        variants["unconstrained (compiled)"] = unconstrained_compiled
    # Lengths for the unconstrained runs: as many tokens as the constrained output of the same prompt.
    for text in prompts:
        lengths[text] = max(len(bridge(True)(text)[0]), 1)
    if args.compile:  # compile outside the timings
        for name in ("grammar (ff, compiled)", "unconstrained (compiled)"):
            start = time.perf_counter()
            variants[name](prompts[0])
            print(f"{name}: first call (compiles) {time.perf_counter() - start:.1f} s")
    totals = {name: {"s": [], "tokens": 0, "forwards": 0, "valid": 0, "blocking": 0.0, "decide": 0.0}
              for name in variants}  # fmt: skip
    for r in range(args.rounds):
        for i, text in enumerate(prompts):
            order = list(variants) if (i + r) % 2 == 0 else list(reversed(variants))
            for name in order:
                forwards.zero_()
                start = time.perf_counter()
                ids, stats = variants[name](text)
                elapsed = time.perf_counter() - start
                t = totals[name]
                t["s"].append(elapsed)
                if r == 0:
                    t["tokens"] += len(ids)
                    t["forwards"] += int(forwards)
                    t["valid"] += valid(tok.decode(ids)) if not name.startswith("unconstrained") else 0
                    if stats:
                        t["blocking"] += stats["blocking_s"]
                        t["decide"] += stats["decide_s"]
    counter.remove()
    n = len(prompts)
    base = totals["unconstrained"]
    step_s = sum(base["s"]) / args.rounds / base["tokens"]  # seconds per unconstrained output token
    print(f"SmolLM2-135M-Instruct fp32, CPU, {torch.get_num_threads()} threads, greedy, batch 1, {n} JSON-schema "
          f"extraction prompts, {args.rounds} round(s), flush_denormal={args.flush_denormal}, torch "
          f"{torch.__version__}, llguidance {llguidance.__version__}")  # fmt: skip
    print(f"unconstrained decode: {step_s * 1e3:.1f} ms per token\n")
    header = ("variant", "valid", "tokens", "fwd/token", "tokens/s", "x unconstr.", "blocking us/tok", "% step",
              "decide us/tok")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, t in totals.items():
        free = name.startswith("unconstrained")
        seconds = sum(t["s"]) / args.rounds
        rate = t["tokens"] / seconds
        base_rate = base["tokens"] / (sum(base["s"]) / args.rounds)
        blocking = t["blocking"] / t["tokens"] * 1e6 if t["tokens"] else 0.0
        row = (name, f"{t['valid']}/{n}" if not free else "-", str(t["tokens"]),
               f"{t['forwards'] / t['tokens']:.2f}", f"{rate:.1f}", f"{rate / base_rate:.2f}",
               f"{blocking:.0f}" if not free else "-",
               f"{blocking / 1e6 / step_s * 100:.1f}" if not free else "-",
               f"{t['decide'] / t['tokens'] * 1e6:.0f}" if not free else "-")  # fmt: skip
        print("| " + " | ".join(row) + " |")
    medians = ", ".join(f"{k} {statistics.median(v['s']):.2f}" for k, v in totals.items())
    print(f"\nmedian seconds per prompt: {medians}")


if __name__ == "__main__":
    main()
