"""Run under `torchrun --nproc-per-node 2`: load each tiny model tensor-parallel, run the checks,
save this rank's results to ``<out_dir>/<family>.rank<r>.pt``. Started by `test_tensor_parallel.py`."""

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_checks import TOKENS, run_checks, run_local_checks

from transformer_bridge import TransformerBridge, UnsupportedArchitectureError
from transformer_bridge.versions import TP_PLAN_KEYWORD, tensor_parallel

warnings.filterwarnings("ignore", category=FutureWarning)  # `tp_plan=` is HF's deprecated spelling


def main(root: str, out_dir: str, families: list[str]) -> None:
    torch.manual_seed(0)
    for i, family in enumerate(families):
        # Both spellings where the release takes both: HF's older `tp_plan="auto"` and its `DistributedConfig`.
        how = {"tp_plan": "auto"} if i == 0 and TP_PLAN_KEYWORD else tensor_parallel(int(os.environ["WORLD_SIZE"]))
        model = TransformerBridge.from_pretrained(os.path.join(root, family), dtype=torch.float32, **how)
        results = {**run_checks(model), **run_local_checks(model)}
        with torch.no_grad():  # no hooks: the bridge runs HF's own tensor-parallel code
            results["bitwise_hf"] = torch.tensor(torch.equal(model(TOKENS), model.hf_model(TOKENS).logits))
        rank = dist.get_rank()
        torch.save({k: v.detach().cpu() for k, v in results.items()}, os.path.join(out_dir, f"{family}.rank{rank}.pt"))
        dist.barrier()
    # A plan that splits the residual stream by position (sequence parallelism) is refused, not shown in shards.
    refused = torch.tensor(0)
    try:
        plan = {"model.norm": "sequence_parallel"}
        how = {"tp_plan": plan} if TP_PLAN_KEYWORD else tensor_parallel(int(os.environ["WORLD_SIZE"]), plan)
        TransformerBridge.from_pretrained(os.path.join(root, families[0]), dtype=torch.float32, **how)
    except NotImplementedError as e:
        refused = torch.tensor(int("sequence_parallel" in str(e)))
    # A width the ranks do not divide: refused where HF's forward cannot run it (before 5.21), wrapped from there on.
    refused_uneven = torch.tensor(0)
    try:
        how = tensor_parallel(int(os.environ["WORLD_SIZE"]))
        TransformerBridge.from_pretrained(os.path.join(root, "uneven"), dtype=torch.float32, **how)
    except UnsupportedArchitectureError as e:
        refused_uneven = torch.tensor(int("widths the ranks do not divide" in str(e) and "mlp.gate_proj" in str(e)))
    torch.save({"refused_sequence_parallel": refused, "refused_uneven": refused_uneven},
               os.path.join(out_dir, f"plan.rank{dist.get_rank()}.pt"))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
