"""Write safetensors files one tensor at a time, sharded with an index above a size limit.

``safetensors.torch.save_file`` takes every tensor at once: an export that casts to bf16
or quantises would hold a second, converted copy of the whole model before writing a byte.
The format is simple and public (an 8-byte little-endian header length, a JSON header with
each tensor's dtype, shape and byte range, then the bytes in that order), so the header is
written from the planned shapes and each tensor is produced, written and dropped in turn:
peak memory is the model plus its largest converted tensor. The files are read back by
``safetensors`` itself in the tests; Hugging Face's sharding convention
(``model-00001-of-00002.safetensors`` + ``model.safetensors.index.json``) is followed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
           torch.bool: "BOOL"}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class Entry:
    """One tensor to write: its name, planned shape and dtype, and a function producing it."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _write_file(path: Path, entries: list[Entry], metadata: dict[str, str]) -> None:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            t = e.produce()
            if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                raise RuntimeError(f"{e.name}: produced {t.dtype} {tuple(t.shape)}, planned {e.dtype} {e.shape}")
            t = t.detach().to("cpu").contiguous()
            if t.numel():
                f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
            del t


def shard_plan(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Entries in order, cut into shards of at most ``max_shard_bytes`` (a bigger tensor alone)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_sharded(out_dir: Path, entries: list[Entry], max_shard_bytes: int,
                  metadata: dict[str, str] | None = None) -> list[Path]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + the index when the
    tensors exceed ``max_shard_bytes``. Returns the files written."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names: {sorted({n for n in names if names.count(n) > 1})[:5]}")
    shards = shard_plan(entries, max_shard_bytes)
    if len(shards) == 1:
        _write_file(out_dir / SINGLE_FILE, shards[0], metadata or {})
        return [out_dir / SINGLE_FILE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_file(out_dir / name, shard, metadata or {})
        files.append(out_dir / name)
        weight_map.update({e.name: name for e in shard})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files + [out_dir / INDEX_FILE]
