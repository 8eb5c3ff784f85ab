"""Quantised weights in the compressed-tensors format (``quant_method: "compressed-tensors"``),
the one vLLM, llm-compressor and ``transformers`` read.

Per quantised ``nn.Linear`` at HF prefix ``P`` (what ``compressed_tensors``' compressors write):

- int8, per output channel, symmetric, format ``int-quantized``: ``P.weight`` int8 (N, K) and
  ``P.weight_scale`` fp32 (N, 1). W = weight * scale: trainforge's int8 grid as it is
  (``int8.py``: per-row absmax / 127).
- int4, per group along the input dim, asymmetric, format ``pack-quantized``:
  ``P.weight_packed`` int32 (N, K/8), eight 4-bit codes per word, code k at bits 4k and stored
  unsigned (signed code + 8); ``P.weight_scale`` fp32 (N, K/g); ``P.weight_zero_point`` int32
  (N/8, K/g), the int8 zero points packed the same way along the output dim; ``P.weight_shape``
  int64 [N, K]. W = (code - zero_point) * scale: trainforge's int4 grid (``int4.py``).

Both are trainforge's stored forms re-laid out, with no arithmetic, so ``compressed_tensors``
decompresses an export to exactly the weights trainforge dequantises (tested against the
package itself). The packing is written here, not imported, so that reading an exported
directory (``trainforge generate``/``serve``) does not need the package; the tests check it
word for word against ``compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32``.
Scales stay fp32 whatever the export dtype: a bf16 scale would change the weights.
"""

from __future__ import annotations

from typing import Any

import torch

from trainforge.errors import CheckpointError

QUANT_METHOD = "compressed-tensors"
FORMATS = {"int8": "int-quantized", "int4": "pack-quantized"}
_SUFFIXES = {"int8": ("weight", "weight_scale"),
             "int4": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}


def _weights(mode: str, group_size: int | None) -> dict[str, Any]:
    if mode == "int8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group_size}
    weights.update({"dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
                    "block_structure": None})
    return weights


def quantization_config(mode: str, group_size: int, ignore: list[str],
                        group_sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """config.json's ``quantization_config`` for every ``Linear`` but ``ignore`` (HF module names).
    ``group_sizes`` (int4): HF module -> its group size where it is not ``group_size`` (the
    per-layer fallback of ``int4_groups.py``): one more config group per size, targeting those
    modules by exact name, which compressed-tensors and vLLM match before the class name. They
    come first: compressed-tensors' matcher stops at a module's first matching target in this
    order, and would warn that an exact name after ``Linear`` matched nothing."""
    by_size: dict[int, list[str]] = {}
    for module, g in (group_sizes or {}).items():
        if g != group_size:
            by_size.setdefault(g, []).append(module)
    groups = {f"group_{i}": {"targets": sorted(by_size[g]), "weights": _weights(mode, g)}
              for i, g in enumerate(sorted(by_size, reverse=True))}
    groups[f"group_{len(groups)}"] = {"targets": ["Linear"], "weights": _weights(mode, group_size)}
    for group in groups.values():
        group.update({"input_activations": None, "output_activations": None, "format": FORMATS[mode]})
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMATS[mode],
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def read_quantization_config(qc: Any, where: str) -> tuple[str, int | None]:
    """(mode, group_size) of a ``quantization_config`` this module can read: the config group's
    that targets ``Linear`` (else the first); int4 groups may differ in group size only
    (``group_sizes_by_target``: a module's own). A clear error for anything else (another method,
    activations quantised, several schemes, other bits)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(f"{where}: quantization_config quant_method {method!r} is not supported; trainforge "
                              f"reads {QUANT_METHOD!r} (int8 per channel, int4 per group), or float weights")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise CheckpointError(f"{where}: quantization_config key 'config_groups' is {groups!r:.80}, not a table of "
                              "schemes")
    if not groups:
        raise CheckpointError(f"{where}: quantization_config has no config_groups; trainforge reads one scheme "
                              "for every quantised Linear (int4: group sizes may differ by module)")
    schemes = [_read_group(name, g, qc, where) for name, g in groups.items()]
    if len({m for m, _ in schemes}) > 1 or (schemes[0][0] == "int8" and len(schemes) > 1):
        raise CheckpointError(f"{where}: quantization_config has {len(groups)} config_groups of different schemes; "
                              "trainforge reads one scheme for every quantised Linear (int4: group sizes may "
                              "differ by module)")
    targets = [g.get("targets") if isinstance(g.get("targets"), list) else [] for g in groups.values()]
    return next((sch for sch, t in zip(schemes, targets) if "Linear" in t), schemes[0])


def group_sizes_by_target(qc: dict[str, Any]) -> dict[str, int]:
    """An int4 ``quantization_config``'s group size per target (``Linear``, a module name)."""
    return {t: g["weights"]["group_size"] for g in qc["config_groups"].values()
            for t in (g.get("targets") if isinstance(g.get("targets"), list) else []) if isinstance(t, str)}


def _read_group(name: Any, group: Any, qc: dict[str, Any], where: str) -> tuple[str, int | None]:
    w = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(group, dict) or not isinstance(w or {}, dict):
        raise CheckpointError(f"{where}: quantization_config key 'config_groups.{str(name):.40}' is {group!r:.80}, "
                              "not a scheme with a 'weights' table")
    w = w or {}
    if group.get("input_activations") or group.get("output_activations"):
        raise CheckpointError(f"{where}: quantised activations are not supported (weights-only int8/int4)")
    fmt = group.get("format") or qc.get("format")
    if w.get("type") == "int" and w.get("num_bits") == 8 and w.get("symmetric") and w.get("strategy") == "channel" \
            and fmt == FORMATS["int8"]:
        return "int8", None
    if w.get("type") == "int" and w.get("num_bits") == 4 and w.get("strategy") == "group" \
            and fmt == FORMATS["int4"] and isinstance(w.get("group_size"), int):
        return "int4", w["group_size"]
    raise CheckpointError(f"{where}: quantization scheme {w!r:.200} in format {fmt!r} is not one trainforge "
                          "reads: int8 channel symmetric 'int-quantized', or int4 group 'pack-quantized'")


# -- 4-bit packing: eight codes per int32, code k at bits 4k (little-endian words) ------------
# Byte b of the words holds codes 2b (low nibble) and 2b + 1 (high): trainforge's packed byte
# with its nibbles swapped (ours has the even code high), so packing is a byte-wise swap and a
# reinterpretation, no per-code work.

def _swap(b: torch.Tensor) -> torch.Tensor:
    return (b << 4) | (b >> 4)  # uint8: the shifts drop the other nibble


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) unsigned codes in [0, 15] -> (R, ceil(C/8)) int32, zero-padded."""
    r, c = codes.shape
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, -c % 8))
    # Through 1-D: a (1, C) result can carry strides (1, 1) that view() refuses (one group per row).
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(-1).view(torch.int32).reshape(r, -1)


def _unpack_nibbles(words: torch.Tensor, cols: int) -> torch.Tensor:
    """(R, W) int32 -> (R, cols) int32 unsigned codes."""
    b = words.contiguous().view(torch.uint8)
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(words.shape[0], -1)[:, :cols].to(torch.int32)


def pack_int4_codes(packed_uint8: torch.Tensor) -> torch.Tensor:
    """trainforge's (N, K/2) uint8 (even k in the high nibble) -> compressed-tensors' (N, ceil(K/8)) int32."""
    p = torch.nn.functional.pad(packed_uint8, (0, -packed_uint8.shape[1] % 4))
    return _swap(p).contiguous().view(torch.int32)


def unpack_int4_codes(words: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors' (N, ceil(K/8)) int32 -> trainforge's (N, K/2) uint8."""
    return _swap(words.contiguous().view(torch.uint8))[:, : k // 2].contiguous()


# -- one module's tensors ---------------------------------------------------------------------

def to_ct(mode: str, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """trainforge stored form of one linear (``weight``, ``scales``[, ``zeros``]) -> the
    compressed-tensors tensors by suffix."""
    if mode == "int8":
        return {"weight": stored["weight"], "weight_scale": stored["scales"].float()[:, None].contiguous()}
    w, scales, zeros = stored["weight"], stored["scales"], stored["zeros"]
    if zeros.dtype != torch.int8:
        raise CheckpointError("int4 weights with float zero points (written by trainforge before 2026-12-01) have "
                              "no compressed-tensors form; quantise the float checkpoint again")
    n, k = w.shape[0], w.shape[1] * 2
    return {"weight_packed": pack_int4_codes(w), "weight_scale": scales.float().contiguous(),
            "weight_zero_point": _pack_nibbles((zeros.to(torch.int32) + 8).t().contiguous()).t().contiguous(),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def ct_shapes(mode: str, n: int, k: int, group_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor ``to_ct`` returns for an (n, k) weight, without computing it."""
    if mode == "int8":
        return {"weight": ((n, k), torch.int8), "weight_scale": ((n, 1), torch.float32)}
    return {"weight_packed": ((n, -(-k // 8)), torch.int32), "weight_scale": ((n, k // group_size), torch.float32),
            "weight_zero_point": ((-(-n // 8), k // group_size), torch.int32), "weight_shape": ((2,), torch.int64)}


def from_ct(mode: str, t: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The inverse of ``to_ct``: compressed-tensors tensors of one module -> trainforge's stored form."""
    missing = [s for s in _SUFFIXES[mode] if s not in t]
    if missing:
        raise CheckpointError(f"{where}: missing {missing} for a {mode} compressed-tensors layer")
    if mode == "int8":
        w, s = t["weight"], t["weight_scale"]
        if w.dtype != torch.int8 or s.shape != (w.shape[0], 1):
            raise CheckpointError(f"{where}: int8 layer wants an int8 weight (N, K) and weight_scale (N, 1); got "
                                  f"{w.dtype} {tuple(w.shape)} and {tuple(s.shape)}")
        return {"weight": w, "scales": s.float().reshape(-1)}
    shape = [int(x) for x in t["weight_shape"].tolist()]
    words, scales, zp = t["weight_packed"], t["weight_scale"], t["weight_zero_point"]
    if len(shape) != 2 or shape[1] % 2 or words.dtype != torch.int32 or zp.dtype != torch.int32 \
            or tuple(words.shape) != (shape[0], -(-shape[1] // 8)) or scales.shape[0] != shape[0] \
            or tuple(zp.shape) != (-(-shape[0] // 8), scales.shape[1]):
        raise CheckpointError(f"{where}: int4 pack-quantized tensors do not fit weight_shape {shape}: weight_packed "
                              f"{words.dtype} {tuple(words.shape)}, weight_scale {tuple(scales.shape)}, "
                              f"weight_zero_point {zp.dtype} {tuple(zp.shape)}")
    zeros = _unpack_nibbles(zp.t().contiguous(), shape[0]).t().contiguous() - 8
    return {"weight": unpack_int4_codes(words, shape[1]), "scales": scales.float().contiguous(),
            "zeros": zeros.to(torch.int8)}


def ct_prefixes(keys: list[str]) -> list[str]:
    """The HF module prefixes of the quantised modules among ``keys`` (those with a
    ``weight_scale``; the scheme is ``quantization_config``'s)."""
    return [k[: -len(".weight_scale")] for k in keys if k.endswith(".weight_scale")]
