"""Fuzz the files a load reads before any weight: GGUF headers, safetensors headers and Hugging
Face config.json values (hypothesis, as ``test_hostile_pickles.py`` fuzzes pickles).

Each example starts from a valid file and changes what an attacker controls: a GGUF count,
length, type or offset (where ``gguf_craft.encode`` wrote it) or a key's value type; a
safetensors header's length, dtype, shape or byte range; a config.json value. The property:
the load (and, for GGUF, building its tokenizer) either succeeds or raises the project's error
with one line naming the file, within ``bounded``'s time and traced-memory limits; never any
other exception, never a hang. derandomize: CI sees the same examples each run.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.faults.gguf_craft import ARRAY, STRING, encode, parse, valid_gguf
from tests.faults.test_hostile_gguf import bounded, load_and_tokenize
from tests.faults.test_hostile_hf import write_hf
from trainforge.errors import TrainforgeError
from trainforge.infer.loading import load_model
from trainforge.model import FLAVORS, build_model
from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Values a count or a length is worth trying: zero, one, the edges of each width, past the file.
INTERESTING = [0, 1, 2, 7, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1]


def assert_property(outcome, path: Path) -> None:
    """Success, or one line of the project's error naming ``path``."""
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, TrainforgeError), repr(outcome)
        msg = str(outcome)
        assert "\n" not in msg and str(path) in msg, msg
        event(f"refused: {type(outcome).__name__}")
    else:
        event("loaded")


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    path = valid_gguf(tmp_path_factory.mktemp("fuzz") / "valid.gguf")
    parts = parse(path)
    encode(parts)  # fills parts.fields
    return path, parts


@pytest.fixture(scope="module")
def scratch_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("examples")


class _Scratch:
    """A fresh directory per example (a function-scoped fixture would be shared by all of them)."""

    def __init__(self, root: Path):
        self.path = Path(tempfile.mkdtemp(dir=root))

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@SETTINGS
@given(draw=st.data())
def test_gguf_header_fields_fuzz(gguf_base, scratch_root, draw):
    """Overwrite 1-3 counts, lengths, types, offsets or dims with interesting values, or flip bytes."""
    src, parts = gguf_base
    data = bytearray(src.read_bytes())
    for _ in range(draw.draw(st.integers(1, 3))):
        offset, width, what = draw.draw(st.sampled_from(parts.fields))
        kind = what.rsplit(" ", 1)[-1]
        if draw.draw(st.booleans()):
            value = draw.draw(st.sampled_from(INTERESTING)) % (1 << 8 * width)
        else:
            value = draw.draw(st.integers(0, (1 << 8 * width) - 1))
        data[offset:offset + width] = value.to_bytes(width, "little")
        event(f"field: {kind}")
    if draw.draw(st.booleans()):  # and maybe some header bytes
        header_end = max(o + w for o, w, _ in parts.fields)
        for i in draw.draw(st.lists(st.integers(0, header_end - 1), max_size=4)):
            data[i] = draw.draw(st.integers(0, 255))
    with _Scratch(scratch_root) as scratch:
        path = scratch / "f.gguf"
        path.write_bytes(bytes(data))
        assert_property(bounded(lambda: load_and_tokenize(path), max_mib=128), path)


_JSONISH = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3))
_SCALAR_TYPES = {0: st.integers(0, 255), 1: st.integers(-128, 127), 4: st.integers(0, 2**32 - 1),
                 5: st.integers(-2**31, 2**31 - 1), 6: st.floats(width=32), 7: st.booleans(),
                 10: st.integers(0, 2**64 - 1), 11: st.integers(-2**63, 2**63 - 1)}


@SETTINGS
@given(draw=st.data())
def test_gguf_metadata_values_fuzz(gguf_base, scratch_root, draw):
    """Give 1-3 keys another type and value: a scalar, a string, an array of numbers or strings."""
    _, base = gguf_base
    parts = base.copy()
    for _ in range(draw.draw(st.integers(1, 3))):
        kv = draw.draw(st.sampled_from(parts.kvs))
        shape = draw.draw(st.sampled_from(["scalar", "string", "numbers", "strings"]))
        if shape == "scalar":
            kv.vtype = draw.draw(st.sampled_from(sorted(_SCALAR_TYPES)))
            kv.value, kv.sub_type = draw.draw(_SCALAR_TYPES[kv.vtype]), None
        elif shape == "string":
            kv.vtype, kv.sub_type, kv.value = STRING, None, draw.draw(st.text(max_size=12))
        else:
            kv.vtype = ARRAY
            kv.sub_type = STRING if shape == "strings" else draw.draw(st.sampled_from(sorted(_SCALAR_TYPES)))
            item = st.text(max_size=6) if shape == "strings" else _SCALAR_TYPES[kv.sub_type]
            kv.value = draw.draw(st.lists(item, max_size=400))
        event(f"{kv.key} -> {shape}")
    with _Scratch(scratch_root) as scratch:
        path = scratch / "v.gguf"
        path.write_bytes(encode(parts))
        assert_property(bounded(lambda: load_and_tokenize(path), max_mib=128), path)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    cfg = FLAVORS["debug"]
    return write_hf(tmp_path_factory.mktemp("fuzz") / "hf", to_hf_state_dict(build_model(cfg, seed=0).state_dict(), cfg),
                    to_hf_config_dict(cfg))


def _header(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


@SETTINGS
@given(draw=st.data(), mapped=st.booleans())
def test_safetensors_header_fuzz(hf_base, scratch_root, draw, mapped):
    """A header that lies: its length, a tensor's dtype, shape or byte range, or its JSON shape.
    Read by safetensors (``mapped=False``) and by trainforge's own mapper (``mapped=True``)."""
    header, data = _header((hf_base / "model.safetensors").read_bytes())
    names = sorted(k for k in header if k != "__metadata__")
    how = draw.draw(st.sampled_from(["length", "dtype", "shape", "offsets", "entry", "json"]))
    length = None
    if how == "length":
        length = draw.draw(st.sampled_from(INTERESTING))
    elif how == "json":
        header = draw.draw(st.sampled_from([[], "x", 1, None, {"a": [[[[]]]]}]))
    else:
        entry = header[draw.draw(st.sampled_from(names))]
        if how == "dtype":
            entry["dtype"] = draw.draw(st.sampled_from(["F8", "I4", "F64", "BOOL", "", 3, None]))
        elif how == "shape":
            entry["shape"] = draw.draw(st.lists(st.sampled_from([-1, 0, 1, 3, 2**31, 2**62]), max_size=4))
        elif how == "offsets":
            entry["data_offsets"] = draw.draw(st.lists(st.sampled_from(INTERESTING + [-1]), min_size=0, max_size=3))
        else:
            entry.update({draw.draw(st.sampled_from(["dtype", "shape", "data_offsets"])): draw.draw(_JSONISH)})
    event(f"safetensors: {how}, mapped {mapped}")
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with _Scratch(scratch_root) as scratch:
        d = scratch / "hf"
        shutil.copytree(hf_base, d)
        f = d / "model.safetensors"
        f.write_bytes(struct.pack("<Q", len(blob) if length is None else length % 2**64) + blob + data)
        assert_property(bounded(lambda: load_model(d, mapped=mapped, kv_slots=lambda cfg: 256), max_mib=256), f)


@SETTINGS
@given(draw=st.data())
def test_config_json_values_fuzz(hf_base, scratch_root, draw):
    """Replace 1-3 config.json values (or add an unknown / rope / quantization key) with any JSON value."""
    cfg = json.loads((hf_base / "config.json").read_text())
    keys = sorted(cfg) + ["quantization_config", "rope_scaling", "head_dim", "model_type", "eos_token_id"]
    value = st.recursive(_JSONISH, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                         max_leaves=6)
    for _ in range(draw.draw(st.integers(1, 3))):
        key = draw.draw(st.sampled_from(keys))
        cfg[key] = draw.draw(value)
        event(f"config.json {key}")
    with _Scratch(scratch_root) as scratch:
        d = scratch / "hf"
        shutil.copytree(hf_base, d)
        (d / "config.json").write_text(json.dumps(cfg))
        assert_property(bounded(lambda: load_model(d, kv_slots=lambda cfg: 256), max_mib=256), d)
