"""Write a model as a Hugging Face directory (``config.json`` + ``model.safetensors``, plus
``tokenizer.json`` when there is one) that ``transformers``' ``from_pretrained`` loads:
``LlamaForCausalLM`` for a dense model (``model/hf.py``), ``DeepseekV3ForCausalLM`` for a
latent-attention MoE (``model/hf_deepseek.py``, the released checkpoints' layout: per-expert
weights, interleaved rotary rows, and the MTP modules as ``model.layers.{n_layers + d}``).

The directory is written atomically (``storage/atomic.py``). Reading it back with
``infer.loading.load_model`` gives the same weights bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainforge.errors import CheckpointError
from trainforge.model import hf, hf_deepseek, hf_moe
from trainforge.model.config import ModelConfig
from trainforge.storage.atomic import atomic_directory

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_layout(cfg: ModelConfig):
    """The conversion module for ``cfg``: ``hf_deepseek`` for latent attention, ``hf_moe`` for other
    MoE models (Glm4Moe / Mixtral), else ``hf`` (Llama)."""
    return hf_deepseek if cfg.is_mla else hf_moe if cfg.is_moe else hf


def save_hf_dir(out_dir: str | Path, state_dict: dict[str, torch.Tensor], cfg: ModelConfig,
                tokenizer_path: Path | None = None, eos_ids: tuple[int, ...] = ()) -> Path:
    """Write ``state_dict`` (our ``Transformer``'s, float) as a Hugging Face directory at
    ``out_dir`` (refuses an existing path). A tensor stored under two names (tied embeddings,
    the MTP layer's copies of the embedding and head) is written once per name, each its own copy,
    as safetensors refuses aliases; ``from_pretrained`` re-ties them."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; choose a new directory")
    layout = hf_layout(cfg)
    tensors = layout.to_hf_state_dict(state_dict, cfg)
    if cfg.tie_embeddings:  # HF's save_pretrained writes the embedding alone when tied
        tensors.pop("lm_head.weight", None)
    dtypes = {v.dtype for v in tensors.values() if v.is_floating_point()} - {torch.float32}
    config = layout.to_hf_config_dict(cfg, dtype=_DTYPES.get(next(iter(dtypes)), "float32") if dtypes else "float32")
    if eos_ids:
        config["eos_token_id"] = list(eos_ids) if len(eos_ids) > 1 else eos_ids[0]
    seen: set[int] = set()
    files: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        # Views into one storage (stacked experts, the MTP copies) must become separate tensors.
        ptr, whole = v.untyped_storage().data_ptr(), v.untyped_storage().nbytes() == v.numel() * v.element_size()
        files[k] = v.contiguous().clone() if ptr in seen or not (whole and v.is_contiguous()) else v
        seen.add(ptr)
    with atomic_directory(out_dir) as tmp:
        save_file(files, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    return out_dir


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """A trainforge checkpoint (or run directory: its newest checkpoint) written as a Hugging
    Face directory at ``out_dir`` (float32, as ``load_model`` reads it)."""
    from trainforge.infer.loading import load_model

    loaded = load_model(checkpoint)
    if loaded.quantization:
        raise CheckpointError(f"{checkpoint} is quantised ({loaded.quantization['mode']}); export the float "
                              "checkpoint it was made from")
    tok = loaded.path / "tokenizer.json"
    return save_hf_dir(out_dir, loaded.model.state_dict(), loaded.model.cfg, tok if tok.is_file() else None,
                       loaded.eos_ids)
