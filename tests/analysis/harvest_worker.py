"""A harvest in a process of its own, for the tests that kill it, starve it of disk or measure its memory.

    python harvest_worker.py '<json options>'

Options: ``out`` (folder), ``docs`` (number of generated documents), ``family`` (tiny model, seeded),
``names``, ``shard_size``, ``context_length``, ``batch_size``, ``fsize_limit`` (bytes: RLIMIT_FSIZE, so a
write past it fails like a full disk), ``slow`` (seconds of sleep per forward, so a kill lands mid-run),
``read_back`` (stream the store once in shuffled batches), ``torchrun`` (join the gloo group torchrun set up),
``tp_model`` / ``saved_model`` (a saved HF folder, loaded tensor-parallel or whole, instead of ``family``).
Prints one JSON line: ``{"rows": ..., "maxrss_mb": ..., "error": ...}``.
"""

import json
import resource
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from conftest import make_bridge  # noqa: E402

from transformer_bridge import TransformerBridge, harvest  # noqa: E402
from transformer_bridge.activations import HarvestWriteError  # noqa: E402
from transformer_bridge.versions import tensor_parallel  # noqa: E402


def documents(n: int, seed: int = 0):
    """``n`` token documents of 5 to 60 ids (a generator: nothing of the dataset's size is held)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        length = int(torch.randint(5, 61, (1,), generator=gen))
        yield torch.randint(3, 99, (length,), generator=gen)


def run(opts: dict, model=None):
    """The harvest the options describe (in this process); returns the store."""
    model = make_bridge(opts.get("family", "llama")) if model is None else model
    return harvest(
        model, documents(opts["docs"]), opts.get("names", ["blocks.0.hook_resid_post"]), opts["out"],
        context_length=opts.get("context_length", 32), batch_size=opts.get("batch_size", 4),
        shard_size=opts.get("shard_size", 16384), progress=False,
    )  # fmt: skip


def main() -> None:
    opts = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    if opts.get("torchrun"):
        torch.distributed.init_process_group("gloo")
    warnings.filterwarnings("ignore")  # `tp_plan=` is HF's deprecated spelling; a saved model has no tokenizer
    if opts.get("fsize_limit"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (opts["fsize_limit"], opts["fsize_limit"]))
    if opts.get("tp_model"):  # tensor parallel over the ranks torchrun started
        world = torch.distributed.get_world_size()
        model = TransformerBridge.from_pretrained(opts["tp_model"], dtype=torch.float32, **tensor_parallel(world))
    elif opts.get("saved_model"):
        model = TransformerBridge.from_pretrained(opts["saved_model"], dtype=torch.float32)
    else:
        model = make_bridge(opts.get("family", "llama"))
    if opts.get("slow"):
        model.add_hook("hook_embed", lambda x, hook: time.sleep(opts["slow"]), read_only=True)
    out: dict = {}
    try:
        store = run(opts, model)
        out["rows"] = len(store)
        if opts.get("read_back"):
            seen = 0
            for batch in store.batches(store.names[0], batch_size=256, seed=1, chunk_rows=1024):
                seen += batch.shape[0]
            out["read_back"] = seen
    except HarvestWriteError as e:
        out["error"] = str(e)
    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if opts.get("torchrun"):
        torch.distributed.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
