"""The streaming safetensors writer and the mapped reader (``storage/safetensors_stream.py``):
files ``safetensors`` itself reads back exactly, sharded with Hugging Face's index, tensors
produced one at a time; the reader's views equal ``load_file``'s tensors, never write the
file, and a damaged header is refused by name."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainforge.storage.safetensors_stream import Entry, map_safetensors, write_sharded

TENSORS = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int32), "c": torch.randn(4).bfloat16(),
           "d": torch.randint(-8, 8, (2, 3), dtype=torch.int8), "e": torch.empty(0, 3), "f": torch.randn(64, 64)}


def _entries(produced: list[str]) -> list[Entry]:
    def make(k):
        def run():
            produced.append(k)
            return TENSORS[k]
        return run
    return [Entry(k, tuple(v.shape), v.dtype, make(k)) for k, v in TENSORS.items()]


def test_written_files_read_back_exactly_single_and_sharded(tmp_path):
    produced: list[str] = []
    (tmp_path / "one").mkdir()
    files = write_sharded(tmp_path / "one", _entries(produced), max_shard_bytes=1 << 30, metadata={"format": "pt"})
    assert [f.name for f in files] == ["model.safetensors"] and produced == list(TENSORS)
    back = load_file(str(files[0]))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in TENSORS.items())
    (tmp_path / "many").mkdir()
    files = write_sharded(tmp_path / "many", _entries([]), max_shard_bytes=64)  # a | b c d e | f (bigger than a shard: alone)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) >= 3 and index["metadata"]["total_size"] == sum(v.nbytes for v in TENSORS.values())
    merged = {k: v for s in shards for k, v in load_file(str(tmp_path / "many" / s)).items()}
    assert all(torch.equal(merged[k], v) for k, v in TENSORS.items())


def test_a_tensor_unlike_its_plan_is_refused(tmp_path):
    bad = [Entry("x", (2, 2), torch.float32, lambda: torch.zeros(2, 3))]
    with pytest.raises(RuntimeError, match="planned"):
        write_sharded(tmp_path, bad, max_shard_bytes=1 << 20)


def test_mapped_reader_equals_load_file_and_never_writes_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(TENSORS, str(path))
    mapped = map_safetensors(path)
    assert all(torch.equal(mapped[k], v) and mapped[k].dtype == v.dtype for k, v in TENSORS.items())
    mapped["a"].add_(1.0)  # copy-on-write: the file keeps its bytes
    assert torch.equal(load_file(str(path))["a"], TENSORS["a"])


@pytest.mark.parametrize("damage", ["short", "huge_header", "not_json", "bad_range", "bad_dtype"])
def test_mapped_reader_refuses_a_damaged_header(tmp_path, damage):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(4, 4)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if damage == "short":
        raw = raw[:5]
    elif damage == "huge_header":
        raw = struct.pack("<Q", 1 << 40) + raw[8:]
    elif damage == "not_json":
        raw = raw[:8] + b"{" * n + raw[8 + n:]
    else:
        header["a"]["data_offsets" if damage == "bad_range" else "dtype"] = [0, 10 ** 6] if damage == "bad_range" \
            else "F33"
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        raw = struct.pack("<Q", len(blob)) + blob + raw[8 + n:]
    path.write_bytes(raw)
    with pytest.raises(ValueError):
        map_safetensors(path)
