"""Where training text comes from: user inputs (files, directories, globs, .jsonl, Parquet,
Hugging Face datasets, any of the files compressed) and the built-in default corpus, the Python
standard library's own sources, which exist on every machine that runs trainforge, so nothing is
downloaded. Files are read as what their first bytes say they are (``sniff.py``)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Union

from trainforge.data.sniff import COMPRESSED_SUFFIXES, damaged, decompress_errors, inner_suffix, open_text, sniff
from trainforge.data.tabular_inputs import (HF_PREFIX, HFDataset, hf_documents, hf_fingerprint, is_hf_dataset_dir,
                                            parquet_documents, parse_hf_spec)
from trainforge.errors import DataError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".text"}
# What a directory walk reads besides TEXT_SUFFIXES: Parquet, and text compressed.
TABLE_SUFFIXES = {".parquet"}
Input = Union[Path, HFDataset]


def _walked(f: Path) -> bool:
    if f.suffix in TEXT_SUFFIXES or f.suffix in TABLE_SUFFIXES:
        return True
    return f.suffix in COMPRESSED_SUFFIXES and inner_suffix(f) in TEXT_SUFFIXES


def resolve_inputs(inputs: list[str]) -> list[Input]:
    """Expand files, directories (recursively: text suffixes, their .gz/.bz2/.xz/.zst, .parquet),
    globs, Hugging Face dataset directories (``save_to_disk``) and ``hf:NAME[:CONFIG][@SPLIT]``
    specs into a sorted, de-duplicated input list. A pattern that matches nothing is an error."""
    files: list[Input] = []
    for spec in inputs:
        p = Path(spec)
        if spec.startswith(HF_PREFIX) and not p.exists():
            files.append(parse_hf_spec(spec))
        elif p.is_file():
            files.append(p)
        elif p.is_dir() and is_hf_dataset_dir(p):
            files.append(HFDataset(spec, path=p))
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and _walked(f))
            if not found:
                raise DataError(f"--input {spec}: directory holds no text files ({sorted(TEXT_SUFFIXES)}, "
                                "compressed or not, or .parquet)")
            files.extend(found)
        else:
            matched = sorted(Path(m) for m in glob.glob(spec, recursive=True) if Path(m).is_file())
            if not matched:
                raise DataError(f"--input {spec}: no such file or directory, and no file matches it as a glob")
            files.extend(matched)
    seen: set = set()
    unique = []
    for f in files:
        key = f.resolve() if isinstance(f, Path) else (f.path.resolve() if f.path else f.spec)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def _jsonl_documents(fh: IO[str], f: Path, text_field: str) -> Iterator[str]:
    for lineno, line in enumerate(fh, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{f}:{lineno}: not valid JSON ({e.msg}); fix or remove the line") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise DataError(f"{f}:{lineno}: record has no string field '{text_field}' "
                            f"(choose the field with --text_field)")
        if record[text_field]:
            yield record[text_field]


def iter_documents(files: list[Input], text_field: str = "text") -> Iterator[str]:
    """One document per plain-text file, one per line of a .jsonl file (its ``text_field``),
    one per row of a Parquet file or Hugging Face dataset (its ``text_field`` column).
    Compressed files are read decompressed; any other binary file raises ``DataError``."""
    for f in files:
        if isinstance(f, HFDataset):
            yield from hf_documents(f, text_field)
            continue
        kind = sniff(f)
        if kind.kind == "parquet":
            yield from parquet_documents(f, text_field)
            continue
        try:
            with open_text(f, kind.codec) as fh:
                if inner_suffix(f) == ".jsonl":
                    yield from _jsonl_documents(fh, f, text_field)
                else:
                    text = fh.read()
                    if text:
                        yield text
        except decompress_errors() as e:
            if kind.codec is None:
                raise
            raise damaged(f, kind.codec, e) from None


# Directories left out of the built-in corpus wherever they appear under the stdlib root.
_CORPUS_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def default_corpus_files() -> list[Path]:
    """The standard library's .py files, without tests and site-packages (~12 MB on 3.11).

    The excluded directories are pruned while walking, not filtered afterwards: under
    pyenv or a system Python, site-packages sits inside the stdlib root and can hold
    thousands more files than the stdlib (a filtered ``rglob`` took 0.5-1 s of every ``trainforge
    train`` start). Same list, same order as ``sorted(root.rglob("*.py"))`` minus the
    excluded directories: symlinked directories are not descended into (as ``rglob``),
    and a matching name is kept whatever kind of entry it is (as ``rglob``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _CORPUS_EXCLUDED_DIRS]
        files.extend(Path(top, n) for n in (*names, *dirs) if n.endswith(".py"))
    files.sort()  # Path order (part by part), which is rglob's sorted order
    if not files:
        raise DataError(f"built-in corpus: no Python sources under {root}; set data.path to prepared data")
    return files


def fingerprint(files: list[Input]) -> str:
    """Cheap identity of a file set (names and sizes), for naming cached preparations."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f}\0{f.stat().st_size if isinstance(f, Path) else hf_fingerprint(f)}\n".encode())
    return h.hexdigest()[:16]
