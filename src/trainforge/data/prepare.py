"""``trainforge prepare``: text -> tokenizer + memory-mappable token shards + manifest.

Layout of an output directory::

    manifest.json        format, dtype, vocab size, eos id, tokenizer hash,
                         every shard's token count and sha256, per split
    tokenizer.json       Hugging Face tokenizers file (trained here or copied)
    train_00000.bin ...  raw little-endian token ids (uint16 if vocab <= 65536, else uint32)
    val_00000.bin ...

Documents are joined with the end-of-text token. A document goes to the
validation split by a hash of its text (stable when the input order changes);
if that leaves a split empty, the token stream's tail is used instead.
Everything is written into a temporary directory and renamed into place last,
so an interrupted prepare never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainforge.data.corpus import default_corpus_files, fingerprint, iter_documents, resolve_inputs
from trainforge.data.tokenizer import eos_id, load_tokenizer, train_tokenizer
from trainforge.errors import DataError
from trainforge.data.tabular_inputs import HF_PREFIX
from trainforge.storage.atomic import commit_directory, make_temp_dir
from trainforge.storage.output_paths import refuse_overlap
from trainforge.storage.manifest import sha256_file  # noqa: F401  (also imported from here by callers)

MANIFEST = "manifest.json"
FORMAT = "trainforge-tokens"
FORMAT_VERSION = 1


@dataclass
class PrepareOptions:
    vocab_size: int = 8192
    val_fraction: float = 0.05
    shard_tokens: int = 1 << 24
    text_field: str = "text"
    tokenizer: str | None = None  # reuse this tokenizer.json instead of training one

    def validate(self) -> None:
        if not 257 <= self.vocab_size <= 1 << 20:
            raise DataError(f"--vocab_size {self.vocab_size}: must be in [257, 1048576]")
        if not 0.0 < self.val_fraction < 0.5:
            raise DataError(f"--val_fraction {self.val_fraction}: must be in (0, 0.5)")
        if self.shard_tokens < 1024:
            raise DataError(f"--shard_tokens {self.shard_tokens}: must be >= 1024")


def _is_val(text: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(text.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def _write_shards(out: Path, split: str, tokens: np.ndarray, shard_tokens: int) -> list[dict]:
    entries = []
    for i, start in enumerate(range(0, len(tokens), shard_tokens)):
        name = f"{split}_{i:05d}.bin"
        chunk = tokens[start:start + shard_tokens]
        chunk.astype(chunk.dtype.newbyteorder("<"), copy=False).tofile(out / name)
        entries.append({"file": name, "tokens": int(len(chunk)), "sha256": sha256_file(out / name)})
    return entries


def prepare(inputs: list[str] | None, output: str | Path, opts: PrepareOptions, log=print) -> Path:
    """Tokenise ``inputs`` (None = the built-in corpus) into ``output``. Returns ``output``.

    Refuses to overwrite an existing prepared directory (nothing is lost)."""
    opts.validate()
    output = Path(output)
    if (output / MANIFEST).exists():
        raise DataError(f"--output {output}: already holds prepared data ({MANIFEST}); "
                        "choose another directory or delete it first")
    named = [("--input", i) for i in inputs or [] if not str(i).startswith(HF_PREFIX) or Path(i).exists()]
    refuse_overlap(output, "--output", named + ([("--tokenizer", opts.tokenizer)] if opts.tokenizer else []))
    files = resolve_inputs(inputs) if inputs else default_corpus_files()
    if inputs:  # what a glob matched, and a symlink's target
        refuse_overlap(output, "--output", [("--input", f) for f in files if isinstance(f, Path)])
    docs = list(iter_documents(files, opts.text_field))
    if not docs:
        raise DataError(f"inputs {inputs}: no text found (all files empty)")
    n_bytes = sum(len(d.encode("utf-8", errors="replace")) for d in docs)
    log(f"prepare: {len(files)} files, {len(docs)} documents, {n_bytes / 1e6:.1f} MB of text")

    if opts.tokenizer:
        tok = load_tokenizer(opts.tokenizer)
        log(f"prepare: reusing tokenizer {opts.tokenizer} (vocab {tok.get_vocab_size()})")
    else:
        tok = train_tokenizer(docs, opts.vocab_size)
        log(f"prepare: trained byte-level BPE tokenizer, vocab {tok.get_vocab_size()}")
    vocab_size = tok.get_vocab_size()
    eos = eos_id(tok)
    dtype = np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)

    is_val = [_is_val(d, opts.val_fraction) for d in docs]
    ids = [e.ids for e in tok.encode_batch(docs)]
    streams: dict[str, list[int]] = {"train": [], "val": []}
    for doc_ids, v in zip(ids, is_val):
        stream = streams["val" if v else "train"]
        stream.extend(doc_ids)
        stream.append(eos)
    if not streams["val"] or not streams["train"]:
        # Too few documents for a hash split: hold out the tail of the token stream.
        allt = streams["train"] + streams["val"]
        cut = max(1, int(len(allt) * (1 - opts.val_fraction)))
        streams = {"train": allt[:cut], "val": allt[cut:]}
    if len(streams["val"]) < 2 or len(streams["train"]) < 2:
        raise DataError(f"inputs {inputs}: only {len(streams['train']) + len(streams['val'])} tokens; "
                        "need more text for a train/validation split")

    tmp = make_temp_dir(output)
    try:
        tok.save(str(tmp / "tokenizer.json"))
        splits = {}
        for split, stream in streams.items():
            splits[split] = _write_shards(tmp, split, np.asarray(stream, dtype=dtype), opts.shard_tokens)
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": vocab_size,
            "eos_id": eos,
            "tokenizer": {"file": "tokenizer.json", "sha256": sha256_file(tmp / "tokenizer.json")},
            "splits": splits,
            "source": {"files": len(files), "documents": len(docs), "bytes": n_bytes,
                       "fingerprint": fingerprint(files), "val_fraction": opts.val_fraction},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if output.exists():
            if any(output.iterdir()):
                raise DataError(f"--output {output}: exists and is not empty; choose an empty or new directory")
            output.rmdir()
        commit_directory(tmp, output)  # fsynced; of two racing prepares one wins (OSError for the other)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    counts = {s: sum(e["tokens"] for e in v) for s, v in splits.items()}
    log(f"prepare: wrote {counts['train']:,} train and {counts['val']:,} val tokens to {output}")
    return output


def default_data_dir(vocab_size: int, cache_dir: str | None = None, tokenizer: str | Path | None = None) -> Path:
    """The built-in corpus, prepared once per (Python stdlib, vocab size) and cached; with
    ``tokenizer`` (a tokenizer.json: a fine-tuned model's), tokenised with it instead, once
    per (stdlib, that file's sha256), and ``vocab_size`` is unused.

    Concurrent callers (several ranks) race safely: the loser's rename fails and it
    uses the winner's directory."""
    root = Path(cache_dir) if cache_dir else Path(os.environ.get("TRAINFORGE_CACHE", Path.home() / ".cache" / "trainforge"))
    files = default_corpus_files()
    if tokenizer is not None:
        out = root / "data" / f"stdlib-{fingerprint(files)}-tok{sha256_file(Path(tokenizer))[:16]}"
        opts = PrepareOptions(tokenizer=str(tokenizer))
    else:
        out = root / "data" / f"stdlib-{fingerprint(files)}-v{vocab_size}"
        opts = PrepareOptions(vocab_size=vocab_size)
    if (out / MANIFEST).exists():
        return out
    try:
        prepare(None, out, opts)
    except DataError:
        if (out / MANIFEST).exists():
            return out
        raise
    except OSError:
        if (out / MANIFEST).exists():
            return out
        raise
    return out
