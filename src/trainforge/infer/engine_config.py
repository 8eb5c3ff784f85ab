"""The engine's sizes and options (``EngineConfig``), validated before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.infer.speculative import check_num_speculative_tokens


@dataclass
class EngineConfig:
    max_batch_size: int = 8  # sequences decoded together
    max_queue: int = 64  # requests waiting beyond the free batch rows; more are refused (QueueFull)
    block_size: int = 16  # tokens per KV-cache block
    n_blocks: int = 0  # KV pool size in blocks; 0 = max_batch_size full-context sequences
    max_context: int = 0  # prompt + generated tokens per sequence; 0 = the model's max_seq_len
    compile: bool = False  # torch.compile the decode step (slow to start on CPU)
    sync_interval_steps: int = 0  # decode steps between host reads of tokens; 0 = 1 on CPU, 8 on CUDA
    num_speculative_tokens: int = 4  # drafts per row per step when the engine has a drafter
    max_prefill_tokens: int = 512  # prompt tokens prefilled together in one forward (a longer prompt: alone)

    def validate(self) -> None:
        for name in ("max_batch_size", "block_size", "max_queue", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("n_blocks", "max_context", "sync_interval_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        check_num_speculative_tokens(self.num_speculative_tokens)
