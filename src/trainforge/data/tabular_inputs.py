"""Column-store inputs of ``trainforge prepare``: Parquet files (pyarrow) and Hugging Face
datasets (a ``save_to_disk`` directory, or a ``load_dataset`` name that resolves without the
network), one document per row of the text column, as a ``.jsonl`` file gives one per line.

Both are read as Arrow record batches, one batch in memory at a time. pyarrow (the
``parquet`` extra) and ``datasets`` (the ``datasets`` extra) are imported only here, only
when such an input is named; without them the input is refused with the install line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trainforge.errors import DataError

HF_PREFIX = "hf:"
BATCH_ROWS = 4096


@dataclass(frozen=True)
class HFDataset:
    """A Hugging Face dataset input: ``path`` is a ``save_to_disk`` directory, or ``name`` a
    ``load_dataset`` argument (``hf:NAME[:CONFIG][@SPLIT]`` on the command line)."""

    spec: str  # as the user wrote it, for messages
    path: Path | None = None
    name: str | None = None
    config: str | None = None
    split: str | None = None

    def __str__(self) -> str:
        return self.spec


def is_hf_dataset_dir(p: Path) -> bool:
    """A ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` directory."""
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def parse_hf_spec(spec: str) -> HFDataset:
    """``hf:NAME[:CONFIG][@SPLIT]`` -> an ``HFDataset`` for ``load_dataset``."""
    rest = spec[len(HF_PREFIX):]
    rest, _, split = rest.partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise DataError(f"--input {spec}: no dataset name; write hf:NAME[:CONFIG][@SPLIT]")
    return HFDataset(spec, name=name, config=config or None, split=split or None)


def _column_batches(batches: Iterable, where: str, text_field: str) -> Iterator[str]:
    """Non-empty strings of ``text_field`` over Arrow record batches / tables, row by row."""
    row = 0
    for batch in batches:
        col = batch.column(text_field)
        if col.null_count:
            first = next(i for i, v in enumerate(col.is_null().to_pylist()) if v)
            raise DataError(f"{where}: row {row + first} has no text (null in column '{text_field}'); "
                            "drop or fill the null rows")
        for text in col.to_pylist():
            if text:
                yield text
        row += len(col)


def _check_column(schema, where: str, text_field: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        raise DataError(f"{where}: no column '{text_field}' (columns: {', '.join(schema.names)}); "
                        "choose the text column with --text_field")
    t = schema.field(text_field).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)):
        raise DataError(f"{where}: column '{text_field}' holds {t}, not strings; choose the text column with "
                        "--text_field")


def parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"--input {path}: a Parquet file; reading it needs pyarrow: "
                        "pip install 'trainforge[parquet]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid / OSError: a damaged or truncated file
        raise DataError(f"--input {path}: not a readable Parquet file ({str(e).splitlines()[0]}); "
                        "replace it or leave it out of --input") from None
    _check_column(pf.schema_arrow, str(path), text_field)
    yield from _column_batches(pf.iter_batches(batch_size=BATCH_ROWS, columns=[text_field]), str(path), text_field)


def _import_datasets(spec: str):
    # No network at run time: a name resolves from a local directory or the Hugging Face cache.
    # Set before the import, which reads them (the hub client too).
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        import huggingface_hub.constants
    except ImportError:
        raise DataError(f"--input {spec}: a Hugging Face dataset; reading it needs the datasets package: "
                        "pip install 'trainforge[datasets]'") from None
    # Imported earlier in this process (a library caller, a test): their flags were read from the
    # environment then, so they are set as the variables would have set them.
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    return datasets


def _load(src: HFDataset):
    datasets = _import_datasets(src.spec)
    if src.path is not None:
        try:
            ds = datasets.load_from_disk(str(src.path))
        except Exception as e:  # damaged arrow files, a version it cannot read
            raise DataError(f"--input {src.spec}: not a readable Hugging Face dataset directory "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                            "write it again with save_to_disk") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"--input {src.spec}: a DatasetDict with splits {sorted(ds)} and no 'train'; "
                                f"name the split's directory, e.g. --input {src.path / sorted(ds)[0]}")
            ds = ds["train"]
        return ds
    try:
        return datasets.load_dataset(src.name, src.config, split=src.split or "train")
    except Exception as e:  # not found offline, unknown split or config, a script it will not run
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"--input {src.spec}: load_dataset failed ({type(e).__name__}: {first:.200}); "
                        "a name must resolve without the network (a local directory, or a dataset already in "
                        "the Hugging Face cache)") from None


def hf_documents(src: HFDataset, text_field: str) -> Iterator[str]:
    ds = _load(src)
    _check_column(ds.data.schema, src.spec, text_field)
    # The arrow format honours an indices mapping (a select or shuffle before save_to_disk).
    batches = ds.select_columns([text_field]).with_format("arrow").iter(batch_size=BATCH_ROWS)
    yield from _column_batches(batches, src.spec, text_field)


def hf_fingerprint(src: HFDataset) -> str:
    """Identity of a dataset input for the manifest: its directory's file names and sizes, or
    its name."""
    if src.path is None:
        return src.spec
    return ";".join(f"{f.relative_to(src.path)}:{f.stat().st_size}" for f in sorted(src.path.rglob("*"))
                    if f.is_file())
