"""Per-process gradient-compression state shared by the communication hooks.

One ``GradientCompressor`` per process holds, per bucket (a DDP bucket or an FSDP
unit's reduce-scatter output): the error-feedback residuals, the adaptive bit width,
and the wire accounting; plus the warm-up step count and the stochastic-rounding
generator. ``state_dict`` carries all of it into the checkpoint (one file per rank:
residuals differ per rank), so a resumed run compresses exactly as before.

The hooks call ``all_reduce_mean(key, flat)``; the trainer calls ``end_step()`` after
each optimizer step and ``window_stats()`` at the logging interval.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainforge.compression.adaptive import AdaptiveBits
from trainforge.compression.codecs import Codec, make_codec
from trainforge.compression.collective import ReduceInfo, compressed_all_reduce_mean, fp32_all_reduce_mean
from trainforge.compression.error_feedback import ErrorFeedback
from trainforge.compression.section import CompressionSection

# In a compressor's state saved with compression.host_reduce: bucket key -> the reduced
# gradient of the checkpoint's last step, not yet applied (compression/host_reduce.py).
PENDING_KEY = "host_reduce_pending"


class GradientCompressor:
    """Compressed mean over ``group`` (the dp_replicate process group).

    ``log`` receives one line per adaptive width change (bucket, old -> new, reason)."""

    def __init__(self, section: CompressionSection, group: dist.ProcessGroup, device: torch.device,
                 seed: int = 0, log: Callable[[str], None] | None = None):
        if section.codec == "powersgd":
            raise ValueError("powersgd is PyTorch's DDP hook: use hooks.register_powersgd, not GradientCompressor")
        self.section, self.group, self.device = section, group, device
        self.log = log or (lambda msg: None)
        self.adaptive = section.codec == "adaptive"
        self.bits_ctl = AdaptiveBits(section.min_bits, section.max_bits, section.target_rel_error)
        self.feedback = ErrorFeedback(section.error_feedback)
        self.step = 0
        self.bypass = False  # True while DDP's buckets are primed: no communication at all
        self.generator = None
        if section.stochastic_rounding:
            # Per rank: ranks round independently, so their rounding errors average out.
            self.generator = torch.Generator(device).manual_seed(seed * 1000 + group.rank() + 1)
        self._codecs: dict[str, Codec] = {}
        self._reset_window()

    # -- codec choice -------------------------------------------------------------------

    def _codec(self, name: str, bits: int | None = None) -> Codec:
        tag = f"{name}:{bits}"
        if tag not in self._codecs:
            s = self.section
            self._codecs[tag] = make_codec(name, s.block_size, bits, s.topk_ratio, s.stochastic_rounding)
        return self._codecs[tag]

    def codec_for(self, key: str) -> Codec | None:
        """The codec for ``key`` now; None = full-precision all-reduce (warm-up)."""
        if self.step < self.section.warmup_steps:
            return None
        if self.adaptive:
            bits = self.bits_ctl.bits(key)
            return self._codec(f"int{bits}")
        return self._codec(self.section.codec)

    # -- the collective -------------------------------------------------------------------

    def all_reduce_mean(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """Mean of ``flat`` over the group (a new fp32 tensor, same on every rank)."""
        if self.bypass:
            return flat
        codec = self.codec_for(key)
        x = flat.detach().reshape(-1).float()
        if codec is None:
            out, info = fp32_all_reduce_mean(x, self.group)
            bits = 32.0
        else:
            out, info = compressed_all_reduce_mean(x, self.group, codec, key, self.feedback, self.generator,
                                                   measure=self.adaptive)
            bits = codec.bits
            if self.adaptive:
                self._observe(key, codec.bits, info)
        self._account(key, bits, info)
        return out.reshape(flat.shape).to(flat.dtype)

    def _observe(self, key: str, used_bits: float, info: ReduceInfo) -> None:
        before = self.bits_ctl.bits(key)
        reason = self.bits_ctl.observe(key, int(used_bits), info.rel_error, info.mean_norm)
        if reason is not None:
            self.log(f"compression: bucket {key} {before} -> {self.bits_ctl.bits(key)} bits at step "
                     f"{self.step + 1}: {reason}")

    # -- accounting --------------------------------------------------------------------

    def _reset_window(self) -> None:
        self._window_steps = 0
        self._bytes = 0
        self._ref_bytes = 0.0
        self._bucket_bits: dict[str, float] = {}
        self._numel: dict[str, int] = defaultdict(int)

    def _account(self, key: str, bits: float, info: ReduceInfo) -> None:
        self._bytes += info.bytes_sent
        self._ref_bytes += info.fp32_ring_bytes
        self._bucket_bits[key] = bits

    def end_step(self) -> None:
        """Call once per optimizer step (after it): advances warm-up, counts the window."""
        self.step += 1
        self._window_steps += 1

    def window_stats(self) -> dict[str, Any]:
        """Bytes this rank sent per step since the last call, the ratio to an fp32 ring
        all-reduce of the same gradients, and the bits each bucket used last."""
        steps = max(1, self._window_steps)
        stats = {
            "wire_bytes_per_step": self._bytes / steps,
            "wire_ratio_vs_fp32": self._bytes / self._ref_bytes if self._ref_bytes else 1.0,
            "compression_bits": dict(self._bucket_bits),
        }
        self._reset_window()
        return stats

    # -- checkpoint ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "residuals": self.feedback.state_dict(),
                                 "adaptive": self.bits_ctl.state_dict(), "codec": self.section.codec,
                                 "group_size": self.group.size()}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Restore; returns a warning when residuals were dropped (another codec or group size)."""
        self.step = int(state["step"])
        dropped = None
        if state.get(PENDING_KEY):
            dropped = ("the checkpoint holds the reduced gradient of its last step, not yet applied "
                       "(saved with compression.host_reduce); without it that gradient is dropped")
        same = state.get("codec") == self.section.codec and state.get("group_size") == self.group.size()
        if not same:
            afresh = (f"compression state saved with codec {state.get('codec')} over {state.get('group_size')} "
                      f"ranks; now {self.section.codec} over {self.group.size()}: residuals and bit widths start "
                      "afresh (the first steps differ slightly from an uninterrupted run)")
            return f"{afresh}; {dropped}" if dropped else afresh
        self.feedback.load_state_dict(state["residuals"], self.device)
        self.bits_ctl.load_state_dict(state["adaptive"])
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
        return dropped
