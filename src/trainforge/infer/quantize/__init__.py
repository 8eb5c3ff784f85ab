"""Weight quantisation in two phases, as gpt-fast does it.

1. Offline: ``quantize_state_dict`` turns a float state dict into the stored form (int8
   codes + per-channel scales, or int4 codes + per-group scales and zeros, beside each other
   under the layer's name) and an ``info`` dict saying what was quantised;
   ``save_quantized`` writes both as a checkpoint directory (``model.safetensors`` with
   ``info`` in its header metadata, ``meta.json``, ``tokenizer.json``): ``trainforge quantize``.
2. Runtime: ``swap_quantized_linears`` replaces those ``nn.Linear`` modules with
   ``Int8Linear`` / ``Int4Linear`` and a MoE layer's ``GroupedExperts`` with
   ``Int8Experts`` / ``Int4Experts`` (on any device, ``meta`` included, so a quantised
   checkpoint loads by assignment like a float one), and ``pack_quantized`` builds each
   layer's kernel form (the kernel per device is chosen in ``common.py``).

``quantize_model`` runs both phases in memory (``--quantize`` on a float checkpoint).
The token embedding stays in float (decode reads one row of it per token), except under a block
mode when it is not tied to the output: ``embedding=True`` (``trainforge quantize``, and always
in ``quantize_model``) keeps it in the mode's blocks (``block_embedding.py``,
``info["embedding"]``), the rows dequantised as they are read; a tied
output projection is quantised as its own matrix. A MoE router's gate stays float (fp32): see
``experts.py`` for why.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainforge.infer.quantize.block_embedding import BlockEmbedding
from trainforge.infer.quantize.blocks import Q4_0Linear, Q8_0Linear
from trainforge.infer.quantize.common import QuantLinear, choose_kernel, measure_kernels
from trainforge.infer.quantize.experts import QuantExperts
from trainforge.infer.quantize.int4 import Int4Linear, quantize_int4
from trainforge.infer.quantize.int4_experts import Int4Experts
from trainforge.quant_formats.int4_groups import group_size_for, why_float
from trainforge.infer.quantize.int8 import Int8Linear, quantize_int8
from trainforge.infer.quantize.int8_experts import Int8Experts
from trainforge.model.moe import GroupedExperts, routers
from trainforge.quant_formats.layers import expert_names, linear_names
from trainforge.storage.atomic import atomic_directory
from trainforge.storage.checkpoint_format import MODEL_FILE, TOKENIZER_FILE, write_meta

MODES = ("int8", "int4", "q8_0", "q4_0")
BLOCK_MODES = {"q8_0": Q8_0Linear, "q4_0": Q4_0Linear}  # 32-value blocks (llama.cpp's), blocks.py
METADATA_KEY = "trainforge_quantization"

__all__ = ["BLOCK_MODES", "BlockEmbedding", "MODES", "Int4Experts", "Int4Linear", "Int8Experts", "Int8Linear", "Q4_0Linear", "Q8_0Linear", "QuantExperts", "QuantLinear",
           "choose_kernel", "expert_names", "linear_names", "measure_kernels", "pack_quantized", "quantize_model",
           "quantize_state_dict", "save_quantized", "swap_quantized_linears"]


def _int4_group(info: dict[str, Any], name: str, in_dim: int, group_size: int, fallback: bool) -> int | None:
    """``name``'s int4 group size (``int4_groups.group_size_for``), recorded in ``info`` when it is
    not ``group_size``; None, with the reason in ``info["skipped"]``, when the layer stays float."""
    g = group_size_for(in_dim, group_size, fallback)
    if g is None:
        info["skipped"][name] = why_float(in_dim, group_size, fallback)
    elif g != group_size:
        info["group_sizes"][name] = g
    return g


def quantize_state_dict(sd: dict[str, torch.Tensor], names: list[str], mode: str, group_size: int = 128,
                        experts: list[str] = (), embedding: bool = False, fallback: bool = True
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Offline transform. ``names``: the linear layers to quantise (``<name>.weight`` in ``sd``);
    ``experts``: the routed experts (``<name>.w1``, ``.w2``, ``.w3``), listed in ``info["experts"]``.
    Returns (stored-form state dict, info). int4 groups each layer by ``int4_groups.group_size_for``
    (``group_size`` where it divides the input dim, else the largest multiple of 32 below it that
    does, unless ``fallback`` is off: a QAT run's grid); ``info["group_size"]`` is ``group_size``
    and ``info["group_sizes"]`` the layers grouped otherwise. Layers that cannot be grouped (no
    such size; 32 for the block modes) stay float and are listed in ``info["skipped"]``, as do
    routed experts under a block mode (its kernels cover dense linears; int8 / int4 quantise
    experts). ``embedding`` (an untied ``tok_embeddings.weight`` in
    ``sd``): under a block mode it is stored in the mode's blocks too (``info["embedding"]``);
    ignored under int8 / int4."""
    if mode not in MODES:
        raise ValueError(f"quantization mode {mode!r}: use one of {MODES}")
    if mode == "int4" and (group_size < 2 or group_size % 2):
        raise ValueError(f"group_size={group_size}: must be an even number >= 2 "
                         "(32, 64, 128 or 256 for the CPU kernel)")
    out = dict(sd)
    info: dict[str, Any] = {"mode": mode, "layers": [], "experts": [], "skipped": {}}
    kw = {}
    if mode == "int4":
        info["group_size"] = kw["group_size"] = group_size
        info["group_sizes"] = {}
    for name in names:
        w = sd[f"{name}.weight"]
        if mode in BLOCK_MODES:
            why = BLOCK_MODES[mode].skip_reason(w.shape[1])
            if why:
                info["skipped"][name] = why
                continue
            stored = BLOCK_MODES[mode].quantize_stored(w)
            out.update({f"{name}.{k}": v for k, v in stored.items()})
        elif mode == "int8":
            q, scales = quantize_int8(w)
            out[f"{name}.weight"], out[f"{name}.scales"] = q, scales
        else:
            g = _int4_group(info, name, w.shape[1], group_size, fallback)
            if g is None:
                continue
            packed, scales, zeros = quantize_int4(w, g)
            out[f"{name}.weight"], out[f"{name}.scales"], out[f"{name}.zeros"] = packed, scales, zeros
        info["layers"].append(name)
    if mode in BLOCK_MODES and embedding and BLOCK_MODES[mode].skip_reason(sd["tok_embeddings.weight"].shape[1]) is None:
        stored = BlockEmbedding.quantize_stored(sd["tok_embeddings.weight"], mode)
        out.update({f"tok_embeddings.{k}": v for k, v in stored.items()})
        info["embedding"] = mode
    if mode in BLOCK_MODES:
        info["skipped"].update({name: f"routed experts stay float under {mode} (int8 / int4 quantise them)"
                                for name in experts})
        experts = ()
    kind = QuantExperts._KINDS.get(mode)
    for name in experts:
        w1, w2, w3 = (sd[f"{name}.{p}"] for p in ("w1", "w2", "w3"))
        ekw = kw
        if mode == "int4":  # grouped along the model dim; the hidden dim is padded to the group (int4_experts.py)
            g = _int4_group(info, name, w1.shape[2], group_size, fallback)
            if g is None:
                continue
            ekw = {"group_size": g}
        why = kind.skip_reason(w1.shape[2], w1.shape[1], **ekw)
        if why:
            info["skipped"][name] = why
            continue
        for p in ("w1", "w2", "w3"):
            del out[f"{name}.{p}"]
        out.update({f"{name}.{k}": v for k, v in kind.quantize_stored(w1, w2, w3, **ekw).items()})
        info["experts"].append(name)
    return out, info


def swap_quantized_linears(model: nn.Module, info: dict[str, Any], kernel: str = "auto") -> nn.Module:
    """Runtime swap: every layer in ``info["layers"]`` becomes an (empty) quantised linear,
    every ``info["experts"]`` an (empty) quantised experts module, and ``tok_embeddings`` a
    ``BlockEmbedding`` when ``info["embedding"]`` names a mode, on the same device as the
    float one it replaces. Fill them with ``load_state_dict(assign=True)``."""
    cls = {"int8": Int8Linear, "int4": Int4Linear, **BLOCK_MODES}[info["mode"]]
    per_layer = info.get("group_sizes") or {}  # absent in files written before the per-layer fallback

    def kw(name: str) -> dict:
        return {"group_size": per_layer.get(name, info["group_size"])} if info["mode"] == "int4" else {}

    for name in info["layers"]:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{name} is a {type(old).__name__}, not an nn.Linear: the quantised file does not "
                             "fit this model")
        setattr(parent, attr, cls(old.in_features, old.out_features, kernel=kernel, device=old.weight.device,
                                  **kw(name)))
    if info.get("embedding"):
        old = model.tok_embeddings
        model.tok_embeddings = BlockEmbedding(old.num_embeddings, old.embedding_dim, info["embedding"],
                                              dtype=old.weight.dtype, device=old.weight.device)
    kind = QuantExperts._KINDS.get(info["mode"])
    for name in info.get("experts", []):  # absent in files written before MoE
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if not isinstance(old, GroupedExperts):
            raise ValueError(f"{name} is a {type(old).__name__}, not GroupedExperts: the quantised file does not "
                             "fit this model")
        n, hidden, dim = old.w1.shape
        setattr(parent, attr, kind(n, dim, hidden, kernel=kernel, device=old.w1.device, **kw(name)))
    return model


def pack_quantized(model: nn.Module, kernel: str | None = None) -> dict[str, int]:
    """Build every quantised layer's kernel form; returns {kernel: layer count}."""
    used: dict[str, int] = {}
    # "auto" probes the kernels on a small layer (``common.choose_kernel``): once per kind of
    # layer, device and kernel arguments, not once per layer.
    chosen: dict[tuple, str] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear) and (kernel or m.kernel) == "auto":
            device, kw = next(iter(m.buffers())).device, m._kernel_kwargs()
            key = (type(m), device, tuple(sorted(kw.items())))
            if key not in chosen:
                chosen[key] = choose_kernel(m.MODE, device, **kw)
            name = m.pack(chosen[key])
        elif isinstance(m, (QuantLinear, QuantExperts)):
            name = m.pack(kernel)
        else:
            continue
        used[name] = used.get(name, 0) + 1
    return used


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, group_size: int = 128, kernel: str = "auto",
                   pack: bool = True, fallback: bool = True) -> dict[str, Any]:
    """Both phases in memory: quantise the model's linear and expert weights, swap, load, (pack).
    Mutates ``model``; returns the info dict (with ``kernels`` when packed)."""
    names, experts = linear_names(model), expert_names(model)
    sd = {f"{n}.weight": model.get_submodule(n).weight for n in names}
    sd.update({f"{n}.{p}": getattr(model.get_submodule(n), p) for n in experts for p in ("w1", "w2", "w3")})
    # An untied embedding as `trainforge quantize` stores it, so both paths decode the same tokens.
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    embedding = isinstance(emb, nn.Embedding) and getattr(out, "weight", None) is not emb.weight
    if embedding:
        sd["tok_embeddings.weight"] = emb.weight
    qsd, info = quantize_state_dict(sd, names, mode, group_size, experts, embedding=embedding, fallback=fallback)
    swap_quantized_linears(model, info, kernel)
    done = set(info["layers"]) | set(info["experts"]) | ({"tok_embeddings"} if info.get("embedding") else set())
    stored = {k: v for k, v in qsd.items() if k.rpartition(".")[0] in done}
    model.load_state_dict(stored, strict=False, assign=True)
    if pack:
        info["kernels"] = pack_quantized(model)
    return info


def save_quantized(out_dir: str | Path, sd: dict[str, torch.Tensor], info: dict[str, Any],
                   model_config: dict[str, Any], tokenizer_path: Path | None = None,
                   source: dict[str, Any] | None = None) -> Path:
    """Write a quantised checkpoint directory (refuses an existing one), atomically and
    durably, in the checkpoint format training writes (``trainforge.storage``):
    ``model.safetensors`` (stored form; ``info`` in the header), ``meta.json`` (version
    fields, sha256 of every file, plus ``quantization`` and ``source``), and
    ``tokenizer.json`` when given."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"--output {out_dir} exists; choose a new directory")
    from safetensors.torch import save_file  # here: a decode process never writes one

    source = source or {}
    with atomic_directory(out_dir) as tmp:
        tensors = dict(sd)
        emb, out = tensors.get("tok_embeddings.weight"), tensors.get("output.weight")
        if out is not None and out is emb:  # tied and left float: stored once (safetensors refuses aliases)
            del tensors["output.weight"]
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(tmp / MODEL_FILE), metadata={METADATA_KEY: json.dumps(info)})
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        write_meta(tmp, source.get("step", 0), source.get("config", {}), model_config,
                   extra={"quantization": info, "source": source.get("path")})
    return out_dir
