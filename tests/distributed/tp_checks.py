"""The checks both sides of the tensor-parallel test run: 2 ranks under torchrun (`tp_worker.py`) and one
process (`test_tensor_parallel.py`). Each returns a flat ``name -> tensor`` dict; the test compares them.

Every edit mixes the axis a tensor-parallel plan splits (heads, neurons), so a hook that saw only its
rank's shard, or an edit written back to the wrong shard, changes the result.
"""

import torch
from torch import Tensor

from transformer_bridge import Branch
from transformer_bridge.versions import TP_UNEVEN_SHARDS

# (family, config keywords). Distinct sizes; d_mlp 37 does not divide by 2 ranks (shards of 19 and 18) where HF's
# tensor parallelism runs uneven shards (`TP_UNEVEN_SHARDS`, 5.21 on; before, the bridge refuses them, which the
# test checks on `UNEVEN`, and the families here have 38). The vocabulary is even: HF gathers the LM head's shards
# only when they are of equal size before 5.21.
D_MLP = 37 if TP_UNEVEN_SHARDS else 38
FAMILIES = {
    "llama": dict(
        model_type="llama", vocab_size=98, hidden_size=32, intermediate_size=D_MLP, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ),
    "qwen3": dict(
        model_type="qwen3", vocab_size=98, hidden_size=32, intermediate_size=D_MLP, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    ),
    "gemma2": dict(
        model_type="gemma2", vocab_size=98, hidden_size=32, intermediate_size=D_MLP, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
    ),
    "gpt_neox": dict(
        model_type="gpt_neox", vocab_size=98, hidden_size=32, intermediate_size=D_MLP, num_hidden_layers=2,
        num_attention_heads=4, rotary_pct=0.5,
    ),
}  # fmt: skip
# Llama with 37 MLP neurons: shards of 19 and 18 on 2 ranks, wrapped where HF runs them, refused before.
UNEVEN = {**FAMILIES["llama"], "intermediate_size": 37}

RELEVANCE_METHODS = ("attnlrp", "cp_lrp", "grad_x_input", "integrated_gradients", "grad_norm", "attention", "dla",
                     "logit_lens")  # fmt: skip

TOKENS = torch.tensor([[5, 17, 3, 44, 8, 91, 2], [12, 7, 66, 9, 31, 4, 50]])
# Second row left-padded by two (generate and caches with padding).
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])


def save_tiny(family: str, path: str) -> None:
    """A seeded random tiny model of ``family`` (or ``"uneven"``: `UNEVEN`) saved as a HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(UNEVEN if family == "uneven" else FAMILIES[family])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def mix(x: Tensor) -> Tensor:
    """An edit that mixes every axis but the batch: ``x + 0.25 * x`` flipped along them (token ids at
    ``hook_tokens``: the ids flipped along the positions)."""
    if not x.is_floating_point():
        return x.flip(-1)
    return x + 0.25 * x.flip(list(range(1, x.dim())))


def mix_(x: Tensor, hook) -> None:
    if not x.is_floating_point():
        x.copy_(x.flip(-1))
        return
    x.add_(0.25 * x.flip(list(range(1, x.dim()))))


def edited_names(model) -> list[str]:
    """One point of each kind, in layer 1 (and the model-level ones)."""
    return [n for n in model.hook_dict if n.startswith(("blocks.1.", "hook_", "ln_final."))]


def run_checks(model) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    pair = (TOKENS, MASK)
    with torch.no_grad():
        out["logits"] = model(TOKENS)
        out["logits_padded"] = model(pair)

    # Every point read, padded batch: named one by one, so the head results (computed on demand) are in it too.
    _, cache = model.run_with_cache(pair, names_filter=list(model.hook_dict))
    for name in model.hook_dict:
        if name in cache:
            out[f"cache/{name}"] = cache[name]

    # Every kind of point edited, by a returned tensor and (for half of them) in place.
    for i, name in enumerate(edited_names(model)):
        with torch.no_grad():
            out[f"edit/{name}"] = model.run_with_hooks(TOKENS, fwd_hooks=[(name, lambda x, hook: mix(x))])
            if i % 2:
                out[f"edit_/{name}"] = model.run_with_hooks(TOKENS, fwd_hooks=[(name, mix_)])

    # Gradients at sharded and whole points (backward through the tensor-parallel model).
    grad_names = ["blocks.0.attn.hook_z", "blocks.0.attn.hook_pattern", "blocks.1.mlp.hook_post",
                  "blocks.1.attn.hook_q", "blocks.0.hook_resid_post", "hook_embed"]  # fmt: skip
    _, gcache = model.run_with_cache(pair, names_filter=grad_names, incl_bwd=True, return_type="loss")
    for name in grad_names:
        out[f"grad/{name}"] = gcache[name + "_grad"]

    # Greedy generation: plain, steered at a sharded point, and with the recomputed cache.
    out["generate"] = model.generate(pair, max_new_tokens=6, temperature=0)
    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: mix(z))]):
        out["generate_steered"] = model.generate(pair, max_new_tokens=6, temperature=0)
    tokens, gen_cache = model.generate(
        pair, max_new_tokens=4, temperature=0, return_cache=True,
        names_filter=["blocks.1.attn.hook_pattern", "blocks.1.mlp.hook_pre"],
    )  # fmt: skip
    out["gen_cache/tokens"] = tokens
    for name in ("blocks.1.attn.hook_pattern", "blocks.1.mlp.hook_pre"):
        out[f"gen_cache/{name}"] = gen_cache[name]

    # A controller (fork, forced tokens, backtrack with fast-forward, a masked sample) steered at a sharded point.
    script = {(0, 2): [Branch.sample(), Branch.forced([10, 11, 12])], (1, 1): Branch(backtrack=1, ff_tokens=[[20]]),
              (0, 4): Branch.sample(torch.arange(98) > 40)}  # fmt: skip

    def controller(view):
        return None if view.backtracked else script.get((view.row, len(view.generated)))

    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: mix(z))]):
        controlled = model.generate(pair, max_new_tokens=6, temperature=0, controller=controller, return_dict=True)
    # Padding is written with the model's pad id, which depends on the tokenizer a loader found: compare real tokens.
    out["generate_controlled"] = controlled.sequences.masked_fill(controlled.attention_mask == 0, -1)
    out["generate_controlled_parents"] = torch.tensor(controlled.parents)

    # Every relevance method: gradients (LRP rules included) back through every rank or device, and
    # the cache methods over a generation cache.
    run = model.forward_pass(TOKENS[:1], max_new_tokens=3, temperature=0)
    for method in RELEVANCE_METHODS:
        out[f"relevance/{method}"] = run.relevance_pass(method=method).scores
    corrupted = run.sequences.clone()
    corrupted[:, 1] = 50
    patched = run.relevance_pass(method="attribution_patching", corrupted_tokens=corrupted)
    out["relevance/attribution_patching"] = patched.scores

    # Weight properties are whole.
    for name in ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "W_E", "W_U", "b_U"):
        out[f"weight/{name}"] = getattr(model, name).detach()
    return out


def run_local_checks(model) -> dict[str, Tensor]:
    """Under `local_shards` a hook sees this rank's shard; returns it with the slice it claims to hold."""
    from transformer_bridge.distributed import local_shards

    seen: dict[str, Tensor] = {}

    def keep(x: Tensor, hook) -> None:
        seen[hook.name] = x.detach().clone()
        r = hook.shard.local_range() if hook.shard is not None else range(0)
        seen[hook.name + "#range"] = torch.tensor([r.start, r.stop, hook.shard.dim if hook.shard else -1])

    names = ["blocks.0.attn.hook_z", "blocks.0.attn.hook_pattern", "blocks.0.mlp.hook_post", "blocks.0.hook_resid_post"]
    with local_shards(model), torch.no_grad():
        model.run_with_hooks((TOKENS, MASK), fwd_hooks=[(n, keep) for n in names])
    out = {f"local/{k}": v for k, v in seen.items()}

    def zero_index_1(x: Tensor, hook) -> None:
        """Zero head / neuron 1 of the full axis, on whichever rank holds it (all of it in one process)."""
        held = hook.shard.local_range() if hook.shard is not None and x.shape[2] < hook.shard.size else None
        held = held if held is not None else range(x.shape[2])
        if 1 in held:
            x[:, :, 1 - held.start] = 0

    # Shard-local edits (hook_result's edited heads are re-summed across ranks).
    for name in ("blocks.0.attn.hook_z", "blocks.0.attn.hook_result", "blocks.1.mlp.hook_post", "blocks.1.attn.hook_v"):
        with local_shards(model), torch.no_grad():
            out[f"local_edit/{name}"] = model.run_with_hooks((TOKENS, MASK), fwd_hooks=[(name, zero_index_1)])
    return out
