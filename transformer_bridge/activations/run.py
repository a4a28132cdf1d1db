"""`harvest`: activations of chosen hook points over a dataset, written to disk at forward speed.

The loop, top to bottom: windows of the data (`windows.py`) are batched and right-padded (the mask marks
the padding, so the model reads each window as it would alone); one forward per batch, stopped after the
last requested layer, with read-only hooks that copy each point's real, non-excluded positions into a
preallocated shard buffer (one gather per point and batch); when a buffer holds a shard's rows it goes to a
writer thread (atomic safetensors file, then the manifest) while the next buffer fills, so disk writes
overlap the forwards. Memory is two shard buffers and one batch, whatever the dataset's size.

Resume: the manifest, rewritten after each shard, holds the cursor (document, position, windows done) of
the first window not yet stored; shards end on batch boundaries, so a rerun skips exactly what is stored and
forms the same batches (the store equals an uninterrupted run's, bit for bit). Temporary files and shards
the manifest does not list (a crash between the shard's rename and the manifest's) are removed first.
"""

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..core import BridgeCore
from .plan import FORMAT, VERSION, Plan, check_resume, resolve
from .shards import read_json, write_json, write_shard
from .store import META, ActivationStore, merge_manifests
from .windows import Cursor, Window, raw_documents, windows

try:  # optional: the progress bar (tqdm comes with huggingface_hub)
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

logger = logging.getLogger(__name__)
RANK_WAIT_SECONDS = 24 * 3600


class HarvestWriteError(OSError):
    """Writing a shard or the manifest failed (disk full, permissions); the shards finished before are valid."""


def harvest(
    model: BridgeCore,
    data: Any,
    names: Any,
    out_dir: str | Path,
    *,
    context_length: int = 128,
    batch_size: int = 8,
    dtype: torch.dtype | str | None = None,
    stop_at_layer: int | None = None,
    exclude_bos: bool = True,
    exclude_tokens: Any = (),
    prepend_bos: bool | None = None,
    text_column: str = "text",
    attention_mask: Int[Tensor, "doc pos"] | None = None,
    shard_size: int | str = "256MB",
    max_tokens: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> ActivationStore:
    """Run the model over ``data`` and store the activations of ``names`` at every real token, in ``out_dir``.

    ``data``: a text, texts, token ids (``[doc, pos]``, with ``attention_mask`` or as a ``(tokens, mask)`` pair; or
    an iterable of 1-D id lists), or a ``datasets.Dataset`` (``text_column``, else ``input_ids``). Without a mask
    every token id is a real token. Documents are cut into windows of ``context_length`` tokens, run
    ``batch_size`` windows per forward, which stops after the last requested layer (``stop_at_layer`` overrides;
    it must not stop before a requested point). ``names``: hook points (a name, shorthand, list or filter).
    Each row is one token position: padding is never stored, BOS (``exclude_bos``) and ``exclude_tokens`` ids
    are not either; rows keep their token id, document index and position (`ActivationStore.tokens` ...).
    ``dtype``: storage dtype (default the model's). ``shard_size``: bytes of activations per shard file.
    ``max_tokens`` stops after that many tokens are fed to the model (per rank under data parallelism).
    ``model`` may be a `VLLMBridge` (the engine runs each window as a request; it always runs the whole model).

    Killed at any moment, a rerun with the same arguments continues where the last finished shard ended; a
    folder holding a harvest with other settings is refused unless ``overwrite=True`` (which deletes it). A
    write error (disk full, permissions) raises `HarvestWriteError` and leaves the finished shards listed and
    valid. Under ``torchrun`` each rank harvests every ``world``-th document into its own shards and rank 0
    merges the manifests; under tensor parallelism rank 0 alone writes. Returns the `ActivationStore`.

    Example:
        >>> store = harvest(model, ["First document.", "Second one."], "blocks.3.hook_resid_post", "acts/",
        ...                 context_length=64, batch_size=16)
        >>> len(store), store.read("blocks.3.hook_resid_post").shape
    """
    if hasattr(model, "_harvest_model"):  # a VLLMBridge: the engine runs the windows (transformer_bridge.vllm.harvest)
        model = model._harvest_model()
    kind, documents = raw_documents(data, text_column, attention_mask)
    plan = resolve(model, names, context_length, batch_size, dtype, stop_at_layer, exclude_bos, exclude_tokens,
                   prepend_bos, shard_size, max_tokens, kind)  # fmt: skip
    if kind == "text" and model.tokenizer is None:
        raise ValueError("`data` is text, but the model has no tokenizer; pass token ids, or build it with one.")
    out = _prepare_dir(Path(out_dir), overwrite, plan)
    manifest_path = out / (f"manifest-r{plan.rank}.json" if plan.world > 1 else "manifest.json")
    manifest = _start_manifest(manifest_path, plan, out)
    if not manifest["complete"]:
        seen: dict[str, str] = {}
        cursor = Cursor(**manifest["cursor"])
        share = plan.rank if plan.world > 1 else 0  # tensor-parallel ranks all run the whole data
        stream = windows(kind, documents, plan.context_length, cursor, model.tokenizer, plan.prepend_bos, share,
                         plan.world, seen)  # fmt: skip
        stream = _checked(stream, seen, manifest["first_document"], out)
        _Harvester(model, plan, out, manifest_path, manifest, progress, seen).run(_limited(stream, plan, manifest))
    return _finish(out, plan)


def _prepare_dir(out: Path, overwrite: bool, plan: Plan) -> Path:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"`out_dir`={str(out)!r} is a file; give a folder (it is created if missing).")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-r{plan.rank}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise HarvestWriteError(e.errno, f"`out_dir`={str(out)!r} cannot be written: {e.strerror or e}.") from e
    if overwrite and plan.writes:
        mine = [f"manifest-r{plan.rank}.json", f"shard-r{plan.rank}-*.safetensors", f".*r{plan.rank}*.tmp"]
        if plan.rank == 0:
            mine += ["manifest.json", ".manifest.json.tmp"]
        for pattern in mine:
            for path in out.glob(pattern):
                path.unlink()
    return out


def _start_manifest(path: Path, plan: Plan, out: Path) -> dict[str, Any]:
    """The manifest to continue (checked against ``plan``), or a new one; stray files of this rank removed."""
    if not path.exists():
        return {
            "format": FORMAT, "version": VERSION, "complete": False, **plan.config, "rank": plan.rank,
            "cursor": vars(Cursor()), "rows": 0, "tokens": 0, "first_document": None, "shards": [],
        }  # fmt: skip
    manifest = read_json(path)
    check_resume(manifest, plan, out)
    listed = {s["file"] for s in manifest["shards"]}
    if plan.writes:
        for stray in [*out.glob(f"shard-r{plan.rank}-*.safetensors"), *out.glob(f".shard-r{plan.rank}-*.tmp")]:
            if stray.name not in listed:
                stray.unlink()
    return manifest


def _checked(stream: Iterator[Window], seen: dict[str, str], recorded: str | None, out: Path) -> Iterator[Window]:
    """``stream``, checking that this rank's first document is the one a resumed harvest started from."""

    def check() -> None:
        if recorded is not None and seen.get("first") not in (None, recorded):
            raise ValueError(
                f"`data` differs from the harvest in {str(out)!r}: its first document is not the one harvested "
                "there. Resume with the same data, or give another `out_dir` (or `overwrite=True`)."
            )

    for window in stream:
        check()
        yield window
    check()


def _limited(stream: Iterator[Window], plan: Plan, manifest: dict[str, Any]) -> Iterator[Window]:
    """``stream`` cut after ``plan.max_tokens`` tokens in all (counting those already harvested)."""
    if plan.max_tokens is None:
        yield from stream
        return
    left = plan.max_tokens - manifest["tokens"]
    for window in stream:
        if left <= 0:
            return
        if window.tokens.shape[0] > left:
            window = Window(window.doc, window.start, window.tokens[:left])
        left -= window.tokens.shape[0]
        yield window


class _Harvester:
    """The loop's state: two shard buffers, the writer thread, the manifest it rewrites, the progress bar."""

    def __init__(self, model: BridgeCore, plan: Plan, out: Path, manifest_path: Path, manifest: dict[str, Any],
                 progress: bool, seen: dict[str, str]) -> None:  # fmt: skip
        self.model, self.plan, self.out, self.manifest_path, self.manifest = model, plan, out, manifest_path, manifest
        self.seen = seen  # this rank's first document's fingerprint, once read
        self.capacity = plan.shard_rows + plan.batch_size * plan.context_length
        pin = model.device.type == "cuda"
        self.buffers = [self._buffers(pin) for _ in range(2)]
        self.current, self.fill = 0, 0
        self.slot: tuple[int, int, Tensor] = (0, 0, torch.zeros(0, dtype=torch.long))
        self.cursor = Cursor(**manifest["cursor"])
        self.shard_index = len(manifest["shards"])
        self.pending: Future | None = None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="harvest-writer") if plan.writes else None
        self.copy_stream = torch.cuda.Stream(model.device) if pin else None
        show = progress and tqdm is not None and plan.rank == 0
        self.bar = tqdm(desc="harvest", unit="tok", unit_scale=True, initial=manifest["tokens"]) if show else None
        self.tokens, self.written, self.start = manifest["tokens"], 0, time.perf_counter()

    def _buffers(self, pin: bool) -> dict[str, Tensor]:
        p, n = self.plan, self.capacity
        out = {name: torch.empty((n, *shape), dtype=p.dtype, pin_memory=pin) for name, shape in p.shapes.items()}
        out[META["tokens"]] = torch.empty(n, dtype=torch.int32)
        out[META["documents"]] = torch.empty(n, dtype=torch.int64)
        out[META["positions"]] = torch.empty(n, dtype=torch.int32)
        return out

    def run(self, stream: Iterator[Window]) -> None:
        hooks = [(name, self._copy_hook(name)) for name in self.plan.names]  # registered once, for every batch
        try:
            with torch.no_grad(), self.model.hooks(fwd_hooks=hooks, read_only=True):
                batch: list[Window] = []
                for window in stream:
                    batch.append(window)
                    if len(batch) == self.plan.batch_size:
                        self._forward(batch)
                        batch = []
                if batch:
                    self._forward(batch)
            self._submit(final=True)
            self._wait()
        finally:
            if self.writer is not None:
                self.writer.shutdown(wait=True)  # an interrupted run still finishes (or drops) its shard atomically
            if self.bar is not None:
                self.bar.close()
        seconds = max(time.perf_counter() - self.start, 1e-9)
        logger.info("harvest: %d tokens in %.1f s (%.0f tok/s), %.3f GB written (%.3f GB/s)", self.tokens, seconds,
                    self.tokens / seconds, self.written / 1e9, self.written / 1e9 / seconds)  # fmt: skip

    def _forward(self, batch: list[Window]) -> None:
        p = self.plan
        width = max(w.tokens.shape[0] for w in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, w in enumerate(batch):
            tokens[i, : w.tokens.shape[0]], mask[i, : w.tokens.shape[0]] = w.tokens, 1
        keep = mask.bool() & ~torch.isin(tokens, torch.tensor(p.exclude, dtype=torch.long))
        index = keep.reshape(-1).nonzero().reshape(-1)
        n, lo = index.numel(), self.fill
        buf = self.buffers[self.current]
        buf[META["tokens"]][lo : lo + n] = tokens.reshape(-1)[index].int()
        buf[META["documents"]][lo : lo + n] = torch.tensor([w.doc for w in batch]).repeat_interleave(width)[index]
        starts = torch.tensor([w.start for w in batch])[:, None] + torch.arange(width)
        buf[META["positions"]][lo : lo + n] = starts.reshape(-1)[index].int()
        device = self.model.device
        self.slot = (lo, lo + n, index.to(device, non_blocking=True))  # where the hooks write this batch's rows
        self.model.forward_tokens(tokens.to(device), mask.to(device), stop_at_layer=p.stop_at_layer, logits_to_keep=1)
        self.fill += n
        fed = int(mask.sum())
        self.tokens += fed
        last = batch[-1]
        following = last.start + last.tokens.shape[0]
        self.cursor = Cursor(last.doc, following, self.cursor.windows + len(batch))
        if self.bar is not None:
            self.bar.update(fed)
        if self.fill >= p.shard_rows:
            self._submit()

    def _copy_hook(self, name: str) -> Callable[[Tensor, Any], None]:
        stream = self.copy_stream

        def hook(activation: Tensor, hook: Any) -> None:
            lo, hi, index = self.slot
            target = self.buffers[self.current][name][lo:hi]
            rows = activation.reshape(-1, *activation.shape[2:]).index_select(0, index)
            if stream is None:
                target.copy_(rows)
                return
            stream.wait_stream(torch.cuda.current_stream(activation.device))
            with torch.cuda.stream(stream):  # the copy to pinned memory overlaps the rest of the forward
                target.copy_(rows, non_blocking=True)
            rows.record_stream(stream)

        return hook

    def _submit(self, final: bool = False) -> None:
        """Hand the current buffer to the writer (with the cursor after it) and switch buffers."""
        if self.fill == 0 and not final:
            return
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self._wait()
        rows, buf = self.fill, self.buffers[self.current]
        state = {"cursor": vars(self.cursor), "tokens": self.tokens, "first_document": self.seen.get("first"),
                 "complete": final}  # fmt: skip
        if self.writer is not None:
            index = self.shard_index if rows else None
            views = {k: v[:rows] for k, v in buf.items()}
            self.pending = self.writer.submit(self._write, index, views, rows, state)
        self.shard_index += bool(rows)
        self.current, self.fill = 1 - self.current, 0

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def _write(self, index: int | None, tensors: dict[str, Tensor], rows: int, state: dict[str, Any]) -> None:
        """In the writer thread: the shard (if any rows), then the manifest that lists it."""
        m = self.manifest
        try:
            if index is not None:
                name = f"shard-r{self.plan.rank}-{index:06d}.safetensors"
                size = write_shard(self.out / name, tensors, {"format": FORMAT, "rank": str(self.plan.rank)})
                self.written += size
                m["shards"].append({"file": name, "rows": rows, "rank": self.plan.rank, "bytes": size})
                m["rows"] += rows
            m.update(state)
            write_json(self.manifest_path, m)
        except OSError as e:
            what = f"shard {index} of" if index is not None else "the manifest of"
            raise HarvestWriteError(
                e.errno,
                f"Writing {what} the harvest in {str(self.out)!r} failed: {e.strerror or e}. The "
                f"{len(m['shards'])} shard(s) listed in {self.manifest_path.name} are complete and valid; free space "
                "or fix the folder, then run harvest again with the same arguments to continue.",
            ) from e


def _finish(out: Path, plan: Plan) -> ActivationStore:
    """Under data parallelism, wait for every rank and merge their manifests (rank 0); then open the store."""
    dist = torch.distributed
    synced = plan.world > 1 or plan.tensor_parallel
    if synced and dist.is_available() and dist.is_initialized():
        dist.barrier()
    if plan.world > 1 and plan.rank == 0:
        paths = [out / f"manifest-r{r}.json" for r in range(plan.world)]
        _wait_for(lambda: all(p.exists() and read_json(p)["complete"] for p in paths), "every rank to finish")
        write_json(out / "manifest.json", merge_manifests([read_json(p) for p in paths]))
    if synced and dist.is_available() and dist.is_initialized():
        dist.barrier()
    elif plan.world > 1 and plan.rank != 0:
        _wait_for(lambda: (out / "manifest.json").exists(), "rank 0 to merge the manifests")
    return ActivationStore(out)


def _wait_for(ready: Callable[[], bool], what: str) -> None:
    """Poll ``ready`` (ranks launched without a process group coordinate through files)."""
    deadline = time.monotonic() + RANK_WAIT_SECONDS
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"harvest waited {RANK_WAIT_SECONDS} s for {what}.")
        time.sleep(0.2)
