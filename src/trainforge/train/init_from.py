"""``model.init_from``: start a run from published or earlier weights (fine-tuning).

The directory is a Hugging Face one (``config.json`` + ``*.safetensors``, sharded or not;
Llama, DeepSeek-V3, Glm4Moe or Mixtral, as ``loading/loader.py`` reads them) or a trainforge
checkpoint or run directory (its newest checkpoint). It decides three things, in the order the
trainer needs them, each before any collective and before anything is written to the run directory:

1. ``open_init_source``: the model shape and the tokenizer (config.json / meta.json only).
2. ``check_tokenizer``: the training data was tokenised with that tokenizer.
3. ``load_init_weights``: the weights, loaded into the single-device model before precision
   and parallelism are applied (``build.build_model_stack``), so every layout (DDP, FSDP2,
   TP, PP) starts from them as it starts from a seeded init.

Only weights are taken: the optimizer, the step, the LR schedule and the data position start
fresh. That is the difference from ``--resume``, which continues a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trainforge.errors import CheckpointError, ConfigError
from trainforge.model.config import ModelConfig
from trainforge.model.hf_deepseek import FIELD_TO_HF as DEEPSEEK_KEYS
from trainforge.model.hf_moe import GLM4_MOE, MIXTRAL
from trainforge.model.hf_moe import field_to_hf as moe_field_to_hf
from trainforge.model.preflight import HF_KEYS
from trainforge.storage.manifest import sha256_file

# How a Llama config.json names the fields a shape mismatch reports.
_LLAMA_KEYS = {**HF_KEYS, "tie_embeddings": "tie_word_embeddings"}


@dataclass(frozen=True)
class InitSource:
    path: Path  # as given in model.init_from
    weights: Path  # what is read: the Hugging Face directory, or the resolved checkpoint directory
    kind: str  # "huggingface" or "trainforge"
    model_config: ModelConfig
    tokenizer: Path | None  # its tokenizer.json, None when it has none
    key_names: dict[str, str]  # ModelConfig field -> the source's name for it (error messages)

    @property
    def where(self) -> str:
        return f"model.init_from {self.path}"


def open_init_source(path: str | Path) -> InitSource:
    """Shape and tokenizer of ``path``; no weight is read. Raises ``CheckpointError`` naming
    the file (unsupported family, unreadable config.json or meta.json)."""
    from trainforge.loading.loader import hf_model_config, trainforge_model_config
    from trainforge.storage.checkpoint_dirs import is_hf_dir

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"config key 'model.init_from' = {str(path)!r}: no such directory; give a Hugging Face "
                          "model directory or a trainforge checkpoint/run directory")
    try:
        if is_hf_dir(path):
            hf_config, cfg, _ = hf_model_config(path)
            model_type = hf_config.get("model_type")
            keys = (DEEPSEEK_KEYS if model_type == "deepseek_v3" else
                    moe_field_to_hf(model_type) if model_type in (GLM4_MOE, MIXTRAL) else _LLAMA_KEYS)
            keys = {k: f"config.json key {v!r}" for k, v in keys.items()}
            weights, kind = path, "huggingface"
        else:
            weights, _, cfg = trainforge_model_config(path)
            keys = {k: f"meta.json model_config.{k}" for k in ModelConfig.__dataclass_fields__}
            kind = "trainforge"
    except CheckpointError as e:
        raise CheckpointError(f"model.init_from: {e}; it must be a Hugging Face directory "
                              "(config.json + *.safetensors) of a Llama, DeepSeek-V3, Glm4Moe or Mixtral model, "
                              "or a trainforge checkpoint or run directory") from None
    tok = weights / "tokenizer.json"
    return InitSource(path, weights, kind, cfg, tok if tok.is_file() else None, keys)


def _same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two tokenizer.json files tokenise alike. ``prepare --tokenizer`` re-saves the
    file (other whitespace and key order than a published one), so equal bytes are not required:
    the canonical serialisation of the loaded tokenizers (vocab, merges, normaliser,
    pre-tokeniser, added tokens) must be equal."""
    if sha256_file(a) == sha256_file(b):
        return True
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(a)).to_str() == Tokenizer.from_file(str(b)).to_str()
    except Exception as e:  # tokenizers raises plain Exception subclasses on bad JSON
        raise CheckpointError(f"tokenizer file {a} or {b} could not be read ({e})") from None


def check_tokenizer(source: InitSource, data_path: str | None, data_tokenizer: Path, log=None) -> None:
    """Refuse data tokenised with another tokenizer than ``source``'s, naming both files and
    the fix. A source without tokenizer.json cannot be checked (the vocab size still is, by
    ``model_config_from_init``): ``log`` warns, or the built-in corpus is refused."""
    if source.tokenizer is None:
        if data_path is None:
            raise ConfigError(f"{source.where} has no tokenizer.json, so the built-in corpus cannot be tokenised "
                              "with the model's tokenizer: prepare your text with it (trainforge prepare "
                              "--tokenizer TOKENIZER.json --output DIR) and set data.path = DIR")
        if log is not None:
            log(f"{source.where} has no tokenizer.json: data.path {data_path} is assumed to be tokenised with "
                "the model's tokenizer (only its vocab size is checked)")
        return
    if not _same_tokenizer(source.tokenizer, data_tokenizer):
        raise ConfigError(f"data.path {data_path} was tokenised with {data_tokenizer}, which differs from "
                          f"{source.tokenizer} of model.init_from: the token ids would mean other tokens. "
                          f"Prepare the data with the model's tokenizer (trainforge prepare --tokenizer "
                          f"{source.tokenizer} --output NEW_DIR ...) and set data.path = NEW_DIR, or leave "
                          "data.path unset to train on the built-in corpus tokenised with it")


def load_init_weights(source: InitSource) -> dict[str, torch.Tensor]:
    """The full float32 weights of ``source`` as a ``Transformer`` state dict (on the CPU).
    Raises ``CheckpointError`` naming the file (damaged safetensors, missing or mis-shaped
    tensors, a quantised or multi-process checkpoint)."""
    from trainforge.loading.loader import QuantizedCheckpointError, load_model

    try:
        # No swap_quantized: training starts from float weights, so a quantised source is refused
        # before any module is built (and training never imports the engine's quantised kernels).
        loaded = load_model(source.weights, device="cpu", dtype=torch.float32)
    except QuantizedCheckpointError as e:
        raise CheckpointError(f"model.init_from = {str(source.path)!r} is quantised "
                              f"({e.mode}); start from the float checkpoint it was made from") from None
    except CheckpointError as e:
        raise CheckpointError(f"model.init_from = {str(source.path)!r}: {e}") from None
    return loaded.model.state_dict()
