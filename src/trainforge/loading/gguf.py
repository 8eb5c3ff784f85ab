"""Load llama.cpp's GGUF files (``--checkpoint model.gguf``): Llama architecture, tensors in
F32 / F16 / BF16 / Q8_0 / Q4_0. The header is read with every count and offset bounded
(``gguf_header.py``); the block types and decoders are llama.cpp's own (the ``gguf`` package).

Q8_0 and Q4_0 blocks become our ``q8_0`` / ``q4_0`` stored forms (``infer/quantize/blocks.py``) by
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
a quantised file, untied, loads byte for byte as a ``BlockEmbedding`` (``infer/quantize/block_embedding.py``,
``info["embedding"]``: the rows dequantised as they are read, the table never); tied, or in another
type, it is dequantised to float, and so is ``output.weight`` when it is in another type gguf-py
decodes (llama-quantize's Q4_0 preset writes it in Q6_K). Other types (Q4_K, Q6_K, ... in a linear)
are refused, naming the tensor.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainforge.errors import CheckpointError
from trainforge.loading.gguf_header import FileTensor, GGUFFile, read_header, typed
from trainforge.loading.gguf_header import gguf_package as _gguf
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


def open_gguf(path: Path) -> tuple[GGUFFile, ModelConfig, str | None]:
    """(the file's header as ``GGUFFile``, its ``ModelConfig``, the block mode most linears are in
    or None); only the header is read (``gguf_header.read_header``: every count bounded)."""
    header = read_header(path)
    cfg = model_config_from_gguf(header, path)
    mode = _majority_mode([t for t in header.tensors if t.name.startswith("blk.") or t.name == "output.weight"])
    return header, cfg, mode


def _f32(v: float) -> float:
    """GGUF stores these as float32: the shortest decimal that reads back to it (1e-06, not 9.99e-07),
    the value the converter was given."""
    return float(str(np.float32(v)))


# ModelConfig fields -> the GGUF keys they come from (check_shape names them so).
GGUF_KEYS = {"dim": "llama.embedding_length", "n_layers": "llama.block_count", "n_heads": "llama.attention.head_count",
             "n_kv_heads": "llama.attention.head_count_kv", "vocab_size": "llama.vocab_size",
             "ffn_hidden_dim": "llama.feed_forward_length", "max_seq_len": "llama.context_length"}


def model_config_from_gguf(header: GGUFFile, path: Path) -> ModelConfig:
    """``ModelConfig`` from the ``general.architecture`` / ``llama.*`` metadata, each key checked
    for its type and the shape (sizes, model limits) by ``check_shape`` under the GGUF key names
    before the HF Llama config reader (same checks) sees it; ``tie_embeddings`` when the file has
    no ``output.weight``."""
    from trainforge.model.preflight import check_shape

    arch = typed(header, "general.architecture", "str", required=True)
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF general.architecture is {arch!r:.80}; trainforge reads 'llama' GGUF "
                              "files only (for others, load the Hugging Face directory)")
    names = {t.name for t in header.tensors}
    g = lambda key, kind, **kw: typed(header, f"llama.{key}", kind, **kw)  # noqa: E731
    scaling = g("rope.scaling.type", "str", default="none")
    if scaling != "none":
        raise CheckpointError(f"{path}: GGUF key 'llama.rope.scaling.type' is {scaling!r:.80}; trainforge's Llama "
                              "has no RoPE scaling")
    emb = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if emb is None or len(emb.shape) != 2:
        raise CheckpointError(f"{path}: no 2-D token_embd.weight tensor")
    tokens = typed(header, "tokenizer.ggml.tokens", "strings")
    heads = g("attention.head_count", "int", required=True)
    values = {"dim": g("embedding_length", "int", required=True), "n_layers": g("block_count", "int", required=True),
              "n_heads": heads, "n_kv_heads": g("attention.head_count_kv", "int", default=heads),
              "vocab_size": g("vocab_size", "int", default=None) or int(emb.shape[1]),  # ggml shapes are (K, N)
              "ffn_hidden_dim": g("feed_forward_length", "int", required=True),
              "max_seq_len": g("context_length", "int", default=2048)}
    # Before anything sizes a table or divides by them: a hostile block_count of 10^9 stops here.
    check_shape(values, GGUF_KEYS, prefix=f"{path}: GGUF key", error=CheckpointError)
    vocab = values["vocab_size"]
    if tokens is not None and len(tokens) != vocab:
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens has {len(tokens)} tokens, the model {vocab}")
    hf = {"hidden_size": values["dim"], "num_hidden_layers": values["n_layers"], "num_attention_heads": heads,
          "num_key_value_heads": values["n_kv_heads"], "intermediate_size": values["ffn_hidden_dim"],
          "vocab_size": vocab, "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", "float", default=1e-5)),
          "rope_theta": _f32(g("rope.freq_base", "float", default=10000.0)),
          "max_position_embeddings": values["max_seq_len"], "tie_word_embeddings": "output.weight" not in names}
    try:
        cfg = model_config_from_hf(hf)
    except CheckpointError as e:  # names config.json keys; say which GGUF file
        raise CheckpointError(f"{path} (GGUF llama.* metadata): {e}") from None
    for key, want in (("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim),
                      ("rope.dimension_count", cfg.head_dim)):
        v = g(key, "int", default=want)
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


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in ggml order (innermost first: a linear's (in, out))."""
    d, f, v = cfg.dim, cfg.ffn_hidden_dim, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layer = {"attn_q": (d, q), "attn_k": (d, kv), "attn_v": (d, kv), "attn_output": (q, d), "ffn_gate": (d, f),
             "ffn_down": (f, d), "ffn_up": (d, f), "attn_norm": (d,), "ffn_norm": (d,)}
    out = {"token_embd.weight": (d, v), "output_norm.weight": (d,), "output.weight": (d, v)}
    out.update({f"blk.{i}.{g}.weight": s for i in range(cfg.n_layers) for g, s in layer.items()})
    return out


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
    shapes = _expected_shapes(cfg)
    wrong = [f"{name} {tensors[name].shape} (want {want})" for name, want in shapes.items()
             if name in tensors and tensors[name].shape != want]
    if wrong:  # before any is read: a q projection that does not fit the heads would not reshape
        raise CheckpointError(f"{path}: GGUF tensors do not fit the llama.* metadata (shapes in ggml order, "
                              f"innermost first): {', '.join(wrong[:4])}")
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


def gguf_tokenizer(header: GGUFFile, path: Path, vocab_size: int | None = None
                   ) -> tuple[Callable[[], Any] | None, tuple[int, ...]]:
    """(a function building the ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*``, or None when
    the file has no tokenizer; eos ids). Checked now (each key's type, the token ids and the
    lengths of the per-token arrays: a ``CheckpointError`` naming the file and key), built when
    called: byte-level BPE (model "gpt2": tokens + merges); SentencePiece ("llama") is refused
    with the way round it."""
    model = typed(header, "tokenizer.ggml.model", "str")
    tokens = typed(header, "tokenizer.ggml.tokens", "strings")
    vocab = vocab_size if vocab_size is not None else len(tokens) if tokens is not None else None
    eos = typed(header, "tokenizer.ggml.eos_token_id", "int")
    if eos is not None and vocab is not None and not 0 <= eos < vocab:
        raise CheckpointError(f"{path}: GGUF key 'tokenizer.ggml.eos_token_id' = {eos} is not a token id of the "
                              f"{vocab}-token vocabulary; the file is damaged (convert it again)")
    eos_ids = (eos,) if eos is not None else ()
    if model is None:
        return None, eos_ids
    if model != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer.ggml.model is {model!r:.80}; trainforge builds byte-level BPE "
                              "('gpt2') tokenizers from GGUF metadata only. Load the Hugging Face directory (its "
                              "tokenizer.json) instead")
    tokens = typed(header, "tokenizer.ggml.tokens", "strings", required=True)
    typed(header, "tokenizer.ggml.merges", "strings", required=True)
    typed(header, "tokenizer.ggml.pre", "str")
    for key, kind in (("token_type", "ints"), ("scores", "floats")):
        v = header.meta.get(f"tokenizer.ggml.{key}")
        if v is not None and (not isinstance(v, np.ndarray) or v.dtype.kind not in ("iu" if kind == "ints" else "f")
                              or len(v) != len(tokens)):
            got = f"{v.dtype} array of {len(v)}" if isinstance(v, np.ndarray) else f"{v!r:.40}"
            raise CheckpointError(f"{path}: GGUF key 'tokenizer.ggml.{key}' is {got}, not one "
                                  f"{'integer' if kind == 'ints' else 'number'} per token of tokenizer.ggml.tokens "
                                  f"({len(tokens)}); the file is damaged (convert it again)")
    return functools.partial(_bpe_tokenizer, header, path), eos_ids


def _bpe_tokenizer(header: GGUFFile, path: Path) -> Any:
    """The byte-level BPE ``tokenizers.Tokenizer`` of a file ``gguf_tokenizer`` accepted. Raises
    ``CheckpointError`` naming the key when the strings do not form one (not UTF-8, a merge that
    is not two tokens of the vocabulary)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    key = "tokenizer.ggml.tokens"
    try:
        tokens = header.meta[key].tolist()
        key = "tokenizer.ggml.merges"
        merges = [tuple(m.split(" ", 1)) for m in header.meta[key].tolist()]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    except Exception as e:  # UnicodeDecodeError; tokenizers' own errors are plain Exceptions
        raise CheckpointError(f"{path}: GGUF key {key!r} does not form a byte-level BPE vocabulary "
                              f"({error_detail(e)}); the file is damaged (convert it again)") from None
    types = header.meta.get("tokenizer.ggml.token_type")
    pre = header.meta.get("tokenizer.ggml.pre", "gpt2")
    if pre in ("llama-bpe", "llama3"):  # Llama 3's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3)
        split = Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # GPT-2's regex, ByteLevel's own
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if types is not None:  # llama.cpp's token types: 3 = control, 4 = user-defined: whole tokens, never split.
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in np.flatnonzero((types == 3) | (types == 4)).tolist()])
    return tok
