"""Text generation from a training checkpoint with a static KV cache.

A simple loop (prefill once, then one token per step); the full inference engine
(paged cache, quantisation, batching, server) is ``trainforge.infer`` proper.
Sampling draws from a seeded ``torch.Generator`` so a seed reproduces the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trainforge.data.tokenizer import eos_id, load_tokenizer
from trainforge.errors import CheckpointError
from trainforge.model import ModelConfig, Transformer
from trainforge.train import checkpoint as ckpt


@dataclass
class SamplingOptions:
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"--max_new_tokens {self.max_new_tokens}: must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"--top_k {self.top_k}: must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top_p {self.top_p}: must be in (0, 1]")


def sample_next(logits: torch.Tensor, opts: SamplingOptions, gen: torch.Generator) -> torch.Tensor:
    """logits: (B, V) -> next token ids (B, 1)."""
    if opts.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / opts.temperature
    if opts.top_k:
        kth = torch.topk(logits, min(opts.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if opts.top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = probs.cumsum(-1) - probs >= opts.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], opts: SamplingOptions,
             stop_id: int | None = None) -> list[int]:
    """Continue ``prompt_ids``; returns only the new ids (stops early at ``stop_id``)."""
    opts.validate()
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    device = model.output.weight.device
    total = len(prompt_ids) + opts.max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + --max_new_tokens {opts.max_new_tokens} exceeds the "
                         f"model's max_seq_len {model.cfg.max_seq_len}")
    gen = torch.Generator(device=device).manual_seed(opts.seed)
    model.eval()
    model.setup_caches(1, total)
    try:
        tokens = torch.tensor([prompt_ids], device=device)
        logits = model(tokens, start_pos=0)[:, -1]  # prefill: (1, V)
        out: list[int] = []
        pos = len(prompt_ids)
        for _ in range(opts.max_new_tokens):
            nxt = sample_next(logits, opts, gen)  # (1, 1)
            token = int(nxt.item())
            if stop_id is not None and token == stop_id:
                break
            out.append(token)
            logits = model(nxt, start_pos=pos)[:, -1]
            pos += 1
        return out
    finally:
        model.clear_caches()


def load_checkpoint_for_inference(path: str | Path, device: str | torch.device = "cpu"):
    """(model, tokenizer) from a checkpoint directory or a run directory (newest checkpoint)."""
    ck = ckpt.resolve_checkpoint(path)
    meta = ckpt.read_meta(ck)
    try:
        model_config = ModelConfig(**meta["model_config"])
    except TypeError as e:
        raise CheckpointError(f"{ck / ckpt.META}: model_config does not fit this trainforge version ({e})") from None
    # Built directly on the device (not meta + to_empty, which would untie tied embeddings);
    # the default init is overwritten by the load.
    with torch.device(device):
        model = Transformer(model_config)
    ckpt.load_model_weights(ck, model)
    tok_file = ck / ckpt.TOKENIZER_FILE
    if not tok_file.is_file():
        raise CheckpointError(f"{tok_file} is missing: the checkpoint cannot turn text into tokens")
    return model, load_tokenizer(tok_file)


def generate_text(model: Transformer, tokenizer, prompt: str, opts: SamplingOptions) -> str:
    ids = tokenizer.encode(prompt).ids
    new = generate(model, ids, opts, stop_id=eos_id(tokenizer))
    return tokenizer.decode(ids + new)
