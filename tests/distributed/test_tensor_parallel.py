"""HF tensor parallelism (``tp_plan="auto"``) on 2 CPU processes over gloo, against one process.

One `torchrun` launch (`tp_worker.py`) runs every check of `tp_checks.py` on four tiny families (Llama:
GQA, 37 MLP neurons split 19/18, or 38 before transformers 5.21, which refuses uneven shards; Qwen 3: per-head
q/k norms; Gemma 2: soft-capped attention (eager; on sdpa, which drops the cap, where HF loads it so), sandwich
norms, tied embeddings; GPT-NeoX: fused per-head QKV, parallel attention and MLP) and saves
each rank's results; the same checks run here in one process on the same
saved weights. Both ranks must hold the single-process values: logits, the whole cache, every kind of
point edited, gradients at sharded points, greedy generation (plain, steered, with its cache), one
relevance method, and whole weights.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_checks import FAMILIES, run_checks, run_local_checks, save_tiny
from transformers import AutoModelForCausalLM

from transformer_bridge import TransformerBridge
from transformer_bridge.distributed.tensor_parallel import check_tp_plan
from transformer_bridge.versions import TP_UNEVEN_SHARDS

pytest.importorskip("accelerate")  # HF's tensor-parallel loading needs it
if not torch.distributed.is_available():
    pytest.skip("torch was built without torch.distributed", allow_module_level=True)

HERE = Path(__file__).resolve().parent
RANKS = 2
TOL = 1e-5  # measured: ≤ 2.1e-6 (the all-reduce sums the halves of each row-wise matmul in another order)


PLAIN_SHARDS = "with its shards as plain tensors"  # `check_tensor_parallel`'s refusal (transformers 5.15)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, list[dict]]]:
    """``family -> (one-process results, [rank 0 results, rank 1 results])``, and ``"plan"`` for the refused plan."""
    root = tmp_path_factory.mktemp("tp")
    for family in [*FAMILIES, "uneven"]:
        save_tiny(family, str(root / family))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
               str(HERE / "tp_worker.py"), str(root), str(root), ",".join(FAMILIES)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and PLAIN_SHARDS in done.stderr:  # the bridge refuses this release's tensor parallelism
        pytest.skip(next(line for line in done.stderr.splitlines() if PLAIN_SHARDS in line)[-400:])
    if done.returncode != 0:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    results = {}
    for family in FAMILIES:
        single = TransformerBridge(AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.float32).eval())
        ranks = [torch.load(root / f"{family}.rank{r}.pt") for r in range(RANKS)]
        results[family] = ({**run_checks(single), **run_local_checks(single)}, ranks)
    results["plan"] = ({}, [torch.load(root / f"plan.rank{r}.pt") for r in range(RANKS)])
    return results


def _compare(expected: dict, got: dict, prefix: str) -> list[str]:
    keys = [k for k in expected if k.startswith(prefix)]
    assert keys, f"no results under {prefix!r}"
    problems = []
    for key in keys:
        a, b = expected[key], got.get(key)
        if b is None:
            problems.append(f"{key}: missing")
        elif a.shape != b.shape:
            problems.append(f"{key}: shape {tuple(b.shape)}, one process {tuple(a.shape)}")
        elif not a.is_floating_point():
            if not torch.equal(a, b):
                problems.append(f"{key}: {b.tolist()} != {a.tolist()}")
        elif not torch.allclose(a, b, atol=TOL, rtol=0):
            problems.append(f"{key}: max |diff| {(a - b).abs().max().item():.3g}")
    return problems


CATEGORIES = ["logits", "cache/", "edit/", "edit_/", "grad/", "generate", "gen_cache/", "relevance/", "weight/",
              "local_edit/"]  # fmt: skip


@pytest.mark.parametrize("category", CATEGORIES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ranks_equal_one_process(runs, family: str, category: str) -> None:
    expected, ranks = runs[family]
    for rank, got in enumerate(ranks):
        problems = _compare(expected, got, category)
        assert not problems, f"rank {rank}: " + "; ".join(problems)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cache_covers_every_point(runs, family: str) -> None:
    expected, _ = runs[family]
    model_points = [k for k in expected if k.startswith("cache/")]
    sharded = ("attn.hook_z", "attn.hook_pattern", "attn.hook_q", "mlp.hook_post", "attn.hook_result")
    assert all(any(k.endswith(s) for k in model_points) for s in sharded)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_local_shards_opt_in(runs, family: str) -> None:
    """Under `local_shards` each rank's hook sees exactly its slice of the full activation."""
    expected, ranks = runs[family]
    covered = set()
    for got in ranks:
        for name in ("blocks.0.attn.hook_z", "blocks.0.attn.hook_pattern", "blocks.0.mlp.hook_post"):
            start, stop, dim = got[f"local/{name}#range"].tolist()
            full = expected[f"cache/{name}"]
            assert dim >= 0 and stop - start < full.shape[dim], f"{name}: not a shard"
            assert torch.allclose(got[f"local/{name}"], full.narrow(dim, start, stop - start), atol=TOL, rtol=0)
            covered.add((name, start))
        whole = got["local/blocks.0.hook_resid_post"]  # residual points are whole on every rank
        assert torch.allclose(whole, expected["cache/blocks.0.hook_resid_post"], atol=TOL, rtol=0)
    assert len(covered) == 3 * RANKS


def test_unsupported_plan_is_refused_on_every_rank(runs) -> None:
    """Loading with a sequence-parallel rule (the residual stream split by position) raises on both ranks."""
    _, ranks = runs["plan"]
    assert [got["refused_sequence_parallel"].item() for got in ranks] == [1] * RANKS


def test_uneven_shards_are_refused_where_hf_cannot_run_them(runs) -> None:
    """37 MLP neurons on 2 ranks: HF's tensor-parallel forward fails on them before transformers 5.21, so the
    bridge refuses the model there, naming the width (from 5.21 on `FAMILIES` run them, 19 and 18)."""
    _, ranks = runs["plan"]
    assert [got["refused_uneven"].item() for got in ranks] == [int(not TP_UNEVEN_SHARDS)] * RANKS


@pytest.mark.parametrize(
    ("plan", "ok"),
    [
        ({"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_rep"},
         True),
        ({"layers.*.self_attn.qkv_proj": "colwise_gather_output", "layers.*.self_attn.o_proj": "rowwise_split_input"},
         True),
        ({"norm": "sequence_parallel"}, False),
        ({"layers.*.mlp.experts": "moe_tp_experts"}, False),
    ],
)  # fmt: skip
def test_check_tp_plan(plan: dict, ok: bool) -> None:
    if ok:
        check_tp_plan(plan)
    else:
        with pytest.raises(NotImplementedError, match=next(iter(plan.values()))):
            check_tp_plan(plan)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_hooks_is_hf_tensor_parallel_bitwise(runs, family: str) -> None:
    _, ranks = runs[family]
    assert [bool(got["bitwise_hf"]) for got in ranks] == [True] * RANKS


def test_a_model_sharded_as_plain_tensors_is_refused() -> None:
    """transformers 5.15 shards a tensor-parallel model's weights as plain tensors (no DTensor says which axis is
    split): the bridge would read a shard's shape as the whole weight's, so it refuses the model, naming why."""
    from conftest import char_tokenizer, make_hf

    from transformer_bridge import TransformerBridge
    from transformer_bridge.adapters import UnsupportedArchitectureError

    hf = make_hf("llama")
    hf._tp_size = 2  # what HF sets for `tp_size`; the weights stay plain tensors, as 5.15 leaves each rank's shard
    with pytest.raises(UnsupportedArchitectureError, match=r"tensor-parallel \(tp_size=2\) with its shards as plain"):
        TransformerBridge(hf, char_tokenizer())
    hf._tp_size = None
    assert TransformerBridge(hf, char_tokenizer()).cfg.d_vocab == hf.config.vocab_size
