"""`ActivationStore`: memory-mapped points, and epoch-shuffled batches across shards that are reproducible per
seed, cover every row exactly once per epoch, and read a bounded chunk at a time."""

from collections.abc import Iterator

import pytest
import torch
from conftest import make_bridge
from harvest_worker import documents

from transformer_bridge import ActivationStore, harvest
from transformer_bridge.activations import Permutation, Rows
from transformer_bridge.activations.shards import write_shard

NAME = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[ActivationStore]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # restored after the module: later tests compare with subprocesses bitwise
    out = tmp_path_factory.mktemp("store")
    try:
        yield harvest(make_bridge("llama"), documents(60), [NAME, "blocks.1.hook_resid_post"], out, context_length=16,
                      batch_size=4, shard_size=6000, progress=False)  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _row_ids(store: ActivationStore, batch: torch.Tensor) -> list[int]:
    """Which rows a batch holds (rows are distinct: each token's residual stream differs)."""
    everything = store.read(NAME).to_tensor()
    return [int((everything == row).all(-1).nonzero()[0]) for row in batch]


def test_rows_are_one_sequence_over_every_shard(store):
    rows = store.read(NAME)
    assert isinstance(rows, Rows) and len(rows) == len(store) == store.manifest["rows"]
    assert len(store.manifest["shards"]) > 10 and rows.shape == (len(store), 32) and rows.dtype == torch.float32
    whole = torch.cat(rows.parts)
    assert torch.equal(rows.to_tensor(), whole)
    assert torch.equal(rows[5], whole[5]) and torch.equal(rows[-1], whole[-1])
    assert torch.equal(rows[10:400:7], whole[10:400:7])
    picks = torch.tensor([len(store) - 1, 0, 77, 77, 300])
    assert torch.equal(rows[picks], whole[picks]) and torch.equal(rows[[3, 1]], whole[[3, 1]])
    assert rows.parts[0].untyped_storage().nbytes() >= rows.parts[0].numel() * 4  # a view of the file's map
    with pytest.raises(IndexError, match=r"Row 100000 is out of range"):
        rows[100_000]
    assert torch.allclose(rows, whole) and torch.equal(rows.mean(0), whole.mean(0))  # any tensor operation
    assert rows.numpy().shape == tuple(whole.shape) and torch.equal(torch.as_tensor(rows.to_tensor()), whole)
    loader = torch.utils.data.DataLoader(rows, batch_size=64, shuffle=True)  # a map-style dataset as it is
    assert sum(b.shape[0] for b in loader) == len(store)


def test_each_epoch_is_a_permutation_of_every_row(store):
    batches = list(store.batches(NAME, batch_size=128, seed=3, chunk_rows=512))
    assert sum(b.shape[0] for b in batches) == len(store) and all(b.shape[0] == 128 for b in batches[:-1])
    seen = torch.cat(batches)
    whole = store.read(NAME).to_tensor()
    for a, b in zip(torch.unique(seen, dim=0, return_counts=True), torch.unique(whole, dim=0, return_counts=True),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)  # the same rows, as often each
    first = _row_ids(store, batches[0])
    shards = torch.searchsorted(store.read(NAME).offsets, torch.tensor(first), right=True) - 1
    assert len(set(shards.tolist())) > 10  # one batch mixes rows of many shards
    assert first != sorted(first)


def test_shuffling_is_reproducible_per_seed_and_epoch(store):
    def first(**kw):
        return next(iter(store.batches(NAME, batch_size=64, **kw)))

    assert torch.equal(first(seed=1), first(seed=1))
    assert not torch.equal(first(seed=1), first(seed=2))
    two = list(store.batches(NAME, batch_size=64, seed=1, epochs=2))
    per_epoch = -(-len(store) // 64)
    assert len(two) == 2 * per_epoch and not torch.equal(two[0], two[per_epoch])
    assert torch.equal(two[0], first(seed=1))
    ordered = torch.cat(list(store.batches(NAME, batch_size=100, shuffle=False)))
    assert torch.equal(ordered, store.read(NAME).to_tensor())


def test_options(store):
    full = list(store.batches(NAME, batch_size=100, drop_last=True))
    assert all(b.shape[0] == 100 for b in full) and len(full) == len(store) // 100
    blocks = torch.cat(list(store.batches(NAME, batch_size=50, block_rows=8, chunk_rows=400)))
    assert blocks.shape[0] == len(store)
    assert not torch.equal(blocks, store.read(NAME).to_tensor())
    half = next(iter(store.batches(NAME, batch_size=8, dtype=torch.bfloat16, device="cpu")))
    assert half.dtype == torch.bfloat16
    forever = store.batches("blocks.1.hook_resid_post", batch_size=len(store), epochs=None)
    assert all(next(forever).shape[0] == len(store) for _ in range(3))


def test_errors_name_the_parameter(store, tmp_path):
    with pytest.raises(KeyError, match=r"`name`='blocks.0.hook_resid_pots'.*Did you mean 'blocks.0.hook_resid_post'"):
        store.read("blocks.0.hook_resid_pots")
    with pytest.raises(ValueError, match=r"give `name`, one of them"):
        store.read()
    with pytest.raises(ValueError, match=r"`batch_size` must be an int >= 1, got 0"):
        next(store.batches(NAME, batch_size=0))
    with pytest.raises(FileNotFoundError, match=r"holds no harvest manifest"):
        ActivationStore(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"is not a folder"):
        ActivationStore(tmp_path / "nope")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 1000, 4097])
def test_the_permutation_is_a_bijection(n):
    for seed in (0, 1):
        p = Permutation(n, seed=seed, epoch=2)
        out = p(torch.arange(n))
        assert sorted(out.tolist()) == list(range(n))
        assert torch.equal(out[3 % n :], p(torch.arange(3 % n, n)))  # any positions, same answer
    if n >= 64:
        a, b = Permutation(n, 0)(torch.arange(n)), Permutation(n, 1)(torch.arange(n))
        assert (a == b).float().mean() < 0.2 and (a == torch.arange(n)).float().mean() < 0.2


def test_shards_are_plain_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 2), "b": torch.arange(5, dtype=torch.int32), "c": torch.randn(2).bfloat16(),
               "d": torch.tensor([True, False])}  # fmt: skip
    write_shard(tmp_path / "x.safetensors", tensors, {"k": "v"})
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert not list(tmp_path.glob(".*tmp"))
