"""bench/tp2d.py's pure parts: the analytic table (from parallel/tp2d/comm_bytes.py), how a
dispatched collective is classified and counted, the counted table's per-block difference, and
the paired ratios (the multi-process runs themselves are exercised by running the bench)."""

import pytest
import torch
import torch.distributed as dist

from bench.tp2d import (
    CollectiveCounter,
    analytic_rows,
    analytic_table,
    break_even_tokens,
    block_shape,
    classify,
    counted_table,
    paired_ratio_stats,
    ring_sent_bytes,
)
from trainforge.parallel.tp2d.comm_bytes import summa_bytes_per_rank, tp1d_bytes_per_rank


def test_analytic_rows_are_comm_bytes_per_block_times_the_layers():
    rows = {(r["flavor"], r["tp"]): r for r in analytic_rows()}
    r = rows[("llama-8b", 4)]
    shape = block_shape("llama-8b", 16, 8192)
    assert r["tp2d_blocks_bytes"] == 32 * summa_bytes_per_rank(shape, 4, 2)
    assert r["tp1d_sp_blocks_bytes"] == 32 * tp1d_bytes_per_rank(shape, 4, True, 2)
    # 2-D sends less at every tp where it splits the model, and its advantage grows with tp
    changes = [rows[("llama-8b", tp)]["blocks_change_vs_sp"] for tp in (4, 16, 64)]
    assert changes[0] < -0.3 and changes[0] > changes[1] > changes[2]
    # q = 8 cannot split small's 12 heads: no 2-D figure, and the note says why
    assert rows[("small", 64)]["tp2d_blocks_bytes"] is None and "2-D refused" in rows[("small", 64)]["note"]
    assert "1-D refused" in rows[("llama-8b", 16)]["note"]  # 8 KV heads over 16 ranks
    table = analytic_table(list(rows.values()))
    assert table.count("\n") == len(rows) + 1 and "| llama-8b (131,072) | 4 |" in table


def test_break_even_is_where_the_two_counts_cross():
    n = break_even_tokens("llama-8b", 4, 8192)
    for tokens, two_d_less in ((n * 0.9, False), (n * 1.1, True)):
        shape = block_shape("llama-8b", 2, int(tokens) // 2)  # 2 sequences: the grid's q = 2 rows
        assert (summa_bytes_per_rank(shape, 4, 2) < tp1d_bytes_per_rank(shape, 4, True, 2)) == two_d_less


@pytest.mark.parametrize(("namespace", "name", "args", "want"), [
    ("_c10d_functional", "all_gather_into_tensor", (torch.zeros(4), 2, "0"), ("all_gather", 2, 32)),
    ("_c10d_functional", "reduce_scatter_tensor", (torch.zeros(8), "sum", 4, "0"), ("reduce_scatter", 4, 32)),
    ("_c10d_functional", "wait_tensor", (torch.zeros(8),), None),
    ("aten", "mm", (torch.zeros(2, 2), torch.zeros(2, 2)), None),
])
def test_classify_reads_kind_group_and_full_tensor(namespace, name, args, want):
    assert classify(namespace, name, args) == want


def test_ring_model_bytes():
    assert ring_sent_bytes("all_gather", 4, 400) == 300  # 3 of 4 chunks leave
    assert ring_sent_bytes("reduce_scatter", 2, 400) == 200
    assert ring_sent_bytes("all_reduce", 4, 400) == 600  # reduce-scatter + all-gather
    assert ring_sent_bytes("all_reduce", 1, 400) == 0


def test_the_counter_sees_collectives_dispatched_through_torch_distributed():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with CollectiveCounter() as counter:
            t = torch.ones(8)
            dist.all_reduce(t)
            out = torch.empty(8)
            dist.all_gather_single(out, t)
            (t * 2).sum()
    finally:
        dist.destroy_process_group()
    kinds = [(r["kind"], r["group_size"], r["full_bytes"], r["sent_bytes"]) for r in counter.records]
    assert kinds == [("all_reduce", 1, 32, 0.0), ("all_gather", 1, 32, 0.0)]


def test_counted_table_takes_one_block_as_the_difference_of_two_depths():
    def ranks(sent):
        return [{"sent_bytes": sent, "count": 10, "by_kind": {}} for _ in range(4)]

    tiny_1d_block = 1_575_936.0  # comm_bytes: tiny widths, 4 x 64 tokens, tp 4, fp32, sequence parallel
    table, out = counted_table({"1d": {1: ranks(1000 + tiny_1d_block), 2: ranks(1000 + 2 * tiny_1d_block)}}, 4, 64)
    assert out["1d"]["block"] == tiny_1d_block and out["1d"]["edges"] == 1000
    assert "| 1.0000 |" in table


def test_paired_ratios():
    s = paired_ratio_stats([2.0, 3.0, 4.0], [1.0, 2.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.5, 2.0, 3)
    with pytest.raises(ValueError, match="need as many"):
        paired_ratio_stats([1.0], [])
