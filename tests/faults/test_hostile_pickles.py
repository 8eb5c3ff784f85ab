"""Loading a checkpoint never runs code, whatever its files hold.

Fault: an attacker rewrites a checkpoint's files (and the sha256 list in meta.json,
which is no authentication) so that unpickling them would run a command. Every
payload here would create a marker file if executed (the first test proves it, with
plain ``pickle``); loading through the real entry points (resuming a ``Trainer``,
``trainforge.infer.loading.load_model``, the CLI) must instead raise one
``TrainforgeError`` line naming the file, and the marker must never appear.

Payloads are hand-assembled opcode streams (``pickletools`` lists the opcodes) for
every protocol 0-5, reaching their callable through GLOBAL, STACK_GLOBAL or INST (with
dotted names such as ``os.system`` under an allowed module), and calling it through
REDUCE, OBJ, NEWOBJ / NEWOBJ_EX (building the argument), BUILD (an instance
``__setstate__``) or after a persistent id (PERSID / BINPERSID). Each test asserts the
bytes hold the opcodes intended.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import pickletools
import shutil
import struct
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tests.conftest import debug_config
from tests.faults.conftest import cli_env, one_error_line, run_cli, torchrun_cmd, train_args
from trainforge.errors import CheckpointError, TrainforgeError
from trainforge.infer.loading import load_model
from trainforge.model.hf import to_hf_config_dict, to_hf_state_dict
from trainforge.train import checkpoint as ckpt
from trainforge.train import loop_checkpoint
from trainforge.train.component import Components
from trainforge.train.compression_component import CompressionComponent
from trainforge.train.trainer import Trainer

_OP = {op.name: op.code.encode("latin-1") for op in pickletools.opcodes}
_OP_PROTO = {op.name: op.proto for op in pickletools.opcodes}

# (module, name, argument kind). Every one creates the marker when called with its arguments.
TARGETS = [
    ("builtins", "open", "open"), ("io", "open", "open"),
    ("os", "system", "shell"), ("posix", "system", "shell"),
    ("builtins", "eval", "python"), ("builtins", "exec", "python"),
    ("subprocess", "Popen", "argv"), ("subprocess", "check_call", "argv"),
    # Dotted names under modules an allow-list might trust: pickle >= 4 walks them attribute by attribute.
    ("torch.distributed.checkpoint.filesystem", "os.system", "shell"),
    ("torch.distributed.checkpoint.metadata", "os.system", "shell"),
    ("torch.serialization", "os.system", "shell"),
    ("pathlib", "os.system", "shell"),
    ("torch.distributed.checkpoint.filesystem", "io.open", "open"),
]
KINDS = ("REDUCE", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "BUILD", "PERSID", "BINPERSID")
_KIND_MIN_PROTO = {"OBJ": 1, "NEWOBJ": 2, "NEWOBJ_EX": 4, "BINPERSID": 1}


def _args(kind: str, marker: str) -> tuple:
    return {"open": (marker, "w"), "shell": (f"touch '{marker}'",), "python": (f"open({marker!r}, 'w').close()",),
            "argv": (["touch", marker],)}[kind]


@dataclass(frozen=True)
class Spec:
    protocol: int
    kind: str  # how the call is made (KINDS)
    lookup: str  # "GLOBAL" or "STACK_GLOBAL" (INST names its callable itself)
    target: tuple[str, str, str]

    def expected_opcodes(self) -> set[str]:
        ops = {self.kind}
        if self.kind != "INST":
            ops.add(self.lookup)
        if self.kind in ("NEWOBJ", "NEWOBJ_EX", "BUILD", "PERSID", "BINPERSID"):
            ops.add("REDUCE")
        if self.protocol >= 2:
            ops.add("PROTO")
        return ops


class _Asm:
    """Emits opcodes valid in ``protocol`` (text opcodes for 0, binary ones from 1)."""

    def __init__(self, protocol: int):
        self.p = protocol

    def s(self, text: str) -> bytes:
        b = text.encode("utf-8")
        if self.p == 0:
            return _OP["UNICODE"] + text.encode("raw-unicode-escape") + b"\n"
        if self.p >= 4 and len(b) < 256:
            return _OP["SHORT_BINUNICODE"] + bytes([len(b)]) + b
        return _OP["BINUNICODE"] + struct.pack("<I", len(b)) + b

    def value(self, v) -> bytes:
        if v is None:
            return _OP["NONE"]
        if isinstance(v, str):
            return self.s(v)
        if isinstance(v, list):
            items = b"".join(self.value(x) for x in v)
            return (_OP["MARK"] + items + _OP["LIST"]) if self.p == 0 else \
                (_OP["EMPTY_LIST"] + _OP["MARK"] + items + _OP["APPENDS"])
        if isinstance(v, tuple):
            return self.tuple([self.value(x) for x in v])
        raise TypeError(v)

    def tuple(self, encoded: list[bytes]) -> bytes:
        if not encoded and self.p >= 1:
            return _OP["EMPTY_TUPLE"]
        if 1 <= len(encoded) <= 3 and self.p >= 2:
            return b"".join(encoded) + _OP[f"TUPLE{len(encoded)}"]
        return _OP["MARK"] + b"".join(encoded) + _OP["TUPLE"]

    def dict1(self, key: str, encoded_value: bytes) -> bytes:
        if self.p == 0:
            return _OP["MARK"] + self.s(key) + encoded_value + _OP["DICT"]
        return _OP["EMPTY_DICT"] + self.s(key) + encoded_value + _OP["SETITEM"]

    def glob(self, module: str, name: str, lookup: str) -> bytes:
        if lookup == "STACK_GLOBAL":
            return self.s(module) + self.s(name) + _OP["STACK_GLOBAL"]
        return _OP["GLOBAL"] + f"{module}\n{name}\n".encode()

    def put0(self) -> bytes:
        return _OP["PUT"] + b"0\n" if self.p == 0 else _OP["BINPUT"] + b"\x00"

    def get0(self) -> bytes:
        return _OP["GET"] + b"0\n" if self.p == 0 else _OP["BINGET"] + b"\x00"


def build_payload(spec: Spec, marker: str) -> bytes:
    """The opcode stream of ``spec`` whose execution creates ``marker``."""
    a = _Asm(spec.protocol)
    module, name, arg_kind = spec.target
    args = _args(arg_kind, marker)
    call = a.glob(module, name, spec.lookup)
    body: bytes
    if spec.kind == "REDUCE":
        body = call + a.value(args) + _OP["REDUCE"]
    elif spec.kind == "INST":
        body = _OP["MARK"] + b"".join(a.value(x) for x in args) + _OP["INST"] + f"{module}\n{name}\n".encode()
    elif spec.kind == "OBJ":
        body = _OP["MARK"] + call + b"".join(a.value(x) for x in args) + _OP["OBJ"]
    elif spec.kind in ("NEWOBJ", "NEWOBJ_EX"):
        # str.__new__(str, arg0) builds the first argument (memo 0), then the call uses it.
        new = a.glob("builtins", "str", spec.lookup) + a.tuple([a.value(args[0])])
        new += _OP["NEWOBJ"] if spec.kind == "NEWOBJ" else _OP["EMPTY_DICT"] + _OP["NEWOBJ_EX"]
        body = (new + a.put0() + _OP["POP"] + call + a.tuple([a.get0(), *(a.value(x) for x in args[1:])])
                + _OP["REDUCE"])
    elif spec.kind == "BUILD":
        # A namespace gets an instance attribute __setstate__ = the callable (slot state of
        # the first BUILD); the second BUILD calls it with the argument as the state.
        ns = a.glob("types", "SimpleNamespace", spec.lookup) + a.tuple([]) + _OP["REDUCE"]
        state = a.tuple([_OP["NONE"], a.dict1("__setstate__", call)])
        body = ns + state + _OP["BUILD"] + a.value(args[0]) + _OP["BUILD"]
    elif spec.kind == "PERSID":
        body = _OP["PERSID"] + b"storage\n" + _OP["POP"] + call + a.value(args) + _OP["REDUCE"]
    else:  # BINPERSID
        body = (a.tuple([a.s("storage"), a.s("0")]) + _OP["BINPERSID"] + _OP["POP"] + call + a.value(args)
                + _OP["REDUCE"])
    header = _OP["PROTO"] + bytes([spec.protocol]) if spec.protocol >= 2 else b""
    return header + body + _OP["STOP"]


def check_opcodes(spec: Spec, data: bytes) -> None:
    """The stream parses, holds the opcodes ``spec`` intends, and none newer than its protocol."""
    ops = [op for op, _, _ in pickletools.genops(data)]
    names = {op.name for op in ops}
    assert spec.expected_opcodes() <= names, (spec, names)
    assert max(op.proto for op in ops) <= spec.protocol, (spec, names)
    if spec.protocol >= 2:
        assert ops[0].name == "PROTO" and data[1] == spec.protocol


@st.composite
def specs(draw, single_arg: bool = False) -> Spec:
    protocol = draw(st.integers(0, 5))
    kind = draw(st.sampled_from([k for k in KINDS if _KIND_MIN_PROTO.get(k, 0) <= protocol]))
    lookup = draw(st.sampled_from(["GLOBAL", "STACK_GLOBAL"] if protocol >= 4 else ["GLOBAL"]))
    targets = [t for t in TARGETS
               if (protocol >= 4 or "." not in t[1])  # plain pickle resolves dotted names from protocol 4
               and (kind not in ("NEWOBJ", "NEWOBJ_EX", "BUILD") or t[2] in ("shell", "python"))]
    return Spec(protocol, kind, lookup, draw(st.sampled_from(targets)))


# -- containers: what the attacker writes into each file ------------------------------------------

def torch_zip(real: bytes, data_pkl: bytes) -> bytes:
    """A ``torch.save`` zip (the real file's members) whose ``data.pkl`` is ``data_pkl``."""
    src = zipfile.ZipFile(io.BytesIO(real))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            z.writestr(info.filename, data_pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


class Blob(bytes):
    """A file's genuine bytes, shown by size in Hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes>"


@st.composite
def file_contents(draw, real: Blob, marker: str, torch_file: bool) -> tuple[bytes, Spec | None]:
    """Hostile bytes for a file whose genuine content is ``real``: a payload (raw, or as the
    data.pkl of a torch zip), or damage (truncated, garbage, a safetensors header that lies)."""
    how = draw(st.sampled_from(["pickle", "pickle", "zip", "truncated", "garbage", "header"] if torch_file
                               else ["pickle", "pickle", "truncated", "garbage", "header"]))
    if how in ("pickle", "zip"):
        spec = draw(specs())
        data = build_payload(spec, marker)
        check_opcodes(spec, data)
        return (torch_zip(real, data) if how == "zip" else data), spec
    if how == "truncated":
        return real[:draw(st.integers(0, len(real) - 1))], None
    if how == "garbage":
        return draw(st.binary(min_size=0, max_size=64)), None
    return struct.pack("<Q", draw(st.sampled_from([2**62, 8, len(real)]))) + b'{"a":', None


def tamper(ck: Path, rel: str, data: bytes) -> None:
    """Write ``data`` into ``ck/rel`` and rewrite meta.json's sha256 for it, as an attacker would."""
    (ck / rel).write_bytes(data)
    meta_file = ck / ckpt.META
    if rel == ckpt.META or not meta_file.is_file():
        return
    meta = json.loads(meta_file.read_text())
    meta["files"][rel] = hashlib.sha256(data).hexdigest()
    meta_file.write_text(json.dumps(meta))
    ckpt.read_meta(ck)  # the sha check passes: what follows tests the loader, not the hash


def assert_refused(err: BaseException, f: Path, marker: Path, spec: Spec | None) -> None:
    msg = str(err)
    assert isinstance(err, TrainforgeError), repr(err)
    assert "\n" not in msg, msg
    assert str(f) in msg, (str(f), msg)
    if spec is not None and spec.target[1] == "Popen":
        time.sleep(0.1)  # Popen would not wait for its child
    assert not marker.exists(), f"{spec}: the payload ran"


# -- the checkpoints, built once per module -------------------------------------------------------

SHARDED_TRAIN = ["--training.seq_len", "32", "--training.steps", "2", "--training.warmup_steps", "1",
                 "--training.val_interval", "0", "--parallel.dp_replicate", "2",
                 "--compression.codec", "int4", "--compression.warmup_steps", "1"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, small_data) -> dict[str, Path]:
    """A single-process run, a 2-process sharded one (DDP with int4 compression: rng/ and
    compression/ per rank), a quantised copy and a Hugging Face export of the first."""
    root = tmp_path_factory.mktemp("pristine")
    sharded = subprocess.Popen(torchrun_cmd(2, *train_args(small_data, "--run_dir", str(root / "sharded"),
                                                           *SHARDED_TRAIN)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        _build_single_quant_hf(root, small_data)
        _, err = sharded.communicate(timeout=240)
    finally:
        if sharded.poll() is None:
            sharded.kill()
    assert sharded.returncode == 0, err[-3000:]
    return {"root": root, "single": root / "single", "sharded": root / "sharded", "quant": root / "quant",
            "hf": root / "hf"}


def _build_single_quant_hf(root: Path, small_data: Path) -> None:
    t = Trainer(debug_config(small_data, "--training.steps", "2", "--training.val_interval", "0",
                             "--training.threads", "1"), root / "single", progress=False)
    try:
        t.fit()
    finally:
        t.close()
    single_ck = ckpt.list_checkpoints(root / "single" / "checkpoints")[-1]
    from trainforge import cli

    assert cli.main(["quantize", "--checkpoint", str(single_ck), "--output", str(root / "quant"),
                     "--mode", "int8"]) == 0
    hf = root / "hf"
    hf.mkdir()
    meta = ckpt.read_meta(single_ck)
    from trainforge.model.config import ModelConfig

    cfg = ModelConfig(**meta["model_config"])
    sd = to_hf_state_dict(ckpt.load_full_weights(single_ck, cfg.tie_embeddings), cfg)
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(to_hf_config_dict(cfg)))
    shutil.copyfile(single_ck / ckpt.TOKENIZER_FILE, hf / "tokenizer.json")


def _copy(src: Path) -> tuple[Path, Path]:
    """A private copy of ``src`` and a marker path beside it (in a fresh directory under
    the module's pytest tmp dir, so a failing example leaves nothing in /tmp)."""
    work = Path(tempfile.mkdtemp(prefix="hostile-", dir=src.parent))
    dst = work / src.name
    shutil.copytree(src, dst)
    return dst, work / "MARKER"


def _newest(run_dir: Path) -> Path:
    return ckpt.list_checkpoints(run_dir / "checkpoints")[-1]


# -- the tests ------------------------------------------------------------------------------------

def _target(module: str, name: str) -> tuple[str, str, str]:
    return next(t for t in TARGETS if t[:2] == (module, name))


# One payload per kind, covering protocols 0-5, GLOBAL / STACK_GLOBAL / INST and dotted names.
LIVE_SPECS = [Spec(p, kind, lookup, _target(module, name)) for p, kind, lookup, module, name in [
    (0, "REDUCE", "GLOBAL", "builtins", "open"), (1, "INST", "GLOBAL", "builtins", "eval"),
    (2, "OBJ", "GLOBAL", "builtins", "exec"), (2, "NEWOBJ", "GLOBAL", "os", "system"),
    (4, "NEWOBJ_EX", "STACK_GLOBAL", "builtins", "eval"), (3, "BUILD", "GLOBAL", "builtins", "eval"),
    (0, "PERSID", "GLOBAL", "io", "open"), (5, "BINPERSID", "GLOBAL", "subprocess", "check_call"),
    (4, "REDUCE", "STACK_GLOBAL", "torch.distributed.checkpoint.filesystem", "os.system"),
    (5, "INST", "GLOBAL", "torch.distributed.checkpoint.filesystem", "io.open"),
    (4, "OBJ", "STACK_GLOBAL", "subprocess", "Popen"),
]]


class _PlainUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):  # what a loader with persistent ids (torch.load) would do
        return pid


def assert_live(spec: Spec, marker: Path) -> None:
    """Plain ``pickle`` runs ``spec``'s payload: it creates ``marker``."""
    data = build_payload(spec, str(marker))
    check_opcodes(spec, data)
    try:
        _PlainUnpickler(io.BytesIO(data)).load()
    finally:
        for _ in range(100):  # Popen returns before its child has run
            if marker.exists():
                break
            time.sleep(0.02)
    assert marker.exists(), spec


@pytest.mark.parametrize("spec", LIVE_SPECS, ids=lambda s: f"p{s.protocol}-{s.kind}-{s.target[1]}")
def test_payloads_are_live_without_an_allow_list(spec, tmp_path):
    """The control: plain ``pickle`` runs each kind of payload (so 'marker absent' below means refused)."""
    assert_live(spec, tmp_path / "MARKER")


def all_specs():
    """Every (protocol, kind, lookup, target) the strategy can draw."""
    for protocol in range(6):
        for kind in KINDS:
            if _KIND_MIN_PROTO.get(kind, 0) > protocol:
                continue
            for lookup in (["GLOBAL", "STACK_GLOBAL"] if protocol >= 4 and kind != "INST" else ["GLOBAL"]):
                for t in TARGETS:
                    if (protocol < 4 and "." in t[1]) or \
                            (kind in ("NEWOBJ", "NEWOBJ_EX", "BUILD") and t[2] not in ("shell", "python")):
                        continue
                    yield Spec(protocol, kind, lookup, t)


def test_every_payload_shape_is_refused_by_both_readers(tmp_path):
    """Exhaustively, below the entry points: the DCP metadata reader and the torch-file
    reader (raw pickle and torch zip) refuse every payload with one line naming the file."""
    from trainforge.safe_unpickle import load_dcp_metadata

    buf = io.BytesIO()
    torch.save({"x": torch.zeros(2)}, buf)
    real = buf.getvalue()
    marker = tmp_path / "MARKER"
    seen: set[str] = set()
    n = 0
    for spec in all_specs():
        data = build_payload(spec, str(marker))
        check_opcodes(spec, data)
        seen |= spec.expected_opcodes()
        for f, content, load in ((tmp_path / ".metadata", data, load_dcp_metadata),
                                 (tmp_path / "raw.pt", data, ckpt.load_tensor_file),
                                 (tmp_path / "zip.pt", torch_zip(real, data), ckpt.load_tensor_file)):
            f.write_bytes(content)
            with pytest.raises(CheckpointError) as e:
                load(f)
            msg = str(e.value)
            assert str(f) in msg and "\n" not in msg and "tampered" in msg, msg
        n += 1
    time.sleep(0.1)  # Popen would not wait for its child
    assert not marker.exists()
    assert n > 300 and seen >= {*KINDS, "GLOBAL", "STACK_GLOBAL", "PROTO"}, (n, seen)


def hostile(draw, real: bytes, marker: Path, torch_file: bool) -> tuple[bytes, Spec | None]:
    """Draw hostile contents; a payload is first proven live (on a control marker)."""
    data, spec = draw.draw(file_contents(Blob(real), str(marker), torch_file))
    if spec is not None:
        assert_live(spec, marker.with_name("CONTROL"))
        event(f"protocol {spec.protocol} {spec.kind} via {'INST' if spec.kind == 'INST' else spec.lookup}")
        event(f"zip: {data[:2] == b'PK'}")
    else:
        event("damaged")
    return data, spec


def test_a_hostile_data_pkl_in_a_torch_zip_runs_under_weights_only_false(pristine, tmp_path):
    """The control for the zip container: torch.load without weights_only would run it."""
    marker = tmp_path / "MARKER"
    real = (_newest(pristine["single"]) / ckpt.STATE_FILE).read_bytes()
    f = tmp_path / "state.pt"
    f.write_bytes(torch_zip(real, build_payload(Spec(2, "REDUCE", "GLOBAL", _target("builtins", "open")), str(marker))))
    torch.load(f, weights_only=False)
    assert marker.exists()


# 40 examples per test (0.1-0.4 s each): the torchrun fixture and the CLI subprocess dominate the
# module's time. derandomize: CI sees the same examples each run; raise max_examples to explore more.
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _resume(run_dir: Path, data: Path, *extra: str) -> None:
    """Build a Trainer resuming from ``run_dir`` (loading the checkpoint is all it does here)."""
    Trainer(debug_config(data, "--training.threads", "1", *extra), run_dir, resume=True, progress=False).close()


@SETTINGS
@given(draw=st.data(), rel=st.sampled_from([ckpt.STATE_FILE, ckpt.MODEL_FILE, ckpt.META]))
def test_single_process_checkpoint_refuses_hostile_files(pristine, small_data, draw, rel):
    """Resumed by a Trainer, and (weights, meta.json) loaded for inference."""
    run_dir, marker = _copy(pristine["single"])
    ck = _newest(run_dir)
    data, spec = hostile(draw, (ck / rel).read_bytes(), marker, rel.endswith(".pt"))
    tamper(ck, rel, data)
    with pytest.raises(TrainforgeError) as e:
        _resume(run_dir, small_data, "--training.steps", "3")
    assert_refused(e.value, ck / rel, marker, spec)
    if rel != ckpt.STATE_FILE:  # inference reads the weights and meta.json too
        with pytest.raises(TrainforgeError) as e:
            load_model(ck)
        assert_refused(e.value, ck / rel, marker, spec)
    shutil.rmtree(run_dir.parent)


SHARDED_FILES = ["sharded/.metadata", "rng/rank_00000.pt", ckpt.STATE_FILE, "sharded/__0_0.distcp"]


@SETTINGS
@given(draw=st.data(), rel=st.sampled_from(SHARDED_FILES))
def test_sharded_checkpoint_refuses_hostile_files(pristine, small_data, draw, rel):
    """Resumed in one process (DCP reshards): every file that load reads."""
    run_dir, marker = _copy(pristine["sharded"])
    ck = _newest(run_dir)
    data, spec = hostile(draw, (ck / rel).read_bytes(), marker, rel.endswith(".pt"))
    tamper(ck, rel, data)
    with pytest.raises(TrainforgeError) as e:  # global batch 8 x 2 ranks, as saved
        _resume(run_dir, small_data, "--training.batch_size", "16", "--training.seq_len", "32",
                "--training.steps", "3")
    assert_refused(e.value, ck / rel, marker, spec)
    shutil.rmtree(run_dir.parent)


class _Compressor:
    """Stands in for the gradient compressor, which only a multi-process run with
    dp_replicate > 1 builds; it must never receive a hostile file's contents."""

    def load_state_dict(self, state):
        raise AssertionError(f"the compression file's contents reached the compressor: {state!r:.200}")


@SETTINGS
@given(draw=st.data())
def test_compression_state_file_refuses_hostile_payloads(pristine, draw):
    """``compression/rank_*.pt`` is read only by a multi-process resume with compression
    (seconds of torchrun per example), so this runs the trainer's own reader of it,
    ``loop_checkpoint.load_components`` with the compression component, on this rank's file."""
    run_dir, marker = _copy(pristine["sharded"])
    ck = _newest(run_dir)
    f = ck / "compression" / "rank_00000.pt"
    assert ckpt.load_tensor_file(f)  # the genuine file loads
    data, spec = hostile(draw, f.read_bytes(), marker, True)
    tamper(ck, "compression/rank_00000.pt", data)
    loop = SimpleNamespace(components=Components([CompressionComponent(_Compressor())]),
                           dist=SimpleNamespace(rank=0), device=torch.device("cpu"), is_main=True)
    with pytest.raises(TrainforgeError) as e:
        loop_checkpoint.load_components(loop, ck, {})
    assert_refused(e.value, f, marker, spec)
    shutil.rmtree(run_dir.parent)


@SETTINGS
@given(draw=st.data(), which=st.sampled_from([("quant", ckpt.MODEL_FILE), ("quant", ckpt.META),
                                              ("quant", ckpt.TOKENIZER_FILE), ("hf", "model.safetensors"),
                                              ("hf", "config.json"), ("hf", "tokenizer.json")]))
def test_quantised_and_hugging_face_directories_refuse_hostile_files(pristine, draw, which):
    """What ``generate``, ``serve`` and ``quantize`` load through ``load_model``."""
    kind, rel = which
    d, marker = _copy(pristine[kind])
    data, spec = hostile(draw, (d / rel).read_bytes(), marker, False)
    tamper(d, rel, data)
    with pytest.raises(TrainforgeError) as e:
        load_model(d)
    assert_refused(e.value, d / rel, marker, spec)
    shutil.rmtree(d.parent)


def test_dcp_metadata_exploit_is_refused_by_the_cli(pristine, small_data):
    """The exploit found: (torch.distributed.checkpoint.filesystem, os.system), protocol 4,
    in a sharded checkpoint's .metadata, resumed with ``trainforge train --resume``."""
    run_dir, marker = _copy(pristine["sharded"])
    ck = _newest(run_dir)
    spec = Spec(4, "REDUCE", "STACK_GLOBAL", ("torch.distributed.checkpoint.filesystem", "os.system", "shell"))
    data = build_payload(spec, str(marker))
    check_opcodes(spec, data)
    tamper(ck, "sharded/.metadata", data)
    r = run_cli(train_args(small_data, "--resume", str(run_dir), "--training.batch_size", "16",
                           "--training.seq_len", "32", "--training.steps", "3", "--parallel.dp_replicate", "1"))
    assert r.returncode == 2, r.stderr[-3000:]
    line = one_error_line(r.stderr)
    assert str(ck / "sharded" / ".metadata") in line and "tampered" in line, line
    assert not marker.exists()
    shutil.rmtree(run_dir.parent)


def test_legit_checkpoints_still_load(pristine, small_data):
    """The control for every refusal above: the untouched copies load."""
    for kind in ("quant", "hf"):
        assert load_model(pristine[kind]).model is not None
    assert load_model(_newest(pristine["single"])).source == "trainforge"
    for kind, extra in (("single", []), ("sharded", ["--training.batch_size", "16", "--training.seq_len", "32"])):
        run_dir, _ = _copy(pristine[kind])
        _resume(run_dir, small_data, "--training.steps", "3", *extra)
        shutil.rmtree(run_dir.parent)


def test_dcp_metadata_allow_list_is_exactly_what_dcp_writes(pristine):
    """Every global in a real .metadata is on the list (and the list holds nothing unjustified)."""
    from trainforge.safe_unpickle import DCP_METADATA_GLOBALS

    data = (_newest(pristine["sharded"]) / "sharded" / ".metadata").read_bytes()
    pushed: list[str | None] = []  # what each pushing opcode put on the stack (None: not a string)
    memo: dict[int, str | None] = {}
    found = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            pushed.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif op.name == "STACK_GLOBAL":
            found.add((pushed[-2], pushed[-1]))
            pushed.append(None)
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
            pushed.append(None)
        elif op.name != "FRAME":
            pushed.append(None)
    assert len(found) >= 10, found  # the tracking above really saw the metadata's classes
    assert found <= DCP_METADATA_GLOBALS
    extras = DCP_METADATA_GLOBALS - found  # the justified alternatives (safe_unpickle.py says why)
    assert extras == {("pathlib._local", "PosixPath"), ("torch", "bfloat16"), ("torch", "float16")}, extras
