"""Shard files and the manifest: safetensors written whole or not at all, read back memory-mapped.

A shard is a safetensors file (the documented layout: an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}`` plus ``__metadata__``, then the raw bytes). It is written here
directly from the tensors' memory (no intermediate copy; ``file.write`` releases the GIL, so a writer thread
overlaps the next forward), to a temporary name, flushed to disk, then renamed: a crash leaves either the
complete shard or a temporary file that never counts. The manifest, a small JSON file, is replaced the same
way after each shard. Reading maps the file once (`mmap`, copy-on-write) and views each tensor in it.
"""

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# safetensors dtype names
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
FROM_NAME = {v: k for k, v in DTYPES.items()}
ALIGN = 8


class ShardFileError(OSError):
    """A shard or manifest that cannot be read (truncated, not safetensors, or from another tool)."""


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename inside it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems without directory fsync
        pass
    finally:
        os.close(fd)


def write_shard(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> int:
    """Write ``tensors`` (CPU, contiguous) as one safetensors file at ``path``, atomically; returns its size.

    The bytes go to ``.<name>.tmp`` beside it, are flushed with fsync, and the file is renamed into place; on
    any error the temporary file is removed and the error re-raised, so ``path`` is complete or absent.

    Example:
        >>> write_shard(Path("shard.safetensors"), {"x": torch.zeros(4, 3)}, {"format": "pt"})
        144
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    # Widest elements first: every tensor then starts at a multiple of its element size (the header is padded
    # to 8 bytes), so it can be viewed in place when read back.
    tensors = dict(sorted(tensors.items(), key=lambda item: -item[1].element_size()))
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % ALIGN)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for t in tensors.values():
                if t.numel():
                    f.write(_bytes(t))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return 8 + len(text) + offset


def _bytes(t: Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy (bfloat16 and bool through same-width integer views)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


class Shard:
    """One shard file opened for reading: ``tensors`` are views of one copy-on-write memory map of it (zero-copy
    slices), and `read_rows` copies chosen rows with ``pread``.

    Why both: a page fault on a mapped file maps its neighbours too (the kernel's fault-around, 64 kB), so
    gathering scattered rows through the map makes the resident set grow with the pages touched, up to the
    whole file; `read_rows` copies exactly the rows asked for, and the resident set stays that of the output.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self.fd = os.open(path, os.O_RDONLY)
        except (OSError, ValueError, struct.error) as e:
            raise ShardFileError(f"{path} is not a readable safetensors file ({e}).") from e
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        start = 8 + n
        raw = torch.frombuffer(self.map, dtype=torch.uint8)
        self.tensors: dict[str, Tensor] = {}
        self.offsets: dict[str, int] = {}  # where each tensor's bytes start in the file
        for name, spec in header.items():
            begin, end = spec["data_offsets"]
            if start + end > size:
                raise ShardFileError(f"{path} is truncated: {name!r} ends at byte {start + end} of {size}.")
            dtype = FROM_NAME[spec["dtype"]]
            view = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}.get(dtype, dtype)
            chunk = raw[start + begin : start + end]
            t = chunk.view(view) if chunk.numel() else torch.empty(0, dtype=view)
            self.tensors[name] = (t.view(dtype) if view != dtype else t).reshape(spec["shape"])
            self.offsets[name] = start + begin

    def read_rows(self, name: str, rows: Tensor, out: Tensor) -> None:
        """Copy rows ``rows`` (sorted, in range) of tensor ``name`` into ``out`` (contiguous, ``[len(rows), ...]``),
        one ``pread`` per run of consecutive rows."""
        if rows.numel() == 0:
            return
        like = self.tensors[name]
        row_bytes = like[0].numel() * like.element_size() if like.shape[0] else 0
        target = memoryview(_bytes_view(out))
        breaks = ((rows[1:] - rows[:-1]) != 1).nonzero().reshape(-1).add(1).tolist()
        starts = [0, *breaks]
        ends = [*breaks, rows.numel()]
        first = rows[starts].tolist()
        base = self.offsets[name]
        for lo, hi, row in zip(starts, ends, first, strict=True):
            want = (hi - lo) * row_bytes
            got = os.preadv(self.fd, [target[lo * row_bytes : hi * row_bytes]], base + row * row_bytes)
            if got != want:
                raise ShardFileError(f"{self.path}: read {got} of {want} bytes of {name!r} (the file shrank?).")

    def close(self) -> None:
        os.close(self.fd)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _bytes_view(t: Tensor) -> Tensor:
    """``t`` (contiguous) as a flat uint8 tensor sharing its memory."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def read_shard(path: Path) -> tuple[dict[str, Tensor], dict[str, str], Shard]:
    """``({name: tensor}, metadata, shard)`` of a safetensors file, every tensor a view of one memory map of it.

    Example:
        >>> tensors, meta, _ = read_shard(Path("shard.safetensors"))
    """
    shard = Shard(path)
    return shard.tensors, shard.metadata, shard


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON atomically (temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_json(path: Path) -> dict[str, Any]:
    """A manifest as a dict, or `ShardFileError` saying what is wrong with it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ShardFileError(f"{path} is not a readable manifest ({e}).") from e
