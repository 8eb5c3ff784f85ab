"""Where training text comes from: user inputs (files, directories, globs, .jsonl)
and the built-in default corpus, the Python standard library's own sources, which
exist on every machine that runs trainforge, so nothing is downloaded."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from trainforge.errors import DataError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".text"}


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """Expand files, directories (recursively, text suffixes only) and globs into a
    sorted, de-duplicated file list. A pattern that matches nothing is an error."""
    files: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"--input {spec}: directory holds no text files ({sorted(TEXT_SUFFIXES)})")
            files.extend(found)
        else:
            matched = sorted(Path(m) for m in glob.glob(spec, recursive=True) if Path(m).is_file())
            if not matched:
                raise DataError(f"--input {spec}: no such file or directory, and no file matches it as a glob")
            files.extend(matched)
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def iter_documents(files: list[Path], text_field: str = "text") -> Iterator[str]:
    """One document per plain-text file, one per line of a .jsonl file (its ``text_field``)."""
    for f in files:
        if f.suffix == ".jsonl":
            with f.open(encoding="utf-8", errors="replace") as fh:
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
        else:
            text = f.read_text(encoding="utf-8", errors="replace")
            if text:
                yield text


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


def fingerprint(files: list[Path]) -> str:
    """Cheap identity of a file set (names and sizes), for naming cached preparations."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f}\0{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]
