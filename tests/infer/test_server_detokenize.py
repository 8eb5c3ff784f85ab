"""Streamed text is decoded incrementally (``DecodeStream``) and is exactly what a full
decode of the same ids gives: for text whose emoji and CJK characters the byte-level BPE
splits across tokens, and for random ids (invalid UTF-8 included); nothing streamed is a
half character; stop strings still cut the text and never stream."""

from __future__ import annotations

import random

import pytest

from trainforge.data.tokenizer import load_tokenizer
from trainforge.infer.request import Request
from trainforge.infer.sampling import SamplingParams

TEXT = "def grüß(): return '😀 世界 naïve ✓' # 🤖🧠 ok\n"


@pytest.fixture(scope="module")
def tok(small_data):
    return load_tokenizer(small_data / "tokenizer.json")


def stream(tok, ids: list[int], per_update: int = 1, **params) -> tuple[Request, list[str], str | None]:
    req = Request(0, [1], SamplingParams(**{"max_new_tokens": len(ids), "ignore_eos": True, **params}))
    deltas, reason = [], None
    for i in range(0, len(ids), per_update):
        _, delta, reason = req.add_tokens(ids[i:i + per_update], (), tok)
        deltas.append(delta)
        if reason:
            break
    return req, deltas, reason


@pytest.mark.parametrize("per_update", [1, 3, 8])  # 1 on CPU; CUDA reads 8 steps at a time
def test_multibyte_characters_split_across_tokens_stream_whole_and_match_the_full_decode(tok, per_update):
    ids = tok.encode(TEXT).ids
    assert len(ids) > len(TEXT.encode()) // 2  # vocab 512 on Python code: the emoji and CJK are byte tokens
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens hold part of a character
    req, deltas, reason = stream(tok, ids, per_update)
    assert reason == "length" and req.text == tok.decode(ids) == TEXT
    assert "".join(deltas) == TEXT and all("\ufffd" not in d for d in deltas)
    assert sum(d == "" for d in deltas) >= (3 if per_update == 1 else 0)  # an emoji's first bytes show nothing yet


def test_random_ids_match_the_full_decode_at_the_end(tok):
    rng = random.Random(0)
    V = tok.get_vocab_size()
    for trial in range(50):
        ids = [rng.randrange(V) for _ in range(rng.randrange(1, 80))]
        req, deltas, _ = stream(tok, ids, per_update=rng.choice([1, 2, 5]))
        assert req.text == tok.decode(ids), trial
        assert "".join(deltas) == req.text, trial  # never retracted: the deltas add up to the text


def test_stop_strings_are_honoured_with_incremental_decoding(tok):
    ids = tok.encode(TEXT).ids
    req, deltas, reason = stream(tok, ids, stop=("世界",))
    assert reason == "stop" and req.text == "def grüß(): return '😀 " and "".join(deltas) == req.text
    assert all("世" not in d for d in deltas)
    req, deltas, reason = stream(tok, ids, stop=("🤖", "naïve"))  # the earliest wins
    assert reason == "stop" and req.text == "def grüß(): return '😀 世界 " == "".join(deltas)
