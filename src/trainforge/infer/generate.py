"""Generation through the engine for one prompt, on a model that may still be training:
the sample printed after ``trainforge train``. ``generate`` leaves the model as it found it
(no fusion: the engine runs the model as it is). ``trainforge generate`` (cli/generate.py) builds
its engine itself: it loads a checkpoint it owns, so it prepares it (``prepare.prepare_model``:
fusion, quantised kernels), may compile, and reports the engine's statistics."""

from __future__ import annotations

import torch

from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.sampling import SamplingParams
from trainforge.model.llama import Transformer

__all__ = ["SamplingParams", "generate", "generate_text"]


def generate(model: Transformer, prompt_ids: list[int], params: SamplingParams, eos_ids: tuple[int, ...] = (),
             tokenizer=None, config: EngineConfig | None = None):
    """Continue ``prompt_ids``; returns the finished ``Request`` (``output_ids``, ``text``
    when a tokenizer is given, ``finish_reason``). A one-row engine sized to this request
    unless ``config`` says otherwise. The model is used as it is (no fusion)."""
    params.validate()
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    total = len(prompt_ids) + params.max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + --max_new_tokens {params.max_new_tokens} exceeds the "
                         f"model's max_seq_len {model.cfg.max_seq_len}")
    was_training = model.training
    config = config or EngineConfig(max_batch_size=1, max_queue=1, max_context=total)
    # The engine computes in the parameters' dtype into buffers of that dtype; a caller's
    # autocast (the trainer's mixed precision) would hand it other dtypes.
    device_type = model.tok_embeddings.weight.device.type
    try:
        with torch.autocast(device_type, enabled=False):
            engine = Engine(model, config, tokenizer=tokenizer, eos_ids=eos_ids)
            return engine.generate([list(prompt_ids)], params)[0]
    finally:
        model.train(was_training)


def generate_text(model: Transformer, tokenizer, prompt: str, params: SamplingParams) -> str:
    """``prompt`` + its continuation, stopping at the tokenizer's end-of-text token."""
    from trainforge.data.tokenizer import eos_id

    ids = tokenizer.encode(prompt).ids
    req = generate(model, ids, params, eos_ids=(eos_id(tokenizer),), tokenizer=tokenizer)
    return tokenizer.decode(ids + req.output_ids)
