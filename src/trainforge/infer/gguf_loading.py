"""Load llama.cpp's GGUF files (``--checkpoint model.gguf``): Llama architecture, tensors in
F32 / F16 / BF16 / Q8_0 / Q4_0, read with llama.cpp's own reader (the ``gguf`` package).

Q8_0 and Q4_0 blocks become our ``q8_0`` / ``q4_0`` stored forms (``quantize/blocks.py``) by
reinterpreting their bytes, never by re-quantising: a GGUF Q8_0 block is 34 bytes (fp16 d, 32
int8 codes), a Q4_0 block 18 bytes (fp16 d, 16 bytes of nibbles, byte j = element j low,
element j + 16 high: our order), so the scale column is split out and the codes kept as they are.

RoPE layout. llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) takes HF
Llama's q/k rows, whose per-head order is rotate-half (rows [0, hd/2) pair with [hd/2, hd), as
ours: ``model/rope.py``, ``model/hf.py`` renames only), and writes

    w.reshape(n_head, 2, hd // 2, K).swapaxes(1, 2).reshape(N, K)

(``n_head`` = head_count for attn_q, head_count_kv for attn_k): GGUF row ``h*hd + 2*j + t`` is
HF row ``h*hd + t*hd/2 + j``, the interleaved pairs ggml's "normal" RoPE rotates. The inverse,
``_unpermute``, is ``reshape(n_head, hd // 2, 2, K).swapaxes(1, 2)``. It moves whole rows, so it
applies to a quantised tensor's rows of blocks unchanged.

Mixed files: linears in the file's majority block type load quantised under that mode; linears in
the other block type (llama.cpp's q4_0 files often keep ``output.weight`` in Q8_0) or in a float
type are dequantised to float and listed in ``info["skipped"]``. A Q8_0 / Q4_0 token embedding of
a quantised file, untied, loads byte for byte as a ``BlockEmbedding`` (``quantize/block_embedding.py``,
``info["embedding"]``: the rows dequantised as they are read, the table never); tied, or in another
type, it is dequantised to float, and so is ``output.weight`` when it is in another type gguf-py
decodes (llama-quantize's Q4_0 preset writes it in Q6_K). Other types (Q4_K, Q6_K, ... in a linear)
are refused, naming the tensor.
"""

from __future__ import annotations

import functools
import gc
import mmap
import pickle
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainforge.errors import CheckpointError
from trainforge.model.config import ModelConfig
from trainforge.model.hf import model_config_from_hf
from trainforge.safe_unpickle import error_detail

_FLOAT_TYPES = ("F32", "F16", "BF16")
_BLOCK_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0"}  # GGML type name -> our quantization mode
_LINEARS = {  # GGUF name relative to blk.{i}. -> ours relative to layers.{i}.
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2", "ffn_up": "feed_forward.w3",
}
# Any type gguf-py decodes (dequantised on load unless in a block type we keep): llama-quantize's
# Q4_0 / Q8_0 presets keep output.weight in Q6_K, and some write the embedding in a K-quant.
_FLOAT_ANY_TYPE = ("token_embd.weight", "output.weight")
_NORMS = {"attn_norm": "attention_norm", "ffn_norm": "ffn_norm"}


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings (``tokenizer.ggml.tokens`` / ``merges``) as one blob: the
    lengths and the UTF-8 bytes end to end. Taken while the reader is open, as two large
    objects, so that every small object the reader made dies with it and the interpreter can
    hand its memory back (a list of str made then would pin the reader's arenas: ~10 MiB left
    behind for an 8k vocabulary). ``tolist`` decodes it once the reader is gone."""
    lengths: np.ndarray
    blob: bytes

    @classmethod
    def of(cls, field) -> "StringArray":
        parts = [field.parts[i] for i in field.data]
        return cls(np.array([len(p) for p in parts], dtype=np.int64), b"".join(p.tobytes() for p in parts))

    def __len__(self) -> int:
        return len(self.lengths)

    def tolist(self) -> list[str]:
        ends = np.cumsum(self.lengths).tolist()
        return [self.blob[e - n:e].decode("utf-8") for e, n in zip(ends, self.lengths.tolist())]


@dataclass(frozen=True)
class GGUFFile:
    """What trainforge takes of a GGUF file's header: the metadata as plain values and where
    each tensor lies. The ``GGUFReader`` it came from is dropped (``FileTensor`` says why)."""
    path: Path
    meta: dict[str, Any]
    tensors: list["FileTensor"]


def open_gguf(path: Path) -> tuple[GGUFFile, ModelConfig, str | None]:
    """(the file's header as ``GGUFFile``, its ``ModelConfig``, the block mode most linears are in
    or None); only the header is read, by gguf-py's ``GGUFReader``, which is then let go."""
    header = pickle.loads(_header_bytes(path))
    cfg = model_config_from_gguf(header, path)
    mode = _majority_mode([t for t in header.tensors if t.name.startswith("blk.") or t.name == "output.weight"])
    return header, cfg, mode


def _header_bytes(path: Path) -> bytes:
    """The file's ``GGUFFile``, pickled, and its reader collected. The reader makes ~100k small
    objects (``FileTensor``); the header's own objects, made among them, would each pin a pool
    of Python's allocator and with it an arena of 1 MiB: ~3 MiB left behind for the 90m model's
    file. Unpickled after the reader is gone, they lie together in fresh pools."""
    reader = _reader(path)
    blob = pickle.dumps(GGUFFile(path, _metadata(reader), file_tensors(reader, path)))
    del reader
    gc.collect()  # the reader's objects hold cycles: free them before the weights are read
    return blob


def _metadata(reader) -> dict[str, Any]:
    constants = _gguf().constants
    string, array = constants.GGUFValueType.STRING, constants.GGUFValueType.ARRAY
    return {key: StringArray.of(f) if f.types[:1] == [array] and f.types[-1] == string else f.contents()
            for key, f in reader.fields.items()}


@dataclass(frozen=True)
class FileTensor:
    """Where one tensor lies in a GGUF file: what ``read_gguf`` needs once the ``GGUFReader`` is
    dropped. The reader parses every metadata array item into its own numpy view (~300 bytes
    each: 25 MiB for an 8192-token vocabulary with its merges, hundreds of MiB for Llama 3's
    128k tokens and 280k merges) and maps the file, so holding it while the weights are read
    would add both to the load's peak memory (the issue's RSS bound)."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: innermost first
    n_bytes: int
    data_offset: int
    dtype: Any  # the reader's element type: float32 / float16 for F32 / F16, else uint8 bytes
    array_shape: tuple[int, ...]  # the reader's array shape in that type
    path: Path

    def read(self) -> np.ndarray:
        """The tensor as the reader's array, read into memory of its own: an anonymous map, page
        aligned (the float GEMV's loads) and outside malloc's heap. A malloc'd buffer, freed,
        raises glibc's dynamic mmap threshold, and the stored forms and their repacks then
        fragment the heap: the 90m q4_0 load peaked 35 MiB higher. No file pages are mapped."""
        buf = np.frombuffer(mmap.mmap(-1, max(self.n_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)[:self.n_bytes]
        with open(self.path, "rb") as f:
            f.seek(self.data_offset)
            got = f.readinto(memoryview(buf))
        if got != self.n_bytes:
            raise CheckpointError(f"{self.path}: tensor {self.name} needs {self.n_bytes} bytes at offset "
                                  f"{self.data_offset}, the file holds {got}: truncated (download or convert it "
                                  "again)")
        return buf.view(self.dtype).reshape(self.array_shape)


def file_tensors(reader, path: Path) -> list[FileTensor]:
    """The places of a ``GGUFReader``'s tensors (``FileTensor``), to read them once it is dropped."""
    return [FileTensor(t.name, t.tensor_type, tuple(int(s) for s in t.shape), int(t.n_bytes), int(t.data_offset),
                       t.data.dtype, tuple(t.data.shape), path) for t in reader.tensors]


def _gguf():
    """The ``gguf`` package with the modules a load uses imported: its reader (``gguf_reader``),
    ``constants`` and ``quants``. Where nothing imported gguf yet, its ``__init__`` is deferred:
    it also imports the writer, every architecture's tensor-name tables, the vocab helpers and,
    for model-card metadata, yaml, 1.6 MiB of a decode process that no load uses (issue 24's
    memory bound; BENCHMARKS.md). The package is then a module of its own whose first read of
    any other name (``gguf.GGUFWriter``, ``from gguf import ...``) runs that ``__init__`` in it
    (PEP 562 ``__getattr__``), so later users see the whole package."""
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
    for sub in ("constants", "quants", "gguf_reader"):
        importlib.import_module(f"gguf.{sub}")
    return pkg


def _reader(path: Path):
    try:
        gguf = _gguf()
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the gguf package: pip install 'trainforge[gguf]'") \
            from None
    try:
        return gguf.gguf_reader.GGUFReader(str(path), "r")
    except Exception as e:  # ValueError on a bad magic / truncated data, struct errors, OSError
        raise CheckpointError(f"{path} could not be read as a GGUF file: truncated, damaged or not GGUF "
                              f"({error_detail(e)})") from None


def _field(header: GGUFFile, key: str, default: Any = None, required: bool = False, path: Path | None = None
           ) -> Any:
    if key not in header.meta:
        if required:
            raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing")
        return default
    return header.meta[key]


def _f32(v: float) -> float:
    """GGUF stores these as float32: the shortest decimal that reads back to it (1e-06, not 9.99e-07),
    the value the converter was given."""
    return float(str(np.float32(v)))


def model_config_from_gguf(header: GGUFFile, path: Path) -> ModelConfig:
    """``ModelConfig`` from the ``general.architecture`` / ``llama.*`` metadata, validated by the HF
    Llama config reader (same checks); ``tie_embeddings`` when the file has no ``output.weight``."""
    arch = _field(header, "general.architecture", required=True, path=path)
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF general.architecture is {arch!r}; trainforge reads 'llama' GGUF files "
                              "only (for others, load the Hugging Face directory)")
    names = {t.name for t in header.tensors}
    g = lambda key, **kw: _field(header, f"llama.{key}", path=path, **kw)  # noqa: E731
    scaling = g("rope.scaling.type", default="none")
    if scaling not in ("none", None):
        raise CheckpointError(f"{path}: GGUF key 'llama.rope.scaling.type' is {scaling!r}; trainforge's Llama has "
                              "no RoPE scaling")
    emb = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")
    tokens = _field(header, "tokenizer.ggml.tokens")
    vocab = g("vocab_size", default=None) or int(emb.shape[1])  # ggml shapes are (K, N)
    hf = {"hidden_size": g("embedding_length", required=True), "num_hidden_layers": g("block_count", required=True),
          "num_attention_heads": g("attention.head_count", required=True),
          "num_key_value_heads": g("attention.head_count_kv", default=None),
          "intermediate_size": g("feed_forward_length", required=True), "vocab_size": vocab,
          "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", default=1e-5)),
          "rope_theta": _f32(g("rope.freq_base", default=10000.0)),
          "max_position_embeddings": g("context_length", default=2048),
          "tie_word_embeddings": "output.weight" not in names}
    hf = {k: v for k, v in hf.items() if v is not None}
    if tokens is not None and len(tokens) != vocab:
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens has {len(tokens)} tokens, the model {vocab}")
    try:
        cfg = model_config_from_hf(hf)
    except CheckpointError as e:  # names config.json keys; say which GGUF file
        raise CheckpointError(f"{path} (GGUF llama.* metadata): {e}") from None
    for key, want in (("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim),
                      ("rope.dimension_count", cfg.head_dim)):
        v = g(key, default=want)
        if v != want:
            raise CheckpointError(f"{path}: GGUF key 'llama.{key}' is {v}; trainforge needs embedding_length / "
                                  f"head_count = {want}")
    return cfg


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF's interleaved q/k rows (N, ...) -> rotate-half rows (module docstring), a copy. In
    numpy, as the file's arrays are: torch's reshape / transpose / clone would each map libtorch
    code that nothing else in a decode process runs (``runner.py``'s docstring)."""
    n = rows.shape[0]
    hd = n // n_head
    return np.ascontiguousarray(rows.reshape(n_head, hd // 2, 2, *rows.shape[1:]).swapaxes(1, 2)).reshape(rows.shape)


def _tensor_bytes(t: FileTensor) -> np.ndarray:
    """A tensor's data as (N, row bytes) uint8, read from the file."""
    return t.read().reshape(int(t.shape[1]) if len(t.shape) > 1 else 1, -1).view(np.uint8)


def _stored_form(t: FileTensor, mode: str) -> dict[str, np.ndarray]:
    """A Q8_0 / Q4_0 tensor's blocks split into our stored form: codes and fp16 scales, bytes as they are."""
    block_bytes = 34 if mode == "q8_0" else 18
    b = _tensor_bytes(t)
    n = b.shape[0]
    b = b.reshape(n, -1, block_bytes)  # (N, K/32, block)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16).reshape(n, -1)  # (N, K/32)
    qs = np.ascontiguousarray(b[..., 2:]).reshape(n, -1)  # (N, K) int8 / (N, K/2) nibbles
    if mode == "q8_0":
        qs = qs.view(np.int8)
    return {"weight": qs, "scales": d}


def _dequantised(t: FileTensor, path: Path) -> np.ndarray:
    gguf = _gguf()
    a = t.read()
    if t.tensor_type.name != "F32":  # F16, BF16, a block type; for the two _FLOAT_ANY_TYPE tensors, any type gguf-py decodes
        try:  # gguf-py decodes the K-quants in numpy (it has no encoder for them)
            a = gguf.quants.dequantize(a, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"{path}: tensor {t.name} is of GGUF type {t.tensor_type.name}, which the gguf "
                                  "package cannot decode; requantise the file with llama-quantize "
                                  "(--output-tensor-type q8_0 --token-embedding-type q8_0)") from None
    shape = tuple(int(s) for s in reversed(t.shape))  # ggml lists dims innermost first
    # Both are our own arrays already (the read buffer, a decoded array): no copy, which would
    # double the embedding's share of the load's peak memory.
    return a.astype(np.float32, copy=False).reshape(shape)


def _majority_mode(tensors: list) -> str | None:
    """The quantization mode of the block type most of ``tensors`` have, or None when none is Q8_0 / Q4_0."""
    counts = Counter(t.tensor_type.name for t in tensors if t.tensor_type.name in _BLOCK_TYPES)
    return _BLOCK_TYPES[counts.most_common(1)[0][0]] if counts else None


def read_gguf(tensors: list[FileTensor], cfg: ModelConfig, path: Path
              ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(our state dict on CPU, quantization info or None) of a GGUF file's tensors (``file_tensors``),
    read one at a time."""
    tensors = {t.name: t for t in tensors}
    supported = list(_FLOAT_TYPES) + list(_BLOCK_TYPES)
    for name, t in tensors.items():
        # The two _FLOAT_ANY_TYPE tensors: checked as they are decoded (_dequantised).
        if t.tensor_type.name not in supported and name not in _FLOAT_ANY_TYPE:
            raise CheckpointError(f"{path}: tensor {name} is of GGUF type {t.tensor_type.name}; trainforge reads "
                                  f"{', '.join(supported)} (requantise the file with llama-quantize to Q8_0 or Q4_0, "
                                  "or load the Hugging Face directory)")
    linears = {f"blk.{i}.{g}.weight": f"layers.{i}.{o}" for i in range(cfg.n_layers) for g, o in _LINEARS.items()}
    if not cfg.tie_embeddings:
        linears["output.weight"] = "output"
    others = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight"}
    others.update({f"blk.{i}.{g}.weight": f"layers.{i}.{o}.weight" for i in range(cfg.n_layers)
                   for g, o in _NORMS.items()})
    expected = set(linears) | set(others)
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected - {"rope_freqs.weight"})
    if missing or unexpected:
        raise CheckpointError(f"{path}: GGUF tensors do not match a Llama of block_count {cfg.n_layers}: missing "
                              f"{missing[:8]}, unexpected {unexpected[:8]}")
    if "rope_freqs.weight" in tensors:  # llama 3.1's long-context factors
        raise CheckpointError(f"{path}: rope_freqs.weight (Llama 3.1 RoPE scaling) is not supported by trainforge")
    mode = _majority_mode([tensors[g] for g in linears])
    sd: dict[str, torch.Tensor] = {}
    info: dict[str, Any] = {"mode": mode, "layers": [], "experts": [], "skipped": {}, "format": "gguf"}
    rope_heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}
    for g, ours in linears.items():
        t = tensors[g]
        kind = t.tensor_type.name
        heads = rope_heads.get(g.split(".")[-2]) if g.startswith("blk.") else None
        if mode is not None and _BLOCK_TYPES.get(kind) == mode:
            stored = _stored_form(t, mode)
            sd.update({f"{ours}.{s}": torch.from_numpy(_unpermute(v, heads) if heads else v)
                       for s, v in stored.items()})
            info["layers"].append(ours)
            continue
        w = _dequantised(t, path)
        sd[f"{ours}.weight"] = torch.from_numpy(_unpermute(w, heads) if heads else w)
        if mode is not None:
            info["skipped"][ours] = f"GGUF {kind} in a {mode} file: loaded as float"
    emb = tensors["token_embd.weight"]
    emb_mode = _BLOCK_TYPES.get(emb.tensor_type.name)
    if mode is not None and emb_mode is not None and not cfg.tie_embeddings:
        # Kept in blocks: the tied case stays float, as the output projection reads it whole.
        sd.update({f"tok_embeddings.{s}": torch.from_numpy(v) for s, v in _stored_form(emb, emb_mode).items()})
        info["embedding"] = emb_mode
        del others["token_embd.weight"]
    for g, ours in others.items():
        sd[ours] = torch.from_numpy(_dequantised(tensors[g], path))
    return sd, (info if mode else None)


def _strings(v: Any) -> list[str]:
    return v.tolist() if isinstance(v, StringArray) else list(v)


def gguf_tokenizer(header: GGUFFile, path: Path) -> tuple[Callable[[], Any] | None, tuple[int, ...]]:
    """(a function building the ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*``, or None when
    the file has no tokenizer; eos ids). Checked now, built when called: byte-level BPE (model
    "gpt2": tokens + merges); SentencePiece ("llama") is refused with the way round it."""
    model = _field(header, "tokenizer.ggml.model")
    eos = _field(header, "tokenizer.ggml.eos_token_id")
    eos_ids = (int(eos),) if eos is not None else ()
    if model is None:
        return None, eos_ids
    if model != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer.ggml.model is {model!r}; trainforge builds byte-level BPE "
                              "('gpt2') tokenizers from GGUF metadata only. Load the Hugging Face directory (its "
                              "tokenizer.json) instead")
    _field(header, "tokenizer.ggml.tokens", required=True, path=path)
    _field(header, "tokenizer.ggml.merges", required=True, path=path)
    return functools.partial(_bpe_tokenizer, header, path), eos_ids


def _bpe_tokenizer(header: GGUFFile, path: Path) -> Any:
    """The byte-level BPE ``tokenizers.Tokenizer`` of a file ``gguf_tokenizer`` accepted."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = _strings(_field(header, "tokenizer.ggml.tokens", required=True, path=path))
    merges = _strings(_field(header, "tokenizer.ggml.merges", required=True, path=path))
    types = _field(header, "tokenizer.ggml.token_type", default=[1] * len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges]))
    pre = _field(header, "tokenizer.ggml.pre", default="gpt2")
    if pre in ("llama-bpe", "llama3"):  # Llama 3's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3)
        split = Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # GPT-2's regex, ByteLevel's own
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # llama.cpp's token types: 3 = control, 4 = user-defined: whole tokens, never split.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty in (3, 4)])
    return tok
