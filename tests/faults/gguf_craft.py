"""GGUF files as an attacker writes them: a valid file written by gguf-py's ``GGUFWriter`` (the
debug-sized Llama of ``tests/infer/test_gguf_loading.py``, with a byte-level BPE tokenizer), parsed
back with gguf-py's ``GGUFReader`` into editable parts, then re-encoded here with any count,
length, type or offset the test chooses (``encode`` records where each of those lies, for byte-level
mutation)."""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

STRING, ARRAY = 8, 9
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class KV:
    key: str
    vtype: int
    value: Any  # a scalar, a str, or a list (of scalars / strs) for ARRAY
    sub_type: int | None = None


@dataclass
class Tensor:
    name: str
    dims: tuple[int, ...]  # ggml order, innermost first
    ggml_type: int
    data: bytes


@dataclass
class Parts:
    kvs: list[KV]
    tensors: list[Tensor]
    version: int = 3
    alignment: int = 32
    # Counts as written (None: the real ones); lets a file claim more than it holds.
    n_kv: int | None = None
    n_tensors: int | None = None
    fields: list[tuple[int, int, str]] = field(default_factory=list)  # (offset, width, what) of counts/lengths/types

    def kv(self, key: str) -> KV:
        return next(k for k in self.kvs if k.key == key)

    def copy(self) -> "Parts":
        return dataclasses.replace(self, kvs=[dataclasses.replace(k) for k in self.kvs],
                                   tensors=[dataclasses.replace(t) for t in self.tensors], fields=[])


def valid_gguf(path: Path) -> Path:
    """The debug Llama (2 layers, dim 64) with a 300-token BPE tokenizer, F32, by gguf-py's writer."""
    import dataclasses as dc

    from tests.infer.test_gguf_loading import CFG, _bpe, write_gguf
    from trainforge.model import build_model

    tok = _bpe(300)
    model = build_model(dc.replace(CFG, vocab_size=tok.get_vocab_size()), seed=5).eval()
    return write_gguf(path, model, tokenizer=tok)


def parse(path: Path) -> Parts:
    """``path`` (a valid file) as editable parts, read by gguf-py's own reader."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    kvs = []
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vtype = int(f.types[0])
        sub = int(f.types[-1]) if vtype == ARRAY else None
        kvs.append(KV(f.name, vtype, f.contents(), sub))
    tensors = [Tensor(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), bytes(np.asarray(t.data).tobytes()))
               for t in r.tensors]
    return Parts(kvs, tensors)


def encode(p: Parts) -> bytes:
    """``p`` as GGUF bytes; fills ``p.fields`` with where every count, length and type lies."""
    out = bytearray()
    p.fields.clear()

    def put(fmt: str, v: Any, what: str | None = None) -> None:
        if what is not None:
            p.fields.append((len(out), struct.calcsize("<" + fmt), what))
        out.extend(struct.pack("<" + fmt, v))

    def string(s: str | bytes, what: str) -> None:
        b = s.encode() if isinstance(s, str) else s
        put("Q", len(b), f"{what} length")
        out.extend(b)

    def value(vtype: int, v: Any, sub: int | None, what: str) -> None:
        if vtype == STRING:
            string(v, what)
        elif vtype == ARRAY:
            put("I", sub, f"{what} item type")
            put("Q", len(v), f"{what} count")
            for x in v:
                value(sub, x, None, what)  # type: ignore[arg-type]
        else:
            put(_SCALAR[vtype], v)

    out.extend(b"GGUF")
    put("I", p.version, "version")
    put("Q", len(p.tensors) if p.n_tensors is None else p.n_tensors, "tensor count")
    put("Q", len(p.kvs) if p.n_kv is None else p.n_kv, "key count")
    for kv in p.kvs:
        string(kv.key, "key")
        put("I", kv.vtype, f"{kv.key} type")
        value(kv.vtype, kv.value, kv.sub_type, kv.key)
    offsets, at = [], 0
    for t in p.tensors:
        at = -(-at // p.alignment) * p.alignment
        offsets.append(at)
        at += len(t.data)
    for t, off in zip(p.tensors, offsets):
        string(t.name, "tensor name")
        put("I", len(t.dims), f"{t.name} n_dims")
        for d in t.dims:
            put("Q", d, f"{t.name} dim")
        put("I", t.ggml_type, f"{t.name} type")
        put("Q", off, f"{t.name} offset")
    out.extend(b"\0" * (-len(out) % p.alignment))
    start = len(out)
    for t, off in zip(p.tensors, offsets):
        out.extend(b"\0" * (start + off - len(out)))
        out.extend(t.data)
    return bytes(out)
