"""Write a model as a Hugging Face directory (``config.json`` + ``model.safetensors``, plus
``tokenizer.json`` when there is one) that ``transformers``' ``from_pretrained`` loads:
``LlamaForCausalLM`` for a dense model (``model/hf.py``), ``DeepseekV3ForCausalLM`` for a
latent-attention MoE (``model/hf_deepseek.py``, the released checkpoints' layout: per-expert
weights, interleaved rotary rows, and the MTP modules as ``model.layers.{n_layers + d}``).

``export`` is ``trainforge export``: any dtype, sharded above a size, tokenizer files that
``AutoTokenizer`` reads, and optionally int8/int4 linear weights in the compressed-tensors
format, streamed tensor by tensor. The directory is written atomically (``storage/atomic.py``).
Reading it back with ``infer.loading.load_model`` gives the same weights bit for bit (float, and
the quantised layers' stored form).
"""

from __future__ import annotations

import json
import shutil
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from trainforge.errors import CheckpointError
from trainforge.model import hf, hf_deepseek, hf_moe
from trainforge.model.config import ModelConfig
from trainforge.storage.atomic import atomic_directory
from trainforge.storage.output_paths import refuse_overlap
from trainforge.storage.safetensors_stream import Entry, write_sharded

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")


def hf_layout(cfg: ModelConfig):
    """The conversion module for ``cfg``: ``hf_deepseek`` for latent attention, ``hf_moe`` for other
    MoE models (Glm4Moe / Mixtral), else ``hf`` (Llama)."""
    return hf_deepseek if cfg.is_mla else hf_moe if cfg.is_moe else hf


def save_hf_dir(out_dir: str | Path, state_dict: dict[str, torch.Tensor], cfg: ModelConfig,
                tokenizer_path: Path | None = None, eos_ids: tuple[int, ...] = ()) -> Path:
    """Write ``state_dict`` (our ``Transformer``'s, float, each tensor in its own dtype) as a
    Hugging Face directory at ``out_dir`` (refuses an existing path): ``export``'s files, from
    a model in memory. A tensor stored under two names (tied embeddings, the MTP layer's copies
    of the embedding and head) is written once per name; ``from_pretrained`` re-ties them."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; choose a new directory")
    layout = hf_layout(cfg)
    tensors = layout.to_hf_state_dict(state_dict, cfg)
    if cfg.tie_embeddings:  # HF's save_pretrained writes the embedding alone when tied
        tensors.pop("lm_head.weight", None)
    dtypes = {v.dtype for v in tensors.values() if v.is_floating_point()} - {torch.float32}
    config = layout.to_hf_config_dict(cfg, dtype=_DTYPES.get(next(iter(dtypes)), "float32") if dtypes else "float32")
    entries = [Entry(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in tensors.items()]
    _write_dir(out_dir, entries, config, eos_ids, tokenizer_path, cfg.max_seq_len)
    return out_dir


def _write_dir(out_dir: Path, entries: list[Entry], config: dict, eos_ids: tuple[int, ...], tok_file: Path | None,
               max_len: int, replace: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES,
               before_commit: Callable[[], None] | None = None) -> list[Path]:
    """The directory's files, written atomically: the weights (``write_sharded``), then
    ``before_commit()`` (raising removes everything), ``config.json`` (``eos_token_id`` set),
    ``generation_config.json`` and the tokenizer files. Returns the weight files."""
    if eos_ids:
        config["eos_token_id"] = list(eos_ids) if len(eos_ids) > 1 else eos_ids[0]
    generation = {"_from_model_config": True}
    if eos_ids:
        generation["eos_token_id"] = config["eos_token_id"]
    with atomic_directory(out_dir, replace=replace) as tmp:
        files = write_sharded(tmp, entries, max_shard_bytes, metadata={"format": "pt"})
        if before_commit is not None:
            before_commit()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tok_file is not None and tok_file.is_file():
            _tokenizer_files(tmp, tok_file, eos_ids, max_len)
    return [out_dir / f.name for f in files]


# Kept float (and fp32) by the dtype cast: the selection bias of DeepSeek-V3's router is an
# fp32 tensor in the released checkpoints, and top-k over near-tied scores flips in bf16.
_KEEP_FP32 = ("e_score_correction_bias",)


@dataclass
class ExportResult:
    path: Path
    files: list[Path]
    tensors: int
    bytes: int
    quantized: list[str]  # our layer names
    ignored: list[str]  # HF module names left float in a quantised export
    notes: list[str] = dataclasses.field(default_factory=list)  # int4: the layers grouped otherwise, or left float


class _Verifier:
    """The sha256 check of a checkpoint's files (``read_meta(verify=True)``) on a thread."""

    def __init__(self, ck: Path):
        import threading

        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(ck,), daemon=True, name="export-verify")
        self.thread.start()

    def _run(self, ck: Path) -> None:
        from trainforge.storage.checkpoint_format import read_meta

        try:
            read_meta(ck, verify=True)
        except BaseException as e:  # re-raised in the caller's thread by result()
            self.error = e

    def result(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _check_args(out_dir: Path, dtype: str, quantize: str | None, group_size: int, force: bool) -> None:
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    if quantize not in (None, "none", "int8", "int4"):
        raise CheckpointError(f"--quantize {quantize!r}: use int8 or int4 (or leave it out for float weights)")
    if quantize == "int4" and (group_size < 2 or group_size % 2):
        raise CheckpointError(f"--group_size {group_size}: int4 groups must be an even number >= 2 "
                              "(32, 64, 128 or 256 run the fast CPU kernel)")
    if out_dir.exists() and not force:
        raise CheckpointError(f"--output {out_dir} exists; choose a new directory, or pass --force to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--output {out_dir} is a file, not a directory")


def _tokenizer_files(tmp: Path, tok_file: Path, eos_ids: tuple[int, ...], max_len: int) -> None:
    """tokenizer.json and a tokenizer_config.json that makes ``AutoTokenizer`` build a
    ``PreTrainedTokenizerFast`` over it, with the end-of-text token set."""
    from tokenizers import Tokenizer

    shutil.copyfile(tok_file, tmp / "tokenizer.json")
    tok = Tokenizer.from_file(str(tok_file))
    eos = tok.id_to_token(eos_ids[0]) if eos_ids else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, "eos_token": eos, "bos_token": None, "pad_token": None,
              "unk_token": None, "add_bos_token": False, "add_eos_token": False}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos} if eos else {}, indent=2) + "\n")


def export(checkpoint: str | Path, out_dir: str | Path, dtype: str = "fp32", quantize: str | None = None,
           group_size: int = 128, force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES,
           skip_indivisible: bool = False, weights: str = "final") -> ExportResult:
    """A trainforge checkpoint (or run directory: its newest checkpoint, or a Hugging Face
    directory) written as a Hugging Face directory at ``out_dir``: ``config.json``,
    ``generation_config.json``, the weights (``model.safetensors``, or shards + index above
    ``max_shard_bytes``) in ``dtype``, and the tokenizer (``tokenizer.json`` +
    ``tokenizer_config.json``). ``quantize``: int8 (per channel) or int4 (per group) linear
    weights in the compressed-tensors format (``quant_formats/compressed_tensors.py``), on the grid of
    ``trainforge quantize``; embeddings, norms, routers, routed experts and latent attention's
    ``wkv_b`` stay float (listed in ``quantization_config.ignore``), as does a tied output head.

    int4 groups each layer as ``trainforge quantize`` does (``quant_formats/int4_groups.py``: ``group_size``
    where it divides the input dim, else the largest multiple of 32 below it that does, else float;
    ``result.notes`` says which layers fell back, in ``quantize``'s words). Routed experts take one
    size dividing both their dims (the Hugging Face layout has no padding of the hidden dim). With
    ``skip_indivisible`` (a QAT run's grid: the CLI sets it) there is no fallback: a layer the
    size does not divide stays float, as training kept it. ``weights``: ``final`` or ``ema`` (the
    moving average of a run trained with ``[ema]``).

    Every argument is checked before anything is read; the directory appears complete or not
    at all (``--force`` replaces an existing one only once the new one is written). Tensors
    are converted and written one at a time (``storage/safetensors_stream.py``)."""
    from trainforge.infer.loading import load_model
    from trainforge.infer.quantize import linear_names, quantize_state_dict
    from trainforge.quant_formats import compressed_tensors as ct
    from trainforge.quant_formats.int4_groups import fallback_lines, group_size_for, why_float

    out_dir = Path(out_dir)
    quantize = None if quantize == "none" else quantize
    # Before the --force check: replacing the checkpoint (or its run) with its own export is refused.
    refuse_overlap(out_dir, "--output", [("--checkpoint", checkpoint)], has_force=True)
    _check_args(out_dir, dtype, quantize, group_size, force)
    # Mapped: each weight is read from disk when it is written out, so the export's own
    # memory is about one converted tensor and a model larger than RAM goes through. The
    # checkpoint's sha256 check runs beside the conversion (hashlib releases the GIL) instead
    # of before it (a whole extra pass: 5 of 13 s for a 1B model, measured); a mismatch is
    # raised before the output is committed, so a damaged checkpoint still writes nothing.
    loaded = load_model(checkpoint, mapped=True, verify=False, weights=weights)
    check = _Verifier(loaded.path) if loaded.source == "trainforge" else None
    if loaded.quantization:
        raise CheckpointError(f"{checkpoint} is quantised ({loaded.quantization['mode']}); export the float "
                              "checkpoint it was made from, with --quantize")
    model, cfg = loaded.model, loaded.model.cfg
    layout = hf_layout(cfg)
    sd = model.state_dict()
    hf_sd = layout.to_hf_state_dict(sd, cfg)
    if cfg.tie_embeddings:  # HF's save_pretrained writes the embedding alone when tied
        hf_sd.pop("lm_head.weight", None)
    target = DTYPES[dtype]

    quantized: dict[str, Callable[[], dict[str, torch.Tensor]]] = {}  # HF prefix -> its stored form, on demand
    group_of: dict[str, int] = {}  # int4: our layer / experts module -> its group size where not group_size
    hf_groups: dict[str, int] = {}  # the same by HF module
    skipped: dict[str, str] = {}  # int4: left float, and why
    notes: list[str] = []
    layer_names: list[str] = []
    ignored: list[str] = []
    if quantize:
        if not hasattr(layout, "key_map"):
            raise CheckpointError(f"{checkpoint}: quantised export of this model family is not supported yet; "
                                  "export float weights (leave out --quantize)")
        names = [n for n in linear_names(model) if not (cfg.tie_embeddings and n == "output")]
        kmap = layout.key_map(cfg)
        # Routed experts: each expert's w1/w2/w3 is a Linear in the HF layout (per-expert keys),
        # quantised on the grid QuantExperts uses (rows stacked: the same codes per expert).
        emap = layout.expert_key_map(cfg) if cfg.is_moe and hasattr(layout, "expert_key_map") else {}
        if quantize == "int4":
            fallback = not skip_indivisible
            in_features = {n: (sd[f"{n}.weight"].shape[1],) for n in names}
            # An experts module: w1/w3 take the model dim, w2 the hidden dim; one size for both.
            in_features.update({k.rsplit(".", 1)[0]: (sd[k].shape[2], sd[k].shape[1]) for k in emap
                                if k.endswith(".w1")})
            for n, dims in in_features.items():
                g = group_size_for(math.gcd(*dims), group_size, fallback)
                if g is None:
                    skipped[n] = why_float(math.gcd(*dims), group_size, fallback)
                elif g != group_size:
                    group_of[n] = g
            names = [n for n in names if n not in skipped]
            emap = {k: v for k, v in emap.items() if k.rsplit(".", 1)[0] not in skipped}
            notes = fallback_lines(group_size, group_of, skipped, in_features, fallback)

        def linear(name: str) -> Callable[[], dict[str, torch.Tensor]]:
            def run() -> dict[str, torch.Tensor]:
                qsd, _ = quantize_state_dict({f"{name}.weight": sd[f"{name}.weight"]}, [name], quantize,
                                             group_of.get(name, group_size), fallback=False)
                # Row permutations (rope rows of latent attention); a 1-D per-row tensor (int8
                # scales) goes through as a column.
                return {s: layout.rows_to_hf(cfg, f"{name}.weight", t if t.dim() > 1 else t[:, None]).reshape(t.shape)
                        for s in ("weight", "scales", "zeros") if (t := qsd.get(f"{name}.{s}")) is not None}
            return run

        def expert(w: torch.Tensor, g: int) -> Callable[[], dict[str, torch.Tensor]]:
            def run() -> dict[str, torch.Tensor]:
                qsd, _ = quantize_state_dict({"e.weight": w}, ["e"], quantize, g, fallback=False)
                return {s: qsd[f"e.{s}"] for s in ("weight", "scales", "zeros") if f"e.{s}" in qsd}
            return run

        quantized = {kmap[f"{n}.weight"][: -len(".weight")]: linear(n) for n in names}
        hf_groups.update({kmap[f"{n}.weight"][: -len(".weight")]: group_of[n] for n in names if n in group_of})
        layer_names = list(names)
        for stacked, keys in emap.items():
            g = group_of.get(stacked.rsplit(".", 1)[0], group_size)
            quantized.update({k[: -len(".weight")]: expert(hf_sd[k], g) for k in keys})
            hf_groups.update({k[: -len(".weight")]: g for k in keys if g != group_size})
            layer_names.append(stacked)
        for key in hf_sd:
            module = key.rsplit(".", 1)[0]
            if hf_sd[key].dim() == 2 and key.endswith(".weight") and module not in quantized \
                    and "embed_tokens" not in key:
                ignored.append(module)
        if cfg.tie_embeddings:
            ignored.append("lm_head")  # tied to the float embedding

    cache: dict[str, dict[str, torch.Tensor]] = {}

    def produce_quantized(prefix: str, suffix: str, last: bool):
        def run() -> torch.Tensor:
            if prefix not in cache:  # one layer's tensors in memory at a time
                cache.clear()
                cache[prefix] = ct.to_ct(quantize, quantized[prefix]())
            t = cache[prefix][suffix]
            if last:
                cache.pop(prefix)
            return t
        return run

    def produce_float(t: torch.Tensor, to: torch.dtype):
        return lambda: t.to(to)

    entries: list[Entry] = []
    for key, t in hf_sd.items():
        module = key.rsplit(".", 1)[0]
        if module in quantized and key.endswith(".weight"):
            n, k = t.shape
            shapes = ct.ct_shapes(quantize, n, k, hf_groups.get(module, group_size))
            for i, (suffix, (shape, dt)) in enumerate(shapes.items()):
                entries.append(Entry(f"{module}.{suffix}", shape, dt,
                                     produce_quantized(module, suffix, i == len(shapes) - 1)))
            continue
        to = t.dtype if not t.is_floating_point() or key.endswith(_KEEP_FP32) else target
        entries.append(Entry(key, tuple(t.shape), to, produce_float(t, to)))

    config = layout.to_hf_config_dict(cfg, dtype=_DTYPES[target])
    if quantize:
        config["quantization_config"] = ct.quantization_config(quantize, group_size, sorted(set(ignored)), hf_groups)
    files = _write_dir(out_dir, entries, config, loaded.eos_ids, loaded.path / "tokenizer.json", cfg.max_seq_len,
                       replace=force, max_shard_bytes=max_shard_bytes,
                       before_commit=check.result if check is not None else None)  # CorruptCheckpointError
    return ExportResult(out_dir, files, len(entries), sum(e.nbytes for e in entries), sorted(layer_names),
                        sorted(set(ignored)), notes)


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """A trainforge checkpoint (or run directory: its newest checkpoint) written as a Hugging
    Face directory at ``out_dir`` (float32, as ``load_model`` reads it)."""
    return export(checkpoint, out_dir).path
