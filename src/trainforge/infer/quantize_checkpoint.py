"""``trainforge quantize``'s offline step: a float checkpoint read (mapped), its linear and
expert weights quantised (``quantize/``) and written as a checkpoint ``generate`` and ``serve``
load directly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainforge.errors import TrainforgeError


def quantize_checkpoint(checkpoint: str, output: str, mode: str, group_size: int | None,
                        fallback: bool) -> list[str]:
    """Write ``checkpoint`` quantised to ``mode`` in the new directory ``output``; the lines that
    say what was done (per-layer int4 group sizes, layers skipped, the size before and after).
    ``fallback``: a layer the group size does not divide takes a smaller one (False for a QAT
    checkpoint, whose grid is the one it trained on)."""
    from trainforge.infer.loading import load_model
    from trainforge.infer.quantize import expert_names, linear_names, quantize_state_dict, save_quantized

    # Mapped: the float weights are views of the file's pages, read as each tensor is quantised and
    # reclaimable after, so the process never holds the fp32 model beside the quantised one.
    loaded = load_model(checkpoint, mapped=True)
    if loaded.quantization:
        raise TrainforgeError(f"{checkpoint} is already quantised ({loaded.quantization['mode']})")
    model = loaded.model
    sd = model.state_dict()
    before = sum(t.nbytes for t in sd.values())
    try:
        qsd, info = quantize_state_dict(sd, linear_names(model), mode, group_size, expert_names(model),
                                        embedding=not model.cfg.tie_embeddings, fallback=fallback)
    except ValueError as e:
        raise TrainforgeError(f"--{e}") from None
    lines = []
    if mode == "int4":  # the per-layer group sizes, in the words export uses (quant_formats/int4_groups.py)
        from trainforge.quant_formats.int4_groups import fallback_lines

        dims = {n: (sd[f"{n}.weight"].shape[1],) for n in linear_names(model)}
        dims.update({n: (sd[f"{n}.w1"].shape[2],) for n in expert_names(model)})  # the hidden dim is padded
        lines += fallback_lines(group_size, info["group_sizes"], info["skipped"], dims, fallback)
        skipped = {k: v for k, v in info["skipped"].items() if k not in dims or not any(
            d % group_size for d in dims[k])}
    else:
        skipped = info["skipped"]
    tok_file = loaded.path / "tokenizer.json"
    out = save_quantized(output, qsd, info, dataclasses.asdict(model.cfg),
                         tok_file if tok_file.is_file() else None, {"path": str(loaded.path)})
    after = (Path(out) / "model.safetensors").stat().st_size
    lines.append(f"quantised {len(info['layers'])} linear layers"
                 + (f" and {len(info['experts'])} layers of routed experts" if info["experts"] else "") + f" to {mode}"
                 + (f" (group_size {group_size})" if mode == "int4" else "")
                 + (f" (skipped {len(skipped)}: {skipped})" if skipped else ""))
    lines.append(f"weights: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB in {out}")
    return lines
