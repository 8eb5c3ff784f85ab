"""`trainforge prepare` reads its inputs as what they are: compressed files decompressed (by
their magic number, whatever the suffix says), Parquet and Hugging Face datasets read by
column, and any other binary file refused with one line naming it, before anything is written.
Every readable form of one corpus gives the very same tokenizer and token shards."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
from pathlib import Path

import fsspec
import pytest

from tests.faults.conftest import one_error_line, run_cli
from trainforge.data.prepare import PrepareOptions, prepare
from trainforge.errors import DataError

QUIET = {"log": lambda *_: None}
OPTS = PrepareOptions(vocab_size=300, val_fraction=0.1)
DOCS = [f"record {i}: the quick brown fox number {i * 7} jumps over the lazy dog\n" * (1 + i % 3) for i in range(80)]


def _outputs(out: Path) -> dict[str, str]:
    """What training reads: the tokenizer and every shard, by sha256 (the manifest's own record)."""
    m = json.loads((out / "manifest.json").read_text())
    shards = {e["file"]: e["sha256"] for split in m["splits"].values() for e in split}
    return {"tokenizer": m["tokenizer"]["sha256"], **shards}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    jsonl = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS)).encode()
    (d / "docs.jsonl").write_bytes(jsonl)
    (d / "docs.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (d / "docs.jsonl.bz2").write_bytes(bz2.compress(jsonl))
    (d / "docs.jsonl.xz").write_bytes(lzma.compress(jsonl))
    with fsspec.open(str(d / "docs.jsonl.zst"), "wb", compression="zstd") as fh:  # as prepare reads it
        fh.write(jsonl)
    (d / "misnamed").mkdir()
    (d / "misnamed" / "docs.jsonl").write_bytes(gzip.compress(jsonl))  # gzip bytes behind a .jsonl name
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(DOCS))), "body": DOCS})
    pq.write_table(table, d / "docs.parquet", row_group_size=16)  # several row groups
    return d


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[str, str]:
    return _outputs(prepare([str(corpus / "docs.jsonl")], tmp_path_factory.mktemp("ref") / "out", OPTS, **QUIET))


@pytest.mark.parametrize("name", ["docs.jsonl.gz", "docs.jsonl.bz2", "docs.jsonl.xz", "docs.jsonl.zst",
                                  "misnamed/docs.jsonl"])
def test_compressed_jsonl_gives_the_same_tokens_as_plain(corpus, reference, tmp_path, name):
    out = prepare([str(corpus / name)], tmp_path / "out", OPTS, **QUIET)
    assert _outputs(out) == reference


def test_parquet_column_gives_the_same_tokens_as_jsonl(corpus, reference, tmp_path):
    opts = PrepareOptions(vocab_size=300, val_fraction=0.1, text_field="body")
    assert _outputs(prepare([str(corpus / "docs.parquet")], tmp_path / "out", opts, **QUIET)) == reference
    with pytest.raises(DataError, match=r"docs.parquet: no column 'text' \(columns: id, body\).*--text_field"):
        prepare([str(corpus / "docs.parquet")], tmp_path / "out2", OPTS, **QUIET)
    assert not (tmp_path / "out2").exists()


def test_hugging_face_dataset_directory_and_load_dataset_spec(corpus, reference, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # load_dataset's cache, not the user's
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    ds = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert _outputs(prepare([str(tmp_path / "ds")], tmp_path / "out", OPTS, **QUIET)) == reference
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    assert _outputs(prepare([str(tmp_path / "dd")], tmp_path / "out_dd", OPTS, **QUIET)) == reference
    # A load_dataset name that resolves locally: a directory of data files, its split by file name.
    (tmp_path / "repo" / "data").mkdir(parents=True)
    ds.to_parquet(str(tmp_path / "repo" / "data" / "train.parquet"))
    out = prepare([f"hf:{tmp_path / 'repo'}@train"], tmp_path / "out_spec", OPTS, **QUIET)
    assert _outputs(out) == reference
    with pytest.raises(DataError, match="hf:no-such/dataset-xyz: load_dataset failed.*without the network"):
        prepare(["hf:no-such/dataset-xyz"], tmp_path / "out_missing", OPTS, **QUIET)


def test_text_files_compressed_read_as_the_same_text(tmp_path):
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    for i, text in enumerate(DOCS[:30]):
        (plain / f"{i:02d}.txt").write_text(text.replace("\n", "\r\n"))  # newlines translated as before
        (packed / f"{i:02d}.txt.gz").write_bytes(gzip.compress(text.replace("\n", "\r\n").encode()))
    a = prepare([str(plain)], tmp_path / "a", OPTS, **QUIET)
    b = prepare([str(packed)], tmp_path / "b", OPTS, **QUIET)
    assert _outputs(a) == _outputs(b)


def test_binary_and_damaged_inputs_are_refused_with_one_line_and_nothing_written(corpus, tmp_path):
    blob = tmp_path / "weights.txt"
    blob.write_bytes(os.urandom(64 << 10))
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes((corpus / "docs.jsonl.gz").read_bytes()[:-40])
    tarball = tmp_path / "docs.tar.gz"
    import tarfile

    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(corpus / "docs.jsonl", arcname="docs.jsonl")
    cases = {blob: "binary data", truncated: "damaged or truncated gzip", tarball: "gzip-compressed a tar archive"}
    for bad, what in cases.items():
        out = tmp_path / f"out-{bad.name}"
        r = run_cli(["prepare", "--input", str(corpus / "docs.jsonl"), str(bad), "--output", str(out),
                     "--vocab_size", "300"])
        line = one_error_line(r.stderr)
        assert r.returncode == 2 and str(bad) in line and what in line, r.stderr
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # The in-process check of the sniff itself: not UTF-8 at all, and Latin-1 with a few accents.
    greek = tmp_path / "greek.txt"
    greek.write_bytes("καλημέρα κόσμε, ".encode("iso-8859-7") * 200)
    with pytest.raises(DataError, match="greek.txt: not UTF-8 text.*iconv"):
        prepare([str(greek)], tmp_path / "g", OPTS, **QUIET)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(("the café on the corner " * 50 + "\n").encode("latin-1") * 20)
    assert (prepare([str(latin)], tmp_path / "l", OPTS, **QUIET) / "manifest.json").is_file()
