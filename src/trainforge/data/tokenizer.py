"""Byte-level BPE tokenizers, trained locally with Hugging Face ``tokenizers``
(no download). Byte-level means any UTF-8 text round-trips exactly."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainforge.errors import DataError

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens, ever
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses on bad JSON
        raise DataError(f"tokenizer file {path} could not be read: {e}") from None
    eos_id(tok, path)
    return tok


# Document separators used by common tokenizer families, ours first.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")


def eos_id(tok: Tokenizer, path: str | Path = "tokenizer") -> int:
    """The id that separates documents in the token stream."""
    for name in _EOS_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"{path}: no end-of-text special token (one of {list(_EOS_CANDIDATES)}); "
                    "add one, or let `trainforge prepare` train a tokenizer")
