"""Hostile GGUF files cost nothing: every count, length, type and offset in the header is
bounded before it is used, and hostile model or tokenizer metadata is one line naming the
file and the key.

Each file here is the valid debug GGUF (``gguf_craft.valid_gguf``, written by gguf-py) with one
thing changed as an attacker would change it. ``bounded`` runs a load under a wall-clock alarm
and measures its peak traced allocation: gguf-py's reader looped for ever, growing, on the
68-byte file of the first test.
"""

from __future__ import annotations

import resource
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.faults.conftest import cli_env, one_error_line
from tests.faults.gguf_craft import ARRAY, STRING, KV, encode, parse, valid_gguf
from trainforge.errors import TrainforgeError
from trainforge.infer.loading import load_model

INT32, UINT8 = 5, 0


class _Overtime(Exception):
    pass


def bounded(fn, seconds: float = 10.0, max_mib: float = 64.0):
    """``fn()``'s result (or the exception it raised), failing the test when it ran past ``seconds``
    or its peak traced allocation (Python objects and numpy arrays) passed ``max_mib``."""
    def alarm(*_):
        raise _Overtime(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    try:
        try:
            return fn()
        except _Overtime:
            raise
        except BaseException as e:  # the caller checks which
            return e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        assert peak < max_mib, f"peak traced allocation {peak:.0f} MiB"


def assert_one_line(err: BaseException, path: Path, *needles: str) -> str:
    assert isinstance(err, TrainforgeError), repr(err)
    msg = str(err)
    assert "\n" not in msg and str(path) in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = valid_gguf(tmp_path_factory.mktemp("gguf") / "valid.gguf")
    return path, parse(path)


def write(tmp_path: Path, parts, name: str = "h.gguf", patch: dict[str, int] | None = None) -> Path:
    """``parts`` encoded, then each field named in ``patch`` (``Parts.fields``' what) overwritten."""
    data = bytearray(encode(parts))
    for what, value in (patch or {}).items():
        offset, width, _ = next(f for f in parts.fields if f[2] == what)
        data[offset:offset + width] = value.to_bytes(width, "little")
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def load_and_tokenize(path: Path):
    """What ``generate --prompt`` does with the file: the model (rotary tables for its KV pool, as
    generate sizes them: a long context_length alone is no cost) and its tokenizer."""
    loaded = load_model(path, kv_slots=lambda cfg: 256)
    return loaded.tokenizer


def test_a_68_byte_file_claiming_2_62_items_is_refused_by_the_cli(tmp_path):
    """The issue's file: one key, an array of uint8 that claims 2^62 items. gguf-py reads each
    item past the end as zero bytes without moving on; main grew to gigabytes with no end."""
    key = b"general.architecture"
    path = tmp_path / "bomb.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", ARRAY, UINT8, 2**62))

    def limit():  # 3 GiB of address space: torch needs ~0.7; main's loop passed it in seconds
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "trainforge", "generate", "--checkpoint", str(path), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=60, env=cli_env(), preexec_fn=limit)
    assert r.returncode == 2, r.stderr[-2000:]
    line = one_error_line(r.stderr)
    assert str(path) in line and "general.architecture" in line and "4611686018427387904 items" in line, line
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("what,value", [("tokenizer.ggml.token_type count", 2**62),
                                        ("tokenizer.ggml.token_type count", 2**31)])
def test_an_array_count_beyond_the_file_is_refused_before_reading(base, tmp_path, what, value):
    path = write(tmp_path, base[1].copy(), patch={what: value})
    err = bounded(lambda: load_model(path))
    assert_one_line(err, path, "tokenizer.ggml.token_type", f"claims {value} items")


def test_metadata_that_is_not_utf8_is_one_line(base, tmp_path):
    """main decoded it after its reader's error handling: a UnicodeDecodeError traceback."""
    parts = base[1].copy()
    parts.kvs.append(KV("tokenizer.ggml.pre", STRING, b"llama\xff-bpe"))
    path = write(tmp_path, parts)
    assert_one_line(bounded(lambda: load_model(path)), path, "'tokenizer.ggml.pre'", "not UTF-8")


def test_huge_block_count_is_refused_in_constant_time(base, tmp_path):
    """main counted the parameters layer by layer for 10^9 layers (minutes) before any check."""
    parts = base[1].copy()
    parts.kv("llama.block_count").value = 10**9
    path = write(tmp_path, parts)
    assert_one_line(bounded(lambda: load_model(path), seconds=5), path, "'llama.block_count' = 1000000000")


def _tensor(parts, name):
    return next(t for t in parts.tensors if t.name == name)


def test_a_q_projection_that_does_not_fit_the_heads_is_one_line(base, tmp_path):
    """attn_q with 60 rows where 4 heads of 16 need 64: main failed reshaping it (a traceback)."""
    parts = base[1].copy()
    t = _tensor(parts, "blk.0.attn_q.weight")
    t.dims, t.data = (64, 60), t.data[: 64 * 60 * 4]
    path = write(tmp_path, parts)
    assert_one_line(bounded(lambda: load_model(path)), path, "blk.0.attn_q.weight (64, 60) (want (64, 64))")


@pytest.mark.parametrize("change,needle", [
    # tokens as integers: main built a vocabulary of ints (a TypeError traceback on first use)
    (lambda p: setattr(p.kv("tokenizer.ggml.tokens"), "sub_type", INT32)
     or setattr(p.kv("tokenizer.ggml.tokens"), "value", list(range(len(p.kv("tokenizer.ggml.tokens").value)))),
     "'tokenizer.ggml.tokens' is an array of"),
    (lambda p: setattr(p.kv("tokenizer.ggml.merges"), "sub_type", INT32)
     or setattr(p.kv("tokenizer.ggml.merges"), "value", [1, 2, 3]), "'tokenizer.ggml.merges' is an array of 3"),
    # a merge of tokens the vocabulary does not have: main's tokenizers error was a traceback
    (lambda p: p.kv("tokenizer.ggml.merges").value.append("zzzq qqqz"), "'tokenizer.ggml.merges' does not form"),
    # one type per token: main indexed the tokens with the longer list (an IndexError traceback)
    (lambda p: p.kv("tokenizer.ggml.token_type").value.extend([3, 3]), "'tokenizer.ggml.token_type' is int32 array"),
    # ids outside the vocabulary (main accepted them as end-of-sequence ids)
    (lambda p: setattr(p.kv("tokenizer.ggml.eos_token_id"), "value", 2**31 - 1),
     "'tokenizer.ggml.eos_token_id' = 2147483647 is not a token id"),
    (lambda p: setattr(p.kv("tokenizer.ggml.eos_token_id"), "vtype", INT32)
     or setattr(p.kv("tokenizer.ggml.eos_token_id"), "value", -5),
     "'tokenizer.ggml.eos_token_id' = -5 is not a token id"),
    # a number as a string: main's float conversion raised a ValueError traceback
    (lambda p: setattr(p.kv("llama.rope.freq_base"), "vtype", STRING) or setattr(p.kv("llama.rope.freq_base"),
                                                                                 "value", "ten thousand"),
     "'llama.rope.freq_base' is 'ten thousand', not a number"),
], ids=["tokens-ints", "merges-ints", "merge-unknown", "types-longer", "eos-huge", "eos-negative", "freq-base-str"])
def test_hostile_tokenizer_and_model_metadata_is_one_line(base, tmp_path, change, needle):
    parts = base[1].copy()
    for kv in parts.kvs:  # the change edits lists in place: give each file its own
        if isinstance(kv.value, list):
            kv.value = list(kv.value)
    change(parts)
    path = write(tmp_path, parts)
    assert_one_line(bounded(lambda: load_and_tokenize(path)), path, needle)


def test_the_untouched_file_loads_and_tokenizes(base):
    tok = bounded(lambda: load_and_tokenize(base[0]), max_mib=256)
    assert not isinstance(tok, BaseException), tok
    assert tok.decode(tok.encode("the cat sat").ids) == "the cat sat"
