"""`ActivationStore`: a harvest read back, memory-mapped, and streamed in shuffled batches for training.

Every shard is memory-mapped once; `Rows` views one hook point (or the row metadata) across all shards as one
sequence, so ``store.read(name)[i]`` or a fancy index touches only the rows it asks for, and a ``Rows`` is a
map-style dataset (``len`` and ``__getitem__``) that a ``torch.utils.data.DataLoader`` takes as it is.

`ActivationStore.batches` shuffles across shards with bounded memory: each epoch is a pseudo-random permutation
of all row indices, computed for a chunk of positions at a time by a keyed Feistel network (a bijection of
``[0, 2^k)`` with ``2^k < 4 n``, cycle-walked into ``[0, n)``), so no index array of the dataset's size is
ever built; a chunk of rows is read sorted by shard and row (locality), then yielded in permuted order. The
permutation depends only on ``(seed, epoch)``: the same seed gives the same batches on any machine.
``block_rows > 1`` permutes blocks of consecutive rows instead (then shuffled within each chunk), which reads
runs of rows when the data is larger than memory and lives on disk.
"""

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..checks import ArgumentIndexError, ArgumentTypeError, ArgumentValueError, check_int, describe, did_you_mean
from ..convertible import Convertible
from .shards import Shard, ShardFileError, read_json

MANIFEST = "manifest.json"
META = {"tokens": "__tokens__", "documents": "__doc__", "positions": "__pos__"}
FEISTEL_ROUNDS = 4


class Rows(Convertible, Sequence[Tensor]):
    """One tensor name across every shard of a store, as one memory-mapped sequence of rows.

    ``rows[i]`` is row ``i``; ``rows[a:b]``, ``rows[index_tensor]`` and ``rows[[i, j]]`` gather (a copy of just
    those rows); ``rows.to_tensor()`` reads them all, and so does any other tensor operation (``rows.mean(0)``,
    ``torch.allclose(rows, x)``), and ``torch.as_tensor(rows)`` / ``np.asarray(rows)``. ``shape`` and ``dtype`` are
    those of the whole; ``parts`` are the shards' memory-mapped views.

    Example:
        >>> resid = store.read("blocks.3.hook_resid_post")
        >>> resid.shape, resid[0].shape, resid[torch.tensor([5, 2])].shape
    """

    def __init__(self, name: str, key: str, shards: list[Shard]) -> None:
        self.name = name
        self.key = key
        self.shards = shards
        self.parts = [s.tensors[key] for s in shards]  # memory-mapped views, one per shard
        sizes = torch.tensor([0, *(p.shape[0] for p in self.parts)])
        self.offsets = sizes.cumsum(0)  # row where each part starts; the last entry is the total

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> torch.Size:
        return torch.Size([len(self), *self.parts[0].shape[1:]])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def __getitem__(self, index: Any) -> Tensor:  # type: ignore[override]
        if isinstance(index, int) or (isinstance(index, Tensor) and index.dim() == 0):
            i = int(index)
            if not -len(self) <= i < len(self):
                raise ArgumentIndexError(f"Row {i} is out of range: {self.name!r} has {len(self)} rows.")
            return self.take(torch.tensor([i % len(self)]))[0]
        if isinstance(index, slice):
            return self.take(torch.arange(len(self))[index])
        return self.take(torch.as_tensor(index, dtype=torch.long))

    def take(self, index: Int[Tensor, " n"]) -> Tensor:
        """Rows at ``index`` (any order, repeats allowed), read shard by shard in sorted order (runs of consecutive
        rows in one read each)."""
        index = index.reshape(-1).long()
        if index.numel() and (bool(index.min() < 0) or bool(index.max() >= len(self))):
            raise ArgumentIndexError(f"Row indices must be in [0, {len(self)}) for {self.name!r}.")
        order = index.argsort()
        ordered = index[order]
        shard = torch.searchsorted(self.offsets, ordered, right=True) - 1
        out = torch.empty((index.numel(), *self.parts[0].shape[1:]), dtype=self.dtype)
        bounds = torch.searchsorted(shard, torch.arange(len(self.parts) + 1))
        for s in range(len(self.parts)):
            lo, hi = int(bounds[s]), int(bounds[s + 1])
            if hi > lo:  # copied with pread, not through the map: see `Shard`
                self.shards[s].read_rows(self.key, ordered[lo:hi] - self.offsets[s], out[lo:hi])
        result = torch.empty_like(out)
        result[order] = out
        return result

    def to_tensor(self) -> Tensor:
        """Every row in one tensor (reads the whole point into memory)."""
        return self.take(torch.arange(len(self)))

    as_tensor = to_tensor

    # Anything else a tensor does, on the rows read into one: ``torch.allclose(rows, x)``, ``rows.mean(0)``,
    # ``rows.numpy()``. Indexing first reads only the rows asked for.
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def whole(x: Any) -> Any:
            if isinstance(x, Rows):
                return x.to_tensor()
            if isinstance(x, (list, tuple)):
                return type(x)(whole(y) for y in x)
            return x

        return func(*whole(args), **{k: whole(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("parts", "shards", "offsets", "key", "name"):
            raise AttributeError(name)
        return getattr(self.to_tensor(), name)

    def __repr__(self) -> str:
        return f"Rows({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, shards={len(self.parts)})"


class Permutation:
    """A keyed pseudo-random permutation of ``[0, n)``, evaluated on any positions in O(len) memory.

    Example:
        >>> p = Permutation(10, seed=0)
        >>> sorted(p(torch.arange(10)).tolist()) == list(range(10))
        True
    """

    def __init__(self, n: int, seed: int, epoch: int = 0) -> None:
        self.n = n
        bits = max(2, math.ceil(math.log2(max(n, 2))))
        bits += bits % 2
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))
        self.keys = torch.randint(0, 2**31 - 1, (FEISTEL_ROUNDS,), generator=gen).tolist()

    def _round(self, right: Tensor, key: int) -> Tensor:
        x = (right * 0x9E3779B1 + key) & 0xFFFFFFFF
        x = (x ^ (x >> 15)) * 0x85EBCA6B & 0xFFFFFFFF
        x = (x ^ (x >> 13)) * 0xC2B2AE35 & 0xFFFFFFFF
        return (x ^ (x >> 16)) & self.mask

    def _once(self, x: Tensor) -> Tensor:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __call__(self, positions: Int[Tensor, " k"]) -> Int[Tensor, " k"]:
        out = self._once(positions.long())
        outside = out >= self.n
        while bool(outside.any()):  # cycle-walk: a bijection of [0, 2^bits) restricted to [0, n)
            out[outside] = self._once(out[outside])
            outside = out >= self.n
        return out


class ActivationStore:
    """A harvest folder, read back: ``len(store)`` rows, the ``manifest``, memory-mapped points, shuffled batches.

    Rows are the harvested token positions, in the order written (rank by rank under data parallelism); for
    each row ``store.tokens``, ``store.documents`` and ``store.positions`` give its token id, document index and
    position in the document. A store of a harvest still running (or killed) reads the shards finished so far.

    Example:
        >>> store = ActivationStore("acts/")
        >>> len(store), store.names, store.read("blocks.3.hook_resid_post").shape
        >>> for x in store.batches("blocks.3.hook_resid_post", batch_size=4096, seed=0):
        ...     loss = sae_step(x)
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"`path`={str(path)!r} is not a folder; give the `out_dir` of a harvest.")
        self.manifest = load_manifest(self.path)
        self.names: list[str] = list(self.manifest["hook_names"])
        self._shards: list[Shard] = []
        for entry in self.manifest["shards"]:
            shard = Shard(self.path / entry["file"])
            found = shard.tensors[META["tokens"]].shape[0]
            if found != entry["rows"]:
                raise ShardFileError(f"{entry['file']} holds {found} rows; the manifest says {entry['rows']}.")
            self._shards.append(shard)

    def __len__(self) -> int:
        return sum(int(s.tensors[META["tokens"]].shape[0]) for s in self._shards)

    def __repr__(self) -> str:
        done = "complete" if self.manifest.get("complete") else "in progress"
        shards = len(self._shards)
        return f"ActivationStore({str(self.path)!r}, rows={len(self)}, shards={shards}, {done}, {self.names})"

    def _rows(self, key: str, label: str) -> Rows:
        if not self._shards:
            raise ValueError(f"The harvest in {str(self.path)!r} has no finished shard yet.")
        return Rows(label, key, self._shards)

    def read(self, name: str | None = None) -> Rows:
        """Every row of hook point ``name`` (the only one when None), memory-mapped: ``[rows, *shape]``.

        Example:
            >>> x = store.read("blocks.3.hook_resid_post")[:1024]   # the first 1024 rows, read from disk
        """
        return self._rows(self._name(name), self._name(name))

    @property
    def tokens(self) -> Rows:
        """The token id of every row."""
        return self._rows(META["tokens"], "tokens")

    @property
    def documents(self) -> Rows:
        """The document index (in the data as given) of every row."""
        return self._rows(META["documents"], "documents")

    @property
    def positions(self) -> Rows:
        """The position of every row's token in its document."""
        return self._rows(META["positions"], "positions")

    def _name(self, name: str | None) -> str:
        if name is None:
            if len(self.names) != 1:
                raise ArgumentValueError(f"This store holds {self.names}; give `name`, one of them.")
            return self.names[0]
        if name not in self.names:
            raise KeyError(f"`name`={name!r} was not harvested here; the store holds {self.names}."
                           f"{did_you_mean(name, self.names)}")  # fmt: skip
        return name

    def batches(
        self,
        name: str | None = None,
        batch_size: int = 4096,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int | None = 1,
        drop_last: bool = False,
        chunk_rows: int | None = None,
        block_rows: int = 1,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Iterator[Tensor]:
        """Batches ``[batch_size, *shape]`` of one point over ``epochs`` passes (None: forever).

        ``shuffle``: each epoch is a fresh permutation of all rows of all shards, reproducible from ``(seed,
        epoch)``; rows are read ``chunk_rows`` at a time (default: 64 batches, at least 65536 rows), which bounds
        memory. ``block_rows`` > 1 permutes blocks of that many consecutive rows and shuffles rows within each
        chunk (faster on disk, rows of one block share a chunk). ``drop_last`` skips a last short batch.
        ``device`` / ``dtype`` convert each batch (pinned memory and a non-blocking copy to an accelerator).

        Example:
            >>> for x in store.batches("blocks.3.hook_resid_post", batch_size=4096, seed=0, epochs=2):
            ...     opt.zero_grad(); sae_loss(x).backward(); opt.step()
        """
        rows = self.read(name)
        batch_size = check_int("batch_size", batch_size, minimum=1)
        block = check_int("block_rows", block_rows, minimum=1)
        if epochs is not None:
            check_int("epochs", epochs, minimum=1)
        if chunk_rows is None:
            chunk_rows = max(64 * batch_size, 1 << 16)
        chunk = check_int("chunk_rows", chunk_rows, minimum=1)
        chunk = max(batch_size, chunk - chunk % batch_size)  # whole batches per chunk, but the last
        target = torch.device(device) if device is not None else None
        if target is not None and not isinstance(device, (str, torch.device)):
            raise ArgumentTypeError(f"`device` must be a str or torch.device, got {describe(device)}.")
        for epoch in range(epochs) if epochs is not None else _forever():
            yield from self._epoch(rows, batch_size, shuffle, seed, epoch, drop_last, chunk, block, target, dtype)

    def _epoch(
        self, rows: Rows, batch_size: int, shuffle: bool, seed: int, epoch: int, drop_last: bool, chunk: int,
        block: int, device: torch.device | None, dtype: torch.dtype | None,
    ) -> Iterator[Tensor]:  # fmt: skip
        n = len(rows)
        blocks = math.ceil(n / block)
        permute = Permutation(blocks, seed, epoch) if shuffle else None
        within = torch.Generator().manual_seed(seed * 7919 + epoch)
        per_chunk = max(1, chunk // block)
        for start in range(0, blocks, per_chunk):
            picked = torch.arange(start, min(start + per_chunk, blocks))
            if permute is not None:
                picked = permute(picked)
            index = (picked[:, None] * block + torch.arange(block)).reshape(-1)
            index = index[index < n]
            if permute is not None and block > 1:
                index = index[torch.randperm(index.numel(), generator=within)]
            data = rows.take(index) if permute is not None else rows[int(index[0]) : int(index[-1]) + 1]
            for lo in range(0, data.shape[0], batch_size):
                batch = data[lo : lo + batch_size]
                if drop_last and batch.shape[0] < batch_size:
                    return
                yield _convert(batch, device, dtype)


def _forever() -> Iterator[int]:
    epoch = 0
    while True:
        yield epoch
        epoch += 1


def _convert(batch: Tensor, device: torch.device | None, dtype: torch.dtype | None) -> Tensor:
    if dtype is not None:
        batch = batch.to(dtype)
    if device is not None and device.type != "cpu":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch


def load_manifest(path: Path) -> dict[str, Any]:
    """The harvest's manifest: ``manifest.json``, or the rank manifests merged while a data-parallel harvest runs."""
    single = path / MANIFEST
    if single.exists():
        return read_json(single)
    ranks = sorted(path.glob("manifest-r*.json"))
    if not ranks:
        raise FileNotFoundError(f"{str(path)!r} holds no harvest manifest ({MANIFEST}); run `harvest` into it first.")
    return merge_manifests([read_json(p) for p in ranks])


def merge_manifests(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """One manifest from the rank manifests of a data-parallel harvest: shards rank by rank, counts summed."""
    manifests = sorted(manifests, key=lambda m: m["rank"])
    merged = {k: v for k, v in manifests[0].items() if k not in ("rank", "cursor")}
    merged["shards"] = [s for m in manifests for s in m["shards"]]
    merged["rows"] = sum(m["rows"] for m in manifests)
    merged["tokens"] = sum(m["tokens"] for m in manifests)
    merged["complete"] = all(m["complete"] for m in manifests) and len(manifests) == manifests[0]["world_size"]
    merged["ranks"] = [m["rank"] for m in manifests]
    return merged
