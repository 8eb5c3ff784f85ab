"""The running batch's attention layout on the host: where each row's tokens sit in the KV pool.

Rows 0..B-1 of the engine's batch are its running requests. For each row this keeps the
position of its next input token and, over the runner's ``context_slots`` token positions,
the pool slot that holds token t (``index``; the padding block past the row's blocks) and an
additive mask (``bias``: 0 where the row holds token t, -inf elsewhere). A decode step lays
the first S columns of rows 0..B-1 out into the runner's ``gather`` / ``bias`` buffers, with
each row's input position and the slot its new token is written to (``positions`` /
``slots``); a speculative step lays out k + 1 tokens per row. Written here in numpy and
pushed to the device in one copy per buffer (``HostBuffer``), so a step costs no small
device writes.

The engine (engine.py) decides which request is in which row; this only keeps their layout,
and moves a row when the engine moves a request (``move_row``, the last row into a hole).
"""

from __future__ import annotations

import numpy as np
import torch

from trainforge.infer.kv_pool import KVPool
from trainforge.infer.runner import ModelRunner


class HostBuffer:
    """A host array the engine writes and the device tensor the runner reads: the same
    memory on CPU; on CUDA, two pinned copies used in turn, each pushed with a non-blocking
    copy (an event guards a copy still in flight when its buffer comes round again). numpy
    has no bfloat16: a bf16 model's attention mask is written in a float32 host copy (its
    0 / -inf are exact in both) and copied over on push, on CPU too."""

    def __init__(self, dev: torch.Tensor):
        self.dev = dev
        self._staged = dev.dtype == torch.bfloat16
        if dev.device.type == "cpu":
            self._hosts = [torch.zeros(dev.shape, dtype=torch.float32) if self._staged else dev]
        else:
            host_dtype = torch.float32 if self._staged else dev.dtype
            self._hosts = [torch.zeros(dev.shape, dtype=host_dtype).pin_memory() for _ in range(2)]
            self._events = [None, None]
        self._i = 0
        self.np = self._hosts[0].numpy()

    def push(self, n: int) -> None:
        """Send the first ``n`` elements; the engine rewrites them in full before every push."""
        if len(self._hosts) == 1:
            if self._staged:
                self.dev[:n].copy_(self._hosts[0][:n])
            return
        self.dev[:n].copy_(self._hosts[self._i][:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[self._i] = ev
        self._i = 1 - self._i
        if self._events[self._i] is not None:
            self._events[self._i].synchronize()
        self.np = self._hosts[self._i].numpy()


class BatchRows:
    def __init__(self, runner: ModelRunner, pool: KVPool, max_rows: int):
        self.pool, self.runner = pool, runner
        bs, C = pool.block_size, runner.context_slots
        self.pos = np.zeros(max_rows, dtype=np.int64)  # position of each row's input token
        self.positions = HostBuffer(runner.positions)
        self.slots = HostBuffer(runner.slots)
        self.gather = HostBuffer(runner.gather)
        self.bias = HostBuffer(runner.bias)
        self._pad_index = np.tile(np.arange(bs, dtype=np.int64), C // bs + 1)[:C]  # the padding block
        self.index = np.tile(self._pad_index, (max_rows, 1))  # (R, C): slot of each row's token t
        self.mask = np.full((max_rows, C), -np.inf, dtype=np.float32)  # 0 where row r holds token t

    def _map_blocks(self, row: int, seq_id: int, first_block: int) -> None:
        """Point ``row``'s columns from block ``first_block`` on at the sequence's pool blocks."""
        bs = self.pool.block_size
        for j, blk in enumerate(self.pool.table(seq_id)[first_block:], first_block):
            self.index[row, j * bs:(j + 1) * bs] = blk * bs + np.arange(bs)

    def start(self, row: int, seq_id: int, prompt_tokens: int) -> None:
        """A prefilled prompt of ``prompt_tokens`` tokens: its blocks and mask; next position."""
        self.pos[row] = prompt_tokens
        self._map_blocks(row, seq_id, 0)
        self.mask[row, :prompt_tokens] = 0.0

    def decode_layout(self, seq_ids: list[int]) -> int:
        """One new token per row (rows 0..B-1 hold ``seq_ids``): take its pool slot, open the
        row's block where the token starts one, and push positions, slots and the (B, S) gather
        / mask to the runner (the compiled step's whole (rows, context) shape once compiled).
        Returns S, the columns the step reads."""
        B, bs, pos = len(seq_ids), self.pool.block_size, self.pos
        longest = 0
        for r, seq_id in enumerate(seq_ids):
            p = int(pos[r])
            self.slots.np[r] = self.pool.append_slots(seq_id, 1)[0]
            if p % bs == 0:  # the token opened a new block, the table's last
                self._map_blocks(r, seq_id, p // bs)
            self.mask[r, p] = 0.0
            longest = max(longest, p + 1)
        S = -(-longest // bs) * bs
        rows, cols = B, S
        if self.runner.static_shape is not None:  # compiled: every row, the whole context
            rows, cols = self.runner.static_shape
            self.slots.np[B:rows] = 0  # idle rows write into the padding block...
            pos[B:rows] = 0
        self.positions.np[:rows] = pos[:rows]
        self.gather.np[:rows * cols].reshape(rows, cols)[:] = self.index[:rows, :cols]
        bias = self.bias.np[:rows * cols].reshape(rows, cols)
        bias[:] = self.mask[:rows, :cols]
        bias[B:] = 0.0  # ...and attend to it, so their (ignored) rows stay finite
        for buf, n in ((self.positions, rows), (self.slots, rows), (self.gather, rows * cols), (self.bias, rows * cols)):
            buf.push(n)
        return S

    def verify_layout(self, seq_ids: list[int], k: int) -> tuple[np.ndarray, int]:
        """k drafts and the input token per row (positions p..p+k): their pool slots, (B, k+1),
        and the columns S the verification reads; ``push_verify`` sends them (after drafting)."""
        B, bs, pos = len(seq_ids), self.pool.block_size, self.pos
        slots = np.empty((B, k + 1), dtype=np.int64)
        for r, seq_id in enumerate(seq_ids):
            p = int(pos[r])
            slots[r] = self.pool.append_slots(seq_id, k + 1)
            self._map_blocks(r, seq_id, p // bs)  # the blocks the new tokens touch
            self.mask[r, p:p + k + 1] = 0.0
        return slots, -(-int(pos[:B].max() + k + 1) // bs) * bs

    def push_verify(self, slots: np.ndarray, S: int) -> None:
        """The verification's slots and (B, S) gather / mask to the runner."""
        B = slots.shape[0]
        self.slots.np[:slots.size] = slots.reshape(-1)
        self.gather.np[:B * S] = self.index[:B, :S].reshape(-1)
        self.bias.np[:B * S] = self.mask[:B, :S].reshape(-1)
        for buf, n in ((self.slots, slots.size), (self.gather, B * S), (self.bias, B * S)):
            buf.push(n)

    def keep(self, row: int, length: int) -> None:
        """The row keeps its first ``length`` tokens (a speculative step's rejected drafts go;
        the pool was cut to ``length`` already); its next position is ``length``."""
        keep = self.pool.blocks_for(length) * self.pool.block_size
        self.index[row, keep:] = self._pad_index[keep:]
        self.mask[row, length:] = -np.inf
        self.pos[row] = length

    # A row-state participant (row_state.py): the engine's scheduler moves the last row into a hole.
    def move_row(self, src: int, dst: int) -> None:
        self.pos[dst] = self.pos[src]
        self.index[dst] = self.index[src]
        self.mask[dst] = self.mask[src]

    def clear_row(self, row: int) -> None:
        self.index[row] = self._pad_index
        self.mask[row] = -np.inf
