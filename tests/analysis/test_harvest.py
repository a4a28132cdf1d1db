"""`harvest`: every stored row against the model run on its window alone, resume after a real SIGKILL equal to an
uninterrupted run, a full disk and bad folders, bounded memory, data parallelism under torchrun."""

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_bridge
from harvest_worker import run

from transformer_bridge import ActivationStore, TransformerBridge, harvest
from transformer_bridge.activations import HarvestConfigError, HarvestWriteError, read_shard
from transformer_bridge.activations.shards import write_json

HERE = Path(__file__).resolve().parent
WORKER = HERE / "harvest_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TEXTS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 4 + 1) for i in range(12)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return make_bridge("llama")


def _worker(opts: dict, timeout: float = 240) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), json.dumps(opts)], env=ENV, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _same_store(a: ActivationStore, b: ActivationStore) -> None:
    assert len(a) == len(b) and a.names == b.names
    for name in a.names:
        assert torch.equal(a.read(name).to_tensor(), b.read(name).to_tensor()), name
    for meta in ("tokens", "documents", "positions"):
        assert torch.equal(getattr(a, meta).to_tensor(), getattr(b, meta).to_tensor()), meta


def _check_against_windows(model, store: ActivationStore, windows: dict, names: list[str], atol: float = 1e-5):
    """Every row equals the point's value when the model runs on that row's window alone."""
    docs, positions, tokens = (store.documents.to_tensor(), store.positions.to_tensor(), store.tokens.to_tensor())
    values = {name: store.read(name).to_tensor() for name in names}
    checked = 0
    for (doc, start), ids in windows.items():
        _, cache = model.run_with_cache(ids[None], names_filter=names, attention_mask=torch.ones(1, len(ids)))
        for col, token in enumerate(ids.tolist()):
            hit = ((docs == doc) & (positions == start + col)).nonzero().flatten()
            if token == model.cfg.bos_token_id:
                assert hit.numel() == 0  # BOS is not stored by default
                continue
            assert hit.numel() == 1 and int(tokens[hit]) == token
            for name in names:
                torch.testing.assert_close(values[name][hit[0]], cache[name][0, col].to(values[name].dtype),
                                           atol=atol, rtol=1e-4)  # fmt: skip
            checked += 1
    assert checked == len(store)


def test_text_rows_equal_the_model_on_each_window(model, tmp_path):
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "blocks.0.mlp.hook_post"]
    store = harvest(model, TEXTS, names, tmp_path / "a", context_length=24, batch_size=3, shard_size=4096,
                    progress=False)  # fmt: skip
    assert len(store.manifest["shards"]) > 3 and store.manifest["complete"]
    windows = {}
    for doc, text in enumerate(TEXTS):
        ids = model.to_tokens(text, truncate=False)[0]
        for start in range(0, len(ids), 24):
            windows[(doc, start)] = ids[start : start + 24]
    _check_against_windows(model, store, windows, names)
    assert store.read("blocks.1.attn.hook_z").shape[1:] == (4, 8)


def test_token_ids_are_all_real_unless_a_mask_says_so(tmp_path):
    """Rows that start with the pad or BOS id are ordinary data (packed datasets): nothing is inferred from ids."""
    model = make_bridge("gpt2")
    tokens = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 9, 10, 1, 11, 12], [13, 14, 15, 16, 17, 18]])
    store = harvest(model, tokens, "blocks.1.hook_resid_post", tmp_path / "a", context_length=4, batch_size=2,
                    exclude_bos=False, progress=False)  # fmt: skip
    assert len(store) == tokens.numel()
    windows = {(d, s): tokens[d, s : s + 4] for d in range(3) for s in (0, 4)}
    model.cfg.bos_token_id, bos = None, model.cfg.bos_token_id  # the oracle checks every id, BOS included
    try:
        _check_against_windows(model, store, windows, ["blocks.1.hook_resid_post"])
    finally:
        model.cfg.bos_token_id = bos
    no_bos = harvest(model, tokens, "blocks.1.hook_resid_post", tmp_path / "b", context_length=4, progress=False)
    assert len(no_bos) == tokens.numel() - 2 and not (no_bos.tokens.to_tensor() == 1).any()
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    masked = harvest(model, tokens, "blocks.1.hook_resid_post", tmp_path / "c", context_length=4, attention_mask=mask,
                     exclude_bos=False, progress=False)  # fmt: skip
    assert len(masked) == int(mask.sum())
    assert masked.positions.to_tensor()[:4].tolist() == [0, 1, 2, 3]  # positions count the document's real tokens
    pair = harvest(model, (tokens, mask), "blocks.1.hook_resid_post", tmp_path / "d", context_length=4,
                   exclude_bos=False, progress=False)  # fmt: skip
    _same_store(masked, pair)


def test_manifest_records_what_a_reader_needs(model, tmp_path):
    store = harvest(model, TEXTS[:3], ["resid_post"], tmp_path, context_length=64, dtype="float16", progress=False)
    m = store.manifest
    assert m["hook_names"] == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    assert m["dtype"] == "float16" and store.read("blocks.0.hook_resid_post").dtype == torch.float16
    assert m["model"]["model_type"] == "llama" and {"transformers", "torch", "transformer_bridge"} <= set(
        m["model"]["versions"])  # fmt: skip
    assert m["context_length"] == 64 and m["exclude_tokens"] == [1] and m["data_kind"] == "text"
    assert m["rows"] == len(store) and m["tokens"] == sum(len(model.to_tokens(t, truncate=False)[0]) for t in TEXTS[:3])
    tensors, meta, _ = read_shard(tmp_path / m["shards"][0]["file"])
    assert meta["format"] == "transformer_bridge.activations" and "__tokens__" in tensors
    from safetensors.torch import load_file  # the shards are plain safetensors

    assert torch.equal(load_file(tmp_path / m["shards"][0]["file"])["__doc__"], tensors["__doc__"])
    assert store.documents.to_tensor().tolist() == sorted(store.documents.to_tensor().tolist())


def test_the_forward_stops_after_the_last_requested_layer(model, tmp_path):
    calls = []
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, hook: calls.append(1))], read_only=True):
        harvest(model, TEXTS[:2], "blocks.0.hook_resid_post", tmp_path / "a", progress=False)
        assert calls == []  # block 1 never ran
        harvest(model, TEXTS[:2], "blocks.0.hook_resid_post", tmp_path / "b", stop_at_layer=2, progress=False)
        assert calls
    with pytest.raises(ValueError, match=r"`stop_at_layer`=1 stops before a requested point.*>= 2"):
        harvest(model, TEXTS[:2], "blocks.1.hook_resid_post", tmp_path / "c", stop_at_layer=1, progress=False)


def test_datasets_text_and_token_columns(model, tmp_path):
    datasets = pytest.importorskip("datasets")
    by_text = harvest(model, datasets.Dataset.from_dict({"text": TEXTS[:4], "id": list(range(4))}),
                      "blocks.0.hook_resid_post", tmp_path / "a", progress=False)  # fmt: skip
    _same_store(by_text, harvest(model, TEXTS[:4], "blocks.0.hook_resid_post", tmp_path / "b", progress=False))
    ids = [model.to_tokens(t, truncate=False)[0].tolist() for t in TEXTS[:4]]
    by_ids = harvest(model, datasets.Dataset.from_dict({"input_ids": ids}), "blocks.0.hook_resid_post",
                     tmp_path / "c", progress=False)  # fmt: skip
    _same_store(by_text, by_ids)
    streamed = datasets.Dataset.from_dict({"content": TEXTS[:4]}).to_iterable_dataset()
    _same_store(by_text, harvest(model, streamed, "blocks.0.hook_resid_post", tmp_path / "d", text_column="content",
                                 progress=False))  # fmt: skip


def test_progress_bar_shows_tokens_per_second(model, tmp_path, capsys):
    harvest(model, TEXTS[:2], "blocks.0.hook_resid_post", tmp_path, progress=True)
    assert "tok/s" in capsys.readouterr().err


def test_max_tokens(model, tmp_path):
    store = harvest(model, TEXTS, "blocks.0.hook_resid_post", tmp_path, max_tokens=100, progress=False)
    assert store.manifest["tokens"] == 100


def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path):
    """A real SIGKILL of the harvesting process at several moments; each rerun continues; the final store equals
    an uninterrupted run's bit for bit, no row lost or duplicated, and no temporary file counts."""
    base = {"docs": 120, "shard_size": 8192, "batch_size": 4, "names": ["blocks.0.hook_resid_post",
            "blocks.1.hook_mlp_out"]}  # fmt: skip
    whole = run({**base, "out": str(tmp_path / "whole")})
    out = tmp_path / "killed"
    manifest = out / "manifest.json"
    kills = 0
    for wait_shards in (1, 4, 9):
        proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps({**base, "out": str(out), "slow": 0.02})],
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if manifest.exists():
                try:
                    listed = len(json.loads(manifest.read_text())["shards"])
                except ValueError:  # replaced while being read: try again
                    continue
                if listed >= wait_shards:
                    break
            time.sleep(0.01)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
        partial = ActivationStore(out)  # what the killed run finished is readable
        assert len(partial) == partial.manifest["rows"]
    assert kills >= 2
    _same_store(whole, run({**base, "out": str(out)}))
    assert not list(out.glob(".*tmp"))


def test_a_crash_between_shard_and_manifest_leaves_no_duplicate(model, tmp_path, monkeypatch):
    """The shard is renamed into place but the manifest is not rewritten: the rerun removes the unlisted shard and
    writes it again."""
    whole = harvest(model, TEXTS, "blocks.0.hook_resid_post", tmp_path / "whole", shard_size=4096, progress=False)
    calls = []

    def crash_on_third(path, data):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if killed right after the shard's rename
        write_json(path, data)

    monkeypatch.setattr("transformer_bridge.activations.run.write_json", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        harvest(model, TEXTS, "blocks.0.hook_resid_post", tmp_path / "x", shard_size=4096, progress=False)
    monkeypatch.undo()
    assert len(list((tmp_path / "x").glob("shard-*"))) == 3 and len(ActivationStore(tmp_path / "x").manifest[
        "shards"]) == 2  # fmt: skip
    _same_store(whole, harvest(model, TEXTS, "blocks.0.hook_resid_post", tmp_path / "x", shard_size=4096,
                               progress=False))  # fmt: skip


def _fails_then_resumes(tmp_path: Path, out: Path, base: dict, **limits) -> None:
    failed = _worker({**base, "out": str(out), **limits})
    assert "failed" in failed["error"] and "complete and valid" in failed["error"] and "run harvest again" in failed[
        "error"]  # fmt: skip
    partial = ActivationStore(out)
    assert 0 < len(partial) == partial.manifest["rows"] and partial.read().to_tensor().isfinite().all()
    assert not list(out.glob(".*tmp"))  # the half-written file is gone
    _same_store(run({**base, "out": str(tmp_path / "whole")}), run({**base, "out": str(out)}))


def test_a_write_refused_by_the_kernel_mid_run_leaves_finished_shards_valid(tmp_path):
    """RLIMIT_FSIZE: the kernel refuses to grow a file past 2500 bytes (EFBIG, as a full disk refuses with ENOSPC).
    The shards (one window of 8 tokens, < 1.6 kB) fit; the manifest, one entry longer after each shard, outgrows
    the limit mid-run."""
    base = {"docs": 20, "shard_size": 512, "batch_size": 1, "context_length": 8, "names": ["blocks.0.hook_resid_post"]}
    _fails_then_resumes(tmp_path, tmp_path / "limited", base, fsize_limit=2500)


def test_a_full_file_system_leaves_finished_shards_valid(tmp_path):
    """A real ENOSPC: a 192 kB tmpfs (needs the right to mount; skipped where it is not granted)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    try:
        base = {"docs": 120, "shard_size": 16384, "batch_size": 4, "names": ["blocks.0.hook_resid_post"]}
        failed = _worker({**base, "out": str(mount / "acts")})
        assert "No space left on device" in failed["error"] and "complete and valid" in failed["error"]
        partial = ActivationStore(mount / "acts")
        assert 0 < len(partial) == partial.manifest["rows"] and not list((mount / "acts").glob(".*tmp"))
        del partial  # its memory maps would keep the file system busy
        gc.collect()
        copy = tmp_path / "copy"
        copy.mkdir()
        for f in (mount / "acts").iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    _same_store(run({**base, "out": str(tmp_path / "whole")}), run({**base, "out": str(copy)}))  # resumed with room


def test_bad_out_dir_and_mismatched_resume(model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError, match=r"`out_dir`=.*is a file"):
        harvest(model, TEXTS[:1], "blocks.0.hook_resid_post", blocker, progress=False)
    with pytest.raises(HarvestWriteError, match=r"`out_dir`=.*cannot be written") as info:
        harvest(model, TEXTS[:1], "blocks.0.hook_resid_post", blocker / "sub", progress=False)
    assert isinstance(info.value, OSError)
    harvest(model, TEXTS[:2], "blocks.0.hook_resid_post", tmp_path / "a", progress=False)
    with pytest.raises(HarvestConfigError, match=r"other settings \(hook_names.*overwrite=True"):
        harvest(model, TEXTS[:2], "blocks.1.hook_resid_post", tmp_path / "a", progress=False)
    with pytest.raises(HarvestConfigError, match=r"context_length: 128 there, 64 now"):
        harvest(model, TEXTS[:2], "blocks.0.hook_resid_post", tmp_path / "a", context_length=64, progress=False)
    again = harvest(model, TEXTS[:2], "blocks.0.hook_resid_post", tmp_path / "a", progress=False)  # complete: as is
    assert again.manifest["complete"]
    fresh = harvest(model, TEXTS[:1], "blocks.1.hook_resid_post", tmp_path / "a", overwrite=True, progress=False)
    assert fresh.names == ["blocks.1.hook_resid_post"] and set(fresh.documents.to_tensor().tolist()) == {0}
    (tmp_path / "b").mkdir()
    partial = {**json.loads((tmp_path / "a" / "manifest.json").read_text()), "complete": False}
    partial["cursor"] = {"doc": 1, "start": 0, "windows": 1}
    for f in (tmp_path / "a").glob("shard-*"):
        (tmp_path / "b" / f.name).write_bytes(f.read_bytes())
    write_json(tmp_path / "b" / "manifest.json", partial)
    with pytest.raises(ValueError, match=r"`data` differs from the harvest"):
        harvest(model, TEXTS[5:7], "blocks.1.hook_resid_post", tmp_path / "b", progress=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"names": "blocks.0.attn.hook_pattern"}, ValueError, r"attention patterns and scores have no row per token"),
        ({"names": "blocks.0.hook_resid_prost"}, KeyError, r"blocks.0.hook_resid_post"),
        ({"dtype": "int8"}, ValueError, r"`dtype` must be one of \['float32', 'float16', 'bfloat16', 'float64'\]"),
        ({"context_length": 1000}, ValueError, r"`context_length`=1000 is longer than the model's context \(128"),
        ({"batch_size": 0}, ValueError, r"`batch_size` must be an int >= 1, got 0"),
        ({"shard_size": "lots"}, ValueError, r"`shard_size`='lots' is not a size"),
        ({"data": []}, ValueError, r"`data` is empty"),
        ({"data": 3.5}, TypeError, r"`data` must be texts, token ids or a datasets.Dataset"),
        ({"data": torch.zeros(2, 3)}, ValueError, r"integer tensor \[doc, pos\]"),
        ({"data": ["ok", 5]}, TypeError, r"`data` document 1 is not a str"),
        ({"exclude_tokens": 5}, TypeError, r"`exclude_tokens` must be a list of token ids"),
        ({"attention_mask": torch.ones(2, 2)}, ValueError, r"`attention_mask` goes with token-id data"),
    ],
)  # fmt: skip
def test_errors_name_the_parameter(model, tmp_path, kwargs, error, pattern):
    args = {"data": TEXTS[:2], "names": "blocks.0.hook_resid_post", **kwargs}
    data, names = args.pop("data"), args.pop("names")
    with pytest.raises(error, match=pattern):
        harvest(model, data, names, tmp_path, progress=False, **args)


def test_text_without_a_tokenizer(tmp_path):
    model = TransformerBridge(make_bridge("llama").hf_model)
    with pytest.raises(ValueError, match="no tokenizer"):
        harvest(model, ["hi"], "blocks.0.hook_resid_post", tmp_path, progress=False)


def test_memory_stays_flat_as_the_dataset_grows(tmp_path):
    """Peak RSS of a whole harvest plus one shuffled pass over the store, for 4× the documents: the growth stays far
    below the data written. (A shuffled chunk of 1024 rows touches at most 1024 pages of the memory maps, about
    4 MB, which `batches` hands back after each chunk: so both sizes exceed that footprint.)"""
    base = {"shard_size": 65536, "batch_size": 8, "names": ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"],
            "read_back": True}  # fmt: skip
    small = _worker({**base, "docs": 1000, "out": str(tmp_path / "small")})
    large = _worker({**base, "docs": 4000, "out": str(tmp_path / "large")}, timeout=600)
    written = [sum(f.stat().st_size for f in (tmp_path / k).glob("shard-*")) / 2**20 for k in ("small", "large")]
    assert large["read_back"] == large["rows"] > 3.5 * small["rows"]
    assert written[1] - written[0] > 20 and large["maxrss_mb"] - small["maxrss_mb"] < 5, (small, large, written)


def test_data_parallel_under_torchrun_reads_as_one_store(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch without torch.distributed")
    opts = {"docs": 30, "shard_size": 8192, "batch_size": 4, "out": str(tmp_path / "dp"), "torchrun": True}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
               json.dumps(opts)]  # fmt: skip
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    store = ActivationStore(tmp_path / "dp")
    assert store.manifest["complete"] and store.manifest["ranks"] == [0, 1]
    assert {s["rank"] for s in store.manifest["shards"]} == {0, 1}
    one = run({**opts, "out": str(tmp_path / "one")})
    assert len(store) == len(one)

    def keyed(s):
        key = s.documents.to_tensor() * 10_000 + s.positions.to_tensor()
        order = key.argsort()
        return key[order], s.read().to_tensor()[order]

    (k1, v1), (k2, v2) = keyed(store), keyed(one)
    assert torch.equal(k1, k2)
    torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)  # batches differ (each rank has every other document)
    assert set(store.documents.to_tensor()[: store.manifest["shards"][0]["rows"]].remainder(2).tolist()) == {0}


def test_tensor_parallel_rank_zero_alone_writes(tmp_path):
    """Under tensor parallelism every rank runs the same batches (the hooks see whole tensors) and rank 0 writes."""
    pytest.importorskip("accelerate")
    if not torch.distributed.is_available():
        pytest.skip("torch without torch.distributed")
    from conftest import CONFIGS, char_tokenizer
    from transformers import AutoModelForCausalLM

    # Widths 2 ranks divide: HF's tensor parallelism before 5.21 runs no others (tests/distributed checks uneven ones).
    config = CONFIGS["llama"]()
    config.vocab_size, config.intermediate_size = 100, 38  # the documents hold ids up to 98
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    opts = {"docs": 20, "shard_size": 8192, "batch_size": 4, "torchrun": True}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
               json.dumps({**opts, "out": str(tmp_path / "tp"), "tp_model": str(tmp_path / "model")})]  # fmt: skip
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    tp = ActivationStore(tmp_path / "tp")
    assert tp.manifest["complete"] and tp.manifest["world_size"] == 1
    assert {f.name.split("-")[1] for f in (tmp_path / "tp").glob("shard-*")} == {"r0"}
    whole = TransformerBridge.from_pretrained(str(tmp_path / "model"), tokenizer=char_tokenizer())
    one = run({**opts, "out": str(tmp_path / "one")}, whole)
    assert torch.equal(tp.tokens.to_tensor(), one.tokens.to_tensor())
    torch.testing.assert_close(tp.read().to_tensor(), one.read().to_tensor(), atol=1e-5, rtol=1e-5)


@pytest.mark.real
def test_smollm2_rows_equal_the_model_on_each_window(smollm2, tmp_path):
    texts = ["The Eiffel Tower is located in Paris.", "Water boils at 100 degrees Celsius at sea level."]
    store = harvest(smollm2, texts, ["blocks.5.hook_resid_post"], tmp_path, context_length=8, batch_size=3,
                    progress=False)  # fmt: skip
    windows = {}
    for doc, text in enumerate(texts):
        ids = smollm2.to_tokens(text, prepend_bos=False)[0]
        for start in range(0, len(ids), 8):
            windows[(doc, start)] = ids[start : start + 8]
    _check_against_windows(smollm2, store, windows, ["blocks.5.hook_resid_post"], atol=1e-4)
