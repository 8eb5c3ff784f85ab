"""Write safetensors files one tensor at a time, sharded with an index above a size limit;
map one without reading it.

``safetensors.torch.save_file`` takes every tensor at once: an export that casts to bf16
or quantises would hold a second, converted copy of the whole model before writing a byte.
The format is simple and public (an 8-byte little-endian header length, a JSON header with
each tensor's dtype, shape and byte range, then the bytes in that order), so the header is
written from the planned shapes and each tensor is produced, written and dropped in turn:
peak memory is the model plus its largest converted tensor. The files are read back by
``safetensors`` itself in the tests; Hugging Face's sharding convention
(``model-00001-of-00002.safetensors`` + ``model.safetensors.index.json``) is followed.

``map_safetensors`` is the reading side of the same idea: every tensor a zero-copy view of a
private memory map of the file, so an export reads each weight from disk when it writes it
and the kernel can drop the pages after (file-backed, clean): a model larger than RAM
exports. ``safetensors.safe_open(...).get_tensor`` copies each tensor into new memory.
"""

from __future__ import annotations

import json
import mmap
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


_FROM_NAME = {v: k for k, v in _DTYPES.items()}


def map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` as a view of a copy-on-write map of it
    (nothing read until touched; writing a tensor never reaches the file). The header is
    checked as ``safetensors`` checks it (known dtypes, byte ranges inside the data, each
    range the size its dtype and shape say); ``ValueError`` names what is wrong."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        size = f.seek(0, 2)
        if n > size - 8 or n > 100 << 20:
            raise ValueError(f"header length {n} does not fit the file's {size} bytes")
        f.seek(8)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data = 8 + n
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 0 else None
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _FROM_NAME[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r:.80}: bad header entry {info!r:.120}") from None
        count = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"tensor {name!r:.80}: negative dim in {shape}")
            count *= d
        item = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= size - data or end - begin != count * item:
            raise ValueError(f"tensor {name!r:.80}: byte range [{begin}, {end}) does not fit its {info['dtype']} "
                             f"{shape} or the file")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=data + begin)
        out[name] = t.view(dtype).view(shape)
    return out
