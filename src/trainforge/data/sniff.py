"""What an input file of ``trainforge prepare`` is, from its first bytes rather than its name.

A compressed file is decompressed by its magic number (gzip, bzip2, xz, zstd: fsspec's codecs),
whatever its suffix says: ``d.jsonl`` holding gzip bytes is read as the JSON lines inside, and
``d.jsonl.gz`` is never tokenised as gzip bytes. Parquet is recognised by its ``PAR1`` magic.
Anything else binary (NUL bytes, mostly invalid UTF-8, a known binary magic) is refused with one
line naming the file and what to do, before anything is written. Text keeps being read as it
always was: UTF-8, undecodable bytes replaced, universal newlines.
"""

from __future__ import annotations

import codecs
import importlib
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from trainforge.errors import DataError

HEAD_BYTES = 8192  # what is sniffed: enough for any magic and a fair sample of the text
# Decompressed by magic number; the names are fsspec's compression codecs.
_CODECS = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
# A directory walk picks these up after a text suffix (``notes.txt.gz``, ``part-0.jsonl.zst``).
COMPRESSED_SUFFIXES = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
PARQUET_MAGIC = b"PAR1"
READS = "prepare reads UTF-8 text, .jsonl and Parquet, plain or .gz/.bz2/.xz/.zst"
# Binary formats a user may pass by mistake, each named in the refusal with what to do instead.
_BINARY_MAGIC = (
    (b"PK\x03\x04", "a zip archive", "unzip it and pass the text files"),
    (b"7z\xbc\xaf\x27\x1c", "a 7z archive", "extract it and pass the text files"),
    (b"\x04\x22\x4d\x18", "an LZ4 file", "decompress it, or recompress it with gzip, xz or zstd"),
    (b"%PDF-", "a PDF document", "extract its text first (e.g. pdftotext)"),
    (b"\x7fELF", "an executable", "leave it out of --input"),
    (b"\x89PNG", "a PNG image", "leave it out of --input"),
    (b"\xff\xd8\xff", "a JPEG image", "leave it out of --input"),
    (b"GGUF", "a GGUF model file", "leave it out of --input"),
    (b"\x93NUMPY", "a NumPy array", "leave it out of --input"),
    (b"SQLite format 3\x00", "an SQLite database", "export the text to .jsonl or Parquet"),
    (b"ARROW1", "an Arrow file", "pass the Hugging Face dataset directory that holds it, or write it as Parquet"),
    (b"\xff\xfe", "UTF-16 text", "convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"),
    (b"\xfe\xff", "UTF-16 text", "convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"),
)
# Share of a text's first bytes that may be undecodable before it counts as not UTF-8: a Latin-1
# file with a few accented letters still reads (replaced, as before); a binary or a Greek
# ISO-8859-7 file does not silently become a tokenizer trained on U+FFFD.
MAX_INVALID_SHARE = 0.10


@dataclass(frozen=True)
class Sniffed:
    kind: str  # "text" (plain text or .jsonl, by the name) or "parquet"
    codec: str | None  # fsspec compression name, None for an uncompressed file


def codec_of(head: bytes) -> str | None:
    return next((name for magic, name in _CODECS if head.startswith(magic)), None)


def binary_reason(head: bytes) -> str | None:
    """Why ``head`` (a file's first bytes, decompressed) is not text, with the fix; None for text."""
    for magic, what, fix in _BINARY_MAGIC:
        if head.startswith(magic):
            return f"{what}, not text; {fix}"
    if len(head) > 262 and head[257:262] == b"ustar":
        return "a tar archive, not text; extract it and pass the text files"
    if b"\0" in head:
        return "binary data (NUL bytes in its first 8 KiB), not text; leave it out of --input"
    # final=False: a character cut by the end of the sample is not counted as invalid.
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=False)
    bad = text.count("\ufffd") - head.count("\ufffd".encode())
    if text and bad / len(text) > MAX_INVALID_SHARE:
        return (f"not UTF-8 text ({100 * bad / len(text):.0f}% of its first 8 KiB does not decode); "
                "convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)")
    return None


def decompress_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a damaged compressed stream raises while it is read (gzip, bz2, xz, zstd)."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, lzma.LZMAError)
    for module in ("zstandard", "compression.zstd", "backports.zstd"):  # whichever fsspec's zstd codec uses
        try:
            errors += (importlib.import_module(module).ZstdError,)
        except ImportError:
            pass
    return errors


def open_binary(path: Path, codec: str | None) -> IO[bytes]:
    """``path``'s bytes, decompressed with fsspec's ``codec`` (None: the file as it is)."""
    if codec is None:
        return open(path, "rb")
    import fsspec

    try:
        return fsspec.open(str(path), "rb", compression=codec).open()
    except ValueError:  # fsspec registers zstd only when a zstd package is importable
        raise DataError(f"--input {path}: {codec}-compressed, and no {codec} decoder is installed; "
                        "pip install zstandard (a trainforge dependency), or decompress it first") from None


def open_text(path: Path, codec: str | None) -> IO[str]:
    """The text of ``path`` as prepare has always read it: UTF-8, undecodable bytes replaced,
    universal newlines (what ``Path.read_text`` does), decompressed first when ``codec`` is set."""
    if codec is None:
        return open(path, encoding="utf-8", errors="replace")
    import io

    return io.TextIOWrapper(open_binary(path, codec), encoding="utf-8", errors="replace")


def sniff(path: Path) -> Sniffed:
    """What ``path`` holds; raises ``DataError`` (one line: the file, what it is, the fix) for
    anything prepare cannot read as text or Parquet."""
    with open(path, "rb") as fh:
        head = fh.read(HEAD_BYTES)
    codec = codec_of(head)
    if codec is not None:
        try:
            with open_binary(path, codec) as fh:
                head = fh.read(HEAD_BYTES)
        except decompress_errors() as e:
            raise damaged(path, codec, e) from None
    if head.startswith(PARQUET_MAGIC):
        if codec is not None:
            raise DataError(f"--input {path}: a {codec}-compressed Parquet file; decompress it first "
                            "(Parquet compresses its own columns)")
        return Sniffed("parquet", None)
    why = binary_reason(head)
    if why is not None:
        inside = f"{codec}-compressed " if codec else ""
        raise DataError(f"--input {path}: {inside}{why} ({READS})")
    return Sniffed("text", codec)


def damaged(path: Path, codec: str, e: BaseException) -> DataError:
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    return DataError(f"--input {path}: damaged or truncated {codec} data ({detail}); "
                     "replace the file or leave it out of --input")


def inner_suffix(path: Path) -> str:
    """The suffix that says how the (decompressed) content is laid out: ``.jsonl`` for
    ``d.jsonl.gz`` and for ``d.jsonl``."""
    p = Path(path.name)
    if p.suffix in COMPRESSED_SUFFIXES:
        p = Path(p.stem)
    return p.suffix
