"""Read a GGUF file's header (its metadata and tensor table) with every count, length and
offset bounded before it is used.

gguf-py's ``GGUFReader`` trusts the file. A metadata array that claims 2^62 items of a
scalar type past the end of the file makes it loop for ever (each item past the end reads as
zero bytes, so its offset never moves): a 68-byte file grew to gigabytes with no error. And
every item it does read becomes a numpy view of its own, ~700 bytes per integer and ~1.3 KB
per string (tracemalloc, gguf 0.19), so a few MB of hostile metadata cost gigabytes.

Here each count is checked against the bytes left in the file (count x the smallest
encoding of one item) and against the caps below before anything is read or allocated; a
scalar array is read as one numpy copy and a string array as one ``(lengths, blob)`` pair
(``StringArray``), so the header costs about its own size in memory. A tensor's byte range
must lie inside the file and a block type's rows must be whole blocks (llama.cpp's own
reader checks the same). Anything else is one ``CheckpointError`` naming the file and the key
or tensor. The layout is llama.cpp's ``docs/gguf.md`` (versions 2 and 3: 64-bit counts);
gguf-py still supplies the type tables (``constants``) and the block decoders (``quants``).
Hand-written because gguf-py offers no bounded reader.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from trainforge.errors import CheckpointError

# Caps on what a header may declare, each far above real files: Llama 3's has ~40 keys, 540k
# metadata items (128k tokens and types, 280k merges) in ~4 MiB, and ~300 tensors; DeepSeek-V3's
# has ~1,100 tensors.
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 17
MAX_METADATA_ITEMS = 1 << 22  # array items, all arrays together
MAX_METADATA_BYTES = 64 << 20  # strings and array data, all keys together
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
_ALIGNMENT_KEY = "general.alignment"
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings (``tokenizer.ggml.tokens`` / ``merges``) as one blob: the
    lengths and the UTF-8 bytes end to end (two objects however many strings: a list of str
    would be ~60 bytes per token for the whole load). ``tolist`` decodes it when needed."""
    lengths: np.ndarray
    blob: bytes

    def __len__(self) -> int:
        return len(self.lengths)

    def tolist(self) -> list[str]:
        """The strings; ``UnicodeDecodeError`` when one is not UTF-8."""
        ends = np.cumsum(self.lengths).tolist()
        return [self.blob[e - n:e].decode("utf-8") for e, n in zip(ends, self.lengths.tolist())]


@dataclass(frozen=True)
class FileTensor:
    """Where one tensor lies in a GGUF file (all ``read_gguf`` needs), read on demand."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: innermost first
    n_bytes: int
    data_offset: int
    dtype: Any  # the element type: float32 / float16 ... for those types, else uint8 bytes
    array_shape: tuple[int, ...]  # the array's shape in that type (rows of bytes for a block type)
    path: Path

    def read(self) -> np.ndarray:
        """The tensor as an array, read into memory of its own: an anonymous map, page aligned
        (the float GEMV's loads) and outside malloc's heap. A malloc'd buffer, freed, raises
        glibc's dynamic mmap threshold, and the stored forms and their repacks then fragment
        the heap: the 90m q4_0 load peaked 35 MiB higher. No file pages are mapped."""
        buf = np.frombuffer(mmap.mmap(-1, max(self.n_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                            dtype=np.uint8)[:self.n_bytes]
        with open(self.path, "rb") as f:
            f.seek(self.data_offset)
            got = f.readinto(memoryview(buf))
        if got != self.n_bytes:
            raise CheckpointError(f"{self.path}: tensor {self.name} needs {self.n_bytes} bytes at offset "
                                  f"{self.data_offset}, the file holds {got}: truncated (download or convert it "
                                  "again)")
        return buf.view(self.dtype).reshape(self.array_shape)


@dataclass(frozen=True)
class GGUFFile:
    """What trainforge takes of a GGUF file's header: the metadata (a scalar as a Python
    value, a string as str, an array of numbers as a numpy array, an array of strings as a
    ``StringArray``) and where each tensor lies."""
    path: Path
    meta: dict[str, Any]
    tensors: list[FileTensor]


class _Cursor:
    """Reads the header from a map of the file; every read is checked to end inside it."""

    def __init__(self, mm: Any, size: int, path: Path):
        self.mm, self.size, self.path, self.off = mm, size, path, 0
        self.items = self.data_bytes = 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path} could not be read as a GGUF file: {what}; it is truncated, damaged "
                               "or not GGUF (convert or download it again)")

    def take(self, n: int, what: str) -> int:
        """Advance past ``n`` bytes; the offset they start at."""
        if n < 0 or n > self.size - self.off:
            raise self.fail(f"{what} needs {n} bytes at offset {self.off}, the file has {self.size - self.off} left")
        start, self.off = self.off, self.off + n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.mm, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.mm, self.take(8, what))[0]

    def count(self, n: int, item_bytes: int, cap: int, what: str) -> int:
        """``n`` items of at least ``item_bytes`` each: refused when they cannot fit in what is
        left of the file, or exceed ``cap``, before any is read."""
        if n > cap:
            raise self.fail(f"{what} claims {n} items; trainforge reads at most {cap}")
        if n * item_bytes > self.size - self.off:
            raise self.fail(f"{what} claims {n} items, at least {n * item_bytes} bytes, but the file has "
                            f"{self.size - self.off} bytes left")
        return n

    def charge(self, items: int, n_bytes: int, what: str) -> None:
        """Count ``items`` array items and ``n_bytes`` of metadata against the header caps."""
        self.items += items
        self.data_bytes += n_bytes
        if self.items > MAX_METADATA_ITEMS or self.data_bytes > MAX_METADATA_BYTES:
            raise self.fail(f"{what}: the metadata exceeds {MAX_METADATA_ITEMS} array items or "
                            f"{MAX_METADATA_BYTES >> 20} MiB, far beyond any real model's")

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        self.charge(0, n, what)
        start = self.take(n, what)
        try:
            return self.mm[start:start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None

    def string_array(self, n: int, what: str) -> StringArray:
        self.count(n, 8, MAX_METADATA_ITEMS, what)
        self.charge(n, 0, what)
        mm, size, off, unpack = self.mm, self.size, self.off, _U64.unpack_from
        lengths = [0] * n
        blob = bytearray()
        for i in range(n):  # each length says where the next string starts: one at a time
            if off + 8 > size:
                raise self.fail(f"{what} item {i}: length past the end of the file")
            length = unpack(mm, off)[0]
            off += 8
            if length > size - off:
                raise self.fail(f"{what} item {i}: {length} bytes at offset {off}, past the end of the file")
            lengths[i] = length
            blob += mm[off:off + length]
            off += length
            if len(blob) + self.data_bytes > MAX_METADATA_BYTES:
                self.charge(0, len(blob), what)  # raises
        self.off = off
        self.charge(0, len(blob), what)
        return StringArray(np.array(lengths, dtype=np.int64), bytes(blob))


def gguf_package():
    """The ``gguf`` package with the modules a load uses imported: ``constants`` and ``quants``.
    Where nothing imported gguf yet, its ``__init__`` is deferred: it also imports the reader and
    writer, every architecture's tensor-name tables, the vocab helpers and, for model-card
    metadata, yaml, 1.6 MiB of a decode process that no load uses (issue 24's memory bound;
    docs/benchmarks-archive.md). The package is then a module of its own whose first read of any other name
    (``gguf.GGUFWriter``, ``from gguf import ...``) runs that ``__init__`` in it (PEP 562
    ``__getattr__``), so later users see the whole package. ``ImportError`` when not installed."""
    import importlib
    import importlib.util
    import sys

    pkg = sys.modules.get("gguf")
    if pkg is None:
        spec = importlib.util.find_spec("gguf")
        if spec is None or spec.loader is None:
            raise ImportError("gguf")
        pkg = importlib.util.module_from_spec(spec)

        def complete(name: str):
            del pkg.__getattr__  # once: the package's own names from here on
            exec(spec.loader.get_code("gguf"), vars(pkg))
            try:
                return vars(pkg)[name]
            except KeyError:
                raise AttributeError(f"module 'gguf' has no attribute {name!r}") from None

        pkg.__getattr__ = complete
        sys.modules["gguf"] = pkg
    for sub in ("constants", "quants"):
        importlib.import_module(f"gguf.{sub}")
    return pkg


def _value_types():
    c = gguf_package().constants
    t = c.GGUFValueType
    scalars = {t.UINT8: np.uint8, t.INT8: np.int8, t.UINT16: np.uint16, t.INT16: np.int16, t.UINT32: np.uint32,
               t.INT32: np.int32, t.FLOAT32: np.float32, t.UINT64: np.uint64, t.INT64: np.int64,
               t.FLOAT64: np.float64, t.BOOL: np.bool_}
    return c, t, {k: np.dtype(v).newbyteorder("<") for k, v in scalars.items()}


def _value(cur: _Cursor, raw_type: int, key: str, value_types) -> Any:
    _, t, scalars = value_types
    if raw_type == t.STRING:
        return cur.string(f"key {key!r}")
    if raw_type in scalars:
        dtype = scalars[raw_type]
        return np.frombuffer(cur.mm, dtype=dtype, count=1, offset=cur.take(dtype.itemsize, f"key {key!r}"))[0].item()
    if raw_type != t.ARRAY:
        raise cur.fail(f"key {key!r} has value type {raw_type}, which GGUF does not define")
    item_type = cur.u32(f"key {key!r} array type")
    n = cur.u64(f"key {key!r} array length")
    if item_type == t.STRING:
        return cur.string_array(n, f"key {key!r}")
    if item_type not in scalars:  # nested arrays included: no model's metadata has them
        raise cur.fail(f"key {key!r} is an array of value type {item_type}; trainforge reads arrays of numbers, "
                       "booleans or strings")
    dtype = scalars[item_type]
    cur.count(n, dtype.itemsize, MAX_METADATA_ITEMS, f"key {key!r}")
    cur.charge(n, n * dtype.itemsize, f"key {key!r}")
    start = cur.take(n * dtype.itemsize, f"key {key!r}")
    return np.frombuffer(cur.mm, dtype=dtype, count=n, offset=start).astype(dtype.newbyteorder("="))  # a copy


def _tensor_info(cur: _Cursor, index: int, value_types) -> tuple[str, tuple[int, ...], Any, int]:
    c = value_types[0]
    name = cur.string(f"tensor {index} name")
    n_dims = cur.u32(f"tensor {name!r} dimension count")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
    shape = tuple(cur.u64(f"tensor {name!r} dimensions") for _ in range(n_dims))
    raw_type = cur.u32(f"tensor {name!r} type")
    try:
        tensor_type = c.GGMLQuantizationType(raw_type)
        c.GGML_QUANT_SIZES[tensor_type]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name!r} has type {raw_type}, which the gguf package does not know") from None
    return name, shape, tensor_type, cur.u64(f"tensor {name!r} offset")


# gguf-py's element types for the plain types; every other type is read as rows of bytes.
_ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


def _file_tensor(cur: _Cursor, info: tuple, data_start: int, value_types) -> FileTensor:
    c = value_types[0]
    name, shape, tensor_type, offset = info
    block_size, type_size = c.GGML_QUANT_SIZES[tensor_type]
    n_elems = 1
    for d in shape:
        n_elems *= d
    array_shape = tuple(reversed(shape))  # numpy order: outermost first
    if tensor_type.name in _ELEMENT_TYPES:
        dtype = np.dtype(_ELEMENT_TYPES[tensor_type.name])
    else:
        if not shape or shape[0] % block_size:
            raise cur.fail(f"tensor {name!r}: rows of {shape[0] if shape else 0} values are not whole "
                           f"{tensor_type.name} blocks of {block_size}")
        dtype = np.dtype(np.uint8)
        array_shape = (*array_shape[:-1], array_shape[-1] // block_size * type_size)
    n_bytes = n_elems * type_size // block_size
    begin = data_start + offset
    if begin + n_bytes > cur.size:
        raise cur.fail(f"tensor {name} needs {n_bytes} bytes at offset {begin}, the file holds "
                       f"{max(cur.size - begin, 0)} there")
    return FileTensor(name, tensor_type, shape, n_bytes, begin, dtype, array_shape, cur.path)


def read_header(path: Path) -> GGUFFile:
    """The header of the GGUF file ``path``, every count and offset checked (module docstring).
    Raises ``CheckpointError`` naming the file and what is wrong."""
    path = Path(path)
    try:
        value_types = _value_types()
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the gguf package: pip install 'trainforge[gguf]'") \
            from None
    c = value_types[0]
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise CheckpointError(f"{path} could not be read as a GGUF file: {size} bytes, shorter than a "
                                      "GGUF header (truncated, or not GGUF)")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"{path} could not be read: {e.strerror or e}") from None
    try:
        cur = _Cursor(mm, size, path)
        if cur.u32("magic") != c.GGUF_MAGIC:
            raise CheckpointError(f"{path} could not be read as a GGUF file: its first bytes are not 'GGUF'")
        version = cur.u32("version")
        if version not in (2, 3):
            swapped = version & 0xFFFF == 0
            raise CheckpointError(f"{path}: GGUF version {version if not swapped else 'of a big-endian file'} is "
                                  "not one trainforge reads (2 or 3, little-endian); convert the model again with a "
                                  "current llama.cpp")
        n_tensors, n_keys = cur.u64("tensor count"), cur.u64("key count")
        # Smallest entries: a key's length, type and a 1-byte value; a tensor's name length, dimension
        # count, type and offset.
        cur.count(n_keys, 8 + 4 + 1, MAX_KEYS, "the key table")
        cur.count(n_tensors, 8 + 4 + 4 + 8, MAX_TENSORS, "the tensor table")
        if n_keys * 13 + n_tensors * 24 > size - cur.off:
            raise cur.fail(f"{n_keys} keys and {n_tensors} tensors cannot fit in the file's {size} bytes")
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_keys}
        for i in range(n_keys):
            key = cur.string(f"key {i} name")
            if key in meta:
                raise cur.fail(f"key {key!r} appears twice")
            meta[key] = _value(cur, cur.u32(f"key {key!r} type"), key, value_types)
        infos = [_tensor_info(cur, i, value_types) for i in range(n_tensors)]
        if len({info[0] for info in infos}) != len(infos):
            raise cur.fail("a tensor name appears twice")
        alignment = meta.get(_ALIGNMENT_KEY, 32)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
                or alignment & (alignment - 1):
            raise cur.fail(f"key {_ALIGNMENT_KEY!r} = {alignment!r:.40} is not a power of two")
        data_start = -(-cur.off // alignment) * alignment
        tensors = [_file_tensor(cur, info, data_start, value_types) for info in infos]
        return GGUFFile(path, meta, tensors)
    finally:
        mm.close()


def typed(header: GGUFFile, key: str, kind: str, default: Any = None, required: bool = False) -> Any:
    """``header.meta[key]`` checked to be of ``kind``: "int" (an integer), "float" (any number),
    "str", "strings" (an array of strings) or "ints" (an array of integers); ``default`` when
    absent. Raises ``CheckpointError`` naming the file and key otherwise."""
    if key not in header.meta:
        if required:
            raise CheckpointError(f"{header.path}: GGUF metadata key {key!r} is missing")
        return default
    v = header.meta[key]
    check: Callable[[Any], bool] = {
        "int": lambda x: isinstance(x, int) and not isinstance(x, bool),
        "float": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
        "str": lambda x: isinstance(x, str),
        "strings": lambda x: isinstance(x, StringArray),
        "ints": lambda x: isinstance(x, np.ndarray) and x.dtype.kind in "iu",
    }[kind]
    if not check(v):
        want = {"int": "an integer", "float": "a number", "str": "a string", "strings": "an array of strings",
                "ints": "an array of integers"}[kind]
        got = f"an array of {len(v)}" if isinstance(v, (np.ndarray, StringArray)) else repr(v)[:60]
        raise CheckpointError(f"{header.path}: GGUF metadata key {key!r} is {got}, not {want}; the file is damaged "
                              "or not a llama.cpp model (convert it again)")
    return v
