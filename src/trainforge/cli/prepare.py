"""``trainforge prepare``: text tokenised into memory-mappable shards (``data/prepare.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.cli.options import Command
from trainforge.config_base import _f

DESCRIPTION = "Tokenise text into memory-mappable shards with a manifest."


@dataclass
class PrepareArgs:
    input: list[str] | None = _f(None, "text files, directories, globs, .jsonl or Parquet files (any of them "
                                       ".gz/.bz2/.xz/.zst), Hugging Face dataset directories (save_to_disk) or "
                                       "hf:NAME[:CONFIG][@SPLIT] (load_dataset, offline; the datasets extra); omit "
                                       "for the built-in corpus", nargs="+", metavar="PATH")
    output: str | None = _f(None, "new directory for manifest.json, tokenizer.json and shards", required=True,
                            metavar="DIR")
    vocab_size: int = _f(8192, "BPE vocabulary size to train")
    tokenizer: str | None = _f(None, "reuse this tokenizer.json instead of training one", metavar="FILE")
    val_fraction: float = _f(0.05, "share of documents held out for validation")
    text_field: str = _f("text", "field holding the text in .jsonl records, or column in Parquet and datasets")
    shard_tokens: int = _f(1 << 24, "tokens per shard file")


SECTIONS = {"prepare": PrepareArgs}
COMMAND = Command("prepare", DESCRIPTION, SECTIONS)


def run(argv: list[str]) -> int:
    parsed = COMMAND.parse(argv)
    if parsed is None:
        return 0
    from trainforge.data.prepare import PrepareOptions, prepare

    a = parsed.section(PrepareArgs)
    prepare(a.input, a.output, PrepareOptions(vocab_size=a.vocab_size, val_fraction=a.val_fraction,
                                              shard_tokens=a.shard_tokens, text_field=a.text_field,
                                              tokenizer=a.tokenizer))
    return 0
