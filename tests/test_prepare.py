import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from trainforge.data.dataset import load_prepared
from trainforge.data.prepare import PrepareOptions, prepare
from trainforge.data.tokenizer import load_tokenizer
from trainforge.errors import DataError

QUIET = {"log": lambda *_: None}


def test_manifest_matches_shards(small_data):
    manifest = json.loads((small_data / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 512
    for split in ("train", "val"):
        assert manifest["splits"][split], split
        for entry in manifest["splits"][split]:
            raw = (small_data / entry["file"]).read_bytes()
            assert hashlib.sha256(raw).hexdigest() == entry["sha256"]
            assert len(raw) == 2 * entry["tokens"]
            assert np.frombuffer(raw, dtype="<u2").max() < manifest["vocab_size"]
    tok = (small_data / "tokenizer.json").read_bytes()
    assert hashlib.sha256(tok).hexdigest() == manifest["tokenizer"]["sha256"]


def test_tokens_decode_back_to_the_text(tmp_path):
    text = "def héllo(wörld):\n    return '日本語' * 3\n"
    (tmp_path / "a.txt").write_text(text * 50)
    out = prepare([str(tmp_path / "a.txt")], tmp_path / "out", PrepareOptions(vocab_size=300), **QUIET)
    data = load_prepared(out)
    tok = load_tokenizer(data.tokenizer_path)
    ids = np.concatenate([np.asarray(s) for s in data.splits["train"] + data.splits["val"]]).tolist()
    ids = [i for i in ids if i != data.eos_id]
    assert tok.decode(ids) == text * 50  # byte-level BPE is lossless


def test_tampered_shard_is_detected(small_data, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(small_data, copy)
    load_prepared(copy)  # intact copy loads
    shard = copy / "train_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="train_00000.bin.*sha256"):
        load_prepared(copy)
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match="train_00000.bin.*truncated"):
        load_prepared(copy, verify="size")


def test_jsonl_input_and_tokenizer_reuse(tmp_path, small_data):
    rows = [{"text": f"record {i}: the quick brown fox jumps over the lazy dog " * 5, "id": i} for i in range(200)]
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = prepare([str(src)], tmp_path / "out", PrepareOptions(tokenizer=str(small_data / "tokenizer.json")), **QUIET)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["documents"] == 200
    assert manifest["tokenizer"]["sha256"] == json.loads((small_data / "manifest.json").read_text())["tokenizer"]["sha256"]


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "fine"}\n{"txt": "wrong field"}\n')
    with pytest.raises(DataError, match=r"docs.jsonl:2.*'text'"):
        prepare([str(src)], tmp_path / "out", PrepareOptions(), **QUIET)
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_prepared_data(small_data):
    before = (small_data / "manifest.json").read_text()
    with pytest.raises(DataError, match="already holds prepared data"):
        prepare([str(small_data / "tokenizer.json")], small_data, PrepareOptions(), **QUIET)
    assert (small_data / "manifest.json").read_text() == before


def test_cli_prepare_directory_and_glob(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        (docs / f"{i}.md").write_text(f"# Note {i}\n\nSome text about item {i} and its neighbours.\n" * 20)
    out = tmp_path / "prepared"
    r = subprocess.run([sys.executable, "-m", "trainforge", "prepare", "--input", str(docs), str(docs / "1*.md"),
                        "--output", str(out), "--vocab_size", "400"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = load_prepared(out)
    assert data.manifest["source"]["files"] == 30  # the glob's files are de-duplicated
    r = subprocess.run([sys.executable, "-m", "trainforge", "prepare", "--input", str(tmp_path / "nope*.txt"),
                        "--output", str(tmp_path / "o2")], capture_output=True, text=True)
    assert r.returncode == 2 and "nope*.txt" in r.stderr
